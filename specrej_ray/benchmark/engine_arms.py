"""`specrej-ray bench --engines hf,vllm`: the vLLM arms, run in the same process after the hf
ones, on the same prompts, rewards, KV budget (search.kv_budget_gb on CPU) and seed.

vLLM arms: SBoN at the spec's settings and Best-of-N at each N of the list, both through
the vLLM backend (its candidates are the hf engine's, by candidate identity), and Best-of-N
as users run it today (vllm_users). Each engine's arms are compared with that engine's
Best-of-N at the spec's N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specrej_ray.benchmark.arms import Arm, ArmRun, run_arm, say, warm_up
from specrej_ray.benchmark.vllm_users import run_users_bon
from specrej_ray.engine.task import EngineTask
from specrej_ray.spec import JobSpec

PREFIX = "vllm:"


def vllm_arms(sbon: Arm, bon_ns: Sequence[int]) -> list[Arm]:
    return [Arm(f"{PREFIX}{sbon.name}", sbon.n, sbon.alpha, sbon.refill, sbon.decisions)] + \
        [Arm(f"{PREFIX}bon-{k}", k, 0.0) for k in sorted(bon_ns)]


def run_vllm_arms(spec: JobSpec, sbon: Arm, bon_ns: Sequence[int],
                  tasks: Sequence[EngineTask], reset: Callable[[], None],
                  reward_stats: Callable[[], list[dict]]) -> list[ArmRun]:
    from specrej_ray.job.engines import make_engine
    from specrej_ray.job.prepare import resolve_generator

    say("starting vLLM")
    engine = make_engine(spec, resolve_generator(spec), backend="vllm")
    try:
        arms = vllm_arms(sbon, bon_ns)
        warm_up(engine, arms[0], tasks[0])
        say(f"warm-up: vllm-n{sbon.n} on prompt {tasks[0].prompt_id!r} (not timed)")
        run_users_bon(engine, tasks[:1], sbon.n)
        runs = []
        for arm in arms:
            reset()
            runs.append(run_arm(engine, arm, tasks))
            runs[-1].rewards = reward_stats()
        reset()
        runs.append(run_users_bon(engine, tasks, sbon.n))
        runs[-1].rewards = reward_stats()
        return runs
    finally:
        engine.close()
