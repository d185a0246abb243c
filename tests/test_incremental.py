"""Incremental reward scoring equals full re-scoring (likelihood and causal classifier rewards),
drops the caches of rejected and finished candidates, stays within its memory bound, takes the
generator's token ids only from the same tokenizer, and processes fewer reward tokens."""

from __future__ import annotations

import random

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from specrej_ray.engine.scoring import RewardSet
from specrej_ray.engine.task import EngineTask
from specrej_ray.reward.base import vocab_fingerprint
from specrej_ray.reward.classifier import ClassifierReward
from specrej_ray.reward.incremental import IncrementalScorer
from specrej_ray.reward.likelihood import LMLikelihoodReward
from specrej_ray.reward.streams import Item, Stream
from specrej_ray.reward.tracked import TrackedReward
from tests.helpers.engines import engine
from tests.tiny import save_tiny_classifier

PROMPT = "Tell me about the sea."
TOL = 1e-4


@pytest.fixture(scope="module")
def likelihood(tiny_lm_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    return LMLikelihoodReward(model, AutoTokenizer.from_pretrained(tiny_lm_dir), name="ll",
                              batch_size=3)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = save_tiny_classifier(tmp_path_factory.mktemp("models") / "tiny-rm")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return ClassifierReward(model, AutoTokenizer.from_pretrained(path), name="rm", batch_size=3)


def texts(seed: int, n: int = 8) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh ij") for _ in range(rng.randint(12, 60)))
            for _ in range(n)]


def sbon_requests(finals: list[str], decisions=(8, 16, 32), seed: int = 0):
    """The requests a prompt's SBoN makes: at each decision the unscored finished candidates
    (full text) and the live ones (their text so far); half the live ones are rejected after
    it; at the end the last finished ones, marked last."""
    rng = random.Random(seed)
    in_play, scored = set(range(len(finals))), set()
    for t in decisions:
        done = [k for k in sorted(in_play) if len(finals[k]) <= t and k not in scored]
        live = [k for k in sorted(in_play) if len(finals[k]) > t]
        if not live:
            break
        yield [(k, finals[k]) for k in done] + [(k, finals[k][:t]) for k in live], False
        scored |= set(done)
        for k in rng.sample(live, len(live) // 2):
            in_play.discard(k)
    rest = [k for k in sorted(in_play) if k not in scored]
    yield [(k, finals[k]) for k in rest], True


@pytest.mark.parametrize("which", ["likelihood", "classifier"])
def test_incremental_scores_equal_full_rescoring(which, likelihood, classifier):
    reward = likelihood if which == "likelihood" else classifier
    tracked = TrackedReward(reward)
    assert tracked.incremental
    for seed in range(3):
        for items, last in sbon_requests(texts(seed), seed=seed):
            keys, responses = [k for k, _ in items], [r for _, r in items]
            got = tracked.score_request(f"p{seed}", PROMPT, responses, keys, last=last)
            want = reward.score([PROMPT] * len(responses), responses)
            assert got == pytest.approx(want, abs=TOL)
    s = tracked.stats
    assert s.fallbacks == 0 and 0 < s.tokens < s.full_tokens
    assert not tracked.scorer.prompts  # every prompt's last request dropped its rows


def test_rows_follow_the_request_new_ones_join_and_others_go(likelihood):
    tracked = TrackedReward(likelihood)
    finals = texts(7, n=4)
    first = tracked.score_request("p", PROMPT, [f[:10] for f in finals], [0, 1, 2, 3])
    assert len(first) == 4
    rows = tracked.scorer.prompts["p"]
    assert rows.keys == [0, 1, 2, 3]
    # 1 and 3 rejected, a new candidate 9 joins (a later wave), 0 finished with its full text.
    again = [finals[0], finals[2][:11], "abc"]
    got = tracked.score_request("p", PROMPT, again, [0, 2, 9])
    assert rows.keys == [0, 2, 9]
    assert got == pytest.approx(likelihood.score([PROMPT] * 3, again), abs=TOL)


def test_a_row_past_the_new_stream_keeps_only_the_common_prefix(likelihood):
    """Re-encoded text can change its last tokens as text grows (a merge): the row masks what
    no longer matches and feeds the rest; the score is the full pass's."""
    ctx, _ = likelihood.encode_pair(PROMPT, "x")
    inc = IncrementalScorer(likelihood.model, "likelihood", likelihood.pad, 1 << 30)

    def stream(tgt):
        return Stream((ctx + tgt)[:-1], len(ctx) - 1, targets=tgt)

    def full(tgts):
        return likelihood.score_streams([stream(t) for t in tgts])

    a, b = [40, 41, 42, 43, 44], [40, 50, 51, 52, 53, 54, 55]
    for tgts in ([a], [b], [b + [60, 61]], [a[:2]]):
        items = [Item(0, stream(t)) for t in tgts]
        got = inc.score("p", items, lambda idx: pytest.fail("no fallback expected"))
        assert got == pytest.approx(full(tgts), abs=TOL)


def test_memory_bound_forgets_prompts_and_scores_stay_exact(likelihood):
    tracked = TrackedReward(likelihood, cache_bytes=1)  # nothing fits
    for pid, seed in (("a", 1), ("b", 2), ("a", 3)):
        responses = texts(seed, n=3)
        got = tracked.score_request(pid, PROMPT, responses, [0, 1, 2])
        assert got == pytest.approx(likelihood.score([PROMPT] * 3, responses), abs=TOL)
        assert not tracked.scorer.prompts
    assert tracked.stats.evicted == 3


def test_token_ids_are_used_only_from_the_same_tokenizer(likelihood):
    tok = likelihood.tokenizer
    tracked = TrackedReward(likelihood)
    ids = [[40, 41, 42], [43, 44]]  # not what the texts encode to
    responses = ["abc", "de"]
    same = tracked.score_request("p", PROMPT, responses, [0, 1], ids, vocab_fingerprint(tok))
    streams = [likelihood.stream(PROMPT, r, i) for r, i in zip(responses, ids, strict=True)]
    assert same == pytest.approx(likelihood.score_streams(streams), abs=TOL)
    other = tracked.score_request("q", PROMPT, responses, [0, 1], ids, "another-vocabulary")
    assert other == pytest.approx(likelihood.score([PROMPT] * 2, responses), abs=TOL)
    assert same != pytest.approx(other, abs=TOL)


def test_tokens_processed_are_the_prefix_once_and_each_feed(likelihood):
    tracked = TrackedReward(likelihood)
    final = "abcdefghijabcdefghijabcdefghij"
    ctx, _ = likelihood.encode_pair(PROMPT, final)
    for t in (8, 16, 24):
        tracked.score_request("p", PROMPT, [final[:t]], [0])
    # The byte tokenizer gives a token per character: 8 new targets per request.
    assert tracked.stats.tokens == (len(ctx) - 1) + 8 + 8 + 8
    assert tracked.stats.full_tokens == 3 * len(ctx) + 7 + 15 + 23


def test_full_mode_counts_what_it_processes(likelihood):
    tracked = TrackedReward(likelihood, incremental=False)
    assert not tracked.incremental
    responses = texts(4, n=2)
    got = tracked.score_request("p", PROMPT, responses, [0, 1])
    assert got == pytest.approx(likelihood.score([PROMPT] * 2, responses), abs=TOL)
    assert tracked.stats.tokens == tracked.stats.full_tokens > 0


def test_a_classifier_without_a_decomposable_template_is_scored_in_full(classifier):
    tok = classifier.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    try:
        assert classifier.stream(PROMPT, "abc") is None
        tracked = TrackedReward(classifier)
        got = tracked.score_request("p", PROMPT, ["abc", "de"], [0, 1])
        assert got == pytest.approx(classifier.score([PROMPT] * 2, ["abc", "de"]), abs=TOL)
        assert tracked.stats.fallbacks == 2
    finally:
        tok.chat_template = saved


def test_the_engine_decides_the_same_with_incremental_scoring(lm, likelihood):
    """A whole SBoN run: the same candidates, decisions and scores as full re-scoring."""
    ids = lm[1]("<|user|>Tell me something.<|assistant|>", add_special_tokens=False).input_ids

    def scorer(tracked):
        def score(responses, rewards=None, tracking=None):
            if tracking is None:
                return [[s] for s in tracked.score([PROMPT] * len(responses), responses)]
            return [[s] for s in tracked.score_request("p", PROMPT, responses, tracking.keys,
                                                       tracking.ids, None, tracking.last)]
        return score

    def run(incremental):
        tracked = TrackedReward(likelihood, incremental=incremental)
        eng = engine(lm, n=8, alpha=0.5, decisions=(4, 8, 12), rewards=RewardSet(("ll",)))
        result = eng.run([EngineTask("p", ids, scorer(tracked))])[0]
        return result, tracked.stats

    (inc, inc_stats), (full, full_stats) = run(True), run(False)
    assert [c.tokens for c in inc.candidates] == [c.tokens for c in full.candidates]
    assert [c.status for c in inc.candidates] == [c.status for c in full.candidates]
    for a, b in zip(inc.candidates, full.candidates, strict=True):
        assert [t for t, _ in a.partial_scores] == [t for t, _ in b.partial_scores]
        assert [s for _, s in a.partial_scores] == pytest.approx(
            [s for _, s in b.partial_scores], abs=TOL)
    assert inc.best == full.best
    assert inc_stats.tokens < full_stats.tokens == full_stats.full_tokens


@pytest.mark.parametrize("which", ["likelihood", "classifier"])
def test_a_request_with_nothing_new_scores_from_the_cache(which, likelihood, classifier):
    """Responses whose streams are unchanged since their last score feed the model nothing:
    the scores stand. The likelihood reward raised here (a zero-width forward pass) in the
    expert-iteration bench, on a trained policy's round-2 candidates."""
    reward = likelihood if which == "likelihood" else classifier
    tracked = TrackedReward(reward)
    responses = ["The sea is deep", "Waves and salt"]
    first = tracked.score_request("p", PROMPT, responses, [0, 1])
    again = tracked.score_request("p", PROMPT, responses, [0, 1], last=True)
    assert again == pytest.approx(first, abs=TOL)
    assert again == pytest.approx(reward.score([PROMPT] * 2, responses), abs=TOL)
