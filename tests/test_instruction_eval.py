"""The evaluation's figures on hand-computed responses, and the paired bootstrap."""

from __future__ import annotations

import pytest

from specrej_ray.quality.instruction_eval import (
    METRICS,
    Response,
    by_instruction,
    compare,
    figures,
)

T, F = True, False
# Prompt a: both instructions followed; b: one of three strict, two loose; c: loose only.
A = Response("a", (T, T), (T, T), 4, "a b a b")  # bigrams ab ba ab
B = Response("b", (T, F, F), (T, T, F), 6, "a b c")  # ab bc
C = Response("c", (F,), (T,), 2, "x")  # no bigram


def test_figures_by_hand():
    got = figures([A, B, C])
    assert got == pytest.approx({
        "prompt_strict": 1 / 3,
        "instruction_strict": 3 / 6,  # pooled: (2 + 1 + 0) / (2 + 3 + 1), not a mean of shares
        "prompt_loose": 2 / 3,
        "instruction_loose": 5 / 6,
        "mean_tokens": 4.0,
        "distinct_2": 3 / 5,  # {ab, ba, bc} of ab ba ab ab bc
    })
    assert set(got) == set(METRICS)


def test_distinct_2_counts_a_repeated_response_again_and_never_spans_two():
    assert figures([A, A, B])["distinct_2"] == pytest.approx(3 / 8)
    # "b" ending one response and "a" starting the next make no bigram.
    assert figures([Response("x", (T,), (T,), 1, "a b"),
                    Response("y", (T,), (T,), 1, "a b")])["distinct_2"] == pytest.approx(1 / 2)
    assert figures([C])["distinct_2"] == 0.0


def test_a_model_against_itself_differs_by_exactly_zero_in_every_draw():
    """Paired: both models' figures come from the same draw of the prompts."""
    other = [Response(r.prompt_id, r.strict, r.loose, r.tokens, r.text) for r in (A, B, C)]
    ref, same = compare([[A, B, C], other], count=200)
    assert ref.against_reference is None
    for m in METRICS:
        d = same.against_reference[m]
        assert (d.value, d.low, d.high) == (0.0, 0.0, 0.0), m
    assert ref.figures["prompt_strict"].low < ref.figures["prompt_strict"].high


def test_one_draw_of_the_prompts_serves_every_figure():
    """With one instruction per prompt, prompt- and instruction-level accuracy agree on every
    draw, so their intervals do too."""
    rows = [Response(str(i), (i % 3 == 0,), (i % 2 == 0,), i, f"w{i} w") for i in range(12)]
    [got] = compare([rows], count=300)
    assert got.figures["prompt_strict"] == got.figures["instruction_strict"]
    assert got.figures["prompt_loose"] == got.figures["instruction_loose"]
    assert got.figures["prompt_strict"].low < got.figures["prompt_strict"].high


def test_the_difference_and_its_interval():
    base = [Response(str(i), (i % 2 == 0, F), (T, F), i, f"a b {i}") for i in range(20)]
    better = [Response(r.prompt_id, (T, r.strict[1]), r.loose, r.tokens + 2, r.text)
              for r in base]
    _, up = compare([base, better], seed=3)
    d = up.against_reference
    assert d["instruction_strict"].value == pytest.approx(10 / 40)
    assert d["prompt_strict"].value == 0.0  # no prompt has all its instructions followed
    assert 0 < d["instruction_strict"].low <= d["instruction_strict"].value \
        <= d["instruction_strict"].high
    assert [d["mean_tokens"].value, d["mean_tokens"].low, d["mean_tokens"].high] == \
        pytest.approx([2, 2, 2])
    # A fixed seed gives the same intervals; another seed other ones.
    assert compare([base, better], seed=3)[1] == up
    assert compare([base, better], seed=4)[1].figures["mean_tokens"] != up.figures["mean_tokens"]


def test_models_must_answer_the_same_prompts():
    with pytest.raises(ValueError, match="other prompts"):
        compare([[A, B], [B, A]])
    with pytest.raises(ValueError, match="at least one instruction"):
        figures([Response("z", (), (), 1, "")])


def test_by_instruction_counts_each_occurrence_strict_and_loose():
    ids = {"a": ["comma", "case"], "b": ["comma", "title", "case"], "c": ["title"]}
    assert by_instruction([A, B, C], ids) == {
        "case": {"strict": 1, "loose": 1, "of": 2},  # a's followed; b's third broken both ways
        "comma": {"strict": 2, "loose": 2, "of": 2},
        "title": {"strict": 0, "loose": 2, "of": 2},  # b's and c's: loose only
    }
    assert list(by_instruction([A, B, C], ids)) == ["case", "comma", "title"]
    with pytest.raises(ValueError, match="prompt c: 1 verdicts for 2 instructions"):
        by_instruction([C], {"c": ["title", "case"]})
