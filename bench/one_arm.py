"""One arm of `specrej-ray bench`, alone: its wall-clock, the rows of every decode step, and
optionally a cProfile of the run. Run it from a tree's directory (that tree's package is the
one imported, so two worktrees compare side by side):

    .venv/bin/python bench/one_arm.py sbon-norefill --prompts 3 --out /tmp/arm
    .venv/bin/python bench/one_arm.py sbon-norefill --prompts 3 --out /tmp/arm --profile

The arm runs as `specrej-ray bench` runs it (the spec, overrides, warm-up and timing are the
CLI's; the other arms are left out), on the 512-token fair bench's settings unless `--set`
says otherwise. Writes OUT_rows.json ({rows in the step: steps}) and, with --profile,
OUT.prof (pstats). The bench's report needs every arm, so the CLI stops after the arm; the
arm's line ("N prompts in S s") is its figure.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import sys

sys.path.insert(0, os.getcwd())

FAIR = ["jobs/bench_cpu.yaml", "--set", "search.n=16",
        "--set", "generator.sampling.max_new_tokens=512", "--set", "generator.threads=1",
        "--set", "reward.threads=1", "--n-list", "16", "--engines", "hf",
        "--skip-throughput", "--skip-roofline"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arm", help="sbon, sbon-norefill or bon-N (N in the bench's --n-list)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", required=True, help="path prefix of what it writes")
    ap.add_argument("--profile", action="store_true", help="also write OUT.prof (cProfile)")
    args, extra = ap.parse_known_args()

    import specrej_ray.benchmark.arms as arms
    from specrej_ray.engine.hf import model_runner

    every = arms.plan_arms
    arms.plan_arms = lambda *a, **k: [x for x in every(*a, **k) if x.name == args.arm]
    rows: collections.Counter[int] = collections.Counter()
    decode = model_runner.ModelRunner.decode

    def counted(self, slots, tokens, pool_slots):
        rows[len(tokens)] += 1
        return decode(self, slots, tokens, pool_slots)

    model_runner.ModelRunner.decode = counted
    sys.argv = ["specrej-ray", "bench", *FAIR, *extra, "--prompts", str(args.prompts),
                "--out", args.out + "_bench"]
    from specrej_ray.cli import main as cli

    prof = cProfile.Profile() if args.profile else None
    try:
        if prof:
            prof.enable()
        cli()
    except (StopIteration, KeyError) as e:  # the report wants the arms left out
        print(f"one_arm: the report stopped ({type(e).__name__}), as expected", file=sys.stderr)
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(args.out + ".prof")
        with open(args.out + "_rows.json", "w") as f:
            json.dump(dict(sorted(rows.items())), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
