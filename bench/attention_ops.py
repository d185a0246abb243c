"""The decode step's attention operations alone, old way against new (issue 30): what the
cache's mask and its own tokens' V sum cost, one layer, one torch thread, the pool warm.

- mask: the step's scores (prefix and own columns concatenated) scaled, then masked with a bool
  mask broadcast over the heads (`masked_fill_`), against scaled in place, then a 0/-inf bias
  added (the two lines of `KVPool.decode`, before and after);
- V: the own tokens' V gathered from the pool then a batched product, against one
  `embedding_bag` over the pool (a bag per kv head, row and query head).

    .venv/bin/python bench/attention_ops.py
    .venv/bin/python bench/attention_ops.py --out bench/results/attention_ops.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.results_io import save  # noqa: E402

# rows, own columns, kv heads, query heads per kv head, head dim: the negligible model of
# bench/host_overhead.py at 512 rows, and SmolLM2-135M at the fair bench's row counts.
SHAPES = ((512, 48, 2, 2, 16), (4, 300, 3, 3, 64), (25, 320, 3, 3, 64), (36, 300, 3, 3, 64))
SLOTS = 40_000  # the pool's capacity


def _us(fn, repeat: int = 100) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e6 * (time.perf_counter() - t0) / repeat


def mask_row() -> dict:
    shared, own = torch.randn(2, 512, 2, 32), torch.randn(2, 512, 2, 64)
    pad = torch.rand(512, 1, 96) < 0.2
    bias = torch.zeros(512, 1, 96).masked_fill_(pad, -torch.inf)

    def filled():
        return (torch.cat([shared, own], dim=-1) * 0.25).masked_fill_(pad, -torch.inf)

    def biased():
        return torch.cat([shared, own], dim=-1).mul_(0.25).add_(bias)

    assert torch.equal(filled(), biased())
    return {"scores": [2, 512, 2, 96], "masked_fill_us": round(_us(filled), 1),
            "bias_us": round(_us(biased), 1)}


def v_row(rows: int, cols: int, kv_heads: int, group: int, dim: int) -> dict:
    from specrej_ray.engine.hf.kv_pool import _bags, _gather

    pool = torch.randn(kv_heads, SLOTS, dim)
    own = torch.randint(0, SLOTS, (rows, cols))
    probs = torch.softmax(torch.randn(kv_heads, rows, group, cols), -1)
    bags, starts = _bags(own, kv_heads, group, SLOTS)

    def gathered():
        return torch.matmul(probs, _gather(pool, own))

    def bagged():  # as KVPool.decode calls it
        return F.embedding_bag(bags, pool.view(-1, dim), starts, mode="sum",
                               per_sample_weights=probs.reshape(-1))

    diff = (gathered().reshape(-1, dim) - bagged()).abs().max().item()
    return {"rows": rows, "cols": cols, "kv_heads": kv_heads, "group": group, "dim": dim,
            "gather_product_us": round(_us(gathered), 1), "embedding_bag_us": round(_us(bagged), 1),
            "max_abs_diff": diff}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mask = mask_row()
    print(f"mask on {mask['scores']}: masked fill {mask['masked_fill_us']} us, "
          f"bias {mask['bias_us']} us")
    rows = []
    for shape in SHAPES:
        row = v_row(*shape)
        print(f"V, {row['rows']} x {row['cols']}, {row['kv_heads']} x {row['group']} x "
              f"{row['dim']}: gather + product {row['gather_product_us']} us, embedding bag "
              f"{row['embedding_bag_us']} us", flush=True)
        rows.append(row)
    save(args.out, {"mask": mask, "v": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
