"""`validate` and `run` give the same verdict on every input `run` refuses before Ray (issue
44): both make the checks of job/preflight.py, so each bad input below exits 2 from both,
with the same first error line, and Ray never starts. Each case is one kind of mistake a
user makes: in the spec, the prompt file, a model, a vLLM setting, the output."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from specrej_ray.job.engines import vllm_installed
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli
from tests.test_fail_early import no_ray  # noqa: F401 (a fixture the test uses)
from tests.test_output_guard import finished_output, snapshot

PROMPTS = [{"id": "a", "prompt": "Say hello."}, {"id": "b", "prompt": "Count to three."}]


class Case:
    """What a case may change: the job dict, files under tmp, locks it holds."""

    def __init__(self, tmp: Path, job: dict, model: Path, hold: contextlib.ExitStack,
                 monkeypatch: pytest.MonkeyPatch):
        self.tmp, self.job, self.model, self.hold = tmp, job, model, hold
        self.monkeypatch = monkeypatch

    def prompts(self, name: str, data: bytes) -> None:
        (self.tmp / name).write_bytes(data)
        self.job["prompts"] = {"path": str(self.tmp / name)}

    def model_copy(self) -> Path:
        copy = Path(shutil.copytree(self.model, self.tmp / "model"))
        self.job["generator"]["model"] = str(copy)
        return copy

    def output(self, path: Path | str, **extra) -> None:
        self.job["output"] = {"path": str(path), **extra}


def _config(c: Case, **change) -> None:
    config = json.loads((c.model_copy() / "config.json").read_text())
    (c.tmp / "model" / "config.json").write_text(json.dumps({**config, **change}))


def _cut(c: Case) -> None:
    weights = c.model_copy() / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _held(c: Case) -> None:
    from specrej_ray.data.dataset import locate
    from specrej_ray.data.output_lock import take_lock

    out = finished_output(c.tmp / "held")
    c.output(out)
    c.hold.enter_context(take_lock(locate(str(out)), "the-other-run"))


def _file(path: Path) -> Path:
    path.parent.mkdir(exist_ok=True)
    path.write_text("x")
    return path


def _inside(c: Case) -> None:
    out = finished_output(c.tmp / "out")
    c.job["prompts"]["path"] = str(write_jsonl(out / "p.jsonl", PROMPTS))
    c.output(out)


def _gguf(c: Case) -> None:
    """The probe's case: a GGUF generator (the packaged one's context is 8192) in vLLM. Its
    conversion (tens of seconds) is stood in for by the tiny model with that context."""
    from specrej_ray.models import loader

    (c.tmp / "m.gguf").write_bytes(b"GGUF")
    _config(c, max_position_embeddings=8192)
    c.monkeypatch.setattr(loader, "convert_gguf", lambda *a, **k: c.tmp / "model")
    _vllm(c, model=str(c.tmp / "m.gguf"), vllm={"max_model_len": 99999999})


def _vllm(c: Case, **generator) -> None:
    c.job["generator"].update(engine="vllm", **generator)


# name -> (what the case changes, what the error both commands print says)
CASES: dict[str, tuple[Callable[[Case], None], str]] = {
    # the spec
    "spec: an unknown key": (lambda c: c.job["search"].update(alpah=0.5),
                             "job.yaml: search.alpah: unknown key"),
    "spec: a decision past max_new_tokens": (
        lambda c: c.job["search"].update(schedule={"tokens": [40]}),
        "job.yaml: search.schedule.tokens: decision at 40 tokens"),
    "spec: a reward function that does not import": (
        lambda c: c.job.update(reward={"type": "callable", "function": "no_such_mod_xyz:f"}),
        "reward.function 'no_such_mod_xyz:f'"),
    # the prompt file
    "prompts: no such file": (lambda c: c.job["prompts"].update(path=str(c.tmp / "nope.jsonl")),
                              "nope.jsonl' does not exist"),
    "prompts: an empty file": (lambda c: c.prompts("p.jsonl", b""), "holds no prompts"),
    "prompts: binary garbage": (lambda c: c.prompts("p.jsonl", bytes(range(256)) * 64),
                                "prompts.path: all "),
    "prompts: one 5 MB line": (lambda c: c.prompts("p.jsonl", b'{"prompt": "' + b"x" * (5 << 20)),
                               "prompts.path: all 1 row(s)"),
    "prompts: invalid UTF-8": (lambda c: c.prompts("p.jsonl", b'{"prompt": "\xff\xfe"}\n' * 3),
                               "prompts.path: all 3 row(s)"),
    "prompts: a folder": (lambda c: c.job["prompts"].update(
        path=str(_file(c.tmp / "dir" / "a.txt").parent)), "save_to_disk did not write"),
    "prompts: a CSV without the prompt column": (lambda c: c.prompts("p.csv", b"id,text\na,hi\n"),
                                                 "prompts.prompt_field: no column 'prompt'"),
    "prompts: a parquet file that is not one": (lambda c: c.prompts("p.parquet", b"PAR1" * 9),
                                                "as parquet: "),
    "prompts: a device": (lambda c: c.job["prompts"].update(path="/dev/null"),
                          "prompts.path: '/dev/null' is not a regular file"),
    "prompts: inside the output": (_inside, "p.jsonl' is inside output.path"),
    # a model
    "model: no config.json": (lambda c: (c.model_copy() / "config.json").unlink(),
                              "model' has no config.json"),
    "model: truncated weights": (_cut, "model.safetensors is cut short"),
    "model: a config of other weights": (lambda c: _config(c, hidden_size=64),
                                         "does not match its config.json"),
    "model: max_new_tokens past the context": (
        lambda c: c.job["generator"]["sampling"].update(max_new_tokens=300),
        "generator.sampling.max_new_tokens: 300 leaves no room"),
    "model: a reward model that is not there": (
        lambda c: c.job["reward"].update(model=str(c.tmp / "typo")),
        "reward.model: '"),
    # a vLLM setting
    "vllm: max_model_len beyond the model's": (
        lambda c: _vllm(c, vllm={"max_model_len": 99999999}),
        "generator.vllm.max_model_len: 99999999 is beyond the model's context (256"),
    "vllm: max_model_len beyond a GGUF's": (
        _gguf, "generator.vllm.max_model_len: 99999999 is beyond the model's context (8192"),
    "vllm: tensor parallel on a machine without GPUs": (
        lambda c: _vllm(c, tensor_parallel_size=3), "generator.tensor_parallel_size: 3"),
    "vllm: an engine_kwargs value of the wrong type": (
        lambda c: _vllm(c, vllm={"engine_kwargs": {"max_num_seqs": "abc"}}),
        "generator.vllm.engine_kwargs.max_num_seqs: 'abc'"),
    # the output
    "output: under /proc": (lambda c: c.output("/proc/specrej-test/out"),
                            "output.path: cannot create /proc/specrej-test/out"),
    "output: under /sys": (lambda c: c.output("/sys/specrej-test"),
                           "output.path: cannot create /sys/specrej-test"),
    "output: held by another run": (_held, "held is in use by pid"),
    "output: inside another output's shards": (
        lambda c: c.output(finished_output(c.tmp / "theirs") / "shards" / "nested"),
        "nested is inside "),
    "output: a folder that is not ours": (lambda c: c.output(_file(c.tmp / "theirs" / "a.txt")
                                                             .parent), "did not write"),
    "output: a file": (lambda c: c.output(_file(c.tmp / "f")), "exists and is not a directory"),
    "output: results that if_exists refuses": (
        lambda c: c.output(finished_output(c.tmp / "done"), if_exists="refuse"),
        "done already has results"),
    "output: results of another spec": (
        lambda c: c.output(finished_output(c.tmp / "done")),
        "done holds results of a different spec"),
}
NEEDS_VLLM = {name for name in CASES if name.startswith("vllm:")}
NEEDS = {"output: under /proc": "/proc", "output: under /sys": "/sys"}


def _first_error(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("specrej-ray: error: ")]
    assert lines, stderr
    return lines[0]


@pytest.mark.usefixtures("no_ray")  # a run that gets as far as starting Ray fails the test
@pytest.mark.parametrize("name", CASES)
def test_validate_and_run_give_the_same_verdict(tmp_path, tiny_lm_dir, monkeypatch, name):
    if name in NEEDS_VLLM and not vllm_installed():
        pytest.skip("vLLM is not installed (make setup installs it)")
    if name in NEEDS and not os.path.isdir(NEEDS[name]):
        pytest.skip(f"no {NEEDS[name]} here")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a machine with no GPU, as this one
    change, expected = CASES[name]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    job = tiny_job(tmp_path, tiny_lm_dir, prompts)
    with contextlib.ExitStack() as hold:
        change(Case(tmp_path, job, tiny_lm_dir, hold, monkeypatch))
        path = write_job(tmp_path / "job.yaml", job)
        before = snapshot(tmp_path)
        done = {command: cli(command, path) for command in ("validate", "run")}
        assert snapshot(tmp_path) == before  # neither wrote anything, anywhere under tmp
    for command, got in done.items():
        assert got.returncode == 2, (command, got.stderr[-2000:])
        assert "Traceback" not in got.stderr, (command, got.stderr[-2000:])
    first = {command: _first_error(got.stderr) for command, got in done.items()}
    assert first["validate"] == first["run"]
    assert expected in first["run"], first["run"]

