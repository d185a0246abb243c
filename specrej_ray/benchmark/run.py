"""`specrej-ray bench`: load the job once, run every arm, measure the machine, write the report."""

from __future__ import annotations

from pathlib import Path

from specrej_ray.benchmark.arms import Arm, plan_arms, run_arm, say, warm_up
from specrej_ray.benchmark.auto import calibration_tasks, run_auto
from specrej_ray.benchmark.engine_arms import run_vllm_arms
from specrej_ray.benchmark.hardware import (
    decode_roofline,
    decode_shape,
    machine_info,
    measure_peak,
    measure_throughput,
)
from specrej_ray.benchmark.options import BenchError, BenchOptions
from specrej_ray.benchmark.report import build, write
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.spec import JobSpec


def run_bench(spec: JobSpec, options: BenchOptions) -> list[Path]:
    """Run the benchmark; returns the files written (bench.json, bench.md, bench.png)."""
    from specrej_ray.job.local import load_local

    s = spec.search
    if s.effective_alpha == 0:
        raise BenchError(
            f"search.mode is {s.mode} with alpha {s.alpha:g}: bench compares SBoN with "
            "Best-of-N; use search.mode=sbon and search.alpha > 0"
        )
    if options.calibration is not None and not s.calibrates:
        raise BenchError(f"--calibration {options.calibration}: only schedule auto "
                         "calibrates; add --set search.schedule=auto or drop --calibration")
    if s.n == "auto":
        raise BenchError("search.n is auto: bench compares SBoN with Best-of-N at the same "
                         "N; give a number (e.g. --set search.n=64)")
    set_torch_threads(spec.generator.threads)  # as the generator actor does
    say(f"loading {spec.generator.model}")
    job = load_local(spec)
    tasks = job.engine_tasks(options.prompts)
    if not tasks:
        raise BenchError(f"{spec.prompts.path}: no prompts to run")
    if options.prompts and options.prompts > len(tasks):
        say(f"--prompts {options.prompts}: the spec has {len(tasks)}; using them all")
    engine, reward = job.engine, job.engine.rewards.names[0]
    auto = None
    if s.calibrates:  # the auto arm first: its choice is what the SBoN arms run
        cal, held_out = calibration_tasks(job, tasks, options.calibration)
        warm_up(engine, Arm("warm-up", s.n, 0.0), tasks[0])
        job.reset_rewards()
        auto = run_auto(engine, s.n, tasks, cal, held_out, spec, job.reset_rewards)
        auto.run.rewards = job.reward_stats()
        arms = plan_arms(s.n, auto.chosen.alpha, options.bon_ns(s.n),
                         auto.chosen.decision_tokens)
    else:
        # A reward that gives bounds adds the arms that prune from them (alone and with the
        # paper's rule).
        every = s.bounds_every if s.bounds and engine.rewards.bounded else 0
        arms = plan_arms(s.n, s.effective_alpha, options.bon_ns(s.n), bounds_every=every)
        warm_up(engine, arms[0], tasks[0])
    say(f"{len(tasks)} prompts, arms: {', '.join(a.name for a in arms)}")
    runs = []
    for arm in arms:
        job.reset_rewards()  # every arm's rewards start cold and count their own tokens
        runs.append(run_arm(engine, arm, tasks))
        runs[-1].rewards = job.reward_stats()
    engine_runs = run_vllm_arms(spec, arms[0], options.bon_ns(s.n), tasks, job.reset_rewards,
                                job.reward_stats) if "vllm" in options.engines else []
    first = tasks[0].input_ids
    throughput = [measure_throughput(engine, first, b) for b in options.batches] \
        if options.throughput else []
    roofline = []
    if options.roofline:
        peak = measure_peak(engine.model.device, engine.model.dtype)
        shape = decode_shape(engine.model)
        roofline = [decode_roofline(shape, peak, b, len(first), engine.sampling.max_new_tokens)
                    for b in options.batches]
    report = build(spec, options.command, machine_info(engine.model.device), runs, reward,
                   throughput, roofline, engine.runner.bytes_per_token, auto, engine_runs)
    paths = write(report, options.out_dir(spec.name))
    say(f"wrote {', '.join(str(p) for p in paths)}")
    return paths
