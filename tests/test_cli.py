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
        ({"search": {"n": 0}}, "search.n: Input should be greater than or equal to 1"),
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


def test_console_script_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: x\n")
    proc = subprocess.run([sys.executable, "-m", "specrej_ray.cli", "validate", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "prompts: required field is missing" in proc.stderr
