"""The block manager alone owns the KV slots (issue 57): prefixes once, rows a page at a time,
pages shared by a fork until written (copy-on-write), and an exact count of what is held."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specrej_ray.engine.hf.block_manager import BlockManager
from specrej_ray.engine.hf.kv_pool import KVPool, PrefillPlan

CHUNK = 4
KV_HEADS, Q_HEADS, DIM = 2, 4, 8


def consistent(blocks: BlockManager) -> None:
    """What the free list says is held is what the tables and prefixes hold, and each slot's
    holders are counted."""
    held = blocks.held_slots()
    assert blocks.tokens() == len(held)
    assert (blocks._refs[held] > 0).all()
    free = blocks._free
    assert len(np.unique(free)) == len(free) and not np.isin(free, held).any()
    assert (blocks._refs[free] == 0).all()


def test_a_fork_shares_its_parents_pages_and_charges_nothing():
    blocks = BlockManager(CHUNK)
    blocks.add_prefix("p", 5)
    parent = blocks.add_group("p", 2)
    for cached in range(6):  # 6 tokens: two pages a row
        blocks.step([(parent, cached)])
    before = blocks.tokens()
    assert before == 5 + 2 * 2 * CHUNK
    child = blocks.fork(parent, [1, 1, 0], 6)
    assert blocks.tokens() == before  # nothing added yet
    table = blocks._groups[child].table
    assert (table == blocks._groups[parent].table[[1, 1, 0]]).all()
    consistent(blocks)


def test_the_first_write_into_a_shared_page_copies_only_its_written_part():
    blocks = BlockManager(CHUNK)
    blocks.add_prefix("p", 3)
    parent = blocks.add_group("p", 1)
    for cached in range(6):  # page 0 full, page 1 holds 2 of 4
        blocks.step([(parent, cached)])
    parent_pages = blocks._groups[parent].table.copy()
    child = blocks.fork(parent, [0], 6)
    before = blocks.tokens()
    assert blocks.growth(child, 6) == CHUNK  # its shared partial page
    step = blocks.step([(child, 6)])
    assert blocks.tokens() == before + CHUNK  # one page copied, the full one still shared
    child_table = blocks._groups[child].table
    assert (child_table[0, :CHUNK] == parent_pages[0, :CHUNK]).all()
    assert not np.isin(child_table[0, CHUNK:], parent_pages).any()
    assert step.copy_from.tolist() == parent_pages[0, CHUNK : CHUNK + 2].tolist()
    assert step.copy_to.tolist() == child_table[0, CHUNK : CHUNK + 2].tolist()
    assert step.write[0] == child_table[0, 6]
    # The parent's page is its own again: it writes in place, copying nothing.
    assert blocks.growth(parent, 6) == 0
    again = blocks.step([(parent, 6)])
    assert len(again.copy_to) == 0 and (blocks._groups[parent].table == parent_pages).all()
    consistent(blocks)


def test_a_fork_at_a_page_boundary_copies_nothing_and_takes_a_fresh_page():
    blocks = BlockManager(CHUNK)
    blocks.add_prefix("p", 1)
    parent = blocks.add_group("p", 3)
    for cached in range(CHUNK):
        blocks.step([(parent, cached)])
    child = blocks.fork(parent, [2], CHUNK)
    step = blocks.step([(child, CHUNK)])
    assert len(step.copy_to) == 0
    assert blocks.tokens() == 1 + 3 * CHUNK + CHUNK
    consistent(blocks)


def test_freeing_a_shared_page_keeps_it_for_the_other_holder():
    blocks = BlockManager(CHUNK)
    blocks.add_prefix("p", 2)
    parent = blocks.add_group("p", 1)
    for cached in range(3):
        blocks.step([(parent, cached)])
    child = blocks.fork(parent, [0, 0], 3)
    blocks.drop_group(parent)
    assert blocks.tokens() == 2 + CHUNK  # the child still holds the page
    blocks.keep_rows(child, [1])
    assert blocks.tokens() == 2 + CHUNK
    blocks.drop_group(child)
    assert blocks.tokens() == 2
    blocks.drop_prefix("p")
    assert blocks.tokens() == 0
    consistent(blocks)


def test_the_limit_holds_and_a_fork_beyond_its_parent_is_refused():
    blocks = BlockManager(CHUNK)
    blocks.set_limit(12)
    blocks.add_prefix("p", 4)
    g = blocks.add_group("p", 2)
    blocks.step([(g, 0)])
    with pytest.raises(ValueError, match="columns"):
        blocks.fork(g, [0], CHUNK + 1)
    with pytest.raises(RuntimeError, match="budget of 12"):
        blocks.add_prefix("q", 5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["step", "fork", "keep", "drop"]),
                          st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=40))
def test_random_steps_forks_and_frees_keep_the_count_exact(ops):
    """Whatever the order of steps, forks, prunes and drops, the free list and the tables
    agree, a slot is written by one table only, and everything returns when all is dropped."""
    blocks = BlockManager(CHUNK)
    blocks.add_prefix("p", 3)
    groups = {blocks.add_group("p", 2): 0}  # gid -> tokens its rows hold
    for op, a, b in ops:
        gids = sorted(groups)
        if not gids:
            break
        gid = gids[a % len(gids)]
        if op == "step":
            slots = blocks.step([(gid, groups[gid])])
            others = [blocks._groups[g].table for g in groups if g != gid]
            # A row's new slot is its own: no other row's table has it.
            assert not any(np.isin(slots.write, t).any() for t in others)
            assert len(np.unique(slots.write)) == len(slots.write)
            groups[gid] += 1
        elif op == "fork" and groups[gid]:
            rows = len(blocks._groups[gid].table)
            at = 1 + b % groups[gid]
            groups[blocks.fork(gid, [b % rows, a % rows], at)] = at
        elif op == "keep":
            rows = len(blocks._groups[gid].table)
            keep = [i for i in range(rows) if (b >> i) & 1]
            blocks.keep_rows(gid, keep)
            if not keep:
                del groups[gid]
        elif op == "drop":
            blocks.drop_group(gid)
            del groups[gid]
        consistent(blocks)
    for gid in list(groups):
        blocks.drop_group(gid)
    blocks.drop_prefix("p")
    assert blocks.tokens() == 0
    consistent(blocks)


def _attend(q, keys, values):
    return torch.nn.functional.scaled_dot_product_attention(q, keys[None], values[None],
                                                            enable_gqa=True)


def test_a_forked_row_attends_to_its_parents_prefix_and_its_own_tokens():
    """On the device: the child sees the parent's first `at` tokens (shared pages, the
    partial one copied on its first write) and then its own; the parent, writing on, sees
    only its own, though the child's copy came from its page."""
    gen = torch.Generator().manual_seed(3)
    blocks, pool = BlockManager(CHUNK), KVPool(layers=1)
    pk, pv, pq = (torch.randn(1, h, 5, DIM, generator=gen)
                  for h in (KV_HEADS, KV_HEADS, Q_HEADS))
    slots = blocks.add_prefix("p", 5)
    pool.expect(blocks.take_growth())
    pool.fit(blocks.capacity)
    pool.prefill(0, PrefillPlan(torch.from_numpy(slots)), pq, pk, pv, DIM**-0.5)

    def step(steps):
        rows = sum(len(blocks._groups[g].table) for g, _ in steps)
        q = torch.randn(rows, Q_HEADS, 1, DIM, generator=gen)
        k = torch.randn(rows, KV_HEADS, 1, DIM, generator=gen)
        v = torch.randn(rows, KV_HEADS, 1, DIM, generator=gen)
        plan = blocks.step(steps)
        pool.expect(blocks.take_growth())
        pool.fit(blocks.capacity)
        pool.begin(plan, torch.device("cpu"))
        out = pool.decode(0, None, q, k, v, DIM**-0.5)
        pool.end()
        return q, k, v, out

    parent = blocks.add_group("p", 1)
    own = {"parent": [], "child": []}
    for cached in range(6):
        q, k, v, _ = step([(parent, cached)])
        own["parent"].append((k[0, :, 0], v[0, :, 0]))
    child = blocks.fork(parent, [0], 6)
    own["child"] = list(own["parent"])
    for n in range(3):  # both write on: the child copies the partial page, the parent does not
        q, k, v, out = step([(child, 6 + n), (parent, 6 + n)])
        for row, name in enumerate(("child", "parent")):
            own[name].append((k[row, :, 0], v[row, :, 0]))
            keys = torch.cat([pk[0], torch.stack([x for x, _ in own[name]], 1)], 1)
            values = torch.cat([pv[0], torch.stack([y for _, y in own[name]], 1)], 1)
            want = _attend(q[row : row + 1], keys, values)
            torch.testing.assert_close(out[row, 0], want[0, :, 0], rtol=1e-5, atol=1e-5)
    consistent(blocks)
