"""A user's mistake is refused before Ray or vLLM starts, in one line with exit 2, and a run
that finishes no prompt leaves nothing on a path it made (issue 31)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrej_ray.distributed import driver
from specrej_ray.engine.vllm.refusal import vllm_reason
from specrej_ray.job.engines import vllm_installed
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import REPO, cli

PROMPTS = [{"id": "a", "prompt": "Say hello."}, {"id": "b", "prompt": "Count to three."}]
needs_vllm = pytest.mark.skipif(not vllm_installed(),
                                reason="vLLM is not installed (make setup installs it)")


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _truncated(model: Path) -> None:
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])  # the last tensor's bytes cut short


def _header_cut(model: Path) -> None:
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:100])


def _wider_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))


MODEL_CASES = {
    "truncated weights": (_truncated, "generator.model: '{m}': model.safetensors is cut short: "),
    "a cut header": (_header_cut, "generator.model: '{m}': model.safetensors is cut short or "
                                  "not safetensors"),
    "a config of other weights": (_wider_config, "generator.model: '{m}' does not match its "
                                                 "config.json: "),
}
VLLM_CASES = {
    "tensor parallel on a CPU machine": (
        {"tensor_parallel_size": 3},
        "generator.tensor_parallel_size: 3 needs 3 GPUs on one node, and this machine has no "
        "GPU"),
    "max_model_len beyond the model's": (
        {"vllm": {"max_model_len": 100_000_000}},
        "generator.vllm.max_model_len: 100000000 is beyond the model's context (256, from "
        "config.json's max_position_embeddings); vLLM refuses it"),
    "a wrong type in engine_kwargs": (
        {"vllm": {"engine_kwargs": {"max_num_seqs": "abc"}}},
        "generator.vllm.engine_kwargs.max_num_seqs: 'abc' is not int | None"),
}


@pytest.fixture
def no_ray(monkeypatch):
    """A run that gets as far as starting Ray fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a run the checks should have refused")

    monkeypatch.setattr(driver, "connect_ray", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def _refused(tmp_path: Path, job: dict, expected: str) -> None:
    """validate and run each exit 2 with the one line expected; run creates nothing."""
    path = write_job(tmp_path / "job.yaml", job)
    for command in ("validate", "run"):
        done = cli(command, path)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr
        [line] = [x for x in done.stderr.splitlines() if x.startswith("specrej-ray:")]
        assert line.startswith("specrej-ray: error: " + expected), line
        assert len(line) < 400, line  # one line, not a dump of every field
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", MODEL_CASES)
def test_a_broken_model_source_is_refused_before_ray(tmp_path, tiny_lm_dir, no_ray, case):
    spoil, expected = MODEL_CASES[case]
    model = _copy_model(tiny_lm_dir, tmp_path / "model")
    spoil(model)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, model, prompts, reward={"type": "callable",
                                                      "function": "tests.helpers.rewards:vowels"})
    _refused(tmp_path, job, expected.format(m=model))


def test_a_broken_reward_model_is_named_as_the_reward(tmp_path, tiny_lm_dir, no_ray):
    model = _copy_model(tiny_lm_dir, tmp_path / "model")
    _truncated(model)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, tiny_lm_dir, prompts,
                   reward={"type": "lm_likelihood", "model": str(model), "threads": 1})
    _refused(tmp_path, job, f"reward.model: '{model}': model.safetensors is cut short: ")


@needs_vllm
@pytest.mark.parametrize("case", VLLM_CASES)
def test_a_vllm_setting_vllm_would_refuse_is_refused_before_ray(tmp_path, tiny_lm_dir, no_ray,
                                                                case):
    generator, expected = VLLM_CASES[case]
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, tiny_lm_dir, prompts)
    job["generator"].update(engine="vllm", **generator)
    _refused(tmp_path, job, expected)


_IMPORTS = """
import sys
import psutil
from specrej_ray.cli import main
for command_job in sys.argv[1:]:
    command, job = command_job.split("=", 1)
    code = main([command, job])
    heavy = sorted(m for m in ("torch", "transformers", "vllm", "ray") if m in sys.modules)
    started = [p.name() for p in psutil.Process().children(recursive=True)]  # ray::, raylet
    print(code, *heavy, *started, flush=True)
"""


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


# name -> (the prompt file's name, how it is written): each is refused as a whole.
PROMPT_FILE_CASES = {
    "an empty file": ("p.jsonl", lambda p: p.write_bytes(b"")),
    "binary garbage": ("p.jsonl", _garbage),
    "a single 5 MB line": ("p.jsonl", lambda p: p.write_bytes(b'{"prompt": "' + b"x" * (5 << 20))),
    "invalid UTF-8": ("p.jsonl", lambda p: p.write_bytes(b'{"prompt": "\xff"}\n' * 3)),
    "a folder": ("folder", lambda p: p.mkdir()),
    "a datasets folder without its files": ("ds", lambda p: p.mkdir() or (
        p / "data-00000-of-00001.arrow").write_bytes(b"x")),
    "a CSV without the prompt column": ("p.csv", lambda p: p.write_text("id,text\na,hi\n")),
    "an empty CSV": ("p.csv", lambda p: p.write_bytes(b"")),
    "a CSV that is not UTF-8": ("p.csv", _garbage),
    "a parquet file that is not one": ("p.parquet", _garbage),
    "a .json file of one object": ("p.json", lambda p: p.write_text('{\n"prompt": "hi"\n}\n')),
    "every row without a prompt": ("p.jsonl", lambda p: p.write_text('{"text": "hi"}\n' * 3)),
    "an unknown extension": ("p.txt", lambda p: p.write_text("hi\n")),
}


@pytest.mark.parametrize("case", PROMPT_FILE_CASES)
def test_a_prompt_file_is_refused_without_importing_torch_or_datasets(tmp_path, tiny_lm_dir,
                                                                     no_ray, monkeypatch, case):
    """In this process, where they may be loaded already: an import of torch, transformers,
    vLLM or datasets fails while the CLI runs (None in sys.modules), so a refusal that needed
    one would be no clean exit 2. The test above asserts the same of a fresh process."""
    name, write = PROMPT_FILE_CASES[case]
    write(tmp_path / name)
    job = tiny_job(tmp_path, tiny_lm_dir, tmp_path / name,
                   reward={"type": "callable", "function": "tests.helpers.rewards:vowels"})
    job["prompts"].pop("id_field")
    path = write_job(tmp_path / "job.yaml", job)
    for heavy in ("torch", "transformers", "vllm", "datasets"):
        monkeypatch.setitem(sys.modules, heavy, None)
    lines = []
    for command in ("validate", "run"):
        done = cli(command, path)
        assert done.returncode == 2, done.stderr
        [line] = [x for x in done.stderr.splitlines() if x.startswith("specrej-ray:")]
        assert line.startswith("specrej-ray: error: prompts."), line
        lines.append(line)
    assert lines[0] == lines[1]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_first_mistakes_are_refused_before_torch_or_vllm_is_imported(tmp_path, tiny_lm_dir):
    """Importing torch (3 s), transformers' model classes (4 s) or vLLM (6-9 s) is what made
    a refusal slow: the mistakes of issue 31, and every prompt file refused as a whole (issue
    44), are refused before any of them loads, and before any process (a `ray::` worker, a
    raylet) is started, by `validate` and by `run`, in one process, one after another (each
    leaves sys.modules as it found it)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    jobs = []
    for i, (name, write) in enumerate(PROMPT_FILE_CASES.values()):
        (tmp_path / f"prompts{i}").mkdir()
        write(tmp_path / f"prompts{i}" / name)
        job = tiny_job(tmp_path, tiny_lm_dir, tmp_path / f"prompts{i}" / name,
                       reward={"type": "callable", "function": "tests.helpers.rewards:vowels"})
        job["prompts"].pop("id_field")
        jobs.append(write_job(tmp_path / f"prompts{i}.yaml", job))
    for i, (spoil, _) in enumerate(MODEL_CASES.values()):
        model = _copy_model(tiny_lm_dir, tmp_path / f"model{i}")
        spoil(model)
        job = tiny_job(tmp_path, model, prompts,
                       reward={"type": "callable", "function": "tests.helpers.rewards:vowels"})
        jobs.append(write_job(tmp_path / f"model{i}.yaml", job))
    for i, (generator, _) in enumerate(VLLM_CASES.values() if vllm_installed() else ()):
        job = tiny_job(tmp_path, tiny_lm_dir, prompts)
        job["generator"].update(engine="vllm", **generator)
        jobs.append(write_job(tmp_path / f"vllm{i}.yaml", job))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a machine with no GPU, as this one
    runs = [f"{command}={job}" for job in jobs for command in ("validate", "run")]
    done = subprocess.run([sys.executable, "-c", _IMPORTS, *runs], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[:-1] == ["2"] * len(runs), done.stdout + done.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["", "  "])
def test_an_empty_output_path_is_refused_in_one_line(tmp_path, tiny_lm_dir, no_ray, path):
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, output={"path": path})
    done = cli("validate", write_job(tmp_path / "job.yaml", job))
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "output.path: names no folder; give one (e.g. out/my-run) or a URL (got "
        f"{path!r})"), done.stderr


def test_vllm_reason_keeps_the_sentence_that_says_why():
    from pydantic import BaseModel, field_validator

    class Config(BaseModel):
        max_model_len: int

        @field_validator("max_model_len")
        @classmethod
        def _fits(cls, v: int) -> int:
            raise ValueError(f"User-specified max_model_len ({v}) is greater than 256. To "
                             "allow it, set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.")

    try:
        Config(max_model_len=10**8)
    except Exception as e:  # noqa: BLE001 (pydantic's ValidationError, as vLLM raises it)
        assert vllm_reason(e) == ("max_model_len: User-specified max_model_len (100000000) is "
                                  "greater than 256.")
    assert vllm_reason(RuntimeError("first line\nsecond")) == "first line"


@pytest.mark.ray
def test_a_run_that_finishes_no_prompt_leaves_no_folder(tmp_path, tiny_lm_dir, ray_cluster):
    """Every prompt's reward raises: exit 2, and the path the run made is gone (no empty
    dataset, card or run record)."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "x", "prompt": "poison"}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts,
                   reward={"type": "callable", "function": "tests.helpers.rewards:raises"})
    done = cli("run", write_job(tmp_path / "job.yaml", job))
    assert done.returncode == 2, done.stderr
    assert "cannot score poison" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.ray
def test_a_model_an_actor_cannot_load_exits_2_and_leaves_no_folder(tmp_path, tiny_lm_dir,
                                                                  ray_cluster):
    """Weights no check before Ray can read (a .bin is not opened there) fail in the actor:
    a model-source error, exit 2, nothing left."""
    model = _copy_model(tiny_lm_dir, tmp_path / "model")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, model, prompts,
                   reward={"type": "callable", "function": "tests.helpers.rewards:vowels"})
    done = cli("run", write_job(tmp_path / "job.yaml", job))
    assert done.returncode == 2, done.stderr
    assert f"generator.model: cannot load '{model}'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_weights_checked_once_are_not_checked_again_until_they_change(tmp_path, tiny_lm_dir,
                                                                        monkeypatch):
    """`run` checks before the driver loads and the driver checks again: the second check of
    unchanged files builds no model; a file changed since is checked again."""
    from specrej_ray.errors import ModelError
    from specrej_ray.models import weights_check

    model = _copy_model(tiny_lm_dir, tmp_path / "model")
    weights_check.check_weights(str(model), "generator.model", str(model))

    def no_second_build(*args):
        raise AssertionError("the model was built again for unchanged files")

    monkeypatch.setattr(weights_check, "_expected_shapes", no_second_build)
    weights_check.check_weights(str(model), "generator.model", str(model))
    _truncated(model)
    with pytest.raises(ModelError, match="model.safetensors is cut short"):
        weights_check.check_weights(str(model), "generator.model", str(model))


@pytest.mark.parametrize("case", ["a config of other weights", "tensor parallel on a CPU machine"])
def test_iterate_checks_the_models_and_vllm_settings_before_ray(tmp_path, tiny_lm_dir, monkeypatch,
                                                                 case):
    """`iterate` runs the same model and vLLM checks as `run` before its loop connects to Ray
    (it checked only the trainer before)."""
    from specrej_ray.distributed import cluster

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started for a loop the checks should have refused")

    monkeypatch.setattr(cluster, "connect_ray", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, as on this machine
    model = _copy_model(tiny_lm_dir, tmp_path / "model")
    generator = {}
    if case in MODEL_CASES:
        MODEL_CASES[case][0](model)
        expected = MODEL_CASES[case][1].format(m=model)
    else:
        generator, expected = VLLM_CASES[case]
        generator = {"engine": "vllm", **generator}
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    job = tiny_job(tmp_path, model, prompts, output={"path": str(tmp_path / "out"),
                                                     "formats": ["sft"]},
                   reward={"type": "callable", "function": "tests.helpers.rewards:vowels"})
    job["generator"].update(generator)
    job["iterate"] = {"rounds": 1, "trainer": {"args": {"max_steps": 1}}}
    done = cli("iterate", write_job(tmp_path / "job.yaml", job))
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("specrej-ray:")]
    assert line.startswith("specrej-ray: error: " + expected), line
    assert not (tmp_path / "out").exists()
