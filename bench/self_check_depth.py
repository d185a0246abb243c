"""The engine's self-check against depth, at Llama-3-8B's width, random weights (issue 30).

For each dtype and number of layers, side by side: the old check's measure (the engine's
logits against the model's SDPA forward, against a fixed 1e-3 in float32 and 5e-2 otherwise)
and the new one (engine.hf.self_check: the engine against the model's eager forward, within
K x the spread that rounding alone moves that forward, plus a floor), for the correct engine
and for defects planted as tests/test_self_check.py plants them (--defects). KL is the
largest over the check's steps of KL(reference || engine) of the next-token distributions,
for comparison. One model is built at the deepest depth and cut to the shallower ones (the
same first layers).

    python bench/self_check_depth.py    # CPU, bfloat16, 4 8 16 layers: 9 GB, ~6 min on 2 cores
    python bench/self_check_depth.py --device cuda --layers 4 8 16 32 \\
        --dtypes bfloat16 float16 float32 --out bench/results/self_check_depth_h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_suite import LLAMA_8B, TINY  # noqa: E402
from bench.results_io import save  # noqa: E402
from specrej_ray.engine.hf import cpu_linear, self_check  # noqa: E402
from specrej_ray.engine.hf.model_runner import ModelRunner  # noqa: E402

OLD_TOLERANCE = {torch.float32: 1e-3}  # the old check: 5e-2 in any other dtype


def build(shape: dict, layers: int, dtype: torch.dtype, device: str):
    """A random Llama of this shape, built in `dtype` (no float32 copy first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**shape, "num_hidden_layers": layers}, bos_token_id=None,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(before)


def cut(model, layers: int) -> None:
    """Keep the model's first `layers` layers."""
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:layers])
    model.config.num_hidden_layers = layers


def engine_logits(model, defect: str | None) -> list[torch.Tensor]:
    """The engine's logits on the check's probe, as its runner computes them at start-up."""
    from tests.test_self_check import planted  # the tests' defects (imports pytest)

    caught = []

    def catch(model, ids, feed, got, linears=False):
        caught.extend(got)
        return self_check.Result(0.0, 0.0, 0.0, "")  # passes: the runner goes on

    real, self_check.judge = self_check.judge, catch
    try:
        with planted(defect, model) if defect else contextlib.nullcontext():
            ModelRunner(model)
    finally:
        self_check.judge = real
    return caught


def kl(want, got) -> float:
    return max(float(torch.nn.functional.kl_div(g.float().log_softmax(-1),
                                                w.float().log_softmax(-1),
                                                log_target=True, reduction="sum"))
               for w, g in zip(want, got, strict=True))


def sdpa_reference(model, ids, feed):
    """The old check's reference: the model's forward through SDPA, a token a step."""
    eager, self_check.REFERENCE = self_check.REFERENCE, "sdpa"
    try:
        return self_check.reference(model, ids, feed)[0]
    finally:
        self_check.REFERENCE = eager


def row(model, dtype: torch.dtype, defects: list[str], packed: bool) -> dict:
    t0 = time.perf_counter()
    ids, feed = self_check.probe(model.config.vocab_size)
    want, moved = self_check.reference(model, ids, feed, linears=packed)
    old_want = sdpa_reference(model, ids, feed)
    spread = max(self_check.relative(want, m) for m in moved)
    bound = self_check.bound(spread, dtype)
    out = {"layers": model.config.num_hidden_layers, "dtype": str(dtype).removeprefix("torch."),
           "spread": spread, "bound": bound, "kl_spread": max(kl(want, m) for m in moved),
           "old_tolerance": OLD_TOLERANCE.get(dtype, 5e-2)}
    for name in ["correct", *defects]:
        got = engine_logits(model, None if name == "correct" else name)
        error = self_check.relative(want, got)
        out[name] = {"old": self_check.relative(old_want, got), "new": error,
                     "new_passes": error <= bound, "kl": kl(want, got)}
        out[name]["old_passes"] = out[name]["old"] <= out["old_tolerance"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def line(r: dict, defects: list[str]) -> str:
    c = r["correct"]
    text = (f"{r['dtype']:>9} {r['layers']:>6} {c['old']:>9.3g}"
            f" {'ok' if c['old_passes'] else 'NO':>3} {c['new']:>9.3g}"
            f" {r['spread']:>9.3g} {r['bound']:>9.3g}"
            f" {'ok' if c['new_passes'] else 'NO':>3} {c['new'] / r['spread']:>6.2f}")
    for d in defects:
        text += f"  {r[d]['new']:>8.3g} ({r[d]['new'] / r['bound']:.1f}x)"
    return text + f"  {r['seconds']:>6}s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--defects", nargs="*", default=["rotary", "kv_heads"],
                    choices=["rotary", "kv_heads"])
    ap.add_argument("--packed", action="store_true",
                    help="on CPU, the engine's packed linear layers (a second copy of weights)")
    ap.add_argument("--tiny", action="store_true", help="the GPU suite's tiny shape (a smoke run)")
    ap.add_argument("--out", default=str(REPO / "bench/results/self_check_depth.json"))
    args = ap.parse_args()
    if not args.packed:
        cpu_linear.available = lambda model: False
    shape = TINY if args.tiny else LLAMA_8B
    width = "a tiny" if args.tiny else "Llama-3-8B's"
    print(f"self-check at {width} width, {args.device}; K={self_check.K:g}, "
          f"floor {self_check.FLOOR_EPS:g} eps; old: fixed tolerance; ratio: new / spread",
          flush=True)
    print(f"{'dtype':>9} {'layers':>6} {'old':>9} {'':>3} {'new':>9} {'spread':>9} "
          f"{'bound':>9} {'':>3} {'ratio':>6}" + "".join(f"  {d + ' (/bound)':>15}"
                                                       for d in args.defects), flush=True)
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        t0 = time.perf_counter()
        model = build(shape, max(args.layers), dtype, args.device)
        built = round(time.perf_counter() - t0, 1)
        for layers in sorted(args.layers, reverse=True):  # cutting only ever drops layers
            cut(model, layers)
            rows.append({**row(model, dtype, args.defects, args.packed), "build_seconds": built})
            print(line(rows[-1], args.defects), flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report = {"device": device, "torch": torch.__version__, "packed_linears": args.packed,
              "shape": shape, "K": self_check.K, "floor_eps": self_check.FLOOR_EPS,
              "rows": rows}
    save(args.out, report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
