"""The job spec: the generated reference, validation errors, overrides, fingerprint."""

from __future__ import annotations

import copy
import json
import re
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from specrej_ray.spec import JobSpec, SpecError, load_spec, parse_override
from specrej_ray.spec import docs as spec_docs
from specrej_ray.spec.iterate import EvaluateSpec, IterateSpec
from specrej_ray.spec.search import DrawsSpec

DOC = Path(__file__).resolve().parents[1] / "docs" / "spec.md"

MINIMAL: dict[str, Any] = {
    "prompts": {"path": "prompts.jsonl"},
    "generator": {"model": "gen-model"},
    "reward": {"type": "classifier", "model": "rm-model"},
    "output": {"path": "out"},
}


def write_spec(tmp_path: Path, data: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_changes(**sections: Any) -> dict[str, Any]:
    data = copy.deepcopy(MINIMAL)
    for key, value in sections.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    return data


def spec_error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path, overrides)
    return str(info.value)


# ---------------------------------------------------------------- the reference doc


def test_doc_is_current() -> None:
    assert DOC.exists(), "docs/spec.md is missing: run `python -m specrej_ray.spec.docs`"
    assert DOC.read_text() == spec_docs.render_reference(), (
        "docs/spec.md is out of date with specrej_ray/spec/: "
        "run `python -m specrej_ray.spec.docs`"
    )


def _all_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    # Independent walk: every field of every model, including mappings inside unions.
    keys = []
    for name, field in model.model_fields.items():
        key = prefix + name
        tp = field.annotation
        arms = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else ()
        inner = get_args(tp)[0] if get_origin(tp) is list else None
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            tp = inner  # one mapping or a list of them: the same keys
        if len(arms) == 2 and type(None) in arms:
            tp = next(a for a in arms if a is not type(None))  # an optional section
            arms = ()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            keys += _all_keys(tp, key + ".")
            continue
        keys.append(key)
        for arm in arms:
            if isinstance(arm, type) and issubclass(arm, BaseModel):
                keys += _all_keys(arm, key + ".")
    return keys


def _doc_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([\w.]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def test_every_field_is_documented() -> None:
    rows = _doc_rows(spec_docs.render_reference())
    keys = _all_keys(JobSpec)
    assert "search.schedule.tokens" in keys and "generator.sampling.top_p" in keys
    missing = [k for k in keys if k not in rows]
    assert not missing, f"undocumented keys: {missing}"
    for key in keys:
        assert rows[key][2], f"{key} has no description"


def test_doc_rows_readable() -> None:
    rows = _doc_rows(spec_docs.render_reference())
    assert rows["search.alpha"][:2] == ["`float`, >= 0, < 1", "`0.5`"]
    assert rows["search.mode"][:2] == ['`"sbon" \\| "bon"`', '`"sbon"`']
    assert rows["search.schedule"][:2] == ['`"memory" \\| "auto" \\| {tokens: [int, ...]}`',
                                          '`"memory"`']
    assert rows["search.schedule.tokens"][:2] == ["`list[int]`, at least 1 item", "required"]
    assert rows["generator.sampling.stop"][:2] == ["`list[str]`", "`[]`"]
    assert rows["prompts.path"][:2] == ["`str`", "required"]
    assert rows["prompts.limit"][:2] == ["`int \\| null`, >= 1", "`null`"]
    assert rows["generator.chat_template"][1] == "`true`"
    assert rows["seed"][:2] == ["`int`, >= 0", "`0`"]
    text = spec_docs.render_reference()
    for section in ["prompts", "generator", "generator.sampling", "reward", "search", "output"]:
        assert f"`{section}`\n" in text
    # Required sections are marked as such; defaulted ones say so.
    assert "## `reward`\n\nRequired section." in text
    assert "## `search`\n\nOptional section" in text


def test_main_writes_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "nested" / "spec.md"
    assert spec_docs.main([str(target)]) == 0
    assert target.read_text() == spec_docs.render_reference()
    assert str(target) in capsys.readouterr().out


def test_doc_example_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(spec_docs.MINIMAL_EXAMPLE)
    spec = load_spec(path)
    assert spec.reward[0].type == "lm_likelihood"
    assert spec_docs.MINIMAL_EXAMPLE in spec_docs.render_reference()


def test_minimal_spec_gets_documented_defaults(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, MINIMAL))
    # Hand-checked values of a few defaults.
    assert spec.name == "specrej"
    assert spec.seed == 0
    assert spec.search.mode == "sbon"
    assert spec.search.n == 16
    assert spec.search.alpha == 0.5
    assert spec.search.schedule == "memory"
    assert spec.search.decision_tokens is None
    assert spec.generator.sampling.max_new_tokens == 256
    assert spec.generator.sampling.stop == []
    assert spec.cluster.generators == 1
    assert spec.output.if_exists == "resume"
    # And every default the doc lists is the one the spec actually gets.
    given = {"prompts.path", "generator.model", "reward.type", "reward.model", "output.path"}
    dumped = spec.model_dump(mode="json")
    # An optional section's keys default to what the section gets when given empty.
    dumped["iterate"] = IterateSpec().model_dump(mode="json")
    dumped["iterate"]["evaluate"] = EvaluateSpec(prompts="held_out.jsonl").model_dump(mode="json")
    dumped["search"]["draws"] = DrawsSpec(max_n=64).model_dump(mode="json")
    checked = 0
    for key, (_, default, _) in _doc_rows(spec_docs.render_reference()).items():
        if default == "required" or key in given:
            continue
        value: Any = dumped
        for part in key.split("."):
            value = value[part]
            value = value[0] if isinstance(value, list) and part == "reward" else value
        assert default == f"`{json.dumps(value)}`", key
        checked += 1
    assert checked > 40


# ---------------------------------------------------------------- validation errors


ERROR_CASES = [
    pytest.param({"extra_key": 1}, "extra_key", "unknown key", id="unknown-top"),
    pytest.param({"search": {"alpah": 0.5}}, "search.alpah", "unknown key", id="unknown-nested"),
    pytest.param(
        {"generator": {"model": "m", "sampling": {"temprature": 0.7}}},
        "generator.sampling.temprature",
        "unknown key",
        id="unknown-deep",
    ),
    pytest.param({"search": {"n": "many"}}, "search.n", "integer", id="wrong-type-int"),
    pytest.param({"search": {"alpha": "high"}}, "search.alpha", "number", id="wrong-type-float"),
    pytest.param({"prompts": "p.jsonl"}, "prompts", "dictionary", id="section-not-mapping"),
    pytest.param({"search": {"alpha": 1.0}}, "search.alpha", "less than 1", id="alpha-1"),
    pytest.param(
        {"search": {"alpha": -0.1}},
        "search.alpha",
        "greater than or equal to 0",
        id="alpha-negative",
    ),
    pytest.param({"search": {"n": 0}}, "search.n", "a positive integer or auto", id="n-0"),
    pytest.param({"search": {"n": "some"}}, "search.n", "a positive integer or auto",
                 id="n-word"),
    pytest.param(
        {"search": {"schedule": {"tokens": []}}},
        "search.schedule.tokens",
        "at least 1",
        id="decisions-empty",
    ),
    pytest.param(
        {"search": {"schedule": {"tokens": [32, 32]}}},
        "search.schedule.tokens",
        "strictly increasing",
        id="decisions-repeated",
    ),
    pytest.param(
        {"search": {"schedule": {"tokens": [64, 32]}}},
        "search.schedule.tokens",
        "strictly increasing",
        id="decisions-decreasing",
    ),
    pytest.param(
        {"search": {"schedule": "tokens"}}, "search.schedule", "'memory'", id="schedule-bad-word"
    ),
    pytest.param({"reward": None}, "reward", "required field is missing", id="missing-section"),
    pytest.param(
        {"reward": {"type": "lm_likelihood"}},
        "reward",
        "reward.model is required",
        id="lm-likelihood-no-model",
    ),
    pytest.param(
        {"reward": {"type": "callable", "function": "scorer"}},
        "reward",
        "reward.function must be 'module:function'",
        id="callable-malformed",
    ),
    pytest.param(
        {"reward": {"type": "callable"}}, "reward", "reward.function", id="callable-missing"
    ),
    pytest.param(
        {"search": {"schedule": {"tokens": [8, "x"]}}},
        "search.schedule.tokens.1",
        "integer",
        id="decisions-not-int",
    ),
    pytest.param(
        {"search": {"schedule": "fastest"}},
        "search.schedule",
        "memory",
        id="schedule-unknown-word",
    ),
]


@pytest.mark.parametrize(("changes", "key", "fragment"), ERROR_CASES)
def test_validation_error_is_one_line_naming_the_key(
    tmp_path: Path, changes: dict[str, Any], key: str, fragment: str
) -> None:
    path = write_spec(tmp_path, with_changes(**changes))
    message = spec_error(path)
    lines = message.splitlines()
    assert len(lines) == 1, message
    assert lines[0].startswith(f"{path}: {key}: "), message
    assert fragment in lines[0]


def test_empty_spec_names_each_missing_section(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    lines = spec_error(path).splitlines()
    assert lines == [
        f"{path}: {s}: required field is missing"
        for s in ["prompts", "generator", "reward", "output"]
    ]


def test_two_mistakes_give_two_lines(tmp_path: Path) -> None:
    path = write_spec(tmp_path, with_changes(search={"alpha": 2, "nn": 4}))
    lines = spec_error(path).splitlines()
    assert len(lines) == 2
    assert {line.split(": ")[1] for line in lines} == {"search.alpha", "search.nn"}


def test_not_a_mapping_and_not_yaml(tmp_path: Path) -> None:
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    assert "must be a YAML mapping" in spec_error(listy)
    broken = tmp_path / "broken.yaml"
    broken.write_text("search:\n  alpha: [0.5\n")
    assert spec_error(broken).startswith(f"{broken}: not valid YAML at line")
    assert "cannot read" in spec_error(tmp_path / "absent.yaml")


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("search.alpha=0.7", ("search.alpha", 0.7)),
        ("search.n=32", ("search.n", 32)),
        ("search.mode=bon", ("search.mode", "bon")),
        ("generator.chat_template=false", ("generator.chat_template", False)),
        ("generator.sampling.stop=[a, b]", ("generator.sampling.stop", ["a", "b"])),
        ("search.schedule={tokens: [4, 8]}", ("search.schedule", {"tokens": [4, 8]})),
        ("output.path=a=b", ("output.path", "a=b")),  # only the first '=' splits
        (" cluster.address = ", ("cluster.address", "")),
    ],
)
def test_parse_override_typed(text: str, expected: tuple[str, Any]) -> None:
    key, value = parse_override(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


@pytest.mark.parametrize("text", ["search.alpha", "=0.7", " =1", "search.alpha=[1"])
def test_parse_override_bad_form(text: str) -> None:
    with pytest.raises(SpecError, match="--set"):
        parse_override(text)


def test_overrides_create_sections_and_validate(tmp_path: Path) -> None:
    path = write_spec(tmp_path, MINIMAL)  # no search, cluster or sampling sections
    spec = load_spec(
        path,
        [
            "search.alpha=0.7",
            "search.schedule={tokens: [4, 8]}",
            "generator.sampling.top_k=5",
            "cluster.generators=3",
        ],
    )
    assert spec.search.alpha == 0.7
    assert spec.search.decision_tokens == [4, 8]
    assert spec.generator.sampling.top_k == 5
    assert spec.generator.model == "gen-model"  # sibling keys survive
    assert spec.cluster.generators == 3


def test_override_replaces_file_value(tmp_path: Path) -> None:
    path = write_spec(tmp_path, with_changes(search={"alpha": 0.3, "n": 8}))
    spec = load_spec(path, ["search.alpha=0.9"])
    assert (spec.search.alpha, spec.search.n) == (0.9, 8)


def test_override_errors(tmp_path: Path) -> None:
    path = write_spec(tmp_path, MINIMAL)
    assert "search.alpha: " in spec_error(path, ["search.alpha=1.5"])
    assert "search.alhpa: unknown key" in spec_error(path, ["search.alhpa=0.5"])
    assert "not a section" in spec_error(path, ["output.path.deeper=1"])


# ---------------------------------------------------------------- fingerprint, alpha


def _fingerprint(tmp_path: Path, data: dict[str, Any], name: str) -> str:
    return load_spec(write_spec(tmp_path, data, name)).fingerprint()


def test_fingerprint_tracks_results_not_placement(tmp_path: Path) -> None:
    base = _fingerprint(tmp_path, MINIMAL, "a.yaml")
    assert base == _fingerprint(tmp_path, copy.deepcopy(MINIMAL), "b.yaml")
    changed = {
        "alpha": with_changes(search={"alpha": 0.7}),
        "seed": {**MINIMAL, "seed": 1},
    }
    for what, data in changed.items():
        assert _fingerprint(tmp_path, data, f"{what}.yaml") != base, what
    same = {
        "output": with_changes(output={"path": "elsewhere"}),
        "cluster": with_changes(cluster={"generators": 4}),
        "name": {**MINIMAL, "name": "other"},
    }
    for what, data in same.items():
        assert _fingerprint(tmp_path, data, f"{what}.yaml") == base, what


def test_effective_alpha(tmp_path: Path) -> None:
    bon = load_spec(write_spec(tmp_path, with_changes(search={"mode": "bon", "alpha": 0.7})))
    assert bon.search.alpha == 0.7
    assert bon.search.effective_alpha == 0.0
    sbon = load_spec(write_spec(tmp_path, with_changes(search={"mode": "sbon", "alpha": 0.7})))
    assert sbon.search.effective_alpha == 0.7


def test_reward_ensemble_list(tmp_path: Path) -> None:
    two = [{"type": "lm_likelihood", "model": "m", "weight": 2},
           {"type": "callable", "function": "mod:fn"}]
    spec = load_spec(write_spec(tmp_path, with_changes(reward=two)))
    assert [r.label for r in spec.reward] == ["lm_likelihood(m)", "callable(mod:fn)"]
    assert spec.reward_label == "zscore(2*lm_likelihood(m) + 1*callable(mod:fn))"
    single = load_spec(write_spec(tmp_path, MINIMAL))
    assert len(single.reward) == 1 and single.reward_label == single.reward[0].label


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        ([{"type": "callable", "function": "m:f"}] * 2, "reward: two rewards are named"),
        ([{"type": "lm_likelihood"}], "reward.0: reward.model is required"),
        ([], "reward: list at least one reward"),
    ],
)
def test_reward_ensemble_errors(tmp_path: Path, reward: Any, expected: str) -> None:
    message = spec_error(write_spec(tmp_path, with_changes(reward=reward)))
    assert len(message.splitlines()) == 1 and expected in message, message


# ---------------------------------------------------------------- values lax YAML lets through


@pytest.mark.parametrize(
    ("changes", "key", "fragment"),
    [
        ({"search": {"n": True}}, "search.n", "not true/false"),
        ({"search": {"alpha": False}}, "search.alpha", "not true/false"),
        ({"search": {"schedule": {"tokens": [True, 8]}}}, "search.schedule.tokens",
         "not true/false"),
        ({"generator": {"model": "m", "sampling": {"temperature": float("inf")}}},
         "generator.sampling.temperature", "finite"),
        ({"reward": {"type": "classifier", "model": "r", "weight": float("nan")}},
         "reward.weight", "finite"),
        ({"generator": {"model": "m", "sampling": {"top_p": "inf"}}},
         "generator.sampling.top_p", "finite"),
    ],
)
def test_booleans_and_non_finite_numbers_are_refused(
    tmp_path: Path, changes: dict[str, Any], key: str, fragment: str
) -> None:
    message = spec_error(write_spec(tmp_path, with_changes(**changes)))
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{tmp_path / 'job.yaml'}: {key}: ") and fragment in message


def test_booleans_still_set_boolean_fields(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, with_changes(search={"refill": False})))
    assert spec.search.refill is False


def test_decisions_past_max_new_tokens_are_refused(tmp_path: Path) -> None:
    data = with_changes(generator={"model": "m", "sampling": {"max_new_tokens": 16}},
                        search={"schedule": {"tokens": [8, 32]}})
    message = spec_error(write_spec(tmp_path, data))
    assert len(message.splitlines()) == 1
    assert "search.schedule.tokens: decision at 32" in message
    assert "max_new_tokens (16)" in message
    data["search"]["schedule"]["tokens"] = [8, 16]  # deciding at the last token is allowed
    assert load_spec(write_spec(tmp_path, data)).search.decision_tokens == [8, 16]


def test_duplicate_keys_are_refused_with_their_line(tmp_path: Path) -> None:
    path = write_spec(tmp_path, MINIMAL)
    path.write_text(path.read_text() + "search:\n  n: 4\n  alpha: 0.5\n  n: 8\n")
    lines = path.read_text().splitlines()
    first, second = (i + 1 for i, line in enumerate(lines) if line.strip().startswith("n:"))
    message = spec_error(path)
    assert message == (f"{path}: not valid YAML at line {second}: duplicate key 'n' "
                       f"(first at line {first}); keep one")


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    path = write_spec(tmp_path, MINIMAL)
    path.write_text("x: &b {n: 4, alpha: 0.3}\n" + path.read_text() + "search:\n  <<: *b\n  n: 8\n")
    assert spec_error(path) == f"{path}: x: unknown key; check the spelling (see docs/spec.md)"


def test_duplicate_keys_in_an_override(tmp_path: Path) -> None:
    path = write_spec(tmp_path, MINIMAL)
    message = spec_error(path, ["search.schedule={tokens: [4], tokens: [8]}"])
    assert message.startswith(f"{path}: --set search.schedule: ")
    assert "duplicate key 'tokens'" in message and len(message.splitlines()) == 1


def test_binary_and_nul_specs_are_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    assert spec_error(binary) == (f"{binary}: not a text file (byte 128 is not UTF-8); "
                                  "give a YAML job spec")
    nul = tmp_path / "nul.yaml"
    nul.write_text("name: a\x00b\n")
    message = spec_error(nul)
    assert message.startswith(f"{nul}: not valid YAML") and len(message.splitlines()) == 1


def test_an_impossible_prompt_path_is_left_to_the_prompt_reader(tmp_path: Path) -> None:
    long_name = "p" * 5000 + ".jsonl"  # stat() raises ENAMETOOLONG rather than saying no
    spec = load_spec(write_spec(tmp_path, with_changes(prompts={"path": long_name})))
    assert spec.prompts.path == long_name


# --- input limits (issue 24): one line before any parsing or reading without end ---


def test_a_spec_over_the_size_limit_is_refused_before_parsing(tmp_path):
    import specrej_ray.spec as spec_module

    path = write_spec(tmp_path, MINIMAL)
    with path.open("a") as f:  # valid YAML all the way: only its size is wrong
        f.write("#" + "x" * spec_module.MAX_SPEC_BYTES + "\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert "\n" not in str(e.value)
    assert f"{path.stat().st_size:,} bytes, over the 1 MiB limit" in str(e.value)


def test_a_spec_that_is_a_device_or_a_fifo_is_one_line(tmp_path):
    import os

    fifo = tmp_path / "job.yaml"
    os.mkfifo(fifo)  # reading it would block for ever
    for path in (Path("/dev/zero"), fifo):
        with pytest.raises(SpecError, match="not a regular file") as e:
            load_spec(path)
        assert "\n" not in str(e.value)


def test_an_alias_bomb_is_one_line(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert str(e.value) == (f"{path}: its aliases expand to over 100,000 values; a job spec "
                            "is small: write the values out")
    with pytest.raises(SpecError, match="aliases expand"):
        load_spec(write_spec(tmp_path, MINIMAL),  # --set values too
                  ["search.alpha={" + ", ".join(lines) + "}"])
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &a [*a]\n")
    with pytest.raises(SpecError, match="refers to itself"):
        load_spec(loop)


def test_anchors_and_merge_keys_within_the_limit_still_work(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "prompts: {path: prompts.jsonl}\n"
        "generator: {model: gen-model}\n"
        "reward:\n"
        "  - &r {type: classifier, model: rm-model, name: a}\n"
        "  - {<<: *r, name: b}\n"
        "output: {path: out}\n")
    spec = load_spec(path)
    assert [(r.name, r.model) for r in spec.reward] == [("a", "rm-model"), ("b", "rm-model")]
