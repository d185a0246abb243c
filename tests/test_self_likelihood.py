"""The generator's own likelihood, scored from the decode loop's log-probabilities (no second
forward pass): equal to the separate reward pass within float tolerance, which scores the
sampled ids as a job's rewards do (reward.tracked); the reward is asked only for responses
with no tokens of their own."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from specrej_ray.engine.decisions import response_tokens
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet
from specrej_ray.engine.stopping import StopChecker
from specrej_ray.engine.task import EngineTask, SearchParams
from specrej_ray.job.prepare import self_likelihood
from specrej_ray.reward.base import vocab_fingerprint
from specrej_ray.reward.likelihood import LMLikelihoodReward
from specrej_ray.reward.tracked import TrackedReward
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job

PROMPT = "Tell me about the sea."


@pytest.fixture(scope="module")
def reward(tiny_lm_dir):
    """The separate pass: the same model loaded again, as a reward actor would."""
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    return LMLikelihoodReward(model, AutoTokenizer.from_pretrained(tiny_lm_dir), name="ll",
                              batch_size=8)


class Separate:
    """The separate pass as a job's scorer makes it (local.LocalJob.scorer): the reward on
    each response's sampled ids, since it shares the generator's vocabulary."""

    def __init__(self, reward, vocab: str) -> None:
        self.tracked, self.vocab, self.asked = TrackedReward(reward, incremental=False), vocab, 0

    def __call__(self, texts, rewards=None, tracking=None):
        assert rewards in (None, (0,)) and tracking is not None
        self.asked += len(texts)
        got = self.tracked.score_request("p", PROMPT, texts, tracking.keys, tracking.ids,
                                         self.vocab, tracking.last)
        return [[s] for s in got]


def on_ids(reward, responses) -> list[float]:
    """The reward of (text, sampled ids) pairs, scored on the ids."""
    return reward.score_streams([reward.stream(PROMPT, text, ids) for text, ids in responses])


def run(lm, reward, *, free: bool, scored: bool, alpha=0.5):
    model, tok = lm
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    rewards = RewardSet(("ll",), (1.0,), "zscore", (free,))
    engine = Engine(model, tok, SamplingParams(1.0, 1.0, 0, 16),
                    SearchParams(12, alpha, (5,), 4, 10**6, 0), rewards)
    scorer = Separate(reward, vocab_fingerprint(tok))
    result = engine.run([EngineTask("p", ids, scorer, self_scored=scored)])[0]
    return result, scorer


def test_free_scores_equal_the_separate_pass(lm, reward):
    result, scorer = run(lm, reward, free=True, scored=True)
    finished = [c for c in result.candidates if c.finished]
    responses = [(c.text, response_tokens(c, len(c.tokens))) for c in finished]
    assert [c.components["ll"] for c in finished] == pytest.approx(on_ids(reward, responses),
                                                                   abs=1e-4)
    # Partial scores at the decision too, on what a live candidate had at 5 tokens.
    stopper = StopChecker(lm[1], set(), ())
    partial = [(c, s) for c in result.candidates for t, s in c.partial_scores if t == 5]
    assert partial
    cut = [(stopper.text(c.tokens[:5]), c.tokens[:5]) for c, _ in partial]
    assert [s for _, s in partial] == pytest.approx(on_ids(reward, cut), abs=1e-4)
    # Every response with tokens of its own was scored for free, those whose text does not
    # re-encode to the sampled tokens included (a random model emits special tokens and
    # broken UTF-8, which text drops or replaces); only empty responses cost a reward pass.
    def canonical(text, tokens):
        return lm[1](text, add_special_tokens=False).input_ids == tokens

    scored = responses + cut
    assert any(tokens and not canonical(text, tokens) for text, tokens in scored)
    assert scorer.asked == sum(not tokens for _, tokens in scored)


def test_same_outcome_as_scoring_with_the_reward(lm, reward):
    free, _ = run(lm, reward, free=True, scored=True)
    paid, scorer = run(lm, reward, free=False, scored=True)
    assert [c.tokens for c in free.candidates] == [c.tokens for c in paid.candidates]
    assert [c.rejected_round for c in free.candidates] == [
        c.rejected_round for c in paid.candidates]
    assert free.best == paid.best
    assert scorer.asked >= len([c for c in paid.candidates if c.finished])


def test_a_prompt_whose_context_differs_is_scored_by_the_reward(lm, reward):
    result, scorer = run(lm, reward, free=True, scored=False)
    finished = [c for c in result.candidates if c.finished]
    assert scorer.asked >= len(finished)


def test_self_likelihood_is_the_generator_loaded_the_same_way(tmp_path, tiny_lm_dir):
    base = tiny_job(tmp_path, tiny_lm_dir, tmp_path / "p.jsonl")
    assert self_likelihood(validate_spec(base)) == (True,)
    other = dict(base, reward=[{**base["reward"], "weight": 1.0},
                               {**base["reward"], "dtype": "bfloat16", "name": "bf16"}])
    assert self_likelihood(validate_spec(other)) == (True, False)
    classifier = dict(base, reward={"type": "callable", "function": "m:f"})
    assert self_likelihood(validate_spec(classifier)) == (False,)
