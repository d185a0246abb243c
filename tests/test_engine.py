"""Engine correctness on a tiny random Llama: identity, pruning, stopping, memory sizing."""

from __future__ import annotations

import pytest
import torch

from specrej_ray.engine.hf.engine import ScoreError
from specrej_ray.engine.hf.memory import kv_bytes_per_token
from specrej_ray.engine.sampling import (
    SamplingParams,
    candidate_uniforms,
    prompt_key,
    sample_next,
)
from tests.conftest import text_score
from tests.helpers.engines import budget_for, engine

PROMPT = "<|user|>Tell me something.<|assistant|>"


def prompt_ids(lm) -> list[int]:
    return lm[1](PROMPT, add_special_tokens=False).input_ids


def run(lm, *, score=text_score, prompt_id="p", **settings):
    return engine(lm, **settings).generate(prompt_id, prompt_ids(lm), score)


def tokens(result) -> list[list[int]]:
    return [c.tokens for c in result.candidates]


def test_candidate_identity_across_batch_compositions(lm):
    model, _ = lm
    plen = len(prompt_ids(lm))
    together = run(lm, alpha=0.0, n=6)
    # Room for one row to the end (19 fed tokens: 2 chunks of 16) beside the prompt.
    one_by_one = run(lm, alpha=0.0, n=6, budget=budget_for(model, plen + 32))
    assert one_by_one.waves == 6 and together.waves == 1
    assert tokens(one_by_one) == tokens(together)
    # A larger N starts with the same first candidates.
    assert tokens(run(lm, alpha=0.0, n=9))[:6] == tokens(together)


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


def test_n0_is_sized_by_the_peak_reservation(lm):
    model, _ = lm
    plen = len(prompt_ids(lm))
    # Tokens schedule: 16 candidates meet at 6 tokens (5 fed: one chunk each); room for 5.
    # The first 5 wait there while the others run (the prompt's own waves), then one
    # cut-off ranks all 16.
    sbon = run(lm, n=16, budget=budget_for(model, plen + 5 * 16))
    assert sbon.n0 == 5 and sbon.waves > 1 and sbon.rounds == 2
    # Best-of-N: rows must fit to the end (19 fed: two chunks each); room for 3.
    assert run(lm, n=16, alpha=0.0, budget=budget_for(model, plen + 3 * 32)).n0 == 3
    # Memory allows all: n0 is N.
    assert run(lm, n=16, budget=10**6).n0 == 16


def test_waves_are_ranked_against_one_cutoff(lm):
    """Split into waves by memory or not, a prompt rejects the same candidates: the first
    decision ranks all N together, as Algorithm 1 does."""
    model, _ = lm
    plen = len(prompt_ids(lm))
    for alpha in (0.5, 0.9):
        whole = run(lm, n=16, alpha=alpha)
        waves = run(lm, n=16, alpha=alpha, budget=budget_for(model, plen + 5 * 16))
        assert whole.waves == 1 and waves.waves > 1
        assert [c.rejected_round for c in waves.candidates] == [
            c.rejected_round for c in whole.candidates]
        assert tokens(waves) == tokens(whole)
        first = [c for c in whole.candidates if c.partial_scores]
        survivors = [c for c in first if c.rejected_round != 1]
        assert len(survivors) == max(1, round((1 - alpha) * 16 + 1e-9))


def decisions_of(result) -> list[tuple[int, int]]:
    """(length, live candidates scored there) per decision, in order."""
    at: dict[int, int] = {}
    for c in result.candidates:
        for t, _ in c.partial_scores:
            at[t] = at.get(t, 0) + 1
    return sorted(at.items())


def test_memory_schedule_decides_when_the_share_would_overflow(lm):
    model, _ = lm
    plen = len(prompt_ids(lm))
    # The device holds 8 rows of one chunk: 16 candidates meet at 4 tokens in two waves,
    # one decision ranks all 16, and the 8 survivors decide again when they would need a
    # second chunk each (the device is the share).
    room = plen + 8 * 16
    result = run(lm, n=16, decisions=None, max_new=40, budget=budget_for(model, room))
    assert result.n0 == 8
    rounds = decisions_of(result)
    assert rounds[0] == (4, 16)
    for length, live in rounds[1:]:
        assert plen + live * _chunks(length) > room >= plen + live * _chunks(length - 1)


def test_memory_schedule_share_is_per_prompt_on_a_large_device(lm):
    # N rows fill the prompt's share at min_decision_tokens; the survivors decide again
    # when they would outgrow it: 4 rows of 33 fed tokens need 3 chunks, 8 x 1 chunk fit.
    result = run(lm, n=8, decisions=None, budget=10**6, max_new=40)
    assert result.n0 == 8
    assert [t for t, _ in decisions_of(result)][:2] == [4, 33]


def test_n_auto_fills_the_budget(lm):
    model, _ = lm
    plen = len(prompt_ids(lm))
    budget = budget_for(model, plen + 12 * 16 + 5)
    result = run(lm, n=None, decisions=None, max_new=40, budget=budget)
    assert len(result.candidates) == result.n0 == 12
    assert decisions_of(result)[0] == (4, 12)


def _chunks(tokens: int) -> int:
    return -(-tokens // 16) * 16


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
    # The cache measures the same from its own tensors (what the budget is planned in).
    assert engine(lm).runner.bytes_per_token == kv_bytes_per_token(model.config, torch.float32)


def test_reward_ensemble_combines_per_prompt(lm):
    from specrej_ray.engine.scoring import RewardSet
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
