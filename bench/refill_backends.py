"""Cross-prompt refill: transformers' continuous batching vs our DynamicCache engine.

    python bench/refill_backends.py [--model smollm2-135m-instruct] [-k 4] [-n 16] [-t 64]
        [-r 32] [--prompts jobs/demo_prompts.jsonl] [--out FILE]

The same work for every backend: K chat-rendered prompts, N sampled forks each (temperature
0.8, top_p 0.95), exactly T new tokens per fork (EOS suppressed), at most R rows decoding
together. Backends:

  cb             transformers' ContinuousBatchingManager (paged cache, sdpa): one request per
                 prompt with num_return_sequences=N, forked after its prefill (the prompt's
                 full pages are shared); max_requests_per_batch=R.
  cb-cancel      the same, cancelling half of each prompt's forks once they hold T/4 tokens
                 (rejection as CB could do it: cancel_request).
  engine         specrej_ray Engine.run(refill=True), Best-of-N (alpha 0), KV budget
                 R * (longest prompt + T) tokens, constant reward.
  engine-reject  the same with alpha 0.5 and one decision at T/4: the constant reward ties,
                 so the upper half of each prompt's candidates is rejected, as in cb-cancel.
                 Its first wave is sized to T/4, so it may hold more than R rows.

Rows: cb counts rows that got a token per forward (prefill and decode share forwards);
engine counts rows per decode step (prefills run apart). Warm-up runs are excluded.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from specrej_ray.data.prompts import PromptError, load_prompts, render_prompt
from specrej_ray.engine.hf.block_manager import CHUNK
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.hf.transformers_internals import attention_of
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.task import EngineTask, SearchParams
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.models.loader import ModelError, load_causal_lm, resolve_model
from specrej_ray.search.reservation import chunk_up
from specrej_ray.spec import PromptsSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

# Tokens per KV page. CB's default (256) would give every fork a page far longer than it
# grows here; forks share only full prompt pages and copy the last one.
PAGE = 16
VARIANTS = ("cb", "cb-cancel", "engine", "engine-reject")


@dataclass(frozen=True)
class Workload:
    prompts: tuple[tuple[int, ...], ...]  # rendered, tokenized prompts
    n: int  # forks per prompt
    max_new_tokens: int  # every fork generates exactly this many (EOS suppressed)
    rows: int  # at most this many rows decode together
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0

    @property
    def kv_tokens(self) -> int:
        """KV tokens R rows of the longest prompt need at full length (CB's paged cache)."""
        return self.rows * (max(map(len, self.prompts)) + self.max_new_tokens)

    def engine_budget(self, layers: int) -> int:
        """The engine's KV budget for R rows at full length: its cache holds each prompt
        once and rows in whole chunks, and keeps a headroom of one layer's tensor."""
        room = sum(map(len, self.prompts)) + self.rows * chunk_up(self.max_new_tokens - 1, CHUNK)
        return room + -(-room // (2 * layers - 1))

    @property
    def cut_at(self) -> int:
        """Generated length at which half of each prompt's forks are cancelled / rejected."""
        return max(1, self.max_new_tokens // 4)


@dataclass
class Result:
    backend: str
    seconds: float
    tokens: int  # tokens generated, over all forks
    rows_mean: float | None  # rows decoding together, averaged over forward passes
    cut: int = 0  # forks cancelled (cb) or rejected (engine) before T tokens
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


# -- transformers continuous batching ------------------------------------------------------


class _RowCounter:
    """Counts the rows that get a token in each forward CB schedules (private scheduler API:
    a benchmark-only hook, nothing else depends on it)."""

    def __init__(self, scheduler) -> None:
        self.forwards = 0
        self.rows = 0
        inner = scheduler.schedule_batch

        def counted(*args, **kwargs):
            out = inner(*args, **kwargs)
            rows = sum(f.has_new_token for f in out[0] or ())
            if rows:
                self.forwards += 1
                self.rows += rows
            return out

        scheduler.schedule_batch = counted

    @property
    def mean(self) -> float | None:
        return self.rows / self.forwards if self.forwards else None


def _cb_configs(work: Workload) -> tuple[GenerationConfig, ContinuousBatchingConfig]:
    gen = GenerationConfig(
        do_sample=True, temperature=work.temperature, top_p=work.top_p,
        max_new_tokens=work.max_new_tokens, num_return_sequences=work.n,
        eos_token_id=-1,  # -1 = no EOS: every request runs to max_new_tokens
    )
    pages_per_row = math.ceil((max(map(len, work.prompts)) + work.max_new_tokens) / PAGE)
    cb = ContinuousBatchingConfig(
        page_size=PAGE,
        # R rows' worth of pages, over the FIFO scheduler's 15% free-page safety margin;
        # left unset, CB would size the cache to 60% of the machine's RAM.
        num_blocks=math.ceil(work.rows * pages_per_row / 0.85) + 1,
        max_requests_per_batch=work.rows,
        # A full decode batch plus one whole prompt's prefill per forward.
        max_batch_tokens=work.rows + max(map(len, work.prompts)),
        auto_switch_to_flash=False,
        seed=work.seed,
    )
    return gen, cb


def _fork_ids(request_id: str, n: int) -> list[str]:
    """The ids CB gives a request's N forks: the request itself and its children."""
    return [request_id] + [f"{request_id}__child#{j}" for j in range(n - 1)]


def run_cb(model, work: Workload, cancel: bool = False) -> Result:
    """All prompts through one ContinuousBatchingManager; optionally cancel half the forks."""
    gen, cb = _cb_configs(work)
    # CB takes only its own attention implementations; the engine's goes back afterwards.
    previous = attention_of(model)
    model.set_attn_implementation("sdpa")
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()  # without CUDA graphs: only builds the batch processor, to count rows
    counter = _RowCounter(manager.batch_processor.scheduler)
    t0 = time.perf_counter()
    manager.start()
    try:
        ids = [manager.add_request(list(p), request_id=f"p{i}", streaming=cancel)
               for i, p in enumerate(work.prompts)]
        lengths, cancelled = _collect(manager, ids, work, cancel)
        seconds = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
        manager.destroy()
        model.set_attn_implementation(previous)
    # Tokens streamed after the loop ended (cancelled forks' last steps) still count.
    while (out := manager.get_result(timeout=0)) is not None:
        lengths[out.request_id] = max(lengths.get(out.request_id, 0), len(out.generated_tokens))
    note = f"{cancelled} forks cancelled at {work.cut_at} tokens" if cancel else ""
    return Result("cb-cancel" if cancel else "cb", seconds, sum(lengths.values()),
                  counter.mean, cancelled, note)


def _collect(manager, ids: list[str], work: Workload, cancel: bool) -> tuple[dict[str, int], int]:
    """Tokens per fork once every fork has finished or been cancelled; forks cancelled."""
    expected = {f for rid in ids for f in _fork_ids(rid, work.n)}
    # The last n // 2 children of each prompt: half its forks, never the request itself.
    victims = {f for rid in ids for f in _fork_ids(rid, work.n)[work.n - work.n // 2:]}
    lengths: dict[str, int] = {}
    done: set[str] = set()
    cancelled: set[str] = set()
    while len(done | cancelled) < len(expected):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped; see its log")
            continue
        if out.error:
            raise RuntimeError(f"continuous batching request {out.request_id}: {out.error}")
        rid = out.request_id
        lengths[rid] = max(lengths.get(rid, 0), len(out.generated_tokens))
        if out.is_finished():
            done.add(rid)
        elif cancel and rid in victims and rid not in cancelled and lengths[rid] >= work.cut_at:
            manager.cancel_request(rid)
            cancelled.add(rid)
    return lengths, len(cancelled - done)


# -- our engine ----------------------------------------------------------------------------


def _constant(responses: list[str]) -> list[list[float]]:
    return [[0.0] for _ in responses]


def run_engine(model, tokenizer, work: Workload, reject: bool = False) -> Result:
    """Engine.run with refill: Best-of-N, or one alpha-0.5 decision at T/4 tokens."""
    # Every candidate runs to max_new_tokens.
    sampling = SamplingParams(work.temperature, work.top_p, 0, work.max_new_tokens, (),
                              ignore_eos=True)
    search = SearchParams(
        n=work.n, alpha=0.5 if reject else 0.0,
        decision_tokens=(work.cut_at,) if reject else None,
        min_decision_tokens=work.cut_at,
        budget_tokens=work.engine_budget(model.config.num_hidden_layers), seed=work.seed,
    )
    engine = Engine(model, tokenizer, sampling, search)
    tasks = [EngineTask(f"p{i}", list(p), _constant) for i, p in enumerate(work.prompts)]
    t0 = time.perf_counter()
    results = engine.run(tasks, refill=True)
    seconds = time.perf_counter() - t0
    rejected = sum(r.rejected for r in results)
    note = f"{rejected} candidates rejected at {work.cut_at} tokens" if reject else ""
    return Result("engine-reject" if reject else "engine", seconds,
                  sum(r.tokens_generated for r in results), engine.stats.mean_rows, rejected, note)


# -- the command ---------------------------------------------------------------------------


def load_workload(tokenizer, prompts_path: str, k: int, n: int, t: int, r: int,
                  seed: int = 0) -> Workload:
    """The first K prompts of a prompt file, chat-rendered and tokenized as `run` does."""
    prompts = load_prompts(PromptsSpec(path=prompts_path, limit=k)).prompts
    # Chat templates write their own special tokens (as in distributed.driver).
    ids = [tokenizer(render_prompt(tokenizer, p, True), add_special_tokens=False).input_ids
           for p in prompts]
    return Workload(tuple(tuple(x) for x in ids), n, t, r, seed=seed)


def run_variant(name: str, model, tokenizer, work: Workload) -> Result:
    if name.startswith("cb"):
        return run_cb(model, work, cancel=name == "cb-cancel")
    return run_engine(model, tokenizer, work, reject=name == "engine-reject")


def table(results: list[Result]) -> str:
    lines = [f"{'backend':<14} {'rows (mean)':>11} {'seconds':>8} {'tokens':>7} {'tokens/s':>9}"]
    for res in results:
        rows = f"{res.rows_mean:.1f}" if res.rows_mean is not None else "-"
        lines.append(f"{res.backend:<14} {rows:>11} {res.seconds:>8.2f} {res.tokens:>7} "
                     f"{res.tokens_per_s:>9.1f}  {res.note}".rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="packaged alias, local model dir or .gguf file")
    ap.add_argument("--prompts", default="jobs/demo_prompts.jsonl")
    ap.add_argument("-k", "--prompts-count", dest="k", type=int, default=4)
    ap.add_argument("-n", type=int, default=16, help="forks per prompt")
    ap.add_argument("-t", "--max-new-tokens", dest="t", type=int, default=64)
    ap.add_argument("-r", "--rows", dest="r", type=int, default=32,
                    help="most rows decoding together")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per backend; the fastest is reported")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; default: every core (a shared machine may favour 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    for flag, value in (("-k", args.k), ("-n", args.n), ("-t", args.t), ("-r", args.r),
                        ("--repeats", args.repeats), ("--threads", args.threads or 1)):
        if value < 1:
            ap.error(f"{flag} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_torch_threads(args.threads)
    try:
        path = resolve_model(args.model, "--model")
        model, tokenizer = load_causal_lm(path, dtype=args.dtype, device="cpu", field="--model")
        work = load_workload(tokenizer, args.prompts, args.k, args.n, args.t, args.r, args.seed)
    except (ModelError, PromptError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # One tiny run per backend first: the first forwards pay one-off allocation costs.
    warm = Workload(work.prompts[:1], 2, 2, 2, seed=args.seed)
    for name in args.variants:
        run_variant(name, model, tokenizer, warm)
    runs = {name: [] for name in args.variants}
    for _ in range(args.repeats):  # interleaved, so a busy spell hits every backend alike
        for name in args.variants:
            runs[name].append(run_variant(name, model, tokenizer, work))
    # The fastest repeat: other load on the machine only ever adds time.
    results = [min(rs, key=lambda res: res.seconds) for rs in runs.values()]
    print(f"K={len(work.prompts)} N={work.n} T={work.max_new_tokens} R={work.rows} "
          f"prompt tokens {min(map(len, work.prompts))}-{max(map(len, work.prompts))}, "
          f"torch threads {threads}, {args.dtype}")
    print(table(results))
    save(args.out, report(args, work, threads, results, runs))
    return 0


def report(args: argparse.Namespace, work: Workload, threads: int, results: list[Result],
           runs: dict[str, list[Result]]) -> dict:
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": threads, "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "workload": {"model": args.model, "prompts": args.prompts, "k": len(work.prompts),
                     "n": work.n, "max_new_tokens": work.max_new_tokens, "rows": work.rows,
                     "prompt_tokens": [len(p) for p in work.prompts], "dtype": args.dtype,
                     "temperature": work.temperature, "top_p": work.top_p, "seed": work.seed},
        "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
        "seconds_per_repeat": {name: [r.seconds for r in rs] for name, rs in runs.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
