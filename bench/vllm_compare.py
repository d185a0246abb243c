"""Best-of-N decoding with vLLM's CPU build against the engine, on the same prompts.

vLLM is not a dependency of the project: it runs in a venv of its own, the engine in ours.

    /tmp/vllm-venv/bin/python bench/vllm_compare.py vllm --json /tmp/vllm.json
    .venv/bin/python bench/vllm_compare.py engine --vllm /tmp/vllm.json \
        --json bench/results/vllm-compare.json

Both sides: the packaged SmolLM2-135M-Instruct (the de-quantized float32 copy the engine
loads), the first K bench prompts rendered with its chat template, N samples each with
temperature 0.8, top_p 0.95, max_tokens T, EOS on; one untimed warm-up prompt first; no
reward (decoding only). Reported: seconds, tokens generated, tokens/s. vLLM's per-request
seeds crash on CPU, so it samples from its global seed; the engine from its counter streams.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # bench/ importable; the package stays the environment's

from bench.results_io import save  # noqa: E402

PROMPTS = REPO / "bench" / "data" / "hh_rlhf_bench.jsonl"


def model_dir() -> str:
    """The de-quantized SmolLM2 the engine uses (converted once from the packaged GGUF)."""
    found = sorted(Path.home().glob(".cache/specrej-ray/gguf/*/config.json"))
    if not found:
        raise SystemExit("run the engine side once first: it converts the packaged model")
    return str(found[0].parent)


def prompt_ids(tokenizer, k: int) -> list[tuple[str, list[int]]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()[:k]]
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append((r["id"], list(ids)))
    return out


def run_vllm(args) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    path = model_dir()
    prompts = prompt_ids(AutoTokenizer.from_pretrained(path), args.prompts)
    llm = LLM(model=path, dtype="float32", seed=0, gpu_memory_utilization=0.3,
              max_model_len=max(len(p) for _, p in prompts) + args.max_tokens)
    params = SamplingParams(n=args.n, temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0][1]}], params)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for _, p in prompts], params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"side": "vllm", "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "kv_cache_gb": os.environ.get(
                "VLLM_CPU_KVCACHE_SPACE", "default"), "version": _version("vllm")}


def run_engine(args) -> dict:
    sys.path.insert(0, str(REPO))
    from specrej_ray.engine.hf.engine import Engine
    from specrej_ray.engine.hf.memory import GIB
    from specrej_ray.engine.sampling import SamplingParams
    from specrej_ray.engine.task import EngineTask, SearchParams
    from specrej_ray.job.runtime import set_torch_threads
    from specrej_ray.models.loader import load_causal_lm, resolve_model

    set_torch_threads(None)
    model, tokenizer = load_causal_lm(resolve_model("smollm2-135m-instruct", "--model"),
                                      dtype="float32", device="cpu")
    prompts = prompt_ids(tokenizer, args.prompts)
    sampling = SamplingParams(0.8, 0.95, 0, args.max_tokens)
    engine = Engine(model, tokenizer, sampling, SearchParams(args.n, 0.0, None, 16, 1, 0))
    budget = int(args.kv_gb * GIB) // engine.runner.bytes_per_token
    engine = engine.with_search(budget_tokens=budget)

    def constant(texts):
        return [[0.0] for _ in texts]

    tasks = [EngineTask(pid, ids, constant) for pid, ids in prompts]
    engine.run(tasks[:1])  # warm-up
    engine.reset_stats()
    t0 = time.perf_counter()
    results = engine.run(tasks)
    seconds = time.perf_counter() - t0
    tokens = sum(r.tokens_generated for r in results)
    return {"side": "engine", "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "kv_budget_gb": args.kv_gb,
            "mean_rows": engine.stats.mean_rows, "occupancy": engine.stats.occupancy}


def _version(pkg: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("side", choices=["vllm", "engine"])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kv-gb", type=float, default=1.0, help="the engine's KV budget")
    ap.add_argument("--vllm", type=Path, help="the vllm side's JSON, to put beside")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    row = run_vllm(args) if args.side == "vllm" else run_engine(args)
    row.update(prompts=args.prompts, n=args.n, max_tokens=args.max_tokens)
    out = {"engine": row}
    if args.vllm:
        out["vllm"] = json.loads(args.vllm.read_text())
        out["engine_over_vllm"] = row["tokens_per_s"] / out["vllm"]["tokens_per_s"]
    print(json.dumps(out if args.side == "engine" else row, indent=1))
    save(args.json, out if args.side == "engine" else row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
