"""The one seam to if-verifiable, the package whose IFEval instruction checkers we score with.

Every import of `if_verifiable` happens here. At import this module checks that what it reaches
exists, and fails in one line naming the installed version and what is missing. It also seeds
langdetect (the language checkers are random otherwise) and knows which instructions need nltk
data that may not be installed.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping
from importlib import metadata
from types import ModuleType
from typing import Any

SUPPORTED = "if-verifiable>=0.1.2,<0.2"


def _installed_version() -> str:
    try:
        return metadata.version("if-verifiable")
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"reward.type instructions needs the if-verifiable package, which is not installed: "
            f"pip install '{SUPPORTED}'"
        ) from None


VERSION = _installed_version()
if not VERSION.startswith("0.1."):
    raise ImportError(
        f"reward.type instructions supports if-verifiable 0.1.x, and {VERSION} is installed: "
        f"pip install '{SUPPORTED}'"
    )

import langdetect  # noqa: E402  (after the version check: its message is the useful one)
import nltk  # noqa: E402
from if_verifiable import common as _common  # noqa: E402
from if_verifiable.ifeval import instructions as _instructions  # noqa: E402
from if_verifiable.ifeval import instructions_registry as _registry  # noqa: E402


def _not_a_language_guess(record: logging.LogRecord) -> bool:
    """False for if-verifiable's 'Unable to detect language' line: its language checker logs
    it at ERROR on the root logger for any text langdetect cannot place (emoji, digits) and
    counts the instruction as followed, IFEval's rule (docs/rewards.md). In a run that is one
    alarming line per such candidate, about nothing the user can act on."""
    return not (record.pathname == _instructions.__file__
                and str(record.msg).startswith("Unable to detect language"))


logging.getLogger().addFilter(_not_a_language_guess)

CHECKER_METHODS = (
    "build_description", "get_instruction_args", "get_instruction_args_keys", "check_following"
)


def _reach(module: ModuleType, name: str) -> Any:
    if not hasattr(module, name):
        raise ImportError(
            f"if-verifiable {VERSION} has no {module.__name__}.{name}, which reward.type "
            f"instructions uses: pip install '{SUPPORTED}'"
        )
    return getattr(module, name)


_REGISTRY: Mapping[str, type] = _reach(_registry, "INSTRUCTION_DICT")
_CONFLICTS: Mapping[str, set[str]] = _reach(_registry, "INSTRUCTION_CONFLICTS")
_loose_transformations: Callable[[str], list[str]] = _reach(_common, "get_loose_transformations")
Checker: type = _reach(_instructions, "Instruction")
for _cls in _REGISTRY.values():
    for _method in CHECKER_METHODS:
        _reach(_cls, _method)
_reach(_reach(langdetect, "DetectorFactory"), "seed")

# langdetect draws from a random generator that it seeds with DetectorFactory.seed, or from
# the clock when that is None: fixed, the language checkers give one verdict per text.
langdetect.DetectorFactory.seed = 0

KNOWN_IDS: tuple[str, ...] = tuple(sorted(_REGISTRY))

# Instructions whose check tokenizes with nltk's Punkt model (sentences; word_tokenize splits
# into sentences first): the resource nltk looks up, and the name its downloader knows it by.
NLTK_DATA: Mapping[str, tuple[str, str]] = {
    "length_constraints:number_sentences": ("punkt_tab", "tokenizers/punkt_tab/english/"),
    "change_case:capital_word_frequency": ("punkt_tab", "tokenizers/punkt_tab/english/"),
}
# Checks that load a model on first use (nltk's Punkt, langdetect's profiles): not worth a
# trial run when a row is parsed, and their arguments are no regular expressions anyway.
HEAVY_CHECKS = frozenset(NLTK_DATA) | {
    "language:response_language",
    "change_case:english_capital",
    "change_case:english_lowercase",
}


def missing_data(instruction_id: str) -> str | None:
    """Why this instruction cannot be checked here, and how to fix it; None when it can."""
    if instruction_id not in NLTK_DATA:
        return None
    name, resource = NLTK_DATA[instruction_id]
    try:
        nltk.data.find(resource)
    except LookupError:
        return (
            f"instruction {instruction_id} needs nltk's {name} data, which is not installed: on "
            f"a machine with internet run `python -m nltk.downloader {name}`, or copy an "
            f"nltk_data folder holding {resource.rstrip('/').rsplit('/', 1)[0]} here and set "
            f"NLTK_DATA to it"
        )
    return None


def conflict(a: str, b: str) -> bool:
    """IFEval's registry marks the pair as not to be given together (either way round)."""
    return b in _CONFLICTS.get(a, ()) or a in _CONFLICTS.get(b, ())


# Seeds the random draws are compared under (see build). The checkers draw from the module
# `random`, so its state is saved and restored around a build, under a lock.
_DRAW_SEEDS = (0, 1, 2, 3)
_random_lock = threading.Lock()


class RandomArguments(Exception):
    """The checker drew some of its arguments at random: the row lacks them, or gave ones
    the checker replaces (a negative count, a letter outside a-z, ...)."""

    def __init__(self, keys: list[str]):
        super().__init__(", ".join(keys))
        self.keys = keys


def build(instruction_id: str, kwargs: Mapping[str, Any], prompt: str) -> Any:
    """The checker for one instruction, configured as IFEval's evaluation does.

    A checker draws an argument at random when the row lacks it or gives one it will not use.
    Such a row's score would be random, so this raises RandomArguments naming those arguments. It is
    found by building under a few random seeds and comparing what the checker ended up with:
    that catches every way a checker falls back to a draw (missing, None, empty, negative, out
    of range), where a list of required keys (get_instruction_args_keys) would catch only the
    missing ones. Whatever the build raises itself (a bad relation, an unknown language, an
    unexpected keyword) propagates.
    """
    with _random_lock:
        state = random.getstate()
        try:
            built = []
            for seed in _DRAW_SEEDS:
                random.seed(seed)
                built.append(_configured(instruction_id, kwargs, prompt))
        finally:
            random.setstate(state)
    first = args_of(built[0]) or {}
    drawn = {key for checker in built[1:] for key, value in (args_of(checker) or {}).items()
             if first.get(key) != value}
    if drawn:
        raise RandomArguments(sorted(drawn))
    return built[0]


def _configured(instruction_id: str, kwargs: Mapping[str, Any], prompt: str) -> Any:
    checker = _REGISTRY[instruction_id](instruction_id)
    checker.build_description(**kwargs)
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def args_of(checker: Any) -> dict[str, Any] | None:
    """The arguments a built checker uses (None for checkers that take none)."""
    return checker.get_instruction_args()


def check(checker: Any, text: str) -> bool:
    """The checker's verdict on a text. A text too deeply nested for json.loads (a long run
    of '[') is not valid JSON: json raises RecursionError where the checker expects
    ValueError."""
    try:
        return bool(checker.check_following(text))
    except RecursionError:
        return False


def loose_variants(response: str) -> list[str]:
    """IFEval's loose variants of a response: itself, without its first and/or last line,
    and each of those without '*'."""
    return _loose_transformations(response)
