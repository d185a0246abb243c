"""Prompt loading: formats, stable ids, row problems, fatal errors, templates, lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specrej_ray.data.prompts import (
    Prompt,
    PromptError,
    RowProblem,
    chat_messages,
    check_lengths,
    load_prompts,
    prompt_id,
    render_prompt,
)
from specrej_ray.spec import PromptsSpec
from tests.tiny import make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"prompt": "How do I boil an egg?", "sys": "Be brief."},
    {"prompt": "Name a prime number.", "sys": None},
    {"prompt": "Why is the sea salty?", "sys": ""},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec(path: Path, **kw) -> PromptsSpec:
    return PromptsSpec(path=str(path), **kw)


def _all_formats(tmp_path: Path) -> dict[str, Path]:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    out = {"jsonl": _write_jsonl(tmp_path / "p.jsonl", ROWS)}
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    out["json"] = tmp_path / "p.json"
    ds.to_parquet(str(tmp_path / "p.parquet"))
    out["parquet"] = tmp_path / "p.parquet"
    ds.to_csv(str(tmp_path / "p.csv"), index=False)
    out["csv"] = tmp_path / "p.csv"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "hfdir"))
    out["hf"] = tmp_path / "hfdir"
    return out


def test_every_format_loads_with_the_same_ids(tmp_path):
    files = _all_formats(tmp_path)
    results = {fmt: load_prompts(_spec(p, system_field="sys")) for fmt, p in files.items()}
    expected = [r["prompt"] for r in ROWS]
    for fmt, ps in results.items():
        assert [p.text for p in ps.prompts] == expected, fmt
        assert ps.problems == [], fmt
        assert [p.row for p in ps.prompts] == [1, 2, 3], fmt
        # A per-row system prompt only where the row has a non-empty one.
        assert [p.system for p in ps.prompts] == ["Be brief.", None, None], fmt
    ids = {fmt: [p.id for p in ps.prompts] for fmt, ps in results.items()}
    assert len({tuple(v) for v in ids.values()}) == 1, ids
    assert ids["jsonl"][0] == prompt_id("How do I boil an egg?", "Be brief.")
    assert len(set(ids["jsonl"])) == 3 and all(len(i) == 16 for i in ids["jsonl"])


def test_ids_are_stable_across_loads_and_depend_on_system(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    a = load_prompts(_spec(path))
    b = load_prompts(_spec(path))
    assert [p.id for p in a.prompts] == [p.id for p in b.prompts]
    c = load_prompts(_spec(path, system="You are helpful."))
    assert all(p.system == "You are helpful." for p in c.prompts)
    assert [p.id for p in a.prompts] != [p.id for p in c.prompts]


def test_explicit_format_overrides_the_extension(tmp_path):
    path = _write_jsonl(tmp_path / "prompts.txt", ROWS)
    ps = load_prompts(_spec(path, format="jsonl"))
    assert len(ps.prompts) == 3


def test_hf_dir_with_a_single_non_train_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)})
    dd.save_to_disk(str(tmp_path / "d"))
    assert len(load_prompts(_spec(tmp_path / "d")).prompts) == 3


def test_hf_dir_with_several_splits_and_no_train_is_fatal(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"a": ds, "b": ds}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(PromptError, match="none is 'train'"):
        load_prompts(_spec(tmp_path / "d"))


def test_row_problems_name_the_right_rows(tmp_path):
    rows = [
        {"id": "a", "prompt": "fine"},          # 1
        {"id": "b"},                            # 2 prompt missing
        {"id": "c", "prompt": "   "},           # 3 empty
        {"id": "d", "prompt": 42},              # 4 not a string
        {"id": "a", "prompt": "again"},         # 5 duplicate of row 1
        {"prompt": "no id"},                    # 6 id missing
        {"id": "e", "prompt": "also fine"},     # 7
    ]
    ps = load_prompts(_spec(_write_jsonl(tmp_path / "p.jsonl", rows), id_field="id"))
    assert [(p.id, p.row) for p in ps.prompts] == [("a", 1), ("e", 7)]
    got = {pr.row: pr for pr in ps.problems}
    assert sorted(got) == [2, 3, 4, 5, 6]
    assert got[2].reason == "prompt is missing" and got[2].id == "b"
    assert got[3].reason == "prompt is empty"
    assert "not a string" in got[4].reason and "int" in got[4].reason
    assert got[5].reason == "duplicate id 'a' (first at row 1)"
    assert got[6].reason == "id is missing or empty" and got[6].id is None
    line = got[3].line("p.jsonl")
    assert line.startswith("p.jsonl row 3 (id 'c'): prompt is empty") and "\n" not in line


def test_duplicate_text_gives_duplicate_hash_id(tmp_path):
    rows = [{"prompt": "same"}, {"prompt": "other"}, {"prompt": "same"}]
    ps = load_prompts(_spec(_write_jsonl(tmp_path / "p.jsonl", rows)))
    assert len(ps.prompts) == 2
    [problem] = ps.problems
    assert problem.row == 3 and "(first at row 1)" in problem.reason


def test_limit_counts_valid_prompts_only(tmp_path):
    rows = [{"prompt": ""}, {"prompt": "one"}, {"prompt": None}, {"prompt": "two"},
            {"prompt": "three"}]
    ps = load_prompts(_spec(_write_jsonl(tmp_path / "p.jsonl", rows), limit=2))
    assert [p.text for p in ps.prompts] == ["one", "two"]
    assert [pr.row for pr in ps.problems] == [1, 3]


def test_missing_file_is_fatal(tmp_path):
    with pytest.raises(PromptError, match="prompts.path: .*nope.jsonl' does not exist"):
        load_prompts(_spec(tmp_path / "nope.jsonl"))


def test_absent_column_is_fatal_and_lists_columns(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"text": "hi"}, {"text": "yo"}])
    with pytest.raises(PromptError, match=r"prompts.prompt_field: no column 'prompt'.*text"):
        load_prompts(_spec(path))
    with pytest.raises(PromptError, match="prompts.id_field: no column 'uid'"):
        load_prompts(_spec(path, prompt_field="text", id_field="uid"))


def test_unknown_extension_is_fatal(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    with pytest.raises(PromptError, match=r"\.jsonl.*\.csv.*prompts.format") as e:
        load_prompts(_spec(path))
    assert "\n" not in str(e.value)


def test_unreadable_file_is_one_line_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(PromptError, match="cannot read .*bad.parquet' as parquet") as e:
        load_prompts(_spec(path))
    assert "\n" not in str(e.value)


def test_loading_writes_nothing_next_to_the_file(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    load_prompts(_spec(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]


def test_render_prompt_with_chat_template():
    tok = make_tokenizer()
    plain = Prompt(id="x", text="Hi there", system=None, row=1)
    with_sys = Prompt(id="y", text="Hi there", system="Be kind.", row=2)
    assert render_prompt(tok, plain, True) == "<|user|>Hi there<|assistant|>"
    assert render_prompt(tok, with_sys, True) == "<|system|>Be kind.<|user|>Hi there<|assistant|>"


def test_render_prompt_without_chat_template():
    tok = make_tokenizer(chat_template=False)
    assert render_prompt(tok, Prompt("x", "Hi", None, 1), False) == "Hi"
    assert render_prompt(tok, Prompt("x", "Hi", "Sys", 1), False) == "Sys\n\nHi"
    with pytest.raises(PromptError, match="set generator.chat_template: false"):
        render_prompt(tok, Prompt("x", "Hi", None, 1), True)


def test_chat_messages_for_sft():
    p = Prompt("x", "Q?", "S", 1)
    assert chat_messages(p, "A.") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
    ]
    assert [m["role"] for m in chat_messages(Prompt("x", "Q?", None, 1), "A.")] == [
        "user", "assistant"
    ]


def test_check_lengths():
    ps = [Prompt(f"p{i}", "t", None, i + 1) for i in range(3)]
    kept, problems = check_lengths(ps, [100, 9000, 7936], max_new_tokens=256, context=8192)
    assert kept == [0, 2]  # 7936 + 256 == 8192 fits exactly
    assert problems == [RowProblem(2, "p1", "prompt is 9000 tokens; with max_new_tokens 256 "
                                            "it exceeds the generator's context of 8192")]


def test_demo_prompts_load_cleanly():
    ps = load_prompts(PromptsSpec(path=str(ROOT / "jobs" / "demo_prompts.jsonl"), id_field="id"))
    assert ps.problems == []
    assert 15 <= len(ps.prompts) <= 25
    assert len({p.text for p in ps.prompts}) == len(ps.prompts)
    assert all(p.id.startswith("demo-") for p in ps.prompts)


# ---- JSON(L) rows we parse ourselves: one bad row is a problem, never the whole file -------


def test_bad_jsonl_lines_are_row_problems(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        b'{"id": "a", "prompt": "fine"}',           # 1
        b'{bad json',                               # 2
        b'{"id": "b", "prompt": "x\x00y"}',         # 3 raw NUL byte: invalid JSON
        b'{"id": "c", "prompt": "lone \\ud800"}',   # 4 a lone surrogate
        b'["not", "an", "object"]',                 # 5
        b'',                                        # 6 blank: no row
        b'{"id": "d", "prompt": "\xff bad utf-8"}', # 7
        b'{"id": "e", "prompt": "nul \\u0000 esc"}',  # 8 a NUL character via an escape
        b'{"id": "f", "prompt": "also fine"}',      # 9
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    ps = load_prompts(_spec(path, id_field="id"))
    assert [(p.id, p.row) for p in ps.prompts] == [("a", 1), ("f", 9)]
    got = {pr.row: pr.reason for pr in ps.problems}
    assert sorted(got) == [2, 3, 4, 5, 7, 8]
    assert got[2].startswith("not valid JSON (") and "column" in got[2]
    assert got[3].startswith("not valid JSON (")
    assert "lone surrogate" in got[4]
    assert got[5] == "row is a JSON list, not an object"
    assert "not UTF-8" in got[7]
    assert "NUL character" in got[8]
    assert all("\n" not in pr.line(str(path)) for pr in ps.problems)


def test_a_jsonl_file_with_no_object_row_lists_its_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("1\n{oops\n")
    ps = load_prompts(_spec(path))
    assert ps.prompts == [] and [pr.row for pr in ps.problems] == [1, 2]


def test_a_surrogate_in_an_id_or_system_is_a_row_problem(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "\\udc00", "prompt": "a"}\n'
                    '{"id": "x", "prompt": "b", "sys": "\\ud800"}\n'
                    '{"id": "y", "prompt": "c"}\n')
    ps = load_prompts(_spec(path, id_field="id", system_field="sys"))
    assert [p.id for p in ps.prompts] == ["y"]
    assert [(pr.row, pr.id) for pr in ps.problems] == [(1, None), (2, "x")]
    assert "id contains a lone surrogate" in ps.problems[0].reason
    assert "sys contains a lone surrogate" in ps.problems[1].reason


def test_json_list_elements_that_are_not_objects_are_row_problems(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": "one"}, "two", None, {"prompt": "three"}]))
    ps = load_prompts(_spec(path))
    assert [(p.text, p.row) for p in ps.prompts] == [("one", 1), ("three", 4)]
    assert [(pr.row, pr.reason) for pr in ps.problems] == [
        (2, "row is a JSON str, not an object"), (3, "row is a JSON NoneType, not an object")]


def test_a_broken_json_list_is_one_line_naming_line_and_column(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('[\n  {"prompt": "one"},\n  {"prompt": oops}\n]\n')
    with pytest.raises(PromptError, match=r"not valid JSON \(.* at line 3 column 14\)") as e:
        load_prompts(_spec(path))
    assert "\n" not in str(e.value) and ".jsonl" in str(e.value)


def test_json_lines_in_a_json_file_are_read_line_by_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"prompt": "one"}\n{broken\n{"prompt": "two"}\n')
    ps = load_prompts(_spec(path))
    assert [p.text for p in ps.prompts] == ["one", "two"]
    assert [pr.row for pr in ps.problems] == [2]


def test_an_id_with_a_newline_stays_on_one_line(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a\nb", "prompt": "x"},
                                               {"id": "a\nb", "prompt": "y"}])
    [problem] = load_prompts(_spec(path, id_field="id")).problems
    assert "\n" not in problem.line("p.jsonl") and "'a\\nb'" in problem.line("p.jsonl")


def test_stray_bytes_in_a_json_file_are_row_problems_not_a_crash(tmp_path):
    # datasets' pyarrow JSON reader crashed the process (SIGSEGV) on exactly this file.
    path = tmp_path / "p.json"
    path.write_bytes(b'null\x00\n{"prompt": ""}\n4\n{"prompt": "ok"}\n')
    ps = load_prompts(_spec(path))
    assert [p.row for p in ps.prompts] == [4]
    assert [pr.row for pr in ps.problems] == [1, 2, 3]


def test_one_pretty_printed_object_is_one_line_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"prompt": ["a", "b"]}, indent=2))
    with pytest.raises(PromptError, match="holds one JSON object; give a list"):
        load_prompts(_spec(path))


# --- input limits (issue 24) ---


def test_a_device_or_a_fifo_as_prompts_path_is_one_line(tmp_path):
    import os

    fifo = tmp_path / "p.jsonl"
    os.mkfifo(fifo)  # reading would block; /dev/zero would be read until memory runs out
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(PromptError, match="is not a regular file") as e:
            load_prompts(_spec(Path(path), format="jsonl"))
        assert "\n" not in str(e.value)


def test_a_line_over_the_limit_is_a_row_problem_and_rows_count_on(tmp_path, monkeypatch):
    import specrej_ray.data.prompts as prompts_module

    monkeypatch.setattr(prompts_module, "MAX_LINE_BYTES", 64)
    path = tmp_path / "p.jsonl"
    long_row = json.dumps({"prompt": "x" * 500})
    path.write_text(json.dumps({"prompt": "first"}) + "\n" + long_row + "\n"
                    + json.dumps({"prompt": "third"}) + "\n" + "y" * 200)  # no newline
    got = load_prompts(_spec(path))
    assert [(p.row, p.text) for p in got.prompts] == [(1, "first"), (3, "third")]
    assert [(p.row, p.reason) for p in got.problems] == [
        (2, "line is over the 64 bytes limit of a prompt row; shorten it"),
        (4, "line is over the 64 bytes limit of a prompt row; shorten it")]


def test_a_line_just_under_the_real_limit_is_read(tmp_path):
    from specrej_ray.data.prompts import MAX_LINE_BYTES

    path = tmp_path / "p.jsonl"
    text = "z" * (MAX_LINE_BYTES - 20)
    path.write_text(json.dumps({"prompt": text}) + "\n"
                    + json.dumps({"prompt": "z" * MAX_LINE_BYTES}) + "\n")
    got = load_prompts(_spec(path))
    assert [p.text for p in got.prompts] == [text] and [p.row for p in got.problems] == [2]
