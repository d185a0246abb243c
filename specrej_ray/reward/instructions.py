"""One prompt row's verifiable instructions (IFEval's), parsed, checked and bounded.

A row carries IFEval's fields: `instruction_id_list` and `kwargs` (one dict of arguments per
instruction). `parse_row` validates them into a `RowInstructions`; `followed` gives each
instruction's strict and loose verdict on a response, as IFEval's evaluation does; `share` is
the reward (the fraction followed); `bounds` is the interval that share can still reach once a
response is known to start with some text.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specrej_ray.reward import ifeval_checkers as checkers
from specrej_ray.reward import instruction_bounds

# A text the parsed checkers are tried on once, so that a row whose words make a bad regular
# expression (if-verifiable matches keywords as regexes) is refused, not failed mid-run.
_TRIAL_TEXT = "A trial response, with *words*, [a] <<title>> and a P.S.\n\nSection 1 ok"
_ERROR_LENGTH = 200


class InstructionError(Exception):
    """A row's instructions are unusable; str() is one line, without the row's number."""


@dataclass(frozen=True)
class Instruction:
    """One instruction of a row: its id, the arguments its checker uses, the checker."""

    id: str
    args: tuple[tuple[str, Any], ...]  # the built checker's arguments, lists made tuples
    checker: Any = field(repr=False, compare=False)

    def arguments(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.args}


@dataclass(frozen=True)
class RowInstructions:
    instructions: tuple[Instruction, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(i.id for i in self.instructions)

    def __len__(self) -> int:
        return len(self.instructions)


def parse_row(ids: Any, kwargs: Any, prompt: str) -> RowInstructions:
    """A row's instructions from IFEval's fields, or InstructionError saying what is wrong.

    kwargs is None (no arguments for any instruction) or one entry per id: a dict or None.
    Arguments that are None (or NaN) are dropped, as in IFEval's Parquet files, where every
    entry holds every argument name and the unused ones are null.
    """
    ids = _ids(ids)
    entries = _entries(kwargs, len(ids))
    for instruction_id in ids:
        _known(instruction_id)
    for instruction_id in dict.fromkeys(ids):
        if (problem := checkers.missing_data(instruction_id)) is not None:
            raise InstructionError(problem)
    parsed = tuple(_instruction(i, entry, prompt) for i, entry in zip(ids, entries, strict=True))
    _no_repeats_or_conflicts(parsed)
    return RowInstructions(parsed)


def follows(row: RowInstructions, response: str, loose: bool = False) -> list[bool]:
    """Per instruction, whether the response follows it: strict, the response itself (which
    must not be blank); loose, any of IFEval's loose variants that is not blank (the
    response is the first)."""
    texts = checkers.loose_variants(response) if loose else [response]
    return [any(t.strip() and checkers.check(i.checker, t) for t in texts)
            for i in row.instructions]


def followed(row: RowInstructions, response: str) -> tuple[list[bool], list[bool]]:
    """Per instruction, the strict and the loose verdict."""
    return follows(row, response), follows(row, response, loose=True)


def share(flags: Sequence[bool]) -> float:
    """The reward: the fraction of instructions followed."""
    return sum(flags) / len(flags)


def verdicts(row: RowInstructions, settled: str, loose: bool = False,
             known: Sequence[bool | None] | None = None) -> list[bool | None]:
    """Per instruction, what a response that starts with `settled` already decides: True met,
    False broken, whatever follows; None still open (instruction_bounds).

    known: the verdicts for an earlier, shorter start of the same response (same `loose`).
    What they settled holds for every longer start, so only the open ones are worked out
    again: a candidate's verdicts can be carried from one request to the next.
    """
    known = known or [None] * len(row)
    return [k if k is not None else
            instruction_bounds.verdict(i.id, i.arguments(), _checking(i), settled, loose)
            for i, k in zip(row.instructions, known, strict=True)]


def interval(found: Sequence[bool | None]) -> tuple[float, float]:
    """The interval (lo, hi) that the share can still reach given these verdicts: computed as
    share is, so equal counts give equal floats."""
    n = len(found)
    met = sum(v is True for v in found)
    broken = sum(v is False for v in found)
    return met / n, (n - broken) / n


def bounds(row: RowInstructions, settled: str, loose: bool = False) -> tuple[float, float]:
    """The interval (lo, hi) that share(followed(...)) can still reach for a response that
    starts with `settled`."""
    return interval(verdicts(row, settled, loose))


# ------------------------------------------------------------------------------ parsing

def _ids(ids: Any) -> list[str]:
    ids = _plain_value(ids)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise InstructionError(
            f"instruction_id_list must be a non-empty list of instruction ids, not {_show(ids)}"
        )
    return ids


def _entries(kwargs: Any, count: int) -> list[dict[str, Any]]:
    kwargs = _plain_value(kwargs)
    if kwargs is None:
        return [{} for _ in range(count)]
    if not isinstance(kwargs, list) or len(kwargs) != count:
        raise InstructionError(
            f"kwargs must be a list with one entry (a dict of arguments, or null) per "
            f"instruction: {count} instruction(s), kwargs {_show(kwargs)}"
        )
    entries = []
    for index, entry in enumerate(kwargs):
        if entry is not None and not isinstance(entry, Mapping):
            raise InstructionError(
                f"kwargs[{index}] must be a dict of arguments or null, not {_show(entry)}"
            )
        plain = {k: _plain_value(v) for k, v in (entry or {}).items()}
        entries.append({k: v for k, v in plain.items() if v is not None})
    return entries


def _plain_value(value: Any) -> Any:
    """Python values from what a file reader may give: arrays and numpy scalars (pandas)
    become lists and numbers, NaN (a missing number to pandas) None, and whole floats ints."""
    if hasattr(value, "tolist") and not isinstance(value, str):
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_plain_value(v) for v in value]
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():
            return int(value)
    return value


def _known(instruction_id: str) -> None:
    if instruction_id in checkers.KNOWN_IDS:
        return
    close = difflib.get_close_matches(instruction_id, checkers.KNOWN_IDS, n=1)
    hint = (f"did you mean {close[0]}?" if close
            else f"known ids are like {', '.join(checkers.KNOWN_IDS[:3])}, ...")
    raise InstructionError(
        f"unknown instruction id {instruction_id!r}: {hint} (docs/rewards.md lists all "
        f"{len(checkers.KNOWN_IDS)})"
    )


def _instruction(instruction_id: str, kwargs: dict[str, Any], prompt: str) -> Instruction:
    where = f"instruction {instruction_id}"
    for key, value in kwargs.items():  # IFEval's list arguments are words, as are ours
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise InstructionError(f"{where}: {key} must be a list of strings, not {_show(value)}")
    try:
        checker = checkers.build(instruction_id, kwargs, prompt)
    except checkers.RandomArguments as drawn:
        raise InstructionError(f"{where}: {_drawn(drawn.keys, kwargs)}") from None
    except Exception as e:  # the checker's own complaint, whatever its kind
        raise InstructionError(
            f"{where}: if-verifiable rejects kwargs {_show(kwargs)} ({_one_line(e)})"
        ) from None
    args = checkers.args_of(checker) or {}
    for key, value in args.items():  # a word where a list was due: its letters, to a checker
        if isinstance(value, list) and isinstance(kwargs.get(key), str):
            raise InstructionError(f"{where}: {key} must be a list of strings, not "
                                   f"{_show(kwargs[key])}")
    if instruction_id not in checkers.HEAVY_CHECKS:
        _try(where, checker)
    return Instruction(instruction_id, tuple((k, _frozen(v)) for k, v in args.items()), checker)


def _drawn(keys: list[str], kwargs: dict[str, Any]) -> str:
    said = [f"{k}={kwargs[k]!r} is not usable" if k in kwargs else f"{k} is missing"
            for k in keys]
    return (f"{', '.join(said)}: if-verifiable would draw {'it' if len(keys) == 1 else 'them'} "
            f"at random and the score would be random; give {' and '.join(keys)}")


def _try(where: str, checker: Any) -> None:
    try:
        checkers.check(checker, _TRIAL_TEXT)
    except re.error as e:
        raise InstructionError(
            f"{where}: a word is not a valid regular expression ({_one_line(e)}); if-verifiable "
            f"matches these words as regular expressions: escape special characters"
        ) from None
    except Exception as e:
        raise InstructionError(f"{where}: its check fails ({_one_line(e)})") from None


def _no_repeats_or_conflicts(parsed: tuple[Instruction, ...]) -> None:
    seen = set()
    for instruction in parsed:
        if instruction in seen:  # same id and arguments: it would count twice
            raise InstructionError(
                f"instruction {instruction.id} is listed twice with the same arguments"
            )
        seen.add(instruction)
    ids = list(dict.fromkeys(i.id for i in parsed))
    for n, a in enumerate(ids):
        for b in ids[n + 1:]:
            if checkers.conflict(a, b):
                raise InstructionError(
                    f"instructions {a} and {b} conflict (IFEval's registry never gives them "
                    f"together): drop one"
                )


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _checking(instruction: Instruction) -> instruction_bounds.Check:
    return lambda text: checkers.check(instruction.checker, text)


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= _ERROR_LENGTH else text[:_ERROR_LENGTH - 3] + "..."
