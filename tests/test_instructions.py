"""Verifiable instructions (IFEval's checkers through if-verifiable): a row's instructions are
validated in one line, scored as IFEval's evaluation scores them, and bounded soundly from any
prefix of the response (docs/rewards.md, "Verifiable instructions")."""

from __future__ import annotations

import ast
import importlib.util
import logging
import pickle
import re
import sys
from importlib import metadata
from pathlib import Path

import nltk
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrej_ray.reward import ifeval_checkers as checkers
from specrej_ray.reward import instruction_bounds
from specrej_ray.reward.instructions import (
    InstructionError,
    bounds,
    followed,
    follows,
    interval,
    parse_row,
    share,
    verdicts,
)

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# ---------------------------------------------------------------------------- validation

IFEVAL_ROW = {  # the shape of IFEval's input_data.jsonl (our own text)
    "prompt": "Write a note about cats. Do not use any commas and use at least 5 words.",
    "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words",
                            "keywords:existence"],
    "kwargs": [{}, {"relation": "at least", "num_words": 5}, {"keywords": ["cat"]}],
}
# IFEval's Parquet: every entry holds every argument name of the dataset, null where unused
ALL_ARGUMENT_NAMES = ["keywords", "keyword", "frequency", "relation", "num_words",
                      "forbidden_words", "letter", "let_frequency", "let_relation", "language",
                      "num_sentences", "num_paragraphs", "nth_paragraph", "first_word",
                      "num_placeholders", "postscript_marker", "num_bullets", "num_highlights",
                      "section_spliter", "num_sections", "prompt_to_repeat", "end_phrase",
                      "capital_frequency", "capital_relation"]


def _parquet_style(kwargs: list[dict]) -> list[dict]:
    return [{name: entry.get(name) for name in ALL_ARGUMENT_NAMES} for entry in kwargs]


def test_an_ifeval_row_parses_from_jsonl_and_from_parquet_alike():
    row = parse_row(IFEVAL_ROW["instruction_id_list"], IFEVAL_ROW["kwargs"], IFEVAL_ROW["prompt"])
    assert row.ids == tuple(IFEVAL_ROW["instruction_id_list"])
    assert row.instructions[1].arguments() == {"num_words": 5, "relation": "at least"}
    parquet = parse_row(IFEVAL_ROW["instruction_id_list"],
                        _parquet_style(IFEVAL_ROW["kwargs"]), IFEVAL_ROW["prompt"])
    assert parquet == row
    # as pandas reads Parquet: arrays for lists, NaN for a missing number, floats for ints
    frame_style = [{**e, "num_words": float("nan")} for e in _parquet_style(IFEVAL_ROW["kwargs"])]
    frame_style[1]["num_words"] = 5.0
    frame_style[2]["keywords"] = np.array(["cat"], dtype=object)
    assert parse_row(np.array(IFEVAL_ROW["instruction_id_list"], dtype=object), frame_style,
                     IFEVAL_ROW["prompt"]) == row
    assert parse_row(["punctuation:no_comma"], None, "").ids == ("punctuation:no_comma",)


def test_the_same_instruction_twice_with_other_arguments_is_a_range():
    # IFEval words "600 to 700 words" this way
    row = parse_row(["length_constraints:number_words"] * 2,
                    [{"relation": "at least", "num_words": 2},
                     {"relation": "less than", "num_words": 4}], "")
    assert followed(row, "one two three")[0] == [True, True]
    assert followed(row, "one two three four")[0] == [True, False]


REFUSED = [  # (ids, kwargs, what the one line must say)
    ([], None, "non-empty list"),
    ("punctuation:no_comma", None, "non-empty list"),
    ([3], None, "non-empty list"),
    (["punctuation:no_comma"], [{}, {}], "one entry"),
    (["punctuation:no_comma"], {"a": 1}, "one entry"),
    (["punctuation:no_comma"], ["x"], "kwargs[0] must be a dict"),
    (["punctuation:no_coma"], None, "did you mean punctuation:no_comma"),
    (["nothing:like_it"], None, "unknown instruction id 'nothing:like_it'"),
    (["length_constraints:number_words"], [{"relation": "more than", "num_words": 3}],
     "rejects kwargs"),
    (["length_constraints:number_words"], [{"relation": "less than", "num_words": "3"}],
     "TypeError"),
    (["detectable_format:title"], [{"size": 3}], "unexpected keyword argument 'size'"),
    (["language:response_language"], [{"language": "xx"}], "KeyError"),
    (["combination:repeat_prompt"], None, "prompt_to_repeat must be set"),
    (["keywords:existence"], None, "keywords is missing"),
    (["keywords:existence"], [{"keywords": []}], "keywords=[] is not usable"),
    (["keywords:frequency"], [{"keyword": "cat", "frequency": 2}], "relation is missing"),
    (["length_constraints:number_words"], [{"relation": "at least", "num_words": -1}],
     "num_words=-1 is not usable"),
    (["keywords:letter_frequency"], [{"letter": "#", "let_frequency": 4,
                                      "let_relation": "at least"}], "letter='#' is not usable"),
    (["length_constraints:nth_paragraph_first_word"],
     [{"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "so"}], "nth_paragraph=3"),
    (["detectable_content:postscript"], None, "postscript_marker is missing"),
    (["keywords:existence"], [{"keywords": "cat"}], "keywords must be a list of strings"),
    (["keywords:forbidden_words"], [{"forbidden_words": ["ok", 3]}], "list of strings"),
    (["keywords:existence"], [{"keywords": ["c(t"]}], "not a valid regular expression"),
    (["punctuation:no_comma", "punctuation:no_comma"], None, "listed twice"),
    (["change_case:english_lowercase", "change_case:english_capital"], None, "conflict"),
    (["keywords:existence", "language:response_language"],
     [{"keywords": ["cat"]}, {"language": "fr"}], "conflict"),
    (["length_constraints:number_sentences"], [{"relation": "less than", "num_sentences": 3}],
     "punkt_tab"),
]


@pytest.mark.parametrize("ids, kwargs, says", REFUSED)
def test_each_unusable_row_is_refused_in_one_line(ids, kwargs, says, monkeypatch, tmp_path):
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])  # no nltk data, wherever we run
    with pytest.raises(InstructionError) as refused:
        parse_row(ids, kwargs, "the prompt")
    message = str(refused.value)
    assert says in message
    assert "\n" not in message and not message.lower().startswith("row")


@pytest.fixture
def punkt_tab(monkeypatch, tmp_path):
    """An nltk data folder whose Punkt model is installed (empty, but loadable)."""
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    model = tmp_path / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt",
                 "ortho_context.tab"):
        (model / name).write_text("")


def test_every_argument_a_checker_would_draw_at_random_is_refused(punkt_tab):
    """Whatever argument a row leaves out, the checker would draw it: refused, for every
    instruction and every argument (IFEval_ARGS holds one complete set per instruction)."""
    for instruction_id, complete in IFEVAL_ARGS.items():
        parse_row([instruction_id], [complete], "")
        for left_out in complete:
            kwargs = {k: v for k, v in complete.items() if k != left_out}
            with pytest.raises(InstructionError, match=left_out):
                parse_row([instruction_id], [kwargs], "")


NLTK_ROW = (["length_constraints:number_sentences", "change_case:capital_word_frequency"],
            [{"relation": "less than", "num_sentences": 3},
             {"capital_relation": "at least", "capital_frequency": 1}])


def test_missing_nltk_data_is_refused_naming_the_remedy(monkeypatch, tmp_path):
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    with pytest.raises(InstructionError) as refused:
        parse_row(*NLTK_ROW, "")
    assert str(refused.value) == (
        "instruction length_constraints:number_sentences needs nltk's punkt_tab data, which is "
        "not installed: on a machine with internet run `python -m nltk.downloader punkt_tab`, "
        "or copy an nltk_data folder holding tokenizers/punkt_tab here and set NLTK_DATA to it")


def test_installed_nltk_data_is_accepted(punkt_tab):
    assert parse_row(*NLTK_ROW, "").ids == tuple(NLTK_ROW[0])


def test_only_the_listed_instructions_need_nltk_data(monkeypatch, tmp_path):
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    for instruction_id, args in IFEVAL_ARGS.items():
        checker = checkers.build(instruction_id, args, "")
        if instruction_id in checkers.NLTK_DATA:
            with pytest.raises(LookupError):
                checkers.check(checker, "One sentence. And another ONE.")
        else:
            checkers.check(checker, "One sentence. And another ONE.")


def _seam_copy(monkeypatch):
    spec = importlib.util.spec_from_file_location("seam_copy", checkers.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "seam_copy", module)
    spec.loader.exec_module(module)


def test_the_seam_names_the_version_and_what_it_misses(monkeypatch):
    _seam_copy(monkeypatch)  # as installed: loads
    common = sys.modules["if_verifiable.common"]
    monkeypatch.delattr(common, "get_loose_transformations")
    with pytest.raises(ImportError, match=rf"if-verifiable {re.escape(checkers.VERSION)} has no "
                                          r"if_verifiable.common.get_loose_transformations"):
        _seam_copy(monkeypatch)
    monkeypatch.setattr(metadata, "version", lambda name: "0.2.0")
    with pytest.raises(ImportError, match=r"supports if-verifiable 0.1.x, and 0.2.0 is installed"):
        _seam_copy(monkeypatch)

    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", absent)
    with pytest.raises(ImportError, match="needs the if-verifiable package, which is not install"):
        _seam_copy(monkeypatch)


def test_only_the_seam_imports_if_verifiable():
    importers = []
    for path in (ROOT / "specrej_ray").rglob("*.py"):
        source = path.read_text()
        if "if_verifiable" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "if_verifiable" for n in names):
                importers.append(path.relative_to(ROOT).as_posix())
    assert set(importers) == {"specrej_ray/reward/ifeval_checkers.py"}


def test_parsing_leaves_the_random_module_as_it_was():
    import random

    random.seed(7)
    expected = random.random()
    random.seed(7)
    parse_row(IFEVAL_ROW["instruction_id_list"], IFEVAL_ROW["kwargs"], "")
    assert random.random() == expected


# ------------------------------------------------------------------------------- scoring

def test_language_verdicts_are_the_same_every_time():
    row = parse_row(["change_case:english_lowercase"], None, "")
    # langdetect, unseeded, calls this English or Dutch at random
    assert len({tuple(followed(row, "hello world")[0]) for _ in range(30)}) == 1


def test_a_row_pickles_and_scores_the_same():
    row = parse_row(IFEVAL_ROW["instruction_id_list"], IFEVAL_ROW["kwargs"], "")
    response = "a cat is a fine pet to have"
    assert followed(pickle.loads(pickle.dumps(row)), response) == followed(row, response)


def test_json_nested_too_deep_is_not_json():
    row = parse_row(["detectable_format:json_format"], None, "")
    assert followed(row, "[" * 5000) == ([False], [False])


# One complete, usable set of arguments per instruction (IFEval's own shapes).
IFEVAL_ARGS = {
    "keywords:existence": {"keywords": ["cat", "dog"]},
    "keywords:frequency": {"keyword": "cat", "frequency": 2, "relation": "at least"},
    "keywords:forbidden_words": {"forbidden_words": ["dog"]},
    "keywords:letter_frequency": {"letter": "a", "let_frequency": 3, "let_relation": "less than"},
    "language:response_language": {"language": "en"},
    "length_constraints:number_sentences": {"num_sentences": 3, "relation": "less than"},
    "length_constraints:number_paragraphs": {"num_paragraphs": 2},
    "length_constraints:number_words": {"num_words": 4, "relation": "less than"},
    "length_constraints:nth_paragraph_first_word": {"num_paragraphs": 2, "nth_paragraph": 2,
                                                    "first_word": "cat"},
    "detectable_content:number_placeholders": {"num_placeholders": 1},
    "detectable_content:postscript": {"postscript_marker": "P.S."},
    "detectable_format:number_bullet_lists": {"num_bullets": 2},
    "detectable_format:constrained_response": {},
    "detectable_format:number_highlighted_sections": {"num_highlights": 1},
    "detectable_format:multiple_sections": {"section_spliter": "Section", "num_sections": 2},
    "detectable_format:json_format": {},
    "detectable_format:title": {},
    "combination:two_responses": {},
    "combination:repeat_prompt": {"prompt_to_repeat": "Say cat."},
    "startend:end_checker": {"end_phrase": "Bye."},
    "change_case:capital_word_frequency": {"capital_frequency": 3, "capital_relation": "less than"},
    "change_case:english_capital": {},
    "change_case:english_lowercase": {},
    "punctuation:no_comma": {},
    "startend:quotation": {},
}


def test_every_instruction_has_a_complete_argument_set_here():
    assert set(IFEVAL_ARGS) == set(checkers.KNOWN_IDS)


# The text responses and prefixes are made of: the characters and words the checkers look at.
TOKENS = [
    "a", "e", "i", "s", "t", "x", "A", "S", "T", "é", "ǅ", "Σ", "σ", "ς", "İ", "ı", "ﬀ", "K",
    "0", "1", "7", ",", ".", "!", "?", ":", "*", "**", "***", "******", "-", "<", ">", "<<",
    ">>", "[", "]", "[x]", "{", "}", '"', "'", "#", "\n", "\n\n", " ", "  ", "\t", "_",
    "cat", "Cat", "CAT", "dog", "cats", "at", "c.t", "a b", "P.S.", "p.s.", "P.P.S", "P. S.",
    "Section 1", "SECTION 2", "Section", "S.", "My answer is yes.", "Say cat.", "say", "ΣA b",
    "Bye.", "hello", "world", "the", "{\"a\": 1}", "is", "s\n",
]
WORDS = ["cat", "dog", "at", "a b", "c.t", "s$", "Σa", "İ", "s"]  # s$: where a regex bites
# English in one case, which langdetect calls English, so that the case checkers can pass
ENGLISH = ["the", "cat", "is", "on", "mat", "this", "a", "fine", "day", "dog", "sat"]
SEPARATORS = [" ", " ", " ", ". ", ", ", "\n", "*", '"']


def _english(upper: bool) -> st.SearchStrategy[str]:
    words = [w.upper() for w in ENGLISH] if upper else ENGLISH
    pair = st.tuples(st.sampled_from(words), st.sampled_from(SEPARATORS)).map("".join)
    return st.lists(pair, max_size=10).map("".join)


soup = st.lists(st.sampled_from(TOKENS), max_size=14).map("".join)
text = st.one_of(soup, _english(False), _english(True))
# starts that end right at a word, continuations that start with one: where boundaries matter
prefixes = st.one_of(text, st.tuples(text, st.sampled_from(WORDS + ENGLISH)).map("".join))
extensions = st.one_of(text, st.tuples(st.sampled_from(WORDS + ["s", "1", ">>", "]"]),
                                       text).map("".join))
relation = st.sampled_from(["less than", "at least"])
count = st.integers(0, 4)

KWARGS = {
    "keywords:existence": st.fixed_dictionaries(
        {"keywords": st.lists(st.sampled_from(WORDS), min_size=1, max_size=2)}),
    "keywords:frequency": st.fixed_dictionaries(
        {"keyword": st.sampled_from(WORDS), "frequency": count, "relation": relation}),
    "keywords:forbidden_words": st.fixed_dictionaries(
        {"forbidden_words": st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)}),
    "keywords:letter_frequency": st.fixed_dictionaries(
        {"letter": st.sampled_from("aeistkS"), "let_frequency": count, "let_relation": relation}),
    "language:response_language": st.fixed_dictionaries({"language": st.just("en")}),
    "length_constraints:number_paragraphs": st.fixed_dictionaries(
        {"num_paragraphs": st.integers(1, 3)}),
    "length_constraints:number_words": st.fixed_dictionaries(
        {"num_words": st.integers(0, 8), "relation": relation}),
    "length_constraints:nth_paragraph_first_word": st.fixed_dictionaries(
        {"num_paragraphs": st.just(2), "nth_paragraph": st.integers(1, 2),
         "first_word": st.just("cat")}),
    "detectable_content:number_placeholders": st.fixed_dictionaries({"num_placeholders": count}),
    "detectable_content:postscript": st.fixed_dictionaries(
        {"postscript_marker": st.sampled_from(["P.S.", "P.P.S", "PS", "Note:", "a.b", "ΣΣ"])}),
    "detectable_format:number_bullet_lists": st.fixed_dictionaries(
        {"num_bullets": st.integers(1, 3)}),
    "detectable_format:constrained_response": st.just({}),
    "detectable_format:number_highlighted_sections": st.fixed_dictionaries(
        {"num_highlights": count}),
    "detectable_format:multiple_sections": st.fixed_dictionaries(
        {"section_spliter": st.sampled_from(["Section", "SECTION", "S.", ""]),
         "num_sections": count}),
    "detectable_format:json_format": st.just({}),
    "detectable_format:title": st.just({}),
    "combination:two_responses": st.just({}),
    "combination:repeat_prompt": st.fixed_dictionaries(
        {"prompt_to_repeat": st.sampled_from(["Say cat.", "ΣA b", "aΣ", "İs", " cat  "])}),
    "startend:end_checker": st.fixed_dictionaries({"end_phrase": st.sampled_from(["Bye.", "cat"])}),
    "change_case:english_capital": st.just({}),
    "change_case:english_lowercase": st.just({}),
    "punctuation:no_comma": st.just({}),
    "startend:quotation": st.just({}),
}
SCORED_IDS = sorted(KWARGS)  # all but the two that need nltk data


ROW_IDS = st.lists(st.sampled_from(SCORED_IDS), min_size=1, max_size=3)


@st.composite
def rows(draw, ids=ROW_IDS):
    chosen = draw(ids)
    kwargs = [draw(KWARGS[i]) for i in chosen]
    try:
        return parse_row(chosen, kwargs, "the prompt")
    except InstructionError:  # a conflicting pair, or the same instruction twice
        return draw(st.nothing())


def test_the_strategies_cover_every_instruction_but_those_needing_nltk_data():
    assert set(SCORED_IDS) == set(checkers.KNOWN_IDS) - set(checkers.NLTK_DATA)


@settings(max_examples=150, **SETTINGS)
@given(row=rows(), response=text)
def test_scores_are_if_verifiables_own(row, response):
    """Our driver scores as if-verifiable's evaluate_instructions does, on responses it does
    not alter (it strips them and drops thinking: ours follows IFEval and does neither)."""
    from if_verifiable.common import evaluate_instructions
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    response = response.strip()
    if not response:
        return
    kwargs = [i.arguments() for i in row.instructions]
    results, scores = evaluate_instructions(response, list(row.ids), kwargs, "the prompt",
                                            INSTRUCTION_DICT)
    strict, loose = followed(row, response)
    assert strict == [r.strict_pass for r in results]
    assert loose == [r.loose_pass for r in results]
    assert share(strict) == scores.partial_strict and share(loose) == scores.partial_loose


# ------------------------------------------------------------------------------- bounds

def _assert_sound(row, prefix, extensions):
    """Whatever follows the prefix, the final share lies within the bounds, strict and loose,
    and each settled verdict is the final one."""
    settled = {loose: (bounds(row, prefix, loose), verdicts(row, prefix, loose))
               for loose in (False, True)}
    for extension in dict.fromkeys(["", *extensions]):
        finals = followed(row, prefix + extension)
        longer = prefix + extension[:len(extension) // 2]
        for loose, ((lo, hi), found) in settled.items():
            final = finals[loose]
            carried = verdicts(row, longer, loose, known=found)
            why = (prefix, extension, loose, found, carried, final)
            assert lo <= share(final) <= hi, why
            for now in (found, carried):
                assert all(v is None or v == f for v, f in zip(now, final, strict=True)), why
            if lo == hi:
                assert share(final) == lo, why  # the same arithmetic: equal, not close


@settings(max_examples=150, **SETTINGS)
@given(row=rows(), prefix=prefixes, ends=st.lists(extensions, max_size=3))
def test_bounds_hold_for_every_continuation(row, prefix, ends):
    """THE soundness property, on whole rows."""
    _assert_sound(row, prefix, ends)


@pytest.mark.parametrize("instruction_id", sorted(instruction_bounds.DIRECTIONS))
@settings(max_examples=40, **SETTINGS)
@given(data=st.data())
def test_bounds_hold_for_each_bounded_instruction(instruction_id, data):
    """The same, per instruction that gives verdicts: each gets its share of examples."""
    row = data.draw(rows(st.just([instruction_id])))
    own = sorted(_words(row.instructions[0].arguments())) or ["s"]  # the row's own words
    prefix = data.draw(st.one_of(prefixes, st.tuples(text, st.sampled_from(own)).map("".join)))
    ends = st.one_of(extensions, st.tuples(st.sampled_from(own), text).map("".join))
    _assert_sound(row, prefix, data.draw(st.lists(ends, max_size=2)))


def _words(args: dict) -> set[str]:
    values = [v for value in args.values() for v in (value if isinstance(value, list) else [value])]
    return {v for v in values if isinstance(v, str)}


SETTLES = [  # (id, kwargs, prefix, strict verdict, loose verdict)
    ("punctuation:no_comma", {}, "a, b", False, None),
    ("punctuation:no_comma", {}, "x\na, b\ny", False, False),
    ("change_case:english_lowercase", {}, "ok ǅ", False, None),
    ("change_case:english_lowercase", {}, "ok\nǅ\n", False, False),
    ("change_case:english_capital", {}, "OK σ", False, None),
    ("keywords:forbidden_words", {"forbidden_words": ["dog"]}, "a dog ", False, None),
    ("keywords:forbidden_words", {"forbidden_words": ["dog"]}, "a dog", None, None),
    ("keywords:forbidden_words", {"forbidden_words": ["d.g"]}, "a dog ", None, None),
    ("startend:quotation", {}, "  x", False, None),
    ("startend:quotation", {}, '  "x', None, None),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say cat."}, " say cat. ok", True, True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say cat."}, " say c", None, None),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Say cat."}, " say d", False, None),
    ("length_constraints:number_words", {"num_words": 2, "relation": "less than"}, "a b", False,
     None),
    ("length_constraints:number_words", {"num_words": 2, "relation": "at least"}, "a b", True,
     True),
    ("keywords:frequency", {"keyword": "cat", "frequency": 1, "relation": "at least"}, "Cat",
     True, True),
    ("keywords:frequency", {"keyword": "c.t", "frequency": 1, "relation": "at least"}, "cat",
     None, None),
    ("keywords:letter_frequency", {"letter": "k", "let_frequency": 1, "let_relation": "less than"},
     "K", False, None),
    ("keywords:existence", {"keywords": ["cat"]}, "a cat", True, True),
    ("keywords:existence", {"keywords": ["s$"]}, "cats", None, None),  # "cats x" has none
    ("combination:repeat_prompt", {"prompt_to_repeat": "aΣ"}, "aΣ", None, None),  # aΣb: aσb
    ("detectable_content:postscript", {"postscript_marker": "ΣΣ"}, "xΣΣ", None, None),
    ("detectable_format:title", {}, "<<t>>", True, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "x\np.s. y", True, True),
    ("detectable_content:number_placeholders", {"num_placeholders": 1}, "[a]", True, True),
    ("detectable_format:constrained_response", {}, "My answer is no.", True, True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 1}, "*a*", True, True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 1},
     "Section 1", True, True),
    ("detectable_format:title", {}, "   ", None, None),
    ("startend:end_checker", {"end_phrase": "Bye."}, "Bye.", None, None),
]


@pytest.mark.parametrize("instruction_id, kwargs, prefix, strict, loose", SETTLES)
def test_prefixes_that_settle_an_instruction(instruction_id, kwargs, prefix, strict, loose):
    row = parse_row([instruction_id], [kwargs], "")
    assert verdicts(row, prefix) == [strict]
    assert verdicts(row, prefix, loose=True) == [loose]


def test_bounds_count_the_settled_instructions():
    row = parse_row(IFEVAL_ROW["instruction_id_list"], IFEVAL_ROW["kwargs"], "")
    assert bounds(row, "") == (0.0, 1.0)
    assert bounds(row, "one cat, two") == (1 / 3, 2 / 3)
    assert bounds(row, "a cat has four legs") == (2 / 3, 1.0)


def test_characters_that_no_lowercase_or_uppercase_text_may_hold():
    """The character rules against Python itself, code point by code point: a text holding
    the character, alone or among others, is never islower() (resp. isupper())."""
    for code in range(0x20000):  # every cased character is below: no case in CJK or tags
        char = chr(code)
        if instruction_bounds._never_lower(char):
            assert not char.islower() and not ("a" + char).islower(), hex(code)
        if instruction_bounds._never_upper(char):
            assert not char.isupper() and not ("A" + char).isupper(), hex(code)
    assert instruction_bounds._never_lower("ǅ") and instruction_bounds._never_upper("ǅ")


def test_the_docs_table_says_which_instructions_give_bounds():
    doc = (ROOT / "docs" / "rewards.md").read_text()
    table = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and ":" in cells[0]:
            table[cells[0].strip("`")] = (cells[1], cells[2])
    assert set(table) == set(checkers.KNOWN_IDS)
    expected = {i: tuple(c or "no" for c in instruction_bounds.DIRECTIONS.get(i, ("", "")))
                for i in checkers.KNOWN_IDS}
    assert table == expected


def test_share_and_bounds_use_one_arithmetic():
    for n in range(1, 8):
        for k in range(n + 1):
            flags = [True] * k + [False] * (n - k)
            assert interval(flags) == (share(flags), share(flags))


def test_known_verdicts_are_carried_and_only_open_ones_worked_out():
    row = parse_row(IFEVAL_ROW["instruction_id_list"], IFEVAL_ROW["kwargs"], "")
    found = verdicts(row, "one cat, two")
    assert found == [False, None, True]
    assert verdicts(row, "one cat, two three four", known=found) == [False, True, True]
    # what is known is taken as given, not worked out again (here it is made up to show it)
    assert verdicts(row, "one cat, two", known=[True, None, False]) == [True, None, False]


def test_an_unplaceable_language_follows_and_its_error_line_is_not_shown(caplog):
    """if-verifiable logs 'Unable to detect language' at ERROR on the root logger for each
    text langdetect cannot place, and counts it as followed (IFEval's rule): one alarming line
    per emoji-only candidate in a run. The verdict stays; the line goes; others' do not."""
    row = parse_row(["language:response_language"], [{"language": "en"}], "Answer in English.")
    with caplog.at_level("ERROR"):
        assert follows(row, "👀👌\n👐👛") == [True]
        logging.error("Unable to detect language, said by someone else")
    assert [r.getMessage() for r in caplog.records] == \
        ["Unable to detect language, said by someone else"]
