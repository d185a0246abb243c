"""What a decode step costs the host: milliseconds a step and operations launched a step, for
the hf engine with a negligible model (issue 30), at the same rows spread over 1 to 128 prompts.

At that size the model's arithmetic is a few milliseconds, so what a step takes is the engine's
own work: what a GPU would wait on. A step whose work grows with the prompts in flight loses
speculative rejection's saving, since rejection is what lets more prompts in.

    .venv/bin/python bench/host_overhead.py                       # the table, hf engine
    .venv/bin/python bench/host_overhead.py --dtype bfloat16      # ... its model in bfloat16
    .venv/bin/python bench/host_overhead.py --engine vllm         # our time per vLLM step
    .venv/bin/python bench/host_overhead.py --out bench/results/host_overhead.json
    .venv/bin/python bench/host_overhead.py --profile 128x4       # where one spread's time goes
    .venv/bin/python bench/host_overhead.py --split               # a step's parts, and the
                                                                  # model's own generate

Operations are counted with torch.profiler over the decode steps of a short run (the first step,
which prefills the prompts, left out): the aten operations that do the work (the leaves of the
profiler's tree: an op that calls no other aten op), which on a GPU are the kernel launches.
Milliseconds a step are the median over a run of --max-new tokens, without the profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import vllm_host  # noqa: E402
from bench.results_io import save  # noqa: E402

NEGLIGIBLE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=2048)
SPREADS = ((1, 512), (8, 64), (32, 16), (128, 4))  # prompts in flight x rows each


def _engine(model, tok, rows: int, max_new: int):
    from bench.gpu_suite import engine_on

    return engine_on(model, tok, n=rows, alpha=0.0, decisions=None, max_new=max_new,
                     budget=10**7)


def _tasks(tok, prompts: int):
    from bench.gpu_suite import tasks_of

    return tasks_of(tok, prompts)


def _timed_steps(engine, label: str | None = None) -> list[float]:
    """Wraps engine.step: the seconds of every step that decoded. With `label`, every step
    after the first (which prefills the prompts) runs inside torch.profiler's
    record_function(label), so its operations can be told from the prefills'."""
    from torch.profiler import record_function

    times: list[float] = []
    step = engine.step

    def timed():
        before = engine.stats.decode_steps
        t0 = time.perf_counter()
        if label and before:
            with record_function(label):
                out = step()
        else:
            out = step()
        if engine.stats.decode_steps > before:
            times.append(time.perf_counter() - t0)
        return out

    engine.step = timed
    return times


def leaf_ops(prof, label: str) -> tuple[int, int]:
    """(aten operations that call no other aten operation, under record_function(label): the
    ones that run a kernel; and the labelled steps)."""
    events = list(prof.events())
    steps = [e for e in events if e.name == label]
    inside = []
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != label:
            parent = parent.cpu_parent
        if parent is not None:
            inside.append(e)
    parents = {id(e.cpu_parent) for e in inside if e.cpu_parent is not None}
    return sum(1 for e in inside if id(e) not in parents), len(steps)


def hf_row(model, tok, prompts: int, rows: int, max_new: int, op_tokens: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model, tok, rows, max_new)
    engine.run(_tasks(tok, prompts)[:1])  # warm-up
    engine = _engine(model, tok, rows, max_new)
    times = _timed_steps(engine)
    engine.run(_tasks(tok, prompts))
    steps = len(times)
    # Operations of the decode steps of a short run of the same batch (the profiler slows
    # the steps it sees, so they are not the ones timed).
    engine = _engine(model, tok, rows, op_tokens)
    _timed_steps(engine, "specrej::decode_step")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.run(_tasks(tok, prompts))
    ops, profiled = leaf_ops(prof, "specrej::decode_step")
    return {"prompts": prompts, "rows_each": rows, "decode_steps": steps,
            "ms_per_step": round(1e3 * statistics.median(times), 2),
            "ms_per_step_mean": round(1e3 * sum(times) / steps, 2),
            "ops_per_step": round(ops / max(profiled, 1), 1), "profiled_steps": profiled,
            "threads": torch.get_num_threads()}


def hf_table(max_new: int, op_tokens: int, spreads=SPREADS,
             dtype: str = "float32") -> list[dict]:
    import torch

    from bench.gpu_suite import random_llama

    torch.set_num_threads(1)
    model, tok = random_llama(NEGLIGIBLE, "cpu", getattr(torch, dtype))
    out = []
    for prompts, rows in spreads:
        row = hf_row(model, tok, prompts, rows, max_new, op_tokens)
        print(f"{prompts:>4} x {rows:<4} {row['ms_per_step']:>8.2f} ms/step "
              f"{row['ops_per_step']:>9.1f} ops/step", flush=True)
        out.append(row)
    return out


def split_row(model, tok, prompts: int, rows: int, max_new: int) -> dict:
    """Milliseconds a decode step spends in each part, timed with perf counters around the
    parts (after a warm-up; steps that also prefilled a prompt left out): the attention
    (the pool's decode in every layer and the step's tables on the device), the linear
    layers, sampling, the scheduler's bookkeeping (the step's slot tables included), and the
    rest (the model's other operations and its Python)."""
    from torch import nn

    _engine(model, tok, rows, max_new).run(_tasks(tok, prompts)[:1])
    engine = _engine(model, tok, rows, max_new)
    spent = dict.fromkeys(("attention", "linears", "sampling", "scheduler"), 0.0)
    wrapped = []  # (object, attribute, its own value before: None if it had none)

    def timed(obj, name: str, part: str) -> None:
        fn = getattr(obj, name)
        wrapped.append((obj, name, obj.__dict__.get(name)))

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    pool = engine.runner.pool  # the step's slot tables are the scheduler's (schedule)
    timed(pool, "decode", "attention")
    timed(pool, "begin", "attention")
    for module in model.modules():
        if isinstance(module, nn.Linear):
            timed(module, "forward", "linears")
    timed(engine.runner, "sample", "sampling")
    timed(engine.runner, "logprobs", "sampling")
    steps, step = [], engine.step

    def one():
        if "schedule" not in engine.scheduler.__dict__:  # made by run()
            timed(engine.scheduler, "schedule", "scheduler")
            timed(engine.scheduler, "postprocess", "scheduler")
        before, prefilled = engine.stats.decode_steps, engine.stats.prefill_tokens
        for part in spent:
            spent[part] = 0.0
        t0 = time.perf_counter()
        out = step()
        total = time.perf_counter() - t0
        if engine.stats.decode_steps > before and engine.stats.prefill_tokens == prefilled:
            steps.append({"step": total, **spent})
        return out

    engine.step = one
    try:
        engine.run(_tasks(tok, prompts))
    finally:  # the model is shared by the next spread: its layers as they were
        for obj, name, own in wrapped:
            if own is None:
                del obj.__dict__[name]
            else:
                obj.__dict__[name] = own
    ms = {k: round(1e3 * statistics.mean(s[k] for s in steps), 2) for k in steps[0]}
    ms["rest"] = round(ms["step"] - sum(ms[k] for k in spent), 2)
    ms["step_median"] = round(1e3 * statistics.median(s["step"] for s in steps), 2)
    return {"prompts": prompts, "rows_each": rows, "steps": len(steps), "ms": ms}


def generate_reference(model, tok, rows: int, max_new: int) -> float:
    """Milliseconds a decode step of the model's own `generate` takes for the same rows
    (one prompt repeated, SDPA, transformers' dynamic cache, sampling): transformers' own
    decode loop on the same model and batch, as a yardstick (the prefill and the first token
    are taken out by timing a 1-token run too)."""
    import torch

    ids = _tasks(tok, 1)[0].input_ids
    batch = torch.tensor([ids] * rows)

    def run(new: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True,
                           top_k=0, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=tok.pad_token_id)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return 1e3 * (run(max_new + 1) - run(1)) / max_new


def split_table(max_new: int, spreads=SPREADS) -> dict:
    import torch

    from bench.gpu_suite import random_llama

    torch.set_num_threads(1)
    model, tok = random_llama(NEGLIGIBLE, "cpu", torch.float32)
    parts = ("step", "attention", "linears", "sampling", "scheduler", "rest", "step_median")
    print("prompts x rows  " + "  ".join(f"{p:>9}" for p in parts)
          + "   (ms a step: means, and the step's median)")
    rows = []
    for prompts, each in spreads:
        row = split_row(model, tok, prompts, each, max_new)
        print(f"{prompts:>4} x {each:<4}   " + "  ".join(f"{row['ms'][p]:>9.2f}" for p in parts),
              flush=True)
        rows.append(row)
    reference = generate_reference(model, tok, SPREADS[0][1], max_new)
    print(f"model.generate, {SPREADS[0][1]} rows: {reference:.2f} ms a step", flush=True)
    return {"split": rows, "generate_ms_per_step": round(reference, 2)}


def profile(prompts: int, rows: int, max_new: int, top: int = 30) -> None:
    """cProfile of one spread's run (after a warm-up), by own time: the Python around the
    step's operations, which torch.profiler shows only as the step's self time."""
    import cProfile
    import pstats

    import torch

    from bench.gpu_suite import random_llama

    torch.set_num_threads(1)
    model, tok = random_llama(NEGLIGIBLE, "cpu", torch.float32)
    _engine(model, tok, rows, max_new).run(_tasks(tok, prompts)[:1])
    engine, tasks = _engine(model, tok, rows, max_new), _tasks(tok, prompts)
    with cProfile.Profile() as prof:
        engine.run(tasks)
    print(f"{prompts} x {rows}, {max_new} new tokens, {engine.stats.decode_steps} decode steps:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the negligible model's dtype, for the table (hf)")
    ap.add_argument("--op-tokens", type=int, default=16,
                    help="new tokens of the profiled run that counts operations")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", metavar="PxR",
                    help="instead of the table: cProfile of P prompts x R rows each (hf)")
    ap.add_argument("--split", action="store_true",
                    help="instead of the table: the milliseconds of a step's parts at each "
                         "spread, and the model's own generate at 512 rows (hf)")
    args = ap.parse_args()
    if args.split:
        save(args.out, {"engine": "hf", "model": NEGLIGIBLE, "max_new": args.max_new,
                        **split_table(args.max_new)})
        return 0
    if args.profile:
        prompts, rows = (int(x) for x in args.profile.lower().split("x"))
        profile(prompts, rows, args.max_new)
        return 0
    if args.engine == "hf":
        print("prompts x rows   ms a step   ops a step   (hf engine, 1 thread)")
        result = {"engine": "hf", "model": NEGLIGIBLE, "max_new": args.max_new,
                  "dtype": args.dtype,
                  "rows": hf_table(args.max_new, args.op_tokens, dtype=args.dtype)}
    else:
        result = {"engine": "vllm", **vllm_host.measure([64, 512, 1024], threads=1)}
    save(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
