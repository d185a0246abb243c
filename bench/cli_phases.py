"""Where a CLI process's time goes (issue 29): a tiny job run cold with `specrej-ray run`,
each phase timed from its first line in the output, side by side with the same run whose
process goes through the interpreter's teardown (what it did before `__main__._exit_now`);
and what a reward actor's code imports, in a fresh process, for a Python-callable reward and
for a model reward.

    .venv/bin/python bench/cli_phases.py [--runs 2] [--out bench/results/cli_phases.json]

The model is a tiny random Llama (tests/tiny.py) as generator and likelihood reward, so what
is timed is the tool's start and end, not a model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import save  # noqa: E402
from tests.helpers.runs import phase_lengths  # noqa: E402
from tests.tiny import save_tiny_lm  # noqa: E402

PHASES = {"to the first line": None,  # imports, the spec, the model checks, the prompts
          "ray.init": "already done",
          "actors and work": "Started a local Ray instance",
          "after the summary": "wall-clock: "}  # Ray's shutdown, the process's end
# The same command, its last exit handler never registered: the interpreter tears down.
TEARDOWN = ("import atexit, sys; import specrej_ray.__main__ as m; "
            "m.atexit = type('NoExitHandler', (), {'register': staticmethod(lambda f: f)}); "
            "sys.argv = ['specrej-ray', 'run', sys.argv[1]]; sys.exit(m.main())")
ARMS = {"as shipped": [str(REPO / ".venv/bin/specrej-ray"), "run"],
        "interpreter teardown": [sys.executable, "-c", TEARDOWN]}
# What a reward actor's process loads before it scores (distributed/reward_pool.py).
ACTOR = ("import sys, time; t = time.monotonic(); "
         "from specrej_ray.distributed.reward_pool import RewardActor; "
         "from specrej_ray.job.runtime import set_torch_threads; "
         "from specrej_ray.reward import build_reward; "
         "from specrej_ray.reward.tracked import TrackedReward; "
         "from specrej_ray.spec import RewardSpec; "
         "spec = RewardSpec(**{spec}); set_torch_threads(1); "
         "TrackedReward(build_reward(spec, {model!r}), spec.incremental); "
         "print(round(time.monotonic() - t, 2), 'torch' in sys.modules)")


def _job(tmp: Path, model: Path, k: int) -> Path:
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Tell me about {i}."})
                               + "\n" for i in range(6)))
    job = {"name": "phases", "prompts": {"path": str(prompts), "id_field": "id"},
           "generator": {"model": str(model), "threads": 1, "sampling": {"max_new_tokens": 12}},
           "reward": {"type": "lm_likelihood", "model": str(model), "threads": 1},
           "search": {"n": 6, "alpha": 0.5, "schedule": {"tokens": [4, 8]}},
           "cluster": {"shard_size": 2}, "output": {"path": str(tmp / f"out{k}")}}
    path = tmp / f"job{k}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _run(argv: list[str], job: Path, log: Path) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "wb") as f:
        proc = subprocess.Popen([*argv, str(job)], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    lengths = phase_lengths(proc, log, PHASES)
    return {**{k: round(v, 2) for k, v in lengths.items()},
            "total": round(sum(lengths.values()), 2)}


def _actor(spec: dict, model: str | None) -> dict:
    done = subprocess.run([sys.executable, "-c", ACTOR.format(spec=spec, model=model)],
                          cwd=REPO, capture_output=True, text=True, check=True)
    seconds, torch = done.stdout.split()
    return {"seconds": float(seconds), "imports torch": torch == "True"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each arm, alternated")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cli_phases.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = save_tiny_lm(tmp / "tiny-lm")
        for k in range(args.runs):
            for arm, argv in ARMS.items():  # alternated: the machine's drift hits both
                n = sum(map(len, runs.values()))
                row = _run(argv, _job(tmp, model, n), tmp / f"run{n}.log")
                runs[arm].append(row)
                print(f"{arm:<22} run {k}: {row}", flush=True)
        actors = {
            "callable reward": _actor({"type": "callable",
                                       "function": "tests.helpers.rewards:vowels"}, None),
            "lm_likelihood reward": _actor({"type": "lm_likelihood", "model": str(model)},
                                           str(model)),
        }
    medians = {arm: {phase: round(statistics.median(r[phase] for r in rows), 2)
                     for phase in [*PHASES, "total"]} for arm, rows in runs.items()}
    for arm, row in medians.items():
        print(f"median, {arm}: {row}")
    for name, row in actors.items():
        print(f"reward actor's code, {name}: {row}")
    save(args.out, {"runs": runs, "medians": medians, "reward_actor": actors})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
