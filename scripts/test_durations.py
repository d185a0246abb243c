"""Summarise a pytest JUnit XML file's durations: totals, by module, the slowest tests.

    python scripts/test_durations.py run.xml [--top 40] [--failed]

docs/testing.md's tables come from it (`pytest --junitxml=run.xml`)."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def cases(path: str) -> list[tuple[str, float, str]]:
    """(test id, seconds, outcome) for every test case in the file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case
                        if child.tag in ("failure", "error", "skipped")), "passed")
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        out.append((test, float(case.get("time", 0)), outcome))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("xml")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--failed", action="store_true", help="only list the failed tests")
    args = parser.parse_args()
    found = cases(args.xml)
    if args.failed:
        print("\n".join(t for t, _, o in found if o in ("failure", "error")))
        return
    total = sum(s for _, s, _ in found)
    outcomes = defaultdict(int)
    for _, _, o in found:
        outcomes[o] += 1
    print(f"{len(found)} tests, {total:.0f} s of test time; "
          + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items())))
    by_module: dict[str, list[float]] = defaultdict(list)
    for test, s, _ in found:
        by_module[test.split("::")[0]].append(s)
    print("\n| module | tests | seconds | share |\n| --- | ---: | ---: | ---: |")
    for module, times in sorted(by_module.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {module} | {len(times)} | {sum(times):.0f} | {sum(times) / total:.1%} |")
    ranked = sorted(found, key=lambda t: -t[1])
    top = ranked[: args.top]
    share = sum(s for _, s, _ in top) / total
    print(f"\nthe {len(top)} slowest: {sum(s for _, s, _ in top):.0f} s ({share:.0%})\n")
    print("| # | test | seconds |\n| ---: | --- | ---: |")
    for i, (test, s, _) in enumerate(top, 1):
        print(f"| {i} | `{test}` | {s:.1f} |")


if __name__ == "__main__":
    main()
