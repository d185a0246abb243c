"""The arms: Best-of-N at each N and SBoN at the spec's settings, timed on the same engine.

Every arm is the job's engine (same model, sampling, rewards, KV budget and seed) with only
n and alpha changed, over the same prompts, so candidate k of a prompt is the same sample
in every arm and the comparisons are paired.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specrej_ray.benchmark.timing import say, sync
from specrej_ray.engine.engine import Engine, EngineStats, EngineTask
from specrej_ray.engine.sequence import PromptResult

SBON, SBON_NOREFILL = "sbon", "sbon-norefill"


@dataclass(frozen=True)
class Arm:
    name: str
    n: int
    alpha: float  # 0 = Best-of-N
    refill: bool = True

    @property
    def is_bon(self) -> bool:
        return self.alpha == 0


@dataclass
class ArmRun:
    arm: Arm
    seconds: float  # wall-clock of Engine.run over all prompts
    results: list[PromptResult]
    stats: EngineStats

    @property
    def tokens(self) -> int:
        return sum(r.tokens_generated for r in self.results)

    @property
    def score_seconds(self) -> float:
        return sum(r.score_seconds for r in self.results)


def plan_arms(n: int, alpha: float, bon_ns: Sequence[int]) -> list[Arm]:
    """SBoN with and without cross-prompt refill, then Best-of-N from the smallest N."""
    sbon = [Arm(SBON, n, alpha, True), Arm(SBON_NOREFILL, n, alpha, False)]
    return sbon + [Arm(f"bon-{k}", k, 0.0) for k in sorted(bon_ns)]


def arm_engine(engine: Engine, arm: Arm) -> Engine:
    """The job's engine with the arm's n and alpha; the model is shared, not reloaded."""
    return engine.with_search(n=arm.n, alpha=arm.alpha)


def run_arm(engine: Engine, arm: Arm, tasks: Sequence[EngineTask]) -> ArmRun:
    e = arm_engine(engine, arm)
    device = e.model.device
    sync(device)
    t0 = time.perf_counter()
    done = 0

    def progress(_result) -> None:
        nonlocal done
        done += 1
        say(f"{arm.name}: {done}/{len(tasks)} prompts done ({time.perf_counter() - t0:.1f} s)")

    results = e.run(tasks, refill=arm.refill, on_result=progress)
    sync(device)
    seconds = time.perf_counter() - t0
    say(f"{arm.name}: {len(results)} prompts in {seconds:.1f} s, "
        f"{sum(r.tokens_generated for r in results)} tokens")
    return ArmRun(arm, seconds, results, e.stats)


def warm_up(engine: Engine, arm: Arm, task: EngineTask) -> None:
    """One untimed prompt, so the first timed arm does not pay one-off start-up costs."""
    say(f"warm-up: {arm.name} on prompt {task.prompt_id!r} (not timed)")
    arm_engine(engine, arm).run([task], refill=arm.refill)
