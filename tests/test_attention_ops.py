"""bench/attention_ops.py (issue 30's mask and V-sum figures) calls the cache's own helpers:
it must keep doing so as they change, and its two V sums must agree."""

from __future__ import annotations

from bench.attention_ops import mask_row, v_row


def test_the_bench_runs_the_caches_bags_and_both_v_sums_agree():
    row = v_row(rows=3, cols=16, kv_heads=2, group=2, dim=8)
    assert row["max_abs_diff"] < 1e-5
    assert row["gather_product_us"] > 0 and row["embedding_bag_us"] > 0
    assert mask_row()["bias_us"] > 0  # it asserts the two masks equal itself
