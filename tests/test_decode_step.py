"""The batched decode step (issue 30): cascade attention over the slot pool, and a step whose
operations do not grow with the prompts in flight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specrej_ray.engine.hf.batch import Streams
from specrej_ray.engine.hf.block_manager import BlockManager
from specrej_ray.engine.hf.kv_pool import KVPool, PrefillPlan, RowLayout
from specrej_ray.engine.hf.model_runner import ModelRunner
from specrej_ray.engine.sampling import SamplingParams

KV_HEADS, Q_HEADS, DIM = 2, 4, 8


class Rows:
    """A group of rows for the runner: fixed tokens, one prompt."""

    def __init__(self, blocks: BlockManager, prefix, pkey: int, rows: int) -> None:
        self.pkey, self.rows, self.fed = pkey, rows, 0
        self.gid = blocks.add_group(prefix, rows)

    def feed(self) -> list[int]:
        return [(7 * self.fed + r) % 50 + 5 for r in range(self.rows)]


class Steps:
    """A runner driven by hand: prompts prefilled, groups of rows fed fixed tokens."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.blocks, self.groups = runner, BlockManager(), []

    def prompt(self, key, ids: list[int]) -> None:
        slots = self.blocks.add_prefix(key, len(ids))
        self.runner.pool.expect(self.blocks.take_growth())
        self.runner.prefill(slots, self.blocks.capacity, ids)

    def rows(self, key, pkey: int, rows: int) -> Rows:
        self.groups.append(Rows(self.blocks, key, pkey, rows))
        return self.groups[-1]

    def decode(self) -> torch.Tensor:
        slots = self.blocks.step([(g.gid, g.fed) for g in self.groups])
        self.runner.pool.expect(self.blocks.take_growth())
        tokens = np.concatenate([np.array(g.feed(), np.int64) for g in self.groups])
        return self.runner.decode(slots, tokens, self.blocks.capacity)

    def streams(self) -> Streams:
        sizes = [g.rows for g in self.groups]
        return Streams(np.repeat([g.pkey for g in self.groups], sizes).astype(np.int64),
                       np.concatenate([np.arange(g.rows) for g in self.groups]),
                       np.repeat([g.fed + 1 for g in self.groups], sizes).astype(np.int64))

    def advance(self) -> None:
        for g in self.groups:
            g.fed += 1

    def clear(self) -> None:
        self.runner.pool.clear()


def test_row_layout_is_its_docstrings_example_and_goes_back_exactly():
    """Groups a1 (prompt A, 2 rows), b1 (prompt B, 3 rows), a2 (prompt A, 1 row)."""
    layout = RowLayout.of(np.array([0, 0, 1, 1, 1, 0]), 2, torch.from_numpy)
    assert (layout.prompts, layout.padded_rows) == (2, 4)
    assert layout.row_at.tolist() == [[0, 1, 5, 0], [2, 3, 4, 0]]
    assert layout.place_of.tolist() == [0, 1, 4, 5, 6, 2]
    rows = torch.arange(6.0).view(1, 6, 1, 1)
    assert layout.to_prompts(rows).flatten().tolist() == [0, 1, 5, 0, 2, 3, 4, 0]
    assert torch.equal(layout.to_rows(layout.to_prompts(rows)), rows)
    # Rows that already stand as prompts x rows: a reshape, padded with zero rows.
    inorder = RowLayout.of(np.array([0, 0, 1, 1]), 2, torch.from_numpy)
    assert inorder.row_at is None and (inorder.rows_each, inorder.padded_rows) == (2, 4)
    rows = torch.arange(1.0, 5.0).view(1, 4, 1, 1)
    assert inorder.to_prompts(rows).flatten().tolist() == [1, 2, 0, 0, 3, 4, 0, 0]
    assert torch.equal(inorder.to_rows(inorder.to_prompts(rows)), rows)


def _prefill(blocks: BlockManager, pool: KVPool, key: str, n: int,
             gen) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(1, KV_HEADS, n, DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, n, DIM, generator=gen)
    q = torch.randn(1, Q_HEADS, n, DIM, generator=gen)
    slots = blocks.add_prefix(key, n)
    pool.expect(blocks.take_growth())
    pool.fit(blocks.capacity)
    pool.prefill(0, PrefillPlan(torch.from_numpy(slots)), q, k, v, DIM**-0.5)
    return k[0], v[0]


def _decode(blocks: BlockManager, pool: KVPool, steps: list[tuple[int, int]], q, k, v):
    """One decode step of these (group, cached) on layer 0 of the pool."""
    slots = blocks.step(steps)
    pool.expect(blocks.take_growth())
    pool.fit(blocks.capacity)
    pool.begin(slots, torch.device("cpu"))
    got = pool.decode(0, None, q, k, v, DIM**-0.5)
    pool.end()
    return got


def test_cascade_attention_equals_plain_attention_over_prefix_and_own_tokens():
    """Prompts of different lengths, groups of different lengths and sizes, rows pruned on
    the way: every row's output is softmax attention over its prefix and its own tokens."""
    gen = torch.Generator().manual_seed(0)
    blocks, pool = BlockManager(chunk=4), KVPool(layers=1)
    prefixes = {key: _prefill(blocks, pool, key, n, gen)
                for key, n in (("a", 5), ("b", 11), ("c", 1))}
    groups = [(blocks.add_group(key, rows), key, rows)
              for key, rows in (("a", 3), ("b", 2), ("a", 1), ("c", 4), ("b", 5))]
    own = {}
    for gid, _, rows in groups:
        own[gid] = [[] for _ in range(rows)]
    for step in range(9):
        # Groups join late and step unevenly, so their lengths differ.
        gids = [gid for i, (gid, _, _) in enumerate(groups) if step >= i and (step + i) % 3]
        if not gids:
            continue
        if step == 6:  # prune: keep rows 2 and 0 of the fifth group, in that order
            g5 = groups[4][0]
            blocks.keep_rows(g5, [2, 0])
            own[g5] = [own[g5][2], own[g5][0]]
        rows = sum(len(own[g]) for g in gids)
        q = torch.randn(rows, Q_HEADS, 1, DIM, generator=gen)
        k = torch.randn(rows, KV_HEADS, 1, DIM, generator=gen)
        v = torch.randn(rows, KV_HEADS, 1, DIM, generator=gen)
        got = _decode(blocks, pool, [(g, len(own[g][0])) for g in gids], q, k, v)
        at = 0
        for gid in gids:
            key = dict((g, p) for g, p, _ in groups)[gid]
            pk, pv = prefixes[key]
            for r in range(len(own[gid])):
                own[gid][r].append((k[at, :, 0], v[at, :, 0]))
                keys = torch.cat([pk, torch.stack([x for x, _ in own[gid][r]], 1)], 1)
                values = torch.cat([pv, torch.stack([y for _, y in own[gid][r]], 1)], 1)
                want = torch.nn.functional.scaled_dot_product_attention(
                    q[at : at + 1], keys[None], values[None], enable_gqa=True)
                torch.testing.assert_close(got[at, 0], want[0, :, 0], rtol=1e-5, atol=1e-5)
                at += 1
    assert blocks.tokens() == 5 + 11 + 1 + sum(
        len(r) * -(-len(r[0]) // 4) * 4 for r in own.values() if r and r[0])


def test_slots_are_exact_reused_and_never_past_the_limit():
    gen = torch.Generator().manual_seed(1)
    blocks, pool = BlockManager(chunk=4), KVPool(layers=1)
    blocks.set_limit(40)
    _prefill(blocks, pool, "p", 6, gen)
    g = blocks.add_group("p", 5)
    fed = 0
    for _ in range(5):  # 5 rows x 8 columns = 40 slots with the prefix's 6: too many at step 5
        if blocks.tokens() + blocks.growth(g, fed) > 40:
            break
        _decode(blocks, pool, [(g, fed)],
                *(torch.randn(5, h, 1, DIM) for h in (Q_HEADS, KV_HEADS, KV_HEADS)))
        fed += 1
    assert blocks.tokens() == 6 + 5 * 4 == len(blocks.held_slots())
    blocks.keep_rows(g, [1, 3])
    assert blocks.tokens() == 6 + 2 * 4
    blocks.step([(g, fed)])  # a second chunk: the freed slots serve it
    assert blocks.tokens() == 6 + 2 * 8
    pool.expect(blocks.take_growth())
    pool.fit(blocks.capacity)
    assert pool.capacity_bytes() <= 40 * pool.slot_bytes()
    with pytest.raises(RuntimeError, match="budget"):
        blocks.add_prefix("q", 41 - blocks.tokens())


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _step_ops(lm, spread: tuple[int, ...], steps: int = 3) -> list[int]:
    """aten operations of each decode + sample of `steps` steps; spread: rows of each prompt."""
    run = Steps(ModelRunner(lm[0]))
    for p, rows in enumerate(spread):
        run.prompt(("p", p), [5 + p, 9, 12 + p, 4][: 2 + p % 3])
        run.rows(("p", p), pkey=p, rows=rows)
    counts = []
    for _ in range(steps):
        with Ops() as ops:
            logits = run.decode()
            run.runner.sample(logits, run.streams(), SamplingParams(), seed=0)
        run.advance()
        counts.append(ops.count)
    run.clear()
    return counts


def test_a_decode_step_launches_the_same_operations_whatever_the_prompts_in_flight(lm):
    """16 rows over 1 to 16 prompts: the operations a step do not grow with the prompts (the
    old cache launched about ten more per prompt and layer). Three layouts, each its own
    constant: prompts of equal rows in order, MIN_ROWS or more (a reshape), or fewer (a
    reshape and a zero pad); any other spread is reordered by index each way, the most."""
    kinds = {"reshaped": ((16,), (4, 4, 4, 4)), "padded": ((2,) * 8, (1,) * 16),
             "reordered": ((5, 3, 8), (1, 2, 3, 4, 6))}
    counts = {kind: {s: _step_ops(lm, s) for s in spreads} for kind, spreads in kinds.items()}
    # The first step also grows the pool (a copy per layer, once in many steps).
    per_kind = {kind: {n for c in found.values() for n in c[1:]} for kind, found in counts.items()}
    assert all(len(n) == 1 for n in per_kind.values()), counts
    reshaped, padded, reordered = (per_kind[k].pop() for k in kinds)
    assert reshaped < padded < reordered, counts


def _logits_of_first(runner: ModelRunner, spec, steps: int = 20) -> torch.Tensor:
    """Logits of the first group's rows at every step; spec: (prompt, rows, join step)."""
    run, out = Steps(runner), []
    for step in range(steps):
        for p, rows, join in spec:
            if join == step:
                key = ("p", p)
                if not run.blocks.has_prefix(key):
                    run.prompt(key, [5 + p, 9, 12 + p, 4, 7, 8, 30, 31, 2][: 2 + p % 7])
                run.rows(key, p, rows)
        logits = run.decode()
        out.append(logits[: run.groups[0].rows].clone())
        run.advance()
    run.clear()
    return torch.stack(out)


def test_a_rows_logits_are_bit_identical_whatever_shares_its_step(lm):
    """Candidate identity at the bit level: other prompts (longer and shorter prefixes, more
    and fewer rows, joining later so their lengths differ) change nothing in a row's logits,
    though they change every padding of the step. On CPU only: cuBLAS picks kernels by
    shape, so on a GPU identity holds in distribution (docs/engine.md)."""
    if lm[0].device.type != "cpu":
        pytest.skip("bit identity across batches is a CPU property (cuBLAS picks by shape)")
    runner = ModelRunner(lm[0])
    alone = _logits_of_first(runner, [(0, 6, 0)])
    mixes = ([(0, 6, 0), (1, 3, 0)], [(0, 6, 0), (3, 40, 2), (5, 1, 7)],
             [(0, 6, 0)] + [(p, 2, p) for p in range(1, 18)])
    for spec in mixes:
        got = _logits_of_first(runner, spec)
        differ = (got != alone).flatten(1).sum(1)
        assert not differ.any(), (spec, differ.tolist(), (got - alone).abs().max().item())
