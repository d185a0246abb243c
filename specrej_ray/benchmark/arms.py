"""The arms: Best-of-N at each N and SBoN at the spec's settings, timed on the same engine.

Every arm is the job's engine (same model, sampling, rewards, KV budget, admission and seed)
with only n and alpha changed, over the same prompts, so candidate k of a prompt is the same
sample in every arm and the comparisons are paired. Best-of-N gets the engine's full care:
row-level admission into a refilled batch, like SBoN.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stats import EngineStats
from specrej_ray.engine.task import EngineTask

SBON, SBON_NOREFILL = "sbon", "sbon-norefill"
# With a reward that gives bounds (search.bounds): pruning from bounds alone (alpha 0, so
# lossless: Best-of-N's answers) and with the paper's rule.
BOUNDS, SBON_BOUNDS = "bounds", "sbon+bounds"


KEEP = "spec"  # an arm's decisions: the spec's schedule


@dataclass(frozen=True)
class Arm:
    name: str
    n: int
    alpha: float  # 0 = Best-of-N
    refill: bool = True
    # Decision lengths (None: the memory schedule), or KEEP: the spec's own.
    decisions: tuple[int, ...] | None | str = KEEP
    bounds_every: int = 0  # prune from bounds every this many tokens (0: never)

    @property
    def is_bon(self) -> bool:
        """Plain Best-of-N: no rule, no bounds (the arms every other is measured against)."""
        return self.alpha == 0 and not self.bounds_every


@dataclass
class ArmRun:
    arm: Arm
    seconds: float  # wall-clock of Engine.run over all prompts
    results: list[PromptResult]
    stats: EngineStats
    rewards: list[dict] = field(default_factory=list)  # LocalJob.reward_stats() after the arm
    vllm: dict | None = None  # the vLLM backend's counters (engine.vllm.vllm_stats)

    @property
    def tokens(self) -> int:
        """Tokens the answers keep (rejected candidates up to their decision)."""
        return sum(r.tokens_generated for r in self.results)

    @property
    def decoded(self) -> int:
        """Decode work: kept tokens, tokens discarded past a decision, replays."""
        return sum(r.tokens_decoded for r in self.results)

    @property
    def score_seconds(self) -> float:
        return sum(r.score_seconds for r in self.results)


def plan_arms(n: int, alpha: float, bon_ns: Sequence[int],
              decisions: tuple[int, ...] | None | str = KEEP, bounds_every: int = 0) -> list[Arm]:
    """SBoN with and without cross-prompt refill, or, where the reward gives bounds
    (`bounds_every`), SBoN, bounds alone and both; then Best-of-N from the smallest N."""
    if bounds_every:
        ours = [Arm(SBON, n, alpha, True, decisions),
                Arm(BOUNDS, n, 0.0, True, decisions, bounds_every),
                Arm(SBON_BOUNDS, n, alpha, True, decisions, bounds_every)]
    else:
        ours = [Arm(SBON, n, alpha, True, decisions),
                Arm(SBON_NOREFILL, n, alpha, False, decisions)]
    return ours + [Arm(f"bon-{k}", k, 0.0) for k in sorted(bon_ns)]


def arm_engine(engine: GenerationEngine, arm: Arm) -> GenerationEngine:
    """The job's engine with the arm's N, alpha, bounds and (unless KEEP) decision lengths."""
    changes = {} if arm.decisions == KEEP else {"decision_tokens": arm.decisions}
    return engine.with_search(n=arm.n, alpha=arm.alpha, bounds_every=arm.bounds_every,
                              **changes)


def run_arm(engine: GenerationEngine, arm: Arm, tasks: Sequence[EngineTask]) -> ArmRun:
    e = arm_engine(engine, arm)
    done = 0
    t0 = time.perf_counter()

    def progress(_result) -> None:
        nonlocal done
        done += 1
        say(f"{arm.name}: {done}/{len(tasks)} prompts done ({time.perf_counter() - t0:.1f} s)")

    results, seconds = timed(lambda: e.run(tasks, refill=arm.refill, on_result=progress),
                             torch.device(e.device))
    say(f"{arm.name}: {len(results)} prompts in {seconds:.1f} s, "
        f"{sum(r.tokens_decoded for r in results)} tokens decoded")
    vllm = getattr(e, "vllm", None)
    return ArmRun(arm, seconds, results, e.stats, vllm=vllm.as_dict() if vllm else None)


def warm_up(engine: GenerationEngine, arm: Arm, task: EngineTask) -> None:
    """One untimed prompt, so the first timed arm does not pay one-off start-up costs."""
    say(f"warm-up: {arm.name} on prompt {task.prompt_id!r} (not timed)")
    arm_engine(engine, arm).run([task], refill=arm.refill)


# -- timing ---------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """fn's result and its seconds, the device's queued work included (CUDA calls return
    before they finish)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` runs: the least disturbed by anything else on the machine."""
    return min(timed(fn, device)[1] for _ in range(repeats))


def say(message: str) -> None:
    """A progress line on stderr (stdout is left for results)."""
    print(f"bench: {message}", file=sys.stderr, flush=True)
