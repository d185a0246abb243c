"""The committed verifiable-instruction prompt sets (jobs/instructions/) are what
scripts/make_instruction_prompts.py makes, and every row is one IFEval's checkers can score."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import pytest
from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS, INSTRUCTION_DICT

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "jobs" / "instructions"
FILES = ("bench.jsonl", "train.jsonl", "eval.jsonl", "README.md")
# their checkers need nltk's punkt data, which is not installed and cannot be fetched offline
NEED_PUNKT = {"length_constraints:number_sentences", "change_case:capital_word_frequency"}


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "make_instruction_prompts", ROOT / "scripts" / "make_instruction_prompts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mip = _load_script()


def _rows(split: str) -> list[dict]:
    lines = (COMMITTED / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    return {split: _rows(split) for split in mip.SPLITS}


def test_the_script_reproduces_the_committed_files_byte_for_byte(tmp_path):
    assert mip.main(["--out", str(tmp_path)]) == 0
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name


def test_splits_have_their_sizes_and_ifevals_fields(rows):
    assert {split: len(r) for split, r in rows.items()} == {
        "bench": 64, "train": 320, "eval": 128}
    for split, split_rows in rows.items():
        for n, row in enumerate(split_rows):
            assert list(row) == ["id", "key", "prompt", "instruction_id_list", "kwargs"]
            assert (row["id"], row["key"]) == (f"{split}-{n}", n)
            assert len(row["kwargs"]) == len(row["instruction_id_list"])


def _all(rows):
    return [row for split_rows in rows.values() for row in split_rows]


def test_every_prompt_has_one_to_three_distinct_registered_usable_ids(rows):
    for row in _all(rows):
        ids = row["instruction_id_list"]
        assert 1 <= len(ids) <= 3, row["id"]
        assert len(set(ids)) == len(ids), row["id"]
        for i in ids:
            assert i in INSTRUCTION_DICT, (row["id"], i)
            assert i not in NEED_PUNKT, (row["id"], i)


def test_no_prompt_pairs_conflicting_instructions(rows):
    """Conflicting as the registry says, read both ways (it lists english_capital under
    english_lowercase, not the reverse), or as the script adds (no answer could meet both)."""
    extra = {frozenset(pair) for pair in mip.EXTRA_CONFLICTS}
    assert frozenset(("combination:repeat_prompt", "punctuation:no_comma")) in extra
    for row in _all(rows):
        ids = row["instruction_id_list"]
        for k, a in enumerate(ids):
            for b in ids[k + 1:]:
                assert b not in INSTRUCTION_CONFLICTS[a], (row["id"], a, b)
                assert a not in INSTRUCTION_CONFLICTS[b], (row["id"], a, b)
                assert frozenset((a, b)) not in extra, (row["id"], a, b)


def test_every_checker_takes_the_rows_kwargs_and_draws_nothing_at_random(rows):
    for row in _all(rows):
        for i, kwargs in zip(row["instruction_id_list"], row["kwargs"], strict=True):
            checker = INSTRUCTION_DICT[i](i)
            taken = list(inspect.signature(checker.build_description).parameters)
            assert sorted(kwargs) == sorted(taken), (row["id"], i)
            checker.build_description(**kwargs)
            assert (checker.get_instruction_args() or {}) == kwargs, (row["id"], i)


def _base_task(row: dict) -> str:
    """The prompt less its instructions' IFEval wording, which it must end with in order."""
    descriptions = [INSTRUCTION_DICT[i](i).build_description(**k)
                    for i, k in zip(row["instruction_id_list"], row["kwargs"], strict=True)]
    prompt = row["prompt"]
    base = prompt[:prompt.index(descriptions[0])].rstrip(" \n")
    if "combination:repeat_prompt" in row["instruction_id_list"]:
        request = mip.join([base] + descriptions[:-1])
        assert row["kwargs"][-1] == {"prompt_to_repeat": request}, row["id"]
        assert prompt == request + "\n" + descriptions[-1], row["id"]
    else:
        assert prompt == mip.join([base] + descriptions), row["id"]
    return base


def test_splits_share_no_base_task_and_none_repeats_within_one(rows):
    bases = {split: [_base_task(row) for row in r] for split, r in rows.items()}
    for split, tasks in bases.items():
        assert len(set(tasks)) == len(tasks), split
    names = list(bases)
    for k, a in enumerate(names):
        for b in names[k + 1:]:
            assert not set(bases[a]) & set(bases[b]), (a, b)


def test_splits_share_no_topic_thing_goal_or_place(rows):
    drawn = mip.make_all(mip.DEFAULT_SEED)
    fillers = {split: {d.filler for d in ds} for split, ds in drawn.items()}
    names = list(fillers)
    for k, a in enumerate(names):
        for b in names[k + 1:]:
            assert not fillers[a] & fillers[b], (a, b)
    for split, ds in drawn.items():  # the drawn base tasks are the committed prompts' own
        assert [d.base_task for d in ds] == [_base_task(r) for r in rows[split]], split


def test_argument_words_cannot_collide():
    """A word one instruction asks for can never hold another's (the frequency and existence
    checkers match substrings), a rare letter or an end phrase's word."""
    words = mip.KEYWORDS + mip.COMMON_WORDS + mip.FIRST_WORDS
    assert len(set(words)) == len(words)
    assert not [(a, b) for a in words for b in words if a != b and a in b]
    assert not [w for w in words if set(w) & set(mip.RARE_LETTERS)]
    assert not [w for w in words if any(w in e.lower() for e in mip.ENDING_PHRASES)]
    fillers = [f for pool in mip.FILLERS.values() for f in pool]
    assert len(set(fillers)) == len(fillers)


def test_a_checker_without_an_argument_draw_is_refused():
    with pytest.raises(ValueError, match="length_constraints:number_sentences"):
        mip.draw_kwargs(mip.random.Random(0), "length_constraints:number_sentences", [],
                        mip.WordDraw(mip.random.Random(0), "a task"))
