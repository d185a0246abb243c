"""Lossless pruning from bounds (search.bounds): a pruned candidate is never one the job keeps,
whatever the candidates go on to generate, and its witnesses rank above it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrej_ray.search.bounds import Keep, Standing, above, may_equal, prune
from specrej_ray.search.rejection import best_index

# Scores on a coarse grid, so ties (the index tie-break) are common.
SCORES = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
TEXTS = st.text(alphabet="ab", min_size=0, max_size=3)


@st.composite
def prompts(draw):
    """One prompt's candidates: each one's true final score and text, and what the pruning
    rule knows of it now (an interval around the score, a prefix of the text). The reward
    is a function of the text: equal texts score alike."""
    n = draw(st.integers(1, 8))
    cands, truth, score_of = [], [], {}
    for k in range(n):
        text = draw(TEXTS)
        final = score_of.setdefault(text, draw(SCORES))
        finished = draw(st.booleans())
        truncated = finished and draw(st.booleans())
        if finished:
            lo = hi = final
            seen = text
        else:
            lo = draw(st.sampled_from([s for s in (0.0, 0.25, 0.5, 0.75, 1.0) if s <= final]))
            hi = draw(st.sampled_from([s for s in (0.0, 0.25, 0.5, 0.75, 1.0) if s >= final]))
            seen = text[: draw(st.integers(0, len(text)))]
        cands.append(Standing(k, lo, hi, finished, truncated, seen))
        # A live candidate's end is unknown: it may still end at the length limit.
        truth.append((final, text, truncated if finished else draw(st.booleans())))
    return cands, truth


KEEPS = st.builds(Keep, top=st.integers(1, 3), drop_truncated=st.booleans(),
                  min_reward=st.sampled_from([None, 0.25, 0.5]), dedupe=st.booleans())


def kept_top(truth, keep: Keep) -> set[int]:
    """What the formats keep once every candidate finished (data.formats' filters and
    ranking): the best `top` after drop_truncated, min_reward and dedupe."""
    kept = list(range(len(truth)))
    if keep.drop_truncated:
        kept = [k for k in kept if not truth[k][2]]
    if keep.min_reward is not None:
        kept = [k for k in kept if truth[k][0] >= keep.min_reward]
    if keep.dedupe:
        first: dict[str, int] = {}
        for k in kept:
            first.setdefault(truth[k][1], k)
        kept = list(first.values())
    return set(sorted(kept, key=lambda k: (-truth[k][0], k))[: keep.top])


@settings(max_examples=600, deadline=None)
@given(prompts(), KEEPS)
def test_a_pruned_candidate_is_never_kept(prompt, keep):
    cands, truth = prompt
    result = prune(cands, keep)
    finals = [f for f, _, _ in truth]
    best = best_index(finals, [True] * len(finals))
    assert best not in result.pruned
    assert not set(result.pruned) & kept_top(truth, keep)
    assert all(not cands[k].finished for k in result.pruned)
    assert not set(result.pruned) & set(result.witnesses)


@settings(max_examples=300, deadline=None)
@given(prompts(), KEEPS)
def test_every_pruned_candidate_has_a_witness_above_it(prompt, keep):
    cands, _ = prompt
    result = prune(cands, keep)
    for k in result.pruned:
        assert any(above(cands[w], cands[k]) for w in result.witnesses) or any(
            above(cands[p], cands[k]) for p in result.pruned)


def test_ties_go_to_the_lower_index():
    a = Standing(0, 0.5, 0.5, finished=True, text="x")
    b = Standing(1, 0.0, 0.5)  # can at best tie a, and a wins the tie
    c = Standing(2, 0.5, 0.5, finished=True, text="y")
    assert prune([a, b], Keep()).pruned == (1,)
    assert prune([b, c], Keep()).pruned == ()  # c ties b at best but has the higher index
    assert prune([a, b], Keep()).witnesses == (0,)


def test_top_k_needs_k_witnesses_that_differ():
    one = Standing(0, 1.0, 1.0, finished=True, text="same")
    twin = Standing(1, 1.0, 1.0, finished=True, text="same")
    other = Standing(2, 1.0, 1.0, finished=True, text="else")
    loser = Standing(3, 0.0, 0.5)
    assert prune([one, twin, loser], Keep(top=2)).pruned == ()  # dedupe keeps one of them
    assert prune([one, twin, loser], Keep(top=2, dedupe=False)).pruned == (3,)
    assert prune([one, twin, other, loser], Keep(top=2)).pruned == (3,)


def test_filters_decide_who_may_witness():
    live = Standing(0, 1.0, 1.0, text="abc")  # met everything, still going
    loser = Standing(1, 0.0, 0.5)
    assert prune([live, loser], Keep()).pruned == (1,)
    # It may still end at the length limit and be dropped: it cannot witness for the files.
    assert prune([live, loser], Keep(drop_truncated=True)).pruned == ()
    done = Standing(0, 1.0, 1.0, finished=True, text="abc")
    assert prune([done, loser], Keep(drop_truncated=True)).pruned == (1,)
    # Below min_reward it is out of the files anyway; best.parquet still needs one above it.
    assert prune([live, loser], Keep(min_reward=0.75, drop_truncated=True)).pruned == (1,)


def test_texts_that_may_still_meet():
    assert may_equal(Standing(0, 0, 1, text="ab"), Standing(1, 0, 1, text="a"))
    assert not may_equal(Standing(0, 0, 1, text="ab"), Standing(1, 0, 1, text="b"))
    assert not may_equal(Standing(0, 0, 0, True, text="a"), Standing(1, 0, 1, text="ab"))
    assert may_equal(Standing(0, 0, 0, True, text="ab"), Standing(1, 0, 1, text="a"))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="empty"):
        Standing(0, 0.6, 0.5)
    with pytest.raises(ValueError, match="top"):
        Keep(top=0)
