"""Survivors that branch, on the hf engine (issue 56): the parents drawn by rank, and a child
that shares its parent's KV pages instead of replaying them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from specrej_ray.search.branching import branch_uniform, choose_parents, rank_weights, systematic
from tests.helpers.engines import engine
from tests.test_refill import PROMPTS, tasks


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.integers(0, 30),
       st.floats(0, 0.999))
def test_systematic_resampling_gives_each_its_share_up_to_one(weights, draws, u):
    total = sum(weights)
    if total == 0:
        return
    w = [x / total for x in weights]
    picks = systematic(w, draws, u)
    assert len(picks) == draws and picks == sorted(picks)
    for i, share in enumerate(w):
        assert abs(picks.count(i) - draws * share) < 1 + 1e-9


def test_parents_are_ranked_by_score_and_the_ineligible_never_chosen():
    scores, indices = [0.1, 0.9, 0.5, 0.9], [10, 11, 12, 13]
    parents = choose_parents(scores, indices, 10, 0.3, eligible=[True, True, True, False])
    assert set(parents) <= {10, 11, 12} and 13 not in parents
    assert parents.count(11) >= parents.count(12) >= parents.count(10)
    assert rank_weights(3) == [3 / 6, 2 / 6, 1 / 6]
    assert choose_parents(scores, indices, 3, 0.5, eligible=[False] * 4) == []
    assert branch_uniform(0, 7, 1) == branch_uniform(0, 7, 1) != branch_uniform(0, 7, 2)


def test_children_share_their_parents_pages_and_replay_nothing(lm):
    """With room for every row, a child enters the cache as a fork of its parent's row: no
    token is replayed, and the children's text is the same as with replays forced (a budget
    that evicts)."""
    wide = engine(lm, n=8, alpha=0.5, decisions=(5, 11), max_new=18, branch=True)
    results = wide.run(tasks(lm))
    assert wide.stats.replayed_tokens == 0
    assert sum(c.parent is not None for r in results for c in r.candidates) > 0
    alone = [engine(lm, n=8, alpha=0.5, decisions=(5, 11), max_new=18, branch=True)
             .run(tasks(lm, (pid,)))[0] for pid in PROMPTS]
    for a, b in zip(results, alone, strict=True):
        assert [(c.tokens, c.parent) for c in a.candidates] == \
            [(c.tokens, c.parent) for c in b.candidates]
