"""The CLI's user errors: exit code 2, one line per error, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specrej_ray.cli import main
from tests.conftest import tiny_job, write_job, write_jsonl

PROMPTS = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Count to three."}]


@pytest.fixture
def job(tmp_path, tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    return tiny_job(tmp_path, tiny_lm_dir, prompts)


def run_cli(capsys, *argv) -> tuple[int, list[str], str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, [line for line in out.err.splitlines() if line.strip()], out.out


def test_validate_ok(tmp_path, job, capsys):
    code, err, out = run_cli(capsys, "validate", write_job(tmp_path / "job.yaml", job))
    assert code == 0 and err == []
    assert "ok: 2 prompts" in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"search": {"alpah": 0.5}}, "search.alpah: unknown key"),
        ({"search": {"alpha": 1.0}}, "search.alpha: Input should be less than 1"),
        ({"search": {"n": 0}}, "search.n: must be a positive integer or auto"),
        ({"search": {"schedule": {"tokens": []}}}, "search.schedule.tokens"),
        ({"generator": {"model": "./no/such/model"}}, "generator.model: './no/such/model'"),
        ({"prompts": {"path": "missing.jsonl"}}, "missing.jsonl"),
        ({"reward": {"type": "callable", "function": "nosuchmodule_xyz:f"}}, "reward.function"),
    ],
)
def test_validate_user_errors(tmp_path, job, capsys, change, expected):
    for section, value in change.items():
        job[section] = {**job.get(section, {}), **value}
    code, err, _ = run_cli(capsys, "validate", write_job(tmp_path / "job.yaml", job))
    assert code == 2
    assert len(err) == 1, err
    assert expected in err[0]
    assert "Traceback" not in err[0]


@pytest.mark.parametrize(("args", "expected"), [
    ({"per_device_train_batch_size": 0},
     "iterate.trainer.args.per_device_train_batch_size: batch_size should be a positive"),
    ({"learning_rate": -1e-5}, "iterate.trainer.args.learning_rate: Invalid learning rate"),
])
def test_validate_checks_trl_arguments_as_training_would_start(tmp_path, job, capsys,
                                                               monkeypatch, args, expected):
    """Values TRL's config takes but its trainer's first step refuses: one line at validate,
    not after a round of generation; and validate writes nothing (TRL's output_dir)."""
    monkeypatch.chdir(tmp_path)
    job["iterate"] = {"rounds": 1, "trainer": {"args": {"max_steps": 4, **args}}}
    path = write_job(tmp_path / "job.yaml", job)
    before = sorted(tmp_path.rglob("*"))
    code, err, _ = run_cli(capsys, "validate", path)
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(("args", "where"), [
    ({"save_strategy": "epoch", "load_best_model_at_end": True},
     "iterate.trainer.args.load_best_model_at_end: TRL's Refusing refuses it: "),
    ({"save_strategy": "epoch"}, "iterate.trainer.args: TRL's Refusing refuses them: "),
])
def test_a_trl_config_refusal_names_the_key_its_message_names(args, where):
    from specrej_ray.errors import TrainError
    from specrej_ray.train.trl_trainer import make_config

    class Refusing:  # TRL's configs refuse in __post_init__, with a message like this one
        def __init__(self, **kwargs):
            raise ValueError("--load_best_model_at_end requires the save and eval strategy "
                             "to match")

    with pytest.raises(TrainError) as e:
        make_config(Refusing, args, "unused", 0, cuda=False)
    assert str(e.value) == where + ("--load_best_model_at_end requires the save and eval "
                                    "strategy to match")


@pytest.mark.parametrize(("key", "value", "refused"), [
    ("steps", 3, False), ("steps", True, True), ("steps", "3", True), ("steps", 3.0, True),
    ("rate", 3, False), ("rate", False, True), ("flag", True, False), ("flag", 1, True),
    ("name", None, False), ("name", "x", False), ("name", 1, True), ("items", "any", False),
])
def test_plain_trainer_fields_get_values_of_their_type_as_yaml_gives_them(key, value, refused):
    from dataclasses import dataclass

    from specrej_ray.errors import TrainError
    from specrej_ray.train.trl_trainer import _check_type

    @dataclass
    class Config:  # the shapes of TRL's plain fields
        steps: int = 1
        rate: float = 0.1
        flag: bool = False
        name: str | None = None
        items: list[str] | None = None  # not plain: left to TRL

    if refused:
        with pytest.raises(TrainError, match=f"^iterate.trainer.args.{key}: must be "):
            _check_type(Config, key, value)
    else:
        _check_type(Config, key, value)


def test_override_is_validated(tmp_path, job, capsys):
    path = write_job(tmp_path / "job.yaml", job)
    code, err, _ = run_cli(capsys, "validate", path, "--set", "search.alpha=-0.1")
    assert code == 2 and len(err) == 1 and "search.alpha" in err[0]
    code, _, out = run_cli(capsys, "validate", path, "--set", "search.n=3")
    assert code == 0 and "N=3" in out


def test_bad_rows_are_listed_with_row_numbers(tmp_path, job, capsys):
    rows = PROMPTS + [{"id": "c", "prompt": ""}, {"id": "a", "prompt": "dup"}, {"id": "d"}]
    job["prompts"]["path"] = str(write_jsonl(tmp_path / "bad.jsonl", rows))
    code, err, _ = run_cli(capsys, "validate", write_job(tmp_path / "job.yaml", job))
    assert code == 2
    joined = "\n".join(err)
    assert "row 3" in joined and "row 4" in joined and "row 5" in joined
    assert "duplicate id 'a'" in joined


def test_invalid_yaml(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("prompts: [unclosed\n")
    code, err, _ = run_cli(capsys, "validate", path)
    assert code == 2 and len(err) == 1 and "not valid YAML" in err[0]


def test_run_refuses_a_foreign_output_dir(tmp_path, job, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    code, err, _ = run_cli(capsys, "run", write_job(tmp_path / "job.yaml", job))
    assert code == 2 and len(err) == 1 and "output.path" in err[0]
    assert (out / "thesis.tex").read_text() == "precious"


@pytest.mark.slow  # the console script's own process
def test_console_script_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: x\n")
    proc = subprocess.run([sys.executable, "-m", "specrej_ray.cli", "validate", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "prompts: required field is missing" in proc.stderr


def test_too_long_prompts_are_listed_by_validate(tmp_path, job, capsys):
    # The tiny model's context is 256 tokens, one token per byte.
    rows = PROMPTS + [{"id": "long", "prompt": "x" * 300}]
    job["prompts"]["path"] = str(write_jsonl(tmp_path / "long.jsonl", rows))
    code, err, _ = run_cli(capsys, "validate", write_job(tmp_path / "job.yaml", job))
    assert code == 2
    assert "row 3 (id 'long'): prompt is" in err[0] and "context of 256" in err[0]


def test_run_where_every_prompt_is_skipped_exits_2_before_any_work(tmp_path, job, capsys):
    job["prompts"]["path"] = str(write_jsonl(tmp_path / "long.jsonl",
                                             [{"id": "long", "prompt": "x" * 300}]))
    code, err, _ = run_cli(capsys, "run", write_job(tmp_path / "job.yaml", job))
    assert code == 2 and len(err) == 1, err
    assert "all 1 row(s)" in err[0] and "row 1" in err[0]
    nothing_written(tmp_path / "out")


def nothing_written(out):
    """At most the lock a run took (`run` holds its output first): no results, no manifest
    that a later run would take for a spec's."""
    assert not out.exists() or {p.name for p in out.iterdir()} == {".specrej-lock"}


@pytest.mark.parametrize("command", ["validate", "run"])
def test_max_new_tokens_over_the_context(tmp_path, job, capsys, command):
    job["generator"]["sampling"] = {"max_new_tokens": 300}
    code, err, _ = run_cli(capsys, command, write_job(tmp_path / "job.yaml", job))
    assert code == 2 and len(err) == 1, err
    assert "generator.sampling.max_new_tokens: 300" in err[0] and "256" in err[0]
    nothing_written(tmp_path / "out")


@pytest.mark.parametrize("command", ["validate", "run"])
def test_incomplete_model_dir_is_one_line(tmp_path, job, capsys, command):
    (tmp_path / "empty").mkdir()
    job["generator"]["model"] = str(tmp_path / "empty")
    code, err, _ = run_cli(capsys, command, write_job(tmp_path / "job.yaml", job))
    assert code == 2 and len(err) == 1 and "has no config.json" in err[0]


@pytest.mark.parametrize(("text", "expected"), [
    ("search:\n  n: true\n", "search.n: expected a number"),
    ("search:\n  n: 4\n  n: 8\n", "duplicate key 'n'"),
    ("generator:\n  sampling:\n    temperature: .inf\n", "must be a finite number"),
])
def test_lax_yaml_is_refused_by_validate_and_run(tmp_path, job, capsys, text, expected):
    path = write_job(tmp_path / "job.yaml", {k: v for k, v in job.items() if k != "search"})
    if "sampling" in text:
        path.write_text(path.read_text().replace("  sampling:\n", "  sampling:\n"
                                                 "    temperature: .inf\n", 1))
    else:
        path.write_text(path.read_text() + text)
    for command in ("validate", "run"):
        code, err, _ = run_cli(capsys, command, path)
        assert code == 2 and len(err) == 1 and expected in err[0], err


def test_binary_spec_is_one_line(tmp_path, capsys):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    code, err, _ = run_cli(capsys, "validate", path)
    assert code == 2 and err == [f"specrej-ray: error: {path}: not a text file (byte 128 is "
                                 "not UTF-8); give a YAML job spec"]
