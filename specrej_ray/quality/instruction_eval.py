"""How well a model follows verifiable instructions, from one response per prompt (pure).

The figures, each over one model's responses to a prompt set:

- `prompt_strict`, `prompt_loose`: IFEval's prompt-level accuracy, the share of prompts
  whose every instruction the response follows;
- `instruction_strict`, `instruction_loose`: IFEval's instruction-level accuracy, the
  instructions followed over all instructions, pooled over the prompts (a prompt with three
  instructions weighs three times one with one);
- `mean_tokens`: the mean response length in the generator's tokens;
- `distinct_2`: distinct word bigrams over all word bigrams of all responses (corpus-level;
  words are whitespace-separated and kept as written; a bigram never spans two responses;
  0 when no response has two words). Words, not tokens: models with other tokenizers stay
  comparable. A model that collapses onto the same phrases lowers it.

Strict and loose are IFEval's (reward.instructions.follows). Against a reference model (the
first, round 0), `compare` gives each figure's difference with a paired bootstrap interval:
every draw resamples the prompts once, for every model and figure alike (quality.stats).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specrej_ray.quality.stats import BOOTSTRAP, Interval, interval, resamples

METRICS: dict[str, str] = {
    "prompt_strict": "prompt-level strict accuracy",
    "instruction_strict": "instruction-level strict accuracy",
    "prompt_loose": "prompt-level loose accuracy",
    "instruction_loose": "instruction-level loose accuracy",
    "mean_tokens": "mean response length (generator tokens)",
    "distinct_2": "distinct-2 (word bigrams, corpus-level)",
}


@dataclass(frozen=True)
class Response:
    """One model's response to one prompt, judged on the prompt's instructions."""

    prompt_id: str
    strict: tuple[bool, ...]  # per instruction, in the row's order
    loose: tuple[bool, ...]
    tokens: int  # generated tokens
    text: str


def word_bigrams(text: str) -> list[tuple[str, str]]:
    words = text.split()
    return list(zip(words, words[1:], strict=False))


@dataclass(frozen=True)
class _Columns:
    """Per prompt, what the figures add up, so a bootstrap draw only sums."""

    all_strict: tuple[int, ...]
    all_loose: tuple[int, ...]
    strict: tuple[int, ...]
    loose: tuple[int, ...]
    instructions: tuple[int, ...]
    tokens: tuple[int, ...]
    bigrams: tuple[int, ...]
    bigram_sets: tuple[frozenset, ...]

    @classmethod
    def of(cls, responses: Sequence[Response]) -> _Columns:
        grams = [word_bigrams(r.text) for r in responses]
        return cls(tuple(int(all(r.strict)) for r in responses),
                   tuple(int(all(r.loose)) for r in responses),
                   tuple(sum(r.strict) for r in responses),
                   tuple(sum(r.loose) for r in responses),
                   tuple(len(r.strict) for r in responses),
                   tuple(r.tokens for r in responses),
                   tuple(len(g) for g in grams),
                   tuple(frozenset(g) for g in grams))


def _figures(c: _Columns, picks: Sequence[int]) -> dict[str, float]:
    n = len(picks)
    instructions = sum(c.instructions[i] for i in picks)
    bigrams = sum(c.bigrams[i] for i in picks)
    distinct = len(frozenset().union(*(c.bigram_sets[i] for i in set(picks))))
    return {
        "prompt_strict": sum(c.all_strict[i] for i in picks) / n,
        "instruction_strict": sum(c.strict[i] for i in picks) / instructions,
        "prompt_loose": sum(c.all_loose[i] for i in picks) / n,
        "instruction_loose": sum(c.loose[i] for i in picks) / instructions,
        "mean_tokens": sum(c.tokens[i] for i in picks) / n,
        "distinct_2": distinct / bigrams if bigrams else 0.0,
    }


def by_instruction(responses: Sequence[Response],
                   ids: Mapping[str, Sequence[str]]) -> dict[str, dict[str, int]]:
    """Per instruction id (sorted), how many of its occurrences the responses follow, strict
    and loose, of how many: which instructions a model follows, as IFEval's own report gives
    them. ids: each prompt's instruction ids, in its row's order."""
    out: dict[str, dict[str, int]] = {}
    for r in responses:
        row = ids[r.prompt_id]
        if len(row) != len(r.strict):
            raise ValueError(f"prompt {r.prompt_id}: {len(r.strict)} verdicts for "
                             f"{len(row)} instructions")
        for i, strict, loose in zip(row, r.strict, r.loose, strict=True):
            got = out.setdefault(i, {"strict": 0, "loose": 0, "of": 0})
            got["strict"] += strict
            got["loose"] += loose
            got["of"] += 1
    return dict(sorted(out.items()))


def figures(responses: Sequence[Response]) -> dict[str, float]:
    """Every figure of METRICS for one model's responses (one per prompt)."""
    _check(responses)
    return _figures(_Columns.of(responses), range(len(responses)))


@dataclass(frozen=True)
class Compared:
    """One model's figures, each with its own bootstrap interval, and, for every model but
    the reference, its difference from the reference's with the paired interval."""

    figures: dict[str, Interval]
    against_reference: dict[str, Interval] | None


def compare(models: Sequence[Sequence[Response]], seed: int = 0,
            count: int = BOOTSTRAP) -> list[Compared]:
    """The models' figures on the same prompts (the first model is the reference), with
    percentile intervals over `count` draws of the prompts, the same draws for all."""
    if not models:
        return []
    ids = [r.prompt_id for r in models[0]]
    for k, responses in enumerate(models):
        _check(responses)
        if [r.prompt_id for r in responses] != ids:
            raise ValueError(f"model {k} answered other prompts than the reference "
                             "(or in another order): a paired comparison needs the same ones")
    draws = resamples(len(ids), seed, count)
    columns = [_Columns.of(responses) for responses in models]
    values = [_figures(c, range(len(ids))) for c in columns]
    drawn = [[_figures(c, picks) for picks in draws] for c in columns]
    out = []
    for k in range(len(models)):
        own = {m: interval(values[k][m], [d[m] for d in drawn[k]]) for m in METRICS}
        diff = None if k == 0 else {
            m: interval(values[k][m] - values[0][m],
                        [d[m] - r[m] for d, r in zip(drawn[k], drawn[0], strict=True)])
            for m in METRICS}
        out.append(Compared(own, diff))
    return out


def _check(responses: Sequence[Response]) -> None:
    if not responses:
        raise ValueError("no responses: the figures need at least one prompt")
    for r in responses:
        if not r.strict or len(r.strict) != len(r.loose):
            raise ValueError(f"prompt {r.prompt_id}: every prompt needs at least one "
                             "instruction, with a strict and a loose verdict for each")


def finite(i: Interval) -> dict[str, float | None]:
    """An interval for JSON: NaN (no draws) as null."""
    return {k: None if math.isnan(v) else v for k, v in i.as_dict().items()}
