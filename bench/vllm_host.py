"""Our host time per vLLM step (issue 30): what CandidateSampler (update_state + apply) adds to
vLLM's own engine step, at 64, 512 and 1,024 live candidates, for the sampler before issue 30
(a Python loop over the rows each step, commit BEFORE_REV) and today's, side by side.

Each implementation runs in a process of its own: this script with its tree's package first
on the path (PYTHONPATH), today's from this checkout, the one before issue 30 from a git
worktree of BEFORE_REV made in a temporary folder and removed after. The processes alternate
(`--repeats` each, their samples pooled) so that the machine's drift hits both alike, and share
one tiny random Llama built here (no hub) and one set of engine arguments.

In each, vLLM's CPU build runs in process (VLLM_ENABLE_V1_MULTIPROCESSING=0), driven the way
VllmEngine drives it: greedy requests carrying draw_args, 64 candidates per prompt, EOS off.
The engine's logits processor forwards to the tree's CandidateSampler and times each call with
perf counters. A step's "vllm" time is LLMEngine.step's minus ours. On the CPU build the
logits' device is the host, so apply's time is all of its work; the target is ours <= 10% of
vLLM's at 1,024 live candidates. Steps are "decode" (no batch change: the steady state) or
"churn" (candidates finishing: removals and condensing moves reach update_state); prefill steps
are left out. Both implementations must draw the same tokens ("same tokens" in the table).

    .venv/bin/python bench/vllm_host.py                       # the table
    .venv/bin/python bench/vllm_host.py --steps 64 --out bench/results/vllm_host.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import save  # noqa: E402

# The last commit with the per-row sampler (the one issue 30 replaced).
BEFORE_REV = "989100b92f019edb572f8a58659e4fab6a89db9f"
# gpu_suite's TINY: vLLM's CPU attention wants a head of 64 or more.
TINY = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024)
PER_PROMPT = 64  # candidates per prompt
PROMPT_TOKENS = 24
WAVES = 4  # candidates finish in this many waves at the end: the churn steps

# Filled by Timed: seconds in our calls, and how many calls carried a batch change.
_clock = {"update": 0.0, "apply": 0.0, "changes": 0}


@contextlib.contextmanager
def checkout(rev: str):
    """A git worktree of `rev` in a temporary folder, removed after."""
    root = Path(tempfile.mkdtemp(prefix="vllm-host-tree-"))
    tree = root / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree),
                    rev], check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       check=False)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)


def _timed_class(impl: type) -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class Timed(LogitsProcessor):
        """Forwards to an `impl` of its own, timed."""

        def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
            self._impl = impl(vllm_config, device, is_pin_memory)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
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


def _engine_args(max_num_seqs: int, model_dir: Path) -> dict:
    """vLLM's engine arguments, the same for both implementations (the logits processor apart)."""
    from specrej_ray.engine.vllm.build import CPU_BLOCK

    return dict(model=str(model_dir), dtype="float32", enable_prefix_caching=True,
                logprobs_mode="raw_logprobs", max_model_len=512, enforce_eager=True, seed=0,
                disable_log_stats=True, block_size=CPU_BLOCK, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(8192, max_num_seqs),
                kv_cache_memory_bytes=512 << 20)


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


def child(tree: Path, engine_args: dict, live: list[int], steps: int,
          threads: int | None) -> dict:
    """In this process, the CandidateSampler of `tree` (its package put first on the path)
    in vLLM's engine: a warm-up, then one run of each live count, its per-step samples and
    the tokens drawn."""
    sys.path.insert(0, str(tree))
    import torch

    import specrej_ray
    from specrej_ray.engine.vllm.build import start_llm
    from specrej_ray.engine.vllm.candidate_sampler import CandidateSampler

    if not Path(specrej_ray.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"vllm_host: {specrej_ray.__file__} imported, not {tree}'s package")
    llm = start_llm({**engine_args, "logits_processors": [_timed_class(CandidateSampler)]})
    try:
        if threads:
            torch.set_num_threads(threads)
        _run(llm, min(live), 4, "warm")  # first-call costs out of the figures
        runs = {}
        for n in live:
            by_kind, tokens = _run(llm, n, steps, f"run-{n}")
            runs[n] = {"samples": by_kind, "tokens": sorted([*k, t] for k, t in tokens.items())}
        return {"package": specrej_ray.__file__, "torch_threads": torch.get_num_threads(),
                "runs": runs}
    finally:
        llm.engine_core.shutdown()


def _in_process(tree: Path, job: dict, scratch: Path) -> dict:
    """`child` of `tree` in a process of its own, with PYTHONPATH pointing at the tree."""
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "job.json").write_text(json.dumps({"tree": str(tree), **job}))
    env = {**os.environ, "PYTHONPATH": str(tree), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run([sys.executable, __file__, "--child", str(scratch / "job.json"),
                           str(scratch / "out.json")], cwd=tree, env=env)
    if done.returncode:
        raise SystemExit(f"vllm_host: the run of {tree}'s sampler failed (exit "
                         f"{done.returncode}); its output is above")
    out = json.loads((scratch / "out.json").read_text())
    out["runs"] = {int(n): run for n, run in out["runs"].items()}
    return out


def side_by_side(job: dict, repeats: int, scratch: Path) -> tuple[dict, dict, int]:
    """Each implementation's per-step samples by live count and kind (its processes pooled),
    the tokens each drew in its first, and the processes' torch threads."""
    with checkout(BEFORE_REV) as before_tree:
        trees = {"before": before_tree, "after": REPO}
        samples = {name: {n: {"decode": [], "churn": []} for n in job["live"]} for name in trees}
        drawn: dict[str, dict] = {}
        for r in range(repeats):
            for name, tree in trees.items():
                out = _in_process(tree, job, scratch / f"{name}-{r}")
                for n, run in out["runs"].items():
                    for kind, s in run["samples"].items():
                        samples[name][n][kind] += s
                drawn.setdefault(name, {n: run["tokens"] for n, run in out["runs"].items()})
    return samples, drawn, out["torch_threads"]


def measure(live: list[int], steps: int = 32, repeats: int = 2, verbose: bool = True,
            threads: int | None = None) -> dict:
    """Median ms per step of vLLM's own work and of ours, before/after issue 30, per live
    count (a process per implementation and repeat, alternating, the samples pooled)."""
    import vllm

    from tests.tiny import save_tiny_lm

    root = Path(tempfile.mkdtemp(prefix="vllm-host-"))
    try:
        model_dir = save_tiny_lm(root / "lm", **TINY)
        job = {"engine_args": _engine_args(max(live), model_dir), "live": live,
               "steps": steps, "threads": threads}
        if verbose:
            print(f"vLLM {vllm.__version__} CPU, tiny random Llama {TINY}, {PER_PROMPT} "
                  f"candidates a prompt, {steps} decode steps, {repeats} runs each, medians",
                  flush=True)
        samples, drawn, torch_threads = side_by_side(job, repeats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [{"live": n, "impl": name, "same_tokens": drawn["before"][n] == drawn["after"][n],
             **{kind: _summary(s) for kind, s in samples[name][n].items()}}
            for n in live for name in samples]
    if verbose:
        _print_table(rows)
    return {"vllm": vllm.__version__, "device": "cpu", "model": TINY,
            "per_prompt": PER_PROMPT, "prompt_tokens": PROMPT_TOKENS, "steps": steps,
            "repeats": repeats, "before_rev": BEFORE_REV, "torch_threads": torch_threads,
            "rows": rows}


def _print_table(rows: list[dict]) -> None:
    print(f"{'live':>5} {'impl':<7}{'kind':<7}{'steps':>5} {'vLLM ms':>9} "
          f"{'ours ms':>8} {'update':>7} {'apply':>7} {'ours/vLLM':>10}")
    for row in rows:
        n, name = row["live"], row["impl"]
        for kind in ("decode", "churn"):
            s = row[kind]
            if s["steps"]:
                print(f"{n:>5} {name:<7}{kind:<7}{s['steps']:>5} {s['vllm_ms']:>9.2f} "
                      f"{s['ours_ms']:>8.3f} {s['update_ms']:>7.3f} {s['apply_ms']:>7.3f} "
                      f"{s['ours_pct']:>9.1f}%")
        if name == "after":
            print(f"{n:>5} same tokens before/after: {row['same_tokens']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--live", type=int, nargs="+", default=[64, 512, 1024])
    ap.add_argument("--steps", type=int, default=32, help="decode steps a run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int,
                    help="torch threads of the process (vLLM's and ours alike) once started")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, type=Path, metavar=("JOB", "OUT"),
                    help=argparse.SUPPRESS)  # one implementation's process (see _in_process)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child[0].read_text())
        out = child(Path(job.pop("tree")), **job)
        args.child[1].write_text(json.dumps(out))
        return 0
    result = measure(args.live, args.steps, args.repeats, threads=args.threads)
    save(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
