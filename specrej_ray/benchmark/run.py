"""`specrej-ray bench`: load the job once, run every arm, measure the machine, write the report."""

from __future__ import annotations

from pathlib import Path

from specrej_ray.benchmark.arms import plan_arms, run_arm, say, warm_up
from specrej_ray.benchmark.hardware import (
    decode_roofline,
    decode_shape,
    machine_info,
    measure_peak,
    measure_throughput,
)
from specrej_ray.benchmark.options import BenchError, BenchOptions
from specrej_ray.benchmark.report import build, write
from specrej_ray.runtime import set_torch_threads
from specrej_ray.spec import JobSpec


def run_bench(spec: JobSpec, options: BenchOptions) -> list[Path]:
    """Run the benchmark; returns the files written (bench.json, bench.md, bench.png)."""
    from specrej_ray.local import load_local

    s = spec.search
    if s.effective_alpha == 0:
        raise BenchError(
            f"search.mode is {s.mode} with alpha {s.alpha:g}: bench compares SBoN with "
            "Best-of-N; use search.mode=sbon and search.alpha > 0"
        )
    if s.calibrates:
        raise BenchError("search.schedule is auto: bench compares fixed settings; give one "
                         "(e.g. --set search.schedule.tokens=[32]) or choose it with "
                         "specrej-ray tune")
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
    arms = plan_arms(s.n, s.effective_alpha, options.bon_ns(s.n))
    say(f"{len(tasks)} prompts, arms: {', '.join(a.name for a in arms)}")
    warm_up(engine, arms[0], tasks[0])
    runs = [run_arm(engine, arm, tasks) for arm in arms]
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
                   throughput, roofline, engine.runner.bytes_per_token)
    paths = write(report, options.out_dir(spec.name))
    say(f"wrote {', '.join(str(p) for p in paths)}")
    return paths
