"""The bench's `auto` arm: `schedule: auto` as a run does it, timed.

Calibration prompts run as Best-of-N with their rewards scored at the calibration grid
(calibrate.score_prefixes), the choice is made from them (calibrate.decide_setting) and the
bench prompts run with it. The calibration prompts are the spec's first
`calibration_prompts` bench prompts, as in a run (their answers are Best-of-N's and count in
the arm, their time too); or, with `bench --calibration FILE`, prompts held out from the
bench (the tune split), whose cost is reported apart: it is paid once per job, so a large job
amortizes it, while on a dozen bench prompts it would dominate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from specrej_ray.benchmark.arms import Arm, ArmRun, say, timed
from specrej_ray.benchmark.options import BenchError
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.task import Choice, EngineTask
from specrej_ray.job.local import LocalJob
from specrej_ray.job.prepare import prepare_prompts, resolve_generator
from specrej_ray.quality.calibrate import choice_from, decide_setting, grid_for, score_prefixes

AUTO = "auto"


@dataclass
class AutoRun:
    run: ArmRun  # over the bench prompts
    choice: dict  # calibrate.decide_setting's evidence (run_with, reason, settings, ...)
    calibration_seconds: float  # Best-of-N and prefix scoring of the calibration prompts
    calibration_ids: list[str]
    held_out: bool  # calibrated on prompts outside the bench's (cost reported apart)

    @property
    def chosen(self) -> Choice:
        return choice_from(self.choice["run_with"])


def calibration_tasks(job: LocalJob, tasks: list[EngineTask],
                      path: Path | None) -> tuple[list[EngineTask], bool]:
    """(calibration tasks, held out): the spec's first calibration_prompts prompts of `path`
    (held out), or of the bench's own."""
    k = job.spec.search.calibration_prompts
    if path is None:
        return tasks[:k], False
    spec = job.spec.model_copy(update={"prompts": job.spec.prompts.model_copy(
        update={"path": str(path), "limit": k})})
    _, prepared, _, _ = prepare_prompts(spec, resolve_generator(spec), allow_empty=True)
    if not prepared:
        raise BenchError(f"--calibration {path}: no usable prompts")
    bench_ids = {t.prompt_id for t in tasks}
    shared = [t.prompt_id for t in prepared if t.prompt_id in bench_ids]
    if shared:
        raise BenchError(f"--calibration {path}: prompt {shared[0]!r} is also a bench prompt; "
                         "calibrate on prompts held out from the bench (the tune split)")
    return [EngineTask(t.prompt_id, t.input_ids, job.scorer(t.prompt_id, t.text),
                       self_scored=t.self_scored) for t in prepared], True


def run_auto(engine: Engine, n: int, tasks: list[EngineTask], cal: list[EngineTask],
             held_out: bool, spec, reset_rewards: Callable[[], None]) -> AutoRun:
    """Calibrate, choose, run the bench prompts with the choice (the calibration prompts
    among them keep their Best-of-N answers). Held-out calibration is reported apart, its
    reward-model tokens too (`reset_rewards` zeroes the counters after it)."""
    s = spec.search
    max_new = engine.sampling.max_new_tokens
    bon = engine.best_of_n(n)
    say(f"{AUTO}: calibrating on {len(cal)} prompts (Best-of-{n}, rewards at "
        f"{list(grid_for(max_new))} tokens)")
    t0 = time.perf_counter()
    cal_results = bon.run(cal)
    tables = {t.prompt_id: score_prefixes(bon, t, r, grid_for(max_new))
              for t, r in zip(cal, cal_results, strict=True)}
    choice = decide_setting(tables, s.target_score, s.calibration_fallback, max_new)
    cal_seconds = time.perf_counter() - t0
    say(f"{AUTO}: {choice['reason']} ({choice['how']}; {cal_seconds:.1f} s)")
    chosen = choice_from(choice["run_with"])
    if held_out:
        reset_rewards()
    rest = [replace(t, choice=chosen) for t in tasks if t.prompt_id not in tables]
    e = engine.with_search(n=n)
    results, seconds = timed(lambda: e.run(rest), e.model.device)
    by_id = {r.prompt_id: r for r in [*cal_results, *results]}
    if not held_out:
        seconds += cal_seconds  # the bench's own prompts calibrated: the arm paid for it
    say(f"{AUTO}: {len(tasks)} prompts in {seconds:.1f} s")
    arm = Arm(AUTO, n, chosen.alpha, True, chosen.decision_tokens)
    run = ArmRun(arm, seconds, [by_id[t.prompt_id] for t in tasks], e.stats)
    return AutoRun(run, choice, cal_seconds, [t.prompt_id for t in cal], held_out)
