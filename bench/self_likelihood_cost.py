"""What free self-likelihood costs the decode loop (issue 11, point 3).

With `lm_likelihood` on the generator's own model, the engine keeps each candidate's
log-probability from the logits its decode step already computed (one log-softmax gather per
step) instead of a second forward pass. This times Engine.run on the same prompts, rows and
tokens (EOS off, Best-of-N so every row decodes to the end) with that bookkeeping on and with
it off (a reward that costs nothing, so only the bookkeeping differs), alternating the two so
that drift on a noisy machine hits both. It also reports the share of candidates scored for
free: a free score is exact only where the candidate's sampled tokens are what its text
tokenizes to (a sampled non-canonical split, "Hel"+"lo" for "Hello", is not), and the others
fall back to the reward's own pass.

    .venv/bin/python bench/self_likelihood_cost.py --json bench/results/self-likelihood-cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from specrej_ray.data.prompts import load_prompts, render_prompt
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet
from specrej_ray.engine.task import EngineTask, SearchParams
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.models.loader import load_causal_lm, resolve_model
from specrej_ray.spec import PromptsSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402


def zeros(responses, rewards=None, tracking=None) -> list[list[float]]:
    return [[0.0] for _ in responses]


def timed_run(model, tokenizer, prompts: list[list[int]], args,
              free: bool) -> tuple[float, float | None]:
    """(seconds, the share of candidates scored for free: None when off)."""
    sampling = SamplingParams(0.8, 0.95, 0, args.tokens, (), ignore_eos=True)
    search = SearchParams(args.n, 0.0, None, 16, args.budget, seed=0)
    engine = Engine(model, tokenizer, sampling, search,
                    RewardSet(free=(True,)) if free else RewardSet())
    tasks = [EngineTask(f"p{i}", ids, zeros, self_scored=free) for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    results = engine.run(tasks)
    seconds = time.perf_counter() - t0
    if not free:
        return seconds, None
    # A free score is a mean log-probability (< 0); the others fell back to the reward,
    # here `zeros` (their sampled tokens are not what their text tokenizes to).
    scores = [c.final_score for r in results for c in r.candidates if c.finished]
    return seconds, sum(s < 0 for s in scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="bench/data/hh_rlhf_bench.jsonl")
    ap.add_argument("-k", type=int, default=2, help="prompts")
    ap.add_argument("-n", type=int, default=16, help="candidates per prompt")
    ap.add_argument("-t", "--tokens", type=int, default=256, help="new tokens per candidate")
    ap.add_argument("-r", "--repeats", type=int, default=3, help="runs of each, alternated")
    ap.add_argument("--budget", type=int, default=15146, help="KV budget in tokens")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    set_torch_threads(None)
    path = resolve_model("smollm2-135m-instruct", "generator.model")
    model, tokenizer = load_causal_lm(path, dtype="float32", device="cpu")
    loaded = load_prompts(PromptsSpec(path=args.prompts, id_field="id")).prompts[: args.k]
    prompts = [tokenizer(render_prompt(tokenizer, p, True), add_special_tokens=False).input_ids
               for p in loaded]
    timed_run(model, tokenizer, prompts[:1], args, True)  # warm-up, not timed
    times: dict[str, list[float]] = {"free": [], "off": []}
    share = None
    for _ in range(args.repeats):
        for name in ("free", "off"):
            seconds, got = timed_run(model, tokenizer, prompts, args, name == "free")
            times[name].append(seconds)
            share = got if got is not None else share
            print(f"{name}: {seconds:.2f} s", flush=True)
    free, off = statistics.median(times["free"]), statistics.median(times["off"])
    tokens = args.k * args.n * args.tokens
    print(f"{tokens} tokens per run; median {free:.2f} s with free self-likelihood, "
          f"{off:.2f} s without: {100 * (free / off - 1):+.1f}% decode time; "
          f"{share:.1%} of the candidates scored for free")
    save(args.json, {"k": args.k, "n": args.n, "tokens_per_candidate": args.tokens,
                     "tokens": tokens, "seconds": times, "median_free": free,
                     "median_off": off, "overhead": free / off - 1, "free_share": share})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
