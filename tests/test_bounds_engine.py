"""Pruning from bounds inside each backend's batch, on random rewards that carry bounds
(tests/helpers/bounded_reward.py): alone it writes exactly what Best-of-N writes, for less;
with the paper's rule it never stops a candidate that would have beaten the answer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrej_ray.engine.decisions import Decisions
from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.engine.scoring import OpenDecision
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stopping import StopChecker
from specrej_ray.engine.task import EngineTask
from specrej_ray.search.bounds import Keep
from specrej_ray.search.schedule import Layout
from tests.helpers.bounded_reward import REWARDS, BoundedChecks
from tests.helpers.engines import BUILDERS

PROMPTS = [(f"p{i}", f"<|user|>Tell me thing {i}.<|assistant|>") for i in range(6)]


def never(*_args, **_kwargs):
    raise AssertionError("a reward scored in the engine went to the reward actors")


@pytest.fixture(params=sorted(BUILDERS))
def backend(request, lm):
    """run(**settings) -> the results of PROMPTS, each with its own random constraints."""
    build = BUILDERS[request.param]

    def run(**settings) -> list[PromptResult]:
        engine: GenerationEngine = build(lm, rewards=REWARDS, max_new=24, **settings)
        tasks = [EngineTask(pid, lm[1](text, add_special_tokens=False).input_ids, never,
                            local=BoundedChecks.drawn(seed)) for seed, (pid, text)
                 in enumerate(PROMPTS)]
        try:
            return engine.run(tasks)
        finally:
            engine.close()

    return run


def written(r: PromptResult, keep: Keep) -> tuple:
    """What the job's files hold of a prompt: the best and the top `keep.top` (no filters)."""
    done = sorted((c for c in r.candidates if c.finished), key=lambda c: (-c.final_score,
                                                                        c.index))
    best = r.candidates[r.best]
    return (r.best, best.text, best.final_score, best.details,
            [(c.index, c.text, c.final_score) for c in done[: keep.top]])


@pytest.mark.parametrize("keep", [Keep(), Keep(top=3)])
def test_bounds_alone_write_what_best_of_n_writes(backend, keep):
    bon = backend(alpha=0.0)
    pruned = backend(alpha=0.0, bounds_every=2, keep=keep)
    assert [written(r, keep) for r in pruned] == [written(r, keep) for r in bon]
    assert sum(r.pruned for r in pruned) > 0
    assert sum(r.tokens_generated for r in pruned) < sum(r.tokens_generated for r in bon)
    for b, p in zip(bon, pruned, strict=True):
        for cb, cp in zip(b.candidates, p.candidates, strict=True):
            assert cb.tokens[: len(cp.tokens)] == cp.tokens  # a pruned one: a prefix
        assert p.bounds_checks > 0


def test_bounds_compose_with_the_paper_rule(backend):
    """Every candidate bounds stopped would, run to its end, rank below the answer: its
    witnesses are kept from the rule, so one of them (or theirs) reaches the end."""
    bon = backend(alpha=0.0)
    both = backend(alpha=0.5, decisions=(6, 12), bounds_every=2)
    assert sum(r.pruned for r in both) > 0 and sum(r.rejected for r in both) > 0
    for b, r in zip(bon, both, strict=True):
        answer = (-r.candidates[r.best].final_score, r.best)
        for c in r.candidates:
            if c.pruned:
                assert (-b.candidates[c.index].final_score, c.index) > answer
            if c.finished:
                assert c.tokens == b.candidates[c.index].tokens


# Pieces of text whose byte tokens make stop strings, multi-byte characters and spaces.
PIECES = ["a", "b", "ab", "\n", "x", " ", ",", " n't", "é", "€", "𝄞"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=16), st.sampled_from([(), ("ab",),
                                                                       ("\n\n", "bx")]))
def test_the_settled_text_starts_every_continuation(lm, pieces, stop):
    """Bounds are computed on this prefix, so it must start the final text whatever comes
    next: byte tokens split multi-byte characters, and a stop string cuts the text."""
    tok = lm[1]
    ids = tok("".join(pieces), add_special_tokens=False).input_ids  # a token a byte
    checker = StopChecker(tok, set(), stop)
    final = checker.text(ids)
    for t in range(len(ids) + 1):
        assert final.startswith(checker.settled(ids[:t]))


def test_a_witness_is_kept_from_the_rule(lm):
    """The paper's rule ranks partial scores; a candidate bounds named a witness stays, or
    the candidate it let stop would lose the one that ranks above it."""
    engine = BUILDERS["hf"](lm, rewards=REWARDS, n=4, alpha=0.5, bounds_every=2)
    cfg = engine._config(None)
    task = EngineTask("p", [1, 2, 3], never, local=BoundedChecks.drawn(0))
    d = Decisions(cfg, task, 4, Layout(3, 1), 0, 10**6)
    for c in d.candidates:
        c.tokens = [5, 6]
    d.open = OpenDecision(1, 2, d.candidates, [False] * 4, [], d.candidates, None)
    scores = [0.9, 0.8, 0.7, 0.1]
    assert d._cut(d.open, scores) == [2, 3]
    d.witnesses = {3}
    assert d._cut(d.open, scores) == [2]


class CleaningTokenizer:
    """A character a token, decoded with transformers' space clean-up (" ," -> ",", as
    WordPiece tokenizers do), which can change the end of a text as it grows."""

    CHARS = " 'ntsvrem.,a"
    clean_up_tokenization_spaces = True

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        from transformers import PreTrainedTokenizerBase

        text = "".join(self.CHARS[i] for i in ids)
        return PreTrainedTokenizerBase.clean_up_tokenization(self, text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([" ", "'", "n't", "'s", "'re", "a", ".", ","]), max_size=12))
def test_the_settled_text_survives_space_clean_up(pieces):
    ids = [CleaningTokenizer.CHARS.index(ch) for ch in "".join(pieces)]
    checker = StopChecker(CleaningTokenizer(), set(), ())
    final = checker.text(ids)
    for t in range(len(ids) + 1):
        assert final.startswith(checker.settled(ids[:t]))
