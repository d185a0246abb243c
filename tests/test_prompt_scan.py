"""A JSON Lines file with no usable row is refused without reading it row by row (issue 44:
every prompt-file refusal in about a second, for 100 MB files): data/prompt_scan.may_hold
says False only where no row could be a prompt, and job.prepare.check_prompt_source then
refuses at once. A False where a row is a prompt would refuse a good file: the property
test below reads each generated file row by row and checks that never happens."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrej_ray.data import prompt_scan
from specrej_ray.data.prompt_scan import may_hold
from specrej_ray.data.prompts import Prompt, PromptError, iter_prompts
from specrej_ray.job import prepare
from specrej_ray.spec import PromptsSpec, validate_spec

ROW = '{"prompt": "Say hello."}\n'


@pytest.mark.parametrize("text, field, holds", [
    (ROW, "prompt", True),
    ('{"text": "no prompt here"}\n' * 3, "prompt", False),
    ('{"\\u0070rompt": "escaped key"}\n', "prompt", True),  # an escape of one character
    (json.dumps({"préface": "x"}) + "\n", "préface", True),  # ensure_ascii's \u00e9
    (json.dumps({"préface": "x"}, ensure_ascii=False) + "\n", "préface", True),
    ('{"a\\"b": "x"}\n', 'a"b', True),
    ('{"prompt": "déjà vu, 中文, 🙂"}\n', "prompt", True),  # UTF-8 of 2, 3 and 4 bytes
    ("", "prompt", False),
])
def test_a_file_may_hold_a_field_only_where_its_name_is_written(tmp_path, text, field, holds):
    path = tmp_path / "p.jsonl"
    path.write_text(text, encoding="utf-8")
    assert may_hold(path, field) is holds


def test_lines_in_another_encoding_or_not_text_hold_nothing(tmp_path):
    path = tmp_path / "p.jsonl"
    latin1 = '{"prompt": "déjà vu"}\n'.encode("latin-1")
    path.write_bytes(latin1 * 1000 + bytes(range(256)) * 40)
    assert may_hold(path, "prompt") is False
    path.write_bytes(latin1 * 1000 + ROW.encode() + latin1)  # one good line among them
    assert may_hold(path, "prompt") is True
    path.write_bytes(ROW.encode("utf-16"))
    assert may_hold(path, "prompt") is False


def test_a_line_over_the_limit_across_blocks_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_scan, "BLOCK", 64)
    monkeypatch.setattr(prompt_scan, "MAX_LINE_BYTES", 100)
    path = tmp_path / "p.jsonl"
    path.write_text('{"x": "' + "y" * 300 + ' "prompt": 1}\n' + '{"text": 1}\n' * 5)
    assert may_hold(path, "prompt") is False
    path.write_text('{"x": "' + "y" * 300 + '"}\n' + '{"text": 1}\n' * 5 + ROW)
    assert may_hold(path, "prompt") is True


_LINES = st.sampled_from([
    ROW.encode(), '{"prompt": "déjà"}\n'.encode(), '{"prompt": "déjà"}\n'.encode("latin-1"),
    b'{"text": "x"}\n', b'{"prompt": ""}\n', b"\n", b"\xff\xfe\x00\n", b'{"prompt": 3}\n',
    b'{"prompt": "\xc3"}\n', b'{"prompt": "\xe2\x82"}\n', b'{"prompt": "\xf0\x9f\x99\x82"}\n',
    b'{"pr\\u006fmpt": "escaped"}\n', b'["prompt"]\n', b'{"prompt": "a"',
])


@settings(max_examples=100, deadline=None)
@given(st.lists(_LINES, max_size=12), st.integers(min_value=8, max_value=64))
def test_a_file_said_to_hold_no_field_has_no_prompt(tmp_path_factory, lines, block):
    path = tmp_path_factory.mktemp("scan") / "p.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompt_scan, "BLOCK", block)
        holds = may_hold(path, "prompt")
    try:
        prompts = [p for p in iter_prompts(PromptsSpec(path=str(path))) if isinstance(p, Prompt)]
    except PromptError:
        prompts = []
    assert holds or not prompts


def _spec(path) -> object:
    return validate_spec({"name": "x", "prompts": {"path": str(path)},
                          "generator": {"model": "/m"},
                          "reward": {"type": "callable", "function": "m:f"},
                          "output": {"path": "/tmp/x"}})


def test_a_file_with_no_usable_row_is_refused_after_its_first_rows(tmp_path, monkeypatch):
    path = tmp_path / "p.jsonl"
    path.write_bytes('{"prompt": "déjà"}\n'.encode("latin-1") * (prepare.QUICK_ROWS + 5))
    read = []
    real = prepare.prompt_rows

    def counted(spec):
        for got in real(spec):
            read.append(got)
            yield got

    monkeypatch.setattr(prepare, "prompt_rows", counted)
    with pytest.raises(PromptError, match=r"^prompts.path: no row of '.*p.jsonl' is a line of "
                       r"UTF-8 with a 'prompt' field \(first: row 1: byte 14 of the line is "
                       r"not UTF-8\)"):
        prepare.check_prompt_source(_spec(path))
    assert len(read) == prepare.QUICK_ROWS
    path.write_bytes(path.read_bytes() + ROW.encode())  # the last row is good: it is found
    prepare.check_prompt_source(_spec(path))
