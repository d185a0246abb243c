"""Property tests: any spec text and any prompt file gives a result or one clear error.

Derandomized (the same examples every run) and without a database, so CI is reproducible
and nothing is written into the repo.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrej_ray.data.prompts import PromptError, PromptSet, load_prompts
from specrej_ray.spec import JobSpec, PromptsSpec, SpecError, load_spec, parse_override

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------- the spec parser

SECTIONS: dict[str, list[str]] = {
    "prompts": ["path", "format", "prompt_field", "id_field", "limit", "system"],
    "generator": ["model", "dtype", "device", "chat_template", "threads", "sampling"],
    "reward": ["type", "model", "function", "weight", "name", "pool_size", "placement"],
    "search": ["mode", "n", "alpha", "schedule", "min_decision_tokens", "kv_budget_gb"],
    "cluster": ["generators", "max_generators", "shard_size", "call_timeout_s"],
    "output": ["path", "if_exists", "formats", "pairs", "pairs_k", "top_k", "filters"],
}
SAMPLING = ["temperature", "top_p", "top_k", "max_new_tokens", "stop"]

scalars = st.one_of(
    st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
    st.none(), st.text(max_size=6), st.sampled_from(
        ["memory", "auto", "sbon", "bon", "classifier", "callable", "m:f", "p.jsonl", "out",
         "cpu", "resume", "sft", "x\x00y", "\ud800"]),
)
values = st.one_of(
    scalars,
    st.lists(st.integers(-2, 400) | st.booleans(), max_size=4),
    st.fixed_dictionaries({"tokens": st.lists(st.integers(-2, 400), max_size=3)}),
    st.dictionaries(st.sampled_from(SAMPLING + ["junk"]), scalars, max_size=3),
)


@st.composite
def section(draw, name: str) -> Any:
    keys = SECTIONS[name] + ["typo_" + name]
    if draw(st.integers(0, 9)) == 0:
        return draw(scalars)  # a section that is not a mapping
    body = draw(st.dictionaries(st.sampled_from(keys), values, max_size=4))
    if name == "reward" and draw(st.booleans()):
        return [body, draw(st.dictionaries(st.sampled_from(keys), values, max_size=3))]
    return body


@st.composite
def spec_text(draw) -> bytes:
    names = draw(st.lists(st.sampled_from([*SECTIONS, "seed", "junk"]), max_size=7,
                          unique=True))
    data = {n: (draw(values) if n in ("seed", "junk") else draw(section(n))) for n in names}
    text = yaml.safe_dump(data, allow_unicode=draw(st.booleans())).encode("utf-8", "replace")
    edit = draw(st.integers(0, 5))
    if edit == 1 and names:  # a duplicate top-level key
        text += f"{names[0]}: 1\n".encode()
    elif edit == 2:  # junk bytes somewhere
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.binary(min_size=1, max_size=8)) + text[at:]
    elif edit == 3:  # a line of arbitrary text
        text += draw(st.text(max_size=20)).encode("utf-8", "surrogatepass") + b"\n"
    return text


overrides = st.lists(
    st.builds(lambda k, v: f"{k}={v}",
              st.sampled_from(["search.n", "search.alpha", "generator.sampling.temperature",
                               "search.schedule", "output.path.deeper", "a..b", ""]),
              st.sampled_from(["1", "true", ".inf", "{tokens: [4], tokens: [8]}", "[1",
                               "{tokens: [2, 4]}", "x\x00", "nan", ""])),
    max_size=2,
)


@settings(max_examples=500, **SETTINGS)
@given(text=spec_text(), sets=overrides)
def test_any_spec_text_gives_a_spec_or_file_named_errors(tmp_path: Path, text: bytes,
                                                         sets: list[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(text)
    try:
        assert isinstance(load_spec(path, sets), JobSpec)
    except SpecError as e:
        lines = str(e).splitlines()
        assert lines, "an empty error"
        assert all(line.startswith(f"{path}: ") for line in lines), lines


@settings(max_examples=500, **SETTINGS)
@given(text=st.text(max_size=30))
def test_any_override_parses_or_is_one_set_error(text: str) -> None:
    try:
        key, _ = parse_override(text)
        assert key == key.strip() and key
    except SpecError as e:
        assert str(e).startswith("--set ") and len(str(e).splitlines()) == 1


# ---------------------------------------------------------------- the prompt readers

texts = st.one_of(st.text(max_size=8), st.sampled_from(["hi", "", " ", "a\x00b", "\ud800"]))
cell = st.one_of(texts, st.integers(-5, 5), st.none(), st.booleans(),
                 st.lists(st.integers(0, 3), max_size=2))
row = st.one_of(
    st.fixed_dictionaries({"prompt": texts}, optional={"id": cell, "sys": cell, "x": cell}),
    st.dictionaries(st.sampled_from(["prompt", "id", "sys", "other"]), cell, max_size=3),
    cell,  # not an object at all
)


def _json_line(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def json_file(draw) -> tuple[str, bytes]:
    rows = draw(st.lists(row, max_size=6))
    ascii_only = draw(st.booleans())
    fmt = draw(st.sampled_from(["jsonl", "json"]))
    if fmt == "json" and draw(st.booleans()):
        body = _json_line(rows, ascii_only)
    else:
        body = b"\n".join(_json_line(r, ascii_only) for r in rows)
    if draw(st.booleans()):  # bad bytes or a broken line somewhere
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.binary(min_size=1, max_size=6)) + body[at:]
    return fmt, body


def _check(source: Path, spec: PromptsSpec) -> None:
    try:
        got = load_prompts(spec)
    except PromptError as e:
        assert len(str(e).splitlines()) == 1 and str(e), str(e)
        return
    assert isinstance(got, PromptSet)
    for problem in got.problems:
        assert isinstance(problem.row, int) and problem.row >= 1
        line = problem.line(str(source))
        assert line.startswith(f"{source} row {problem.row}") and "\n" not in line
    for prompt in got.prompts:
        prompt.text.encode("utf-8")  # whatever is kept can be tokenized and written
        assert "\x00" not in prompt.text


FIELDS = st.fixed_dictionaries({}, optional={"id_field": st.sampled_from(["id", "nope"]),
                                             "system_field": st.just("sys"),
                                             "limit": st.integers(1, 3)})


@settings(max_examples=400, **SETTINGS)
@given(file=json_file(), fields=FIELDS)
def test_any_json_prompt_file_gives_prompts_or_one_line(tmp_path: Path, file, fields) -> None:
    fmt, body = file
    path = tmp_path / f"p.{fmt}"
    path.write_bytes(body)
    _check(path, PromptsSpec(path=str(path), **fields))


@st.composite
def table_file(draw) -> tuple[str, bytes]:
    columns = draw(st.lists(st.sampled_from(["prompt", "id", "sys", "other"]), min_size=1,
                            max_size=3, unique=True))
    rows = draw(st.lists(st.lists(st.one_of(st.text(max_size=6), st.integers(0, 9),
                                            st.none()),
                                  min_size=len(columns), max_size=len(columns)), max_size=5))
    if draw(st.booleans()):
        return "parquet", _parquet(columns, rows) if draw(st.integers(0, 3)) else draw(
            st.binary(max_size=30))
    out = io.StringIO()
    csv.writer(out).writerows([columns, *rows])
    body = out.getvalue().encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.binary(min_size=1, max_size=4)) + body[at:]
    return "csv", body


def _parquet(columns: list[str], rows: list[list[Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One type per column, as a real table has: everything as text, None kept as null.
    table = pa.table({c: [None if r[i] is None else str(r[i]) for r in rows]
                      for i, c in enumerate(columns)})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


@settings(max_examples=100, **SETTINGS)
@given(file=table_file(), fields=FIELDS)
def test_any_csv_or_parquet_gives_prompts_or_one_line(tmp_path: Path, file, fields) -> None:
    fmt, body = file
    path = tmp_path / f"p.{fmt}"
    path.write_bytes(body)
    _check(path, PromptsSpec(path=str(path), **fields))
