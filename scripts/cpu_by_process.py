"""Where a command's CPU goes, by kind of process: run it, read every process's CPU time from
/proc once a second until it ends, and print the seconds of each kind (Ray's worker processes
by the actor or task they ran, Ray's daemons, pytest, the test zygote, setup's pip, ...).

    python scripts/cpu_by_process.py --json cpu.jsonl -- make test
    python scripts/cpu_by_process.py --report cpu.jsonl        # the table again

Linux only. Every process on the machine is read, so run nothing else beside it. A process
that lives less than a second may be missed, and a process's last second before it ends is;
the machine's busy and idle seconds come from /proc/stat and count everything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
# (a word in the command line or a process title, the kind it makes)
KINDS = (("gcs_server", "ray: gcs"), ("dashboard", "ray: dashboard and agents"),
         ("runtime_env", "ray: dashboard and agents"), ("log_monitor", "ray: log monitor"),
         ("monitor.py", "ray: monitor"), ("raylet", "ray: raylet"),
         ("tests.helpers.zygote", "test zygote and its forks"), ("pytest", "pytest"),
         ("exec(eval(sys.stdin.readline()))", "pytest (xdist worker)"),
         (" pip ", "setup: pip"), ("-m pip", "setup: pip"), ("ruff", "ruff"),
         ("specrej_ray", "specrej-ray (fresh interpreter)"), ("cpu_by_process", "this sampler"))


def _machine() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _read(pid: str) -> tuple[tuple[int, int], float, str, str] | None:
    """((pid, start), CPU seconds, name, command line) of a live process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()
    return ((int(pid), int(rest[19])), (int(rest[11]) + int(rest[12])) / TICK,
            stat[stat.index("(") + 1: stat.rindex(")")], cmd)


def sample(start, every_s: float = 1.0) -> tuple[list[dict], subprocess.Popen]:
    """Every process seen while the process `start()` starts runs: its CPU seconds since the
    start when last seen, its command line and the titles it took (Ray renames its workers
    `ray::Actor.method`); and the process, ended."""
    first, t0, seen = _machine(), time.monotonic(), {}
    before = {got[0]: got[1] for pid in filter(str.isdigit, os.listdir("/proc"))
              if (got := _read(pid)) is not None}  # what ran before counts from now
    proc = start()
    while proc.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            got = _read(pid)
            if got is None:
                continue
            key, cpu, name, cmd = got
            p = seen.setdefault(key, {"pid": key[0], "name": name, "cmd": cmd, "titles": []})
            p["cpu"] = cpu - before.get(key, 0.0)
            if cmd != p["cmd"] and cmd not in p["titles"] and len(p["titles"]) < 6:
                p["titles"].append(cmd[:120])
        time.sleep(every_s)
    machine = [b - a for a, b in zip(first, _machine(), strict=False)]
    head = {"wall_s": time.monotonic() - t0, "busy_s": (sum(machine) - machine[3] - machine[4])
            / TICK, "idle_s": (machine[3] + machine[4]) / TICK, "cores": os.cpu_count()}
    return [head, *seen.values()], proc


def kind(p: dict) -> str:
    renamed = any(t.startswith("ray::") for t in p["titles"])
    if "ray_worker.py" in p["cmd"] and not renamed:  # tests/helpers/ray_worker.py
        return "ray worker: stand-in for a fork"
    # A worker the tests' workers zygote forked has the zygote's command line until Ray
    # renames it; a stand-in that could not fork became a worker itself.
    forked = "tests.helpers.zygote" in p["cmd"] and renamed
    if not (forked or "default_worker.py" in p["cmd"] or "ray_worker.py" in p["cmd"]):
        for word, name in KINDS:  # a worker's arguments name the raylet, ...; Ray's daemons
            if word in p["cmd"]:  # rename themselves too: the first command line tells
                return name
    text = " ".join([p["cmd"], *p["titles"]])
    if "default_worker.py" in text or "ray::" in text:
        names = [_actor(t) for t in [*p["titles"], p["cmd"]] if t.startswith("ray::")]
        names = [n for n in names if n != "IDLE"]
        return "ray worker: " + (names[0] if names else "never used (IDLE)")
    return "other: " + p["name"]


def _actor(title: str) -> str:
    """`ray::NAME:Class.method` or `ray::Class.method` -> Class; `ray::task-name-3` -> the
    task's name without its number or uuid (one kind for all of them)."""
    name = (title[len("ray::"):].split() or [""])[0].rsplit(":", 1)[-1].split(".")[0]
    return re.sub(r"-([0-9a-f]{8,}|\d+)$", "", name)


def report(rows: list[dict]) -> str:
    head, procs = rows[0], rows[1:]
    by = collections.defaultdict(list)
    for p in procs:
        by[kind(p)].append(p["cpu"])
    total = sum(sum(v) for v in by.values())
    lines = [f"{head['wall_s']:.0f} s wall on {head['cores']} cores: the machine busy "
             f"{head['busy_s']:.0f} s, idle {head['idle_s']:.0f} s "
             f"({100 * head['busy_s'] / max(head['busy_s'] + head['idle_s'], 0.01):.0f}% busy); "
             f"the processes seen: {total:.0f} CPU-seconds", "",
             "| kind | processes | CPU seconds | share | median a process |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, cpus in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        if sum(cpus) <= 0.005 * total:  # also: nothing used a tick of CPU
            continue
        cpus.sort()
        lines.append(f"| {name} | {len(cpus)} | {sum(cpus):.0f} | "
                     f"{100 * sum(cpus) / total:.1f}% | {cpus[len(cpus) // 2]:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="keep the samples here (JSON lines)")
    ap.add_argument("--report", metavar="JSONL", help="print the table of kept samples")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            print(report([json.loads(line) for line in f]))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give a command after --, or --report FILE")
    rows, proc = sample(lambda: subprocess.Popen(command))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(report(rows))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
