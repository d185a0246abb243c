"""Issue 30's next step, measured before it is built: a decode attention that reads every K and
V where it lies in the pool (a paged-attention kernel), against the cache's own decode.

The kernel is plain C, compiled here with `cc -O3 -march=native` and called through ctypes on
the step's own tables. A row at a time, a kv head at a time: its scores against its prompt's
prefix and its own tokens (16 columns at once, each score summed over the head dim in order),
one softmax (a polynomial exp), then its probabilities times V, summed in place. No gather,
no padding, one call a layer. It is float32 only, one thread, and untuned (GCC's
autovectorizer, no intrinsics, no sharing of the prefix between a prompt's rows): it shows
what reading in place gives before anyone writes a tuned one.

Both sides are timed on one layer's call after the same cache was filled, the K/V writes
included, the step's tables made beforehand (one torch thread, the pool warm). The outputs
are compared (max abs difference).

    .venv/bin/python bench/inplace_attention.py
    .venv/bin/python bench/inplace_attention.py --out bench/results/inplace_attention.json
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.attention_ops import _us  # noqa: E402 (after the path)
from bench.results_io import save  # noqa: E402

# prompts, rows a prompt, prefix tokens, own tokens, kv heads, query heads a kv head, head dim:
# host_overhead.py's negligible model at 1 x 512 and 128 x 4 (32 of its 64 tokens), and
# SmolLM2-135M at the row counts of the fair bench's sbon-norefill steps.
SHAPES = ((1, 512, 20, 32, 2, 2, 16), (128, 4, 20, 32, 2, 2, 16),
          (1, 1, 300, 256, 3, 3, 64), (1, 2, 300, 256, 3, 3, 64),
          (1, 3, 500, 400, 3, 3, 64), (1, 16, 300, 64, 3, 3, 64))

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#define BLOCK 16

static void exp_le0(float *x, int64_t n) {  /* e^x for x <= 0: 2^k p(r), |r| <= ln2/2 */
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = __builtin_rintf(v * 1.44269504088896341f);
        float r = v - k * 0.693359375f + k * 2.12194440e-4f;
        float p = 1.9875691500E-4f;
        p = p * r + 1.3981999507E-3f; p = p * r + 8.3334519073E-3f;
        p = p * r + 4.1665795894E-2f; p = p * r + 1.6666665459E-1f;
        p = p * r + 5.0000001201E-1f; p = p * r * r + r + 1.0f;
        int32_t e = ((int32_t)k + 127) << 23;
        float s;
        memcpy(&s, &e, 4);
        x[i] = x[i] < -87.0f ? 0.0f : p * s;
    }
}

/* q [rows, kv, group, dim]; pools [kv, cap, dim]; prefix [prompts, pstride] slots, plen of
   each; own [rows, ostride] slots, olen of each; out like q; scratch: group x (n + BLOCK). */
void decode_f32(const float *q, const float *kp, const float *vp, int64_t cap,
                const int64_t *prefix, int64_t pstride, const int64_t *plen,
                const int64_t *prompt_of, const int64_t *own, int64_t ostride,
                const int64_t *olen, int64_t rows, int64_t kv, int64_t group, int64_t dim,
                float scaling, float *out, float *scratch) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = prompt_of[r], np = plen[p], n = np + olen[r];
        const int64_t nb = (n + BLOCK - 1) / BLOCK * BLOCK;
        const int64_t *ps = prefix + p * pstride, *os = own + r * ostride;
        for (int64_t h = 0; h < kv; h++) {
            const float *K = kp + h * cap * dim, *V = vp + h * cap * dim;
            const float *Q = q + (r * kv + h) * group * dim;
            float *O = out + (r * kv + h) * group * dim;
            for (int64_t c0 = 0; c0 < n; c0 += BLOCK) {
                int64_t idx[BLOCK];
                for (int64_t c = 0; c < BLOCK; c++) {
                    int64_t cc = c0 + (c0 + c < n ? c : 0);
                    idx[c] = (cc < np ? ps[cc] : os[cc - np]) * dim;
                }
                for (int64_t g = 0; g < group; g++) {
                    float acc[BLOCK] = {0};
                    const float *qg = Q + g * dim;
                    for (int64_t d = 0; d < dim; d++)
                        for (int c = 0; c < BLOCK; c++) acc[c] += qg[d] * K[idx[c] + d];
                    for (int c = 0; c < BLOCK; c++) scratch[g * nb + c0 + c] = acc[c] * scaling;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scratch + g * nb, mx = -INFINITY, z = 0;
                for (int64_t c = 0; c < n; c++) mx = s[c] > mx ? s[c] : mx;
                for (int64_t c = 0; c < n; c++) s[c] -= mx;
                exp_le0(s, n);
                for (int64_t c = 0; c < n; c++) z += s[c];
                for (int64_t c = 0; c < n; c++) s[c] /= z;
            }
            memset(O, 0, sizeof(float) * group * dim);
            for (int64_t c = 0; c < n; c++) {
                const float *v = V + (c < np ? ps[c] : os[c - np]) * dim;
                for (int64_t g = 0; g < group; g++) {
                    const float w = scratch[g * nb + c];
                    float *o = O + g * dim;
                    for (int64_t d = 0; d < dim; d++) o[d] += w * v[d];
                }
            }
        }
    }
}
"""


def compile_kernel(workdir: Path) -> ctypes.CDLL:
    """The kernel, built with the C compiler on PATH (cc); RuntimeError if there is none."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH: install gcc to run this bench")
    src, lib = workdir / "inplace_attention.c", workdir / "inplace_attention.so"
    src.write_text(SOURCE)
    subprocess.run([cc, "-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared",
                    str(src), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    p, i = ctypes.c_void_p, ctypes.c_int64
    dll.decode_f32.argtypes = [p, p, p, i, p, i, p, p, p, i, p, i, i, i, i, ctypes.c_float, p, p]
    return dll


def filled_cache(prompts: int, rows: int, plen: int, olen: int, kv: int, group: int, dim: int):
    """One layer's pool after `olen - 1` decode steps of `prompts` x `rows`, with the next
    step begun; and that step's query, key and value."""
    from specrej_ray.engine.hf.block_manager import BlockManager
    from specrej_ray.engine.hf.kv_pool import DecodePlan, KVPool, PrefillPlan

    gen = torch.Generator().manual_seed(0)
    blocks, cache, gids = BlockManager(), KVPool(1), []
    for i in range(prompts):
        k = torch.randn(1, kv, plen, dim, generator=gen)
        slots = blocks.add_prefix(f"p{i}", plen)
        cache.expect(blocks.take_growth())
        cache.fit(blocks.capacity)
        cache.prefill(0, PrefillPlan(torch.from_numpy(slots)), torch.randn(
            1, kv * group, plen, dim, generator=gen), k, torch.randn(k.shape, generator=gen),
            dim ** -0.5)
        gids.append(blocks.add_group(f"p{i}", rows))
    n = prompts * rows
    plan, cpu = DecodePlan(plen + olen), torch.device("cpu")

    def step_inputs():
        kv_shape = (n, kv, 1, dim)
        return (torch.randn(n, kv * group, 1, dim, generator=gen),
                torch.randn(kv_shape, generator=gen), torch.randn(kv_shape, generator=gen))

    def begin(fed: int) -> None:
        slots = blocks.step([(g, fed) for g in gids])
        cache.expect(blocks.take_growth())
        cache.fit(blocks.capacity)
        cache.begin(slots, cpu)

    for fed in range(olen - 1):
        begin(fed)
        cache.decode(0, plan, *step_inputs(), dim ** -0.5)
    begin(olen - 1)  # the step measured: begun, its token the olen-th
    q, k, v = step_inputs()
    return cache, plan, (q, k, v)


def row(dll, prompts: int, rows: int, plen: int, olen: int, kv: int, group: int,
        dim: int) -> dict:
    cache, plan, (q, k, v) = filled_cache(prompts, rows, plen, olen, kv, group, dim)
    s, scaling, n = cache._step, dim ** -0.5, prompts * rows
    prefix, own = s.prefix.numpy(), s.own.numpy()  # the step's tables (on the CPU: shared)
    plens = np.full(prompts, plen, np.int64)
    olens = np.full(n, olen, np.int64)
    which = np.repeat(np.arange(prompts, dtype=np.int64), rows)
    scratch = np.empty(group * (prefix.shape[1] + own.shape[1] + 16), np.float32)
    out = torch.empty(n, 1, kv * group, dim)

    def cache_decode():
        return cache.decode(0, plan, q, k, v, scaling)

    def inplace():
        k_pool, v_pool = cache.write(0, k, v)  # as decode writes
        qc = q.reshape(n, kv * group, dim).contiguous()
        dll.decode_f32(qc.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[1],
                       prefix.ctypes.data, prefix.shape[1], plens.ctypes.data,
                       which.ctypes.data, own.ctypes.data, own.shape[1], olens.ctypes.data,
                       n, kv, group, dim, scaling, out.data_ptr(), scratch.ctypes.data)
        return out

    diff = (cache_decode() - inplace()).abs().max().item()
    repeat = max(20, int(2e5 // (n * (plen + olen))))
    ours, theirs = _us(cache_decode, repeat), _us(inplace, repeat)
    return {"prompts": prompts, "rows_each": rows, "prefix": plen, "own": olen,
            "kv_heads": kv, "group": group, "head_dim": dim,
            "cache_decode_us": round(ours, 1), "inplace_c_us": round(theirs, 1),
            "inplace_over_decode": round(theirs / ours, 2), "max_abs_diff": diff}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dll = compile_kernel(Path(tmp))
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f"inplace_attention: {e}", file=sys.stderr)
            return 2
        print("prompts x rows  prefix  own  kv x group x dim   decode us   in-place C us   "
              "C / decode   max diff")
        rows = []
        for shape in SHAPES:
            r = row(dll, *shape)
            print(f"{r['prompts']:>4} x {r['rows_each']:<4}  {r['prefix']:>6} {r['own']:>4}  "
                  f"{r['kv_heads']} x {r['group']} x {r['head_dim']:<9} "
                  f"{r['cache_decode_us']:>10.0f} {r['inplace_c_us']:>15.0f} "
                  f"{r['inplace_over_decode']:>12.2f} {r['max_abs_diff']:>10.1e}", flush=True)
            rows.append(r)
    save(args.out, {"threads": 1, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
