"""What a prefix of a response already settles about one IFEval instruction.

For a prefix P of the final response, a verdict is True when the instruction is met whatever
follows P, False when it is broken whatever follows, None when that is still open. "Met" is
IFEval's strict rule, `final.strip() and check_following(final)`, or its loose rule (any of the
eight loose variants, see `ifeval_checkers.loose_variants`). Each rule below follows the
checker's source (if-verifiable 0.1.x, the seam pins it) and is sound for every continuation,
the empty one included; where that cannot be shown the verdict is None, which is always safe.

Shared facts the rules rely on:
- A regular expression made of literal characters only (`_plain`) matches the same text at
  the same place in P and in P + E: a match inside P stays a match, with IGNORECASE too (one
  pattern character consumes one text character). Patterns built from a row's own words
  (keywords, forbidden words, markers, section splitters) get a verdict only when plain.
- `findall` scans left to right: every match that lies inside P is found again in P + E, in
  the same order, for the counting checkers here (keyword, placeholder, highlight, section
  and word counts). A match that would cross the end of P starts after P's last one, so a
  count never drops as text is appended.
- `str.lower()` maps each character alone, except a capital sigma, whose lowercase depends
  on its neighbours (final sigma); no ASCII letter, '.', 'p', 's' or whitespace comes of it.
- A prefix whose strip() is empty can still end as an empty response, which strict IFEval
  counts as not followed: no "met" verdict for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

Verdict = bool | None
Check = Callable[[str], bool]
Rule = Callable[[Mapping[str, Any], Check, str], Verdict]

_REGEX_SPECIAL = re.compile(r"[\\.^$*+?{}\[\]|()]")
_SIGMA = ("σ", "ς")
_KNOWN_POSTSCRIPTS = ("P.S.", "P.P.S")  # the checker's own patterns for these, no user regex


def _plain(pattern: Any) -> bool:
    return isinstance(pattern, str) and not _REGEX_SPECIAL.search(pattern)


def _never_lower(char: str) -> bool:
    """Any text holding this character fails str.islower(): CPython's islower is False at an
    upper- or titlecase character, and a one-character text is checked with ISLOWER alone.
    (One character's istitle() is ISTITLE or ISUPPER.)"""
    return char.istitle() and not char.islower()


def _never_upper(char: str) -> bool:
    """Any text holding this character fails str.isupper() (as _never_lower, mirrored)."""
    return not char.isupper() and (char.islower() or char.istitle())


def _middle(prefix: str) -> str:
    """The lines strictly between P's first and last newline: every loose variant of every
    final response keeps them (variants drop the first and/or last line, strip whitespace at
    the ends, or drop '*')."""
    first, last = prefix.find("\n"), prefix.rfind("\n")
    return prefix[first + 1:last] if first < last else ""


# ------------------------------------------------------------------ broken whatever follows

def _any_comma(text: str) -> bool:
    return "," in text


def _any_never_lower(text: str) -> bool:
    return not text.islower() and any(map(_never_lower, text))


def _any_never_upper(text: str) -> bool:
    return not text.isupper() and any(map(_never_upper, text))


def _broken_if(found: Callable[[str], bool], loose: bool) -> Rule:
    """Broken once the prefix (strict) or its middle lines (loose) hold an offending character:
    appending never removes it, and the checker's verdict is False wherever it is."""
    def rule(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
        return False if found(_middle(prefix) if loose else prefix) else None
    return rule


def _forbidden_word(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """`\\bword\\b` matched inside P with a character of P after it: both boundaries are
    decided by characters of P, so the match survives any continuation."""
    for word in args["forbidden_words"]:
        if _plain(word) and re.search(r"\b" + word + r"\b(?=.)", prefix, re.I | re.S):
            return False
    return None


def _quotation(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """The final response's stripped text starts where P's does."""
    start = prefix.lstrip()
    return False if start and start[0] != '"' else None


def _repeat_prompt(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """`final.strip().lower().startswith(target)`: P.strip() starts the final's stripped text,
    and its lowercase starts the final's (sigma aside, hence no verdict when the target holds
    one). Met once P's covers the target, broken once they differ within both."""
    target = args["prompt_to_repeat"].strip().lower()
    if any(s in target for s in _SIGMA):
        return None
    start = prefix.strip().lower()
    if not start:
        return None
    if start.startswith(target):
        return True
    return False if not target.startswith(start[:len(target)]) else None


# -------------------------------------------------------------------- met whatever follows

def _met_once_checked(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """For checkers whose verdict is "at least one / at least k" of something that appending
    cannot take away (a count that never drops, a match that stays)."""
    return True if prefix.strip() and check(prefix) else None


def _broken_once_failed(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """For "fewer than k" of a count that never drops: once P reaches k, so does any final."""
    return False if not check(prefix) else None


def _by_relation(key: str) -> Rule:
    """'at least': met once reached; 'less than': broken once reached."""
    def rule(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
        at_least = args[key] == "at least"
        return (_met_once_checked if at_least else _broken_once_failed)(args, check, prefix)
    return rule


def _when_plain(key: str, rule: Rule) -> Rule:
    def guarded(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
        values = args[key]
        values = [values] if isinstance(values, str) else values
        return rule(args, check, prefix) if all(map(_plain, values)) else None
    return guarded


def _postscript(args: Mapping[str, Any], check: Check, prefix: str) -> Verdict:
    """The checker searches `\\s*<marker>.*$` in the lowercased text: the marker's match inside
    P stays (sigma aside), and `.*$` matches whatever ends the line."""
    marker = args["postscript_marker"]
    if marker not in _KNOWN_POSTSCRIPTS:
        lowered = marker.lower()
        if not _plain(lowered) or any(s in lowered for s in _SIGMA):
            return None
    return _met_once_checked(args, check, prefix)


class _Entry(NamedTuple):
    strict: Rule
    loose: Rule | None  # None: only the strict "met" carries over (variant 0 is the response)
    broken: str  # when a "broken whatever follows" verdict can come ("" never), for the docs
    met: str  # likewise for "met whatever follows"


_RELATIONS = ("relation less than", "relation at least")

# A loose "broken" needs every loose variant broken: shown for three rules only.
_RULES: dict[str, _Entry] = {
    "punctuation:no_comma": _Entry(
        _broken_if(_any_comma, False), _broken_if(_any_comma, True), "yes", ""),
    "change_case:english_lowercase": _Entry(
        _broken_if(_any_never_lower, False), _broken_if(_any_never_lower, True), "yes", ""),
    "change_case:english_capital": _Entry(
        _broken_if(_any_never_upper, False), _broken_if(_any_never_upper, True), "yes", ""),
    "keywords:forbidden_words": _Entry(_forbidden_word, None, "yes", ""),
    "startend:quotation": _Entry(_quotation, None, "yes", ""),
    "combination:repeat_prompt": _Entry(_repeat_prompt, None, "yes", "yes"),
    "length_constraints:number_words": _Entry(_by_relation("relation"), None, *_RELATIONS),
    "keywords:frequency": _Entry(
        _when_plain("keyword", _by_relation("relation")), None, *_RELATIONS),
    # counts of an ASCII letter in text.lower() never drop as text is appended
    "keywords:letter_frequency": _Entry(_by_relation("let_relation"), None, *_RELATIONS),
    "keywords:existence": _Entry(_when_plain("keywords", _met_once_checked), None, "", "yes"),
    "detectable_format:title": _Entry(_met_once_checked, None, "", "yes"),
    "detectable_content:postscript": _Entry(_postscript, None, "", "yes"),
    "detectable_content:number_placeholders": _Entry(_met_once_checked, None, "", "yes"),
    "detectable_format:constrained_response": _Entry(_met_once_checked, None, "", "yes"),
    "detectable_format:number_highlighted_sections": _Entry(
        _met_once_checked, None, "", "yes"),
    "detectable_format:multiple_sections": _Entry(
        _when_plain("section_spliter", _met_once_checked), None, "", "yes"),
}

# id -> (once broken stays broken, once met stays met), "" for never: the docs' table.
DIRECTIONS: Mapping[str, tuple[str, str]] = {k: (e.broken, e.met) for k, e in _RULES.items()}
LOOSE_BROKEN = frozenset(k for k, e in _RULES.items() if e.loose is not None)


def verdict(instruction_id: str, args: Mapping[str, Any] | None, check: Check, prefix: str,
            loose: bool = False) -> Verdict:
    """What the prefix settles about the instruction (module docstring); args are the built
    checker's arguments, check its check_following."""
    if instruction_id not in _RULES:
        return None
    entry = _RULES[instruction_id]
    settled = entry.strict(args or {}, check, prefix)
    if not loose or settled is True:
        return settled
    return entry.loose(args or {}, check, prefix) if entry.loose is not None else None

