"""Our host time per vLLM step (issue 30): what CandidateSampler (update_state + apply) adds to
vLLM's own engine step, at 64, 512 and 1,024 live candidates, for the sampler before issue 30
(a Python loop over the rows each step, commit BEFORE_REV) and today's, side by side.

vLLM's CPU build in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on a tiny random Llama
built here (no hub), driven the way VllmEngine drives it: greedy requests carrying draw_args,
64 candidates per prompt, EOS off. One engine serves both implementations: its processor
forwards to the one being measured, a fresh instance per run, and times each call with perf
counters. A step's "vllm" time is LLMEngine.step's minus ours. On the CPU build the logits'
device is the host, so apply's time is all of its work; the target is ours <= 10% of vLLM's
at 1,024 live candidates. Steps are "decode" (no batch change: the steady state) or "churn"
(candidates finishing: removals and condensing moves reach update_state); prefill steps are
left out. Both implementations must draw the same tokens ("same tokens" in the table).

    .venv/bin/python bench/vllm_host.py                       # the table
    .venv/bin/python bench/vllm_host.py --steps 64 --out bench/results/vllm_host.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.host_overhead import save  # noqa: E402

# The last commit with the per-row sampler (the one issue 30 replaced).
BEFORE_REV = "989100b92f019edb572f8a58659e4fab6a89db9f"
SAMPLER_PATH = "specrej_ray/engine/vllm/candidate_sampler.py"
# gpu_suite's TINY: vLLM's CPU attention wants a head of 64 or more.
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024)
PER_PROMPT = 64  # candidates per prompt
PROMPT_TOKENS = 24
WAVES = 4  # candidates finish in this many waves at the end: the churn steps

# Filled by Timed: seconds in our calls, and how many calls carried a batch change.
_clock = {"update": 0.0, "apply": 0.0, "changes": 0}
_active: dict = {"cls": None}


def before_class(rev: str = BEFORE_REV) -> type:
    """CandidateSampler as it was at `rev`, loaded from git (not imported: a module apart)."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{SAMPLER_PATH}"],
                         check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("candidate_sampler_before")
    exec(compile(src, f"{rev[:8]}:{SAMPLER_PATH}", "exec"), module.__dict__)
    return module.CandidateSampler


def _timed_class() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class Timed(LogitsProcessor):
        """Forwards to _active["cls"] (a fresh instance whenever it changes), timed."""

        def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
            self._init = (vllm_config, device, is_pin_memory)
            self._cls: type | None = None
            self._impl = None

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            if self._cls is not _active["cls"]:
                # A switch happens between runs: the old run's rows are all removed in the
                # next run's first update, so the new instance starts with the batch.
                self._cls = _active["cls"]
                self._impl = self._cls(*self._init)
            t0 = time.perf_counter()
            self._impl.update_state(batch_update)
            _clock["update"] += time.perf_counter() - t0
            _clock["changes"] += batch_update is not None

        def apply(self, logits):
            t0 = time.perf_counter()
            out = self._impl.apply(logits)
            _clock["apply"] += time.perf_counter() - t0
            return out

    return Timed


def _start(max_num_seqs: int, model_dir: Path):
    from specrej_ray.engine.vllm.build import CPU_BLOCK, start_llm

    return start_llm(dict(
        model=str(model_dir), dtype="float32", enable_prefix_caching=True,
        logits_processors=[_timed_class()], logprobs_mode="raw_logprobs", max_model_len=512,
        enforce_eager=True, seed=0, disable_log_stats=True, block_size=CPU_BLOCK,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, max_num_seqs),
        kv_cache_memory_bytes=512 << 20))


def _run(llm, live: int, steps: int, tag: str) -> tuple[dict, dict]:
    """One Best-of-N-like run of `live` candidates: per-step timings by kind, and the tokens."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind

    from specrej_ray.engine.sampling import SamplingParams
    from specrej_ray.engine.vllm.candidate_sampler import draw_args

    sampling = SamplingParams(1.0, 1.0, 0)
    prompts = max(1, live // PER_PROMPT)
    tokens: dict[tuple[int, int], list[int]] = {}
    for p in range(prompts):
        prompt = [5 + (p * 31 + 7 * t) % 250 for t in range(PROMPT_TOKENS)]
        for i in range(min(live, PER_PROMPT)):
            # the last WAVES * 2 steps: a quarter of the candidates ends every 2 steps
            max_tokens = steps + 2 * WAVES - 2 * (i % WAVES)
            params = VllmParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, output_kind=RequestOutputKind.DELTA,
                                extra_args=draw_args(0, 1000 + p, i, len(prompt), sampling))
            llm.add_request(f"{tag}:{p}#{i}", prompt, params)
            tokens[(p, i)] = []
    by_kind: dict[str, list[tuple[float, float, float]]] = {"decode": [], "churn": []}
    started = 0  # candidates with a first token: prefill steps are left out
    while llm.has_unfinished_requests():
        before = dict(_clock)
        t0 = time.perf_counter()
        outputs = llm.step()
        seconds = time.perf_counter() - t0
        for out in outputs:
            p, i = map(int, out.request_id.split(":")[1].split("#"))
            new = list(out.outputs[0].token_ids)
            started += bool(new) and not tokens[(p, i)]
            tokens[(p, i)] += new
        update, apply = (_clock[k] - before[k] for k in ("update", "apply"))
        if started == len(tokens) and update + apply > 0:
            kind = "churn" if _clock["changes"] > before["changes"] else "decode"
            by_kind[kind].append((seconds - update - apply, update, apply))
    return by_kind, tokens


def _summary(samples: list[tuple[float, float, float]]) -> dict:
    if not samples:
        return {"steps": 0}
    vllm, update, apply = (statistics.median(s[k] for s in samples) * 1e3 for k in range(3))
    ours = statistics.median((s[1] + s[2]) for s in samples) * 1e3
    return {"steps": len(samples), "vllm_ms": vllm, "ours_ms": ours, "update_ms": update,
            "apply_ms": apply, "ours_pct": 100 * ours / vllm}


def measure(live: list[int], steps: int = 32, repeats: int = 2, verbose: bool = True,
            threads: int | None = None) -> dict:
    """Median ms per step of vLLM's own work and of ours, before/after issue 30, per live
    count (runs interleaved, `repeats` each, pooled)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm

    from specrej_ray.engine.vllm.candidate_sampler import CandidateSampler
    from tests.tiny import save_tiny_lm

    impls = {"before": before_class(), "after": CandidateSampler}
    root = Path(tempfile.mkdtemp(prefix="vllm-host-"))
    llm = None
    try:
        model_dir = save_tiny_lm(root / "lm", **TINY)
        llm = _start(max(live), model_dir)
        if threads:
            import torch

            torch.set_num_threads(threads)
        for name, cls in impls.items():  # warm-up: first-call costs out of the figures
            _active["cls"] = cls
            _run(llm, min(live), 4, f"warm-{name}")
        rows = []
        if verbose:
            print(f"vLLM {vllm.__version__} CPU, tiny random Llama {TINY}, {PER_PROMPT} "
                  f"candidates a prompt, {steps} decode steps, {repeats} runs each, medians",
                  flush=True)
            print(f"{'live':>5} {'impl':<7}{'kind':<7}{'steps':>5} {'vLLM ms':>9} "
                  f"{'ours ms':>8} {'update':>7} {'apply':>7} {'ours/vLLM':>10}")
        for n in live:
            samples: dict[str, dict[str, list]] = {k: {"decode": [], "churn": []}
                                                   for k in impls}
            drawn: dict[str, dict] = {}
            for r in range(repeats):
                for name, cls in impls.items():
                    _active["cls"] = cls
                    by_kind, tokens = _run(llm, n, steps, f"{name}-{n}-{r}")
                    for kind, s in by_kind.items():
                        samples[name][kind] += s
                    drawn.setdefault(name, tokens)
            same = drawn["before"] == drawn["after"]
            for name in impls:
                row = {"live": n, "impl": name, "same_tokens": same,
                       **{kind: _summary(s) for kind, s in samples[name].items()}}
                rows.append(row)
                if verbose:
                    for kind in ("decode", "churn"):
                        s = row[kind]
                        if s["steps"]:
                            print(f"{n:>5} {name:<7}{kind:<7}{s['steps']:>5} "
                                  f"{s['vllm_ms']:>9.2f} {s['ours_ms']:>8.3f} "
                                  f"{s['update_ms']:>7.3f} {s['apply_ms']:>7.3f} "
                                  f"{s['ours_pct']:>9.1f}%", flush=True)
            if verbose:
                print(f"{n:>5} same tokens before/after: {same}", flush=True)
        return {"vllm": vllm.__version__, "device": "cpu", "model": TINY,
                "per_prompt": PER_PROMPT, "prompt_tokens": PROMPT_TOKENS, "steps": steps,
                "repeats": repeats, "before_rev": BEFORE_REV, "torch_threads": _threads(),
                "rows": rows}
    finally:
        if llm is not None:
            llm.engine_core.shutdown()
        shutil.rmtree(root, ignore_errors=True)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--steps", type=int, default=32, help="decode steps a run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int,
                    help="torch threads of the process (vLLM's and ours alike) once started")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = measure(args.live, args.steps, args.repeats, threads=args.threads)
    save(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
