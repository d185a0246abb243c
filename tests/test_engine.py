"""Engine correctness on a tiny random Llama: identity, pruning, stopping, memory sizing."""

from __future__ import annotations

import pytest
import torch

from specrej_ray.engine.generate import Engine, ScoreError, SearchParams
from specrej_ray.engine.memory import kv_bytes_per_token
from specrej_ray.engine.sampling import (
    SamplingParams,
    candidate_uniforms,
    prompt_key,
    sample_next,
)
from tests.conftest import text_score

PROMPT = "<|user|>Tell me something.<|assistant|>"




def run(lm, *, n=8, alpha=0.5, decisions=(6, 12), budget=10**6, max_new=20, stop=(),
        temperature=1.0, top_p=1.0, top_k=0, score=text_score, seed=0, prompt_id="p",
        rewards=None):
    model, tok = lm
    sampling = SamplingParams(temperature, top_p, top_k, max_new, tuple(stop))
    search = SearchParams(n, alpha, decisions, 4, budget, seed)
    ids = tok(PROMPT, add_special_tokens=False).input_ids
    return Engine(model, tok, sampling, search, rewards).generate(prompt_id, ids, score)


def tokens(result) -> list[list[int]]:
    return [c.tokens for c in result.candidates]


def test_alpha_zero_is_best_of_n(lm):
    bon = run(lm, alpha=0.0)
    sbon0 = run(lm, alpha=0.0, decisions=(3, 7))
    assert tokens(sbon0) == tokens(bon)
    assert [c.final_score for c in sbon0.candidates] == [c.final_score for c in bon.candidates]
    assert bon.rejected == 0 and bon.rounds == 0 and bon.finished == 8
    finals = [c.final_score for c in bon.candidates]
    assert bon.best == finals.index(max(finals))


def test_pruning_never_changes_a_survivor(lm):
    bon, sbon = run(lm, alpha=0.0), run(lm, alpha=0.5)
    assert sbon.rejected > 0
    for b, s in zip(bon.candidates, sbon.candidates, strict=True):
        if s.finished:
            assert s.tokens == b.tokens and s.text == b.text
        else:
            assert b.tokens[: len(s.tokens)] == s.tokens
    assert sbon.tokens_generated < bon.tokens_generated


def test_candidate_identity_across_batch_compositions(lm):
    model, tok = lm
    plen = len(tok(PROMPT, add_special_tokens=False).input_ids)
    together = run(lm, alpha=0.0, n=6)
    one_by_one = run(lm, alpha=0.0, n=6, budget=plen + 20)
    assert one_by_one.waves == 6 and together.waves == 1
    assert tokens(one_by_one) == tokens(together)
    # A larger N starts with the same first candidates.
    assert tokens(run(lm, alpha=0.0, n=9))[:6] == tokens(together)


def test_seed_and_prompt_change_the_streams(lm):
    base = tokens(run(lm, alpha=0.0, n=3))
    assert tokens(run(lm, alpha=0.0, n=3, seed=1)) != base
    assert tokens(run(lm, alpha=0.0, n=3, prompt_id="other")) != base
    assert len({tuple(t) for t in base}) == 3


def test_rejects_the_lowest_partial_scores(lm):
    result = run(lm, alpha=0.5, decisions=(6,), n=8)
    first_round = [c for c in result.candidates if c.partial_scores and c.partial_scores[0][0] == 6]
    assert len(first_round) == 8  # nothing finishes in 6 tokens with this model
    rejected = [c.partial_scores[0][1] for c in first_round if c.rejected_round == 1]
    kept = [c.partial_scores[0][1] for c in first_round if c.rejected_round is None]
    assert len(rejected) == 4 and len(kept) == 4
    assert min(kept) >= max(rejected)
    assert all(c.final_score is not None for c in result.candidates if c.finished)


def test_eos_finishes_a_candidate(lm):
    model, tok = lm
    greedy = run(lm, alpha=0.0, n=1, temperature=0.0)
    eos_like = greedy.candidates[0].tokens[4]
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [old, eos_like]
    try:
        stopped = run(lm, alpha=0.0, n=1, temperature=0.0).candidates[0]
    finally:
        model.generation_config.eos_token_id = old
    first = greedy.candidates[0].tokens.index(eos_like)
    assert stopped.finish_reason == "eos"
    assert stopped.tokens == greedy.candidates[0].tokens[: first + 1]


def test_stop_string_cuts_the_response(lm):
    greedy = run(lm, alpha=0.0, n=1, temperature=0.0).candidates[0]
    assert greedy.finish_reason == "length" and len(greedy.tokens) == 20
    stop = greedy.text[8:10]
    cut = run(lm, alpha=0.0, n=1, temperature=0.0, stop=[stop]).candidates[0]
    assert cut.finish_reason == "stop"
    assert cut.text == greedy.text[: greedy.text.index(stop)]
    assert stop not in cut.text


def test_n0_follows_the_memory_rule(lm):
    model, tok = lm
    plen = len(tok(PROMPT, add_special_tokens=False).input_ids)
    # Tokens schedule: rows must fit up to the first decision (6 tokens).
    assert run(lm, n=16, budget=(plen + 6) * 5).n0 == 5
    # Best-of-N: rows must fit to max_new_tokens.
    assert run(lm, n=16, alpha=0.0, budget=(plen + 20) * 3).n0 == 3
    # Memory allows all: n0 is N.
    assert run(lm, n=16, budget=10**6).n0 == 16


def first_decision(result) -> int:
    return min(t for c in result.candidates for t, _ in c.partial_scores)


def test_memory_schedule_decides_when_the_budget_is_full(lm):
    model, tok = lm
    plen = len(tok(PROMPT, add_special_tokens=False).input_ids)
    # The device is the limit: 16 rows would not fit, n0 fills it to min_decision_tokens (4).
    budget = (plen + 8) * 8
    result = run(lm, n=16, decisions=None, budget=budget)
    n0 = budget // (plen + 4)
    assert result.n0 == n0 < 16
    # Token g is sampled from a cache of plen + g - 1; feeding it needs n0 * (plen + g).
    expected = next(g for g in range(4, 99) if n0 * (plen + g) > budget)
    assert first_decision(result) == expected
    assert result.rounds >= 1 and result.rejected >= n0 // 2


def test_memory_schedule_budget_is_per_prompt_on_a_large_device(lm):
    # N rows fill the prompt's share exactly at min_decision_tokens: decide right after,
    # then again when the survivors have grown back into the same share.
    result = run(lm, n=8, decisions=None, budget=10**6, max_new=40)
    assert result.n0 == 8 and first_decision(result) == 5
    model, tok = lm
    plen = len(tok(PROMPT, add_special_tokens=False).input_ids)
    rounds = sorted({t for c in result.candidates for t, _ in c.partial_scores})
    assert len(rounds) >= 2
    # After the first decision 4 rows live; they refill 8 * (plen + 4) at 2 * plen + 8 tokens.
    assert rounds[1] == next(g for g in range(6, 99) if 4 * (plen + g) > 8 * (plen + 4))


def test_non_finite_score_names_the_candidate(lm):
    def bad(responses):
        return [[float("nan")]] + [[0.0]] * (len(responses) - 1)

    with pytest.raises(ScoreError, match="candidate 0; a reward must return finite"):
        run(lm, score=bad)


def test_wrong_score_count_is_an_error(lm):
    with pytest.raises(ScoreError, match="returned 1 score rows"):
        run(lm, score=lambda rs: [[0.0]])


def test_sampling_is_a_function_of_its_own_row():
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=0)
    u = candidate_uniforms(3, prompt_key("x"), torch.arange(4), step=5)
    together = sample_next(logits, params, u)
    alone = torch.stack([sample_next(logits[i : i + 1], params, u[i : i + 1])[0] for i in range(4)])
    assert torch.equal(together, alone)


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -9.0, -9.0]]).repeat(200, 1)
    u = candidate_uniforms(0, 1, torch.arange(200), 0)
    assert set(sample_next(logits, SamplingParams(top_k=2), u).tolist()) == {0, 1}
    # p(0) ~ 0.665, p(1) ~ 0.245: top_p 0.7 needs tokens 0 and 1 only.
    assert set(sample_next(logits, SamplingParams(top_p=0.7), u).tolist()) == {0, 1}
    assert sample_next(logits, SamplingParams(temperature=0.0), u).unique().tolist() == [0]


def test_uniforms_are_in_range_and_differ():
    u = candidate_uniforms(0, prompt_key("a"), torch.arange(1000), 0)
    assert u.min().item() > 0.0 and u.max().item() < 1.0
    assert u.unique().numel() == 1000
    assert abs(u.mean().item() - 0.5) < 0.05


def test_kv_bytes_per_token_uses_grouped_query_heads(lm):
    model, _ = lm
    # 2 layers, 2 kv heads (of 4), head_dim 32 / 4 = 8, float32.
    assert kv_bytes_per_token(model.config, torch.float32) == 2 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token(model.config, torch.bfloat16) == 2 * 2 * 2 * 8 * 2


def test_reward_ensemble_combines_per_prompt(lm):
    from specrej_ray.engine.generate import RewardSet
    from specrej_ray.search.combine import zscores

    def two(responses):  # b is a rescaled a: z-scores agree, so decisions must not change
        return [[row[0], 1000 * row[0] + 5] for row in text_score(responses)]

    single = run(lm, alpha=0.5)
    both = run(lm, alpha=0.5, score=two, rewards=RewardSet(("a", "b"), (1.0, 3.0), "zscore"))
    assert tokens(both) == tokens(single)
    assert [c.rejected_round for c in both.candidates] == [
        c.rejected_round for c in single.candidates]
    finished = [c for c in both.candidates if c.finished]
    raw = [c.components["a"] for c in finished]
    assert raw == [c.final_score for c in single.candidates if c.finished]
    assert [c.components["b"] for c in finished] == pytest.approx([1000 * a + 5 for a in raw])
    assert [c.final_score for c in finished] == pytest.approx(zscores(raw))
    assert both.best == single.best


def full_sort_top_p(logits, params, u):
    """Nucleus sampling the plain way: the whole vocabulary, stably sorted."""
    values, order = (logits.float() / params.temperature).sort(dim=-1, descending=True,
                                                                stable=True)
    probs = torch.softmax(values, dim=-1).double()
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, 0.0)
    cdf = probs.cumsum(dim=-1)
    pos = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).clamp_(max=cdf.shape[-1] - 1)
    return order.gather(-1, pos).squeeze(-1)


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (full sort) to peaked (head only)
def test_nucleus_from_the_head_equals_the_full_sort(scale, monkeypatch):
    from specrej_ray.engine import sampling

    widths = []
    inverse_cdf = sampling._inverse_cdf
    monkeypatch.setattr(sampling, "_inverse_cdf",
                        lambda p, o, u: widths.append(p.shape) or inverse_cdf(p, o, u))
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(48, 5000, generator=gen) * scale
    logits[:8, 100:110] = logits[:8, 100:101]  # ties at the top of some rows
    logits[8:16, :] = logits[8:16, :1]  # every token tied: the full sort's order decides
    params = SamplingParams(temperature=0.8, top_p=0.9)
    u = candidate_uniforms(0, 5, torch.arange(48), 3)
    assert torch.equal(sample_next(logits, params, u), full_sort_top_p(logits, params, u))
    # The tied rows took the full sort; peaked rows were sampled from the head.
    paths = {w[1] for w in widths}
    assert paths == ({5000} if scale < 1 else {sampling.NUCLEUS_HEAD, 5000})
