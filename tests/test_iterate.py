"""`specrej-ray iterate` on the tiny model: two rounds of generate -> train, round 1 generated
by round 0's trained model (by weight hash), a kill in each phase resuming to the result of
an undisturbed loop, and the user's mistakes as one line with exit 2 and the finished rounds
kept."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from specrej_ray.cli import main
from specrej_ray.models.identity import weights_sha256
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers import zygote
from tests.helpers.runs import REPO, Done, cli, cli_env, start_run, wait_for

# The runs that are not killed run in this process, on the shared cluster (iterate_cli).
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

# lr 1e-2 moves the tiny model's weights enough that round 1 samples other texts.
TRL_ARGS = {"max_steps": 4, "save_steps": 1, "per_device_train_batch_size": 2,
            "max_length": 64, "learning_rate": 1e-2}


def iterate_job(tmp: Path, model: Path, **iterate) -> dict:
    prompts = write_jsonl(tmp / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me about {i}."}
                                            for i in range(6)])
    job = tiny_job(tmp, model, prompts, output={"path": str(tmp / "out"), "formats": ["sft"]})
    job["iterate"] = {"rounds": 2, "trainer": {"args": dict(TRL_ARGS)}, **iterate}
    return job


def iterate_cli(job: dict, tmp: Path, *crash: str) -> Done | subprocess.CompletedProcess:
    """`specrej-ray iterate` in this process on the shared Ray cluster; with `crash`, in a
    subprocess (its own local Ray) through tests.helpers.iterate_crash, dying in that phase:
    only there is the process what the test is about."""
    path = write_job(tmp / "job.yaml", job)
    if not crash:
        return cli("iterate", path)
    argv = [sys.executable, "-m", "tests.helpers.iterate_crash", str(path), *crash]
    return zygote.run(argv, cwd=REPO, env=cli_env(), timeout=600)


def outcome(root: Path) -> dict:
    """What a loop made, per round: the best responses, the policy that generated them and
    the model trained on them (by weight hash)."""
    rounds = {}
    for r in sorted(root.glob("round-*")):
        best = pq.read_table(r / "best.parquet", columns=["id", "response", "reward"])
        rounds[r.name] = {"best": best.to_pylist(),
                          "policy": json.loads((r / "run.json").read_text())["policy"]["sha256"],
                          "model": weights_sha256(r / "model")}
    return rounds


def log(done: Done | subprocess.CompletedProcess) -> str:
    return done.stdout + done.stderr


def errors(done: Done | subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in done.stderr.splitlines() if ln.startswith("specrej-ray:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_lm_dir):
    """An undisturbed two-round loop and what it made."""
    tmp = tmp_path_factory.mktemp("iterate-ref")
    job = iterate_job(tmp, tiny_lm_dir)
    done = iterate_cli(job, tmp)
    assert done.returncode == 0, log(done)
    return job, tmp / "out", outcome(tmp / "out"), log(done)


def test_two_rounds_and_round_1_is_generated_by_round_0s_model(reference, tiny_lm_dir):
    _, root, made, _ = reference
    base = weights_sha256(tiny_lm_dir)
    assert made["round-0"]["policy"] == base
    assert made["round-1"]["policy"] == made["round-0"]["model"] != base
    assert made["round-1"]["model"] != made["round-0"]["model"]
    info = json.loads((root / "round-1" / "run.json").read_text())
    assert info["policy"]["path"] == str(root / "round-0" / "model")
    assert info["policy"]["from_round"] == 0
    assert info["models"]["generator"]["sha256"] == made["round-0"]["model"]
    assert "the model trained in round 0" in (root / "round-1" / "README.md").read_text()
    # The trained model generates other texts than the base did on the same prompts.
    assert ([b["response"] for b in made["round-0"]["best"]]
            != [b["response"] for b in made["round-1"]["best"]])
    record = json.loads((root / "iterate.json").read_text())
    assert [x["round"] for x in record["rounds"]] == [0, 1]
    assert record["rounds"][1]["model"]["sha256"] == made["round-1"]["model"]
    assert record["rounds"][0]["training"]["steps"] == TRL_ARGS["max_steps"]
    for r in (0, 1):  # what each round trained on: its SFT file's rows
        sft = pq.read_table(root / f"round-{r}" / "sft_prompt_completion.parquet")
        assert record["rounds"][r]["training"]["data_rows"] == sft.num_rows > 0
    # Saved to generate with: TRL trains with the KV cache off, and would save it so.
    config = json.loads((root / "round-0" / "model" / "config.json").read_text())
    assert config.get("use_cache", True) is True


def test_a_driver_killed_while_generating_resumes_to_the_same_result(reference, tmp_path):
    job, _, made, _ = reference
    job = {**job, "output": {**job["output"], "path": str(tmp_path / "out")}}
    # Rounds have 3 shards each: the 5th record is round 1's second.
    assert iterate_cli(job, tmp_path, "shard", "5").returncode == 137
    assert (tmp_path / "out" / "round-0" / "model").is_dir()
    assert not (tmp_path / "out" / "round-1" / "best.parquet").exists()
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 0: generation already complete" in log(done)
    assert "round 0: model already trained" in log(done)
    assert "2 already done" in log(done)  # round 1's first shard is not generated again
    assert outcome(tmp_path / "out") == made


def test_a_training_worker_lost_mid_training_restarts_from_its_checkpoint(reference, tmp_path):
    job, _, made, _ = reference
    job = {**job, "output": {**job["output"], "path": str(tmp_path / "out")}}
    done = iterate_cli(job, tmp_path, "checkpoint", "checkpoint-2")
    assert done.returncode == 0, log(done)
    assert "the training task died" in log(done)
    assert "resuming training from checkpoint-2" in log(done)
    assert outcome(tmp_path / "out") == made
    assert not temp_models(tmp_path / "out")  # the lost task's, removed at the end


def test_a_training_killed_for_good_resumes_on_the_next_run(reference, tmp_path):
    job, _, made, _ = reference
    job = {**job, "output": {**job["output"], "path": str(tmp_path / "out")}}
    job["iterate"] = {**job["iterate"], "trainer": {**job["iterate"]["trainer"],
                                                    "max_restarts": 0}}
    done = iterate_cli(job, tmp_path, "checkpoint", "checkpoint-2")
    assert done.returncode == 1, log(done)
    assert len(errors(done)) == 1 and "run again to resume" in errors(done)[0], done.stderr
    assert (tmp_path / "out" / "round-0" / "best.parquet").exists()
    assert not (tmp_path / "out" / "round-0" / "model").exists()
    assert temp_models(tmp_path / "out")  # the killed task's: its clean-up never ran
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 0: resuming training from checkpoint-2" in log(done)
    assert outcome(tmp_path / "out") == made
    assert not temp_models(tmp_path / "out")


def test_a_driver_killed_after_training_before_recording_resumes(reference, tmp_path):
    job, _, made, _ = reference
    job = {**job, "output": {**job["output"], "path": str(tmp_path / "out")}}
    assert iterate_cli(job, tmp_path, "recorded", "0").returncode == 137
    assert (tmp_path / "out" / "round-0" / "model").is_dir()
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 0: model already trained" in log(done)
    assert outcome(tmp_path / "out") == made
    # More rounds go on from the last model, the finished ones untouched.
    job["iterate"] = {**job["iterate"], "rounds": 3}
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    more = outcome(tmp_path / "out")
    assert {k: more[k] for k in made} == made
    assert more["round-2"]["policy"] == made["round-1"]["model"]


def test_a_finished_loop_run_again_does_nothing(reference, tmp_path):
    job, root, made, _ = reference
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 1: model already trained" in log(done)
    assert "training" not in " ".join(ln for ln in log(done).splitlines()
                                      if ln.startswith("[specrej] round"))
    assert outcome(root) == made


INSTRUCTION_ROWS = [
    {"prompt": "Write anything.", "instruction_id_list": ["punctuation:no_comma"],
     "kwargs": [{}]},
    {"prompt": "Write more.", "instruction_id_list": ["keywords:letter_frequency",
                                                      "change_case:english_lowercase"],
     "kwargs": [{"letter": "e", "let_frequency": 1, "let_relation": "at least"}, {}]},
    {"prompt": "Write less.", "instruction_id_list": ["length_constraints:number_words"],
     "kwargs": [{"num_words": 3, "relation": "less than"}]},
]
PERTURB = REPO / "tests" / "helpers" / "perturb_model.py"


def test_every_policy_is_evaluated_once_against_the_base(tmp_path, tiny_lm_dir):
    """iterate.evaluate: the base before round 0, each round's model once published, each
    recorded by weight hash; a loop run again evaluates none of them again."""
    train = write_jsonl(tmp_path / "train.jsonl", [{**r, "id": f"t{i}"} for i, r in
                                                   enumerate(INSTRUCTION_ROWS * 2)])
    held = write_jsonl(tmp_path / "held.jsonl", [{**r, "id": f"e{i}"} for i, r in
                                                 enumerate(INSTRUCTION_ROWS)])
    job = tiny_job(tmp_path, tiny_lm_dir, train, reward={"type": "instructions"},
                   output={"path": str(tmp_path / "out"), "formats": ["sft"]})
    job["search"] = {"n": 4, "alpha": 0.5, "schedule": {"tokens": [4]}}
    job["iterate"] = {"rounds": 2, "evaluate": {"prompts": str(held)}, "trainer": {
        "type": "command", "command": f"{sys.executable} {PERTURB} {{model}} {{output}} "
        "{round}"}}
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    root = tmp_path / "out"
    record = json.loads((root / "iterate.json").read_text())
    found = record["evaluations"]
    assert [x["round"] for x in found] == [0, 1, 2]
    hashes = [weights_sha256(tiny_lm_dir), weights_sha256(root / "round-0" / "model"),
              weights_sha256(root / "round-1" / "model")]
    assert [x["policy"]["sha256"] for x in found] == hashes and len(set(hashes)) == 3
    assert found[0]["against_base"] is None
    assert all(x["prompts"] == 3 and set(x["against_base"]) == {"greedy", "sampled"}
               for x in found[1:])
    report = json.loads((root / "eval" / "eval.json").read_text())
    labels = ["round 0 (base)", "round 1", "round 2 (final)"]
    assert [m["label"] for m in report["models"]] == [x["label"] for x in found] == labels
    for m, x in zip(report["models"][1:], found[1:], strict=True):
        assert m["decodings"]["greedy"]["against_reference"] == x["against_base"]["greedy"]
    assert (root / "eval" / "eval.png").exists()
    lines = log(done).splitlines()
    at = {key: next(i for i, ln in enumerate(lines) if key in ln) for key in (
        "round 0 (base): evaluating", "round 0: generating", "round 0: training",
        "round 1: evaluating", "round 1: generating")}
    assert list(at.values()) == sorted(at.values()), at  # in this order
    for label in labels:  # the summary: one line per policy
        assert any(ln.startswith(label) for ln in lines[at["round 1: generating"]:]), label

    again = iterate_cli(job, tmp_path)
    assert again.returncode == 0, log(again)
    assert "evaluating on" not in log(again)
    assert log(again).count("evaluation already recorded") == 3
    assert json.loads((root / "iterate.json").read_text())["evaluations"] == found


def temp_models(root: Path) -> list[Path]:
    """The temporary folders a training writes its model into before renaming it."""
    return sorted(root.glob("round-*/.model-*"))


def test_a_resumed_loop_removes_the_temporary_models_of_trainings_cut_short(tmp_path,
                                                                          tiny_lm_dir):
    """A training task killed with its worker leaves its temporary model folder (empty, or
    half saved): the next run removes those at its start, and at its end those of a task
    restarted within the run; nothing else in a round's folder."""
    job = iterate_job(tmp_path, tiny_lm_dir, rounds=1,
                      trainer={"type": "command", "command": "cp -rT {model} {output}"})
    assert iterate_cli(job, tmp_path).returncode == 0
    r0 = tmp_path / "out" / "round-0"
    (r0 / ".model-k1lled_0").mkdir()
    (r0 / ".model-k1lled_1").mkdir()
    (r0 / ".model-k1lled_1" / "config.json").write_text("{}")
    for other in (".model-keep", ".other-k1lled_0"):  # not a name train() makes
        (r0 / other).mkdir()
    (r0 / ".model-file_123").write_text("")  # nor a folder
    # Round 1's command leaves one behind, as a restarted task's first attempt would.
    job["iterate"] = {**job["iterate"], "rounds": 2, "trainer": {
        "type": "command",
        "command": """bash -c 'mkdir "$(dirname "$1")/.model-restart1" && cp -rT "$0" "$1"' """
                   "{model} {output}"}}
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert temp_models(tmp_path / "out") == [r0 / ".model-file_123", r0 / ".model-keep"]
    assert (r0 / ".other-k1lled_0").is_dir()
    assert "removed 2 temporary model folder(s)" in log(done)  # at the start
    restarted = tmp_path / "out" / "round-1" / ".model-restart1"
    assert f"removed 1 temporary model folder(s) left by trainings cut short: {restarted}" \
        in log(done)  # at the end


def test_a_failing_trainer_command_is_one_line_and_keeps_the_round(tmp_path, tiny_lm_dir):
    job = iterate_job(tmp_path, tiny_lm_dir, trainer={
        "type": "command",
        "command": f"{sys.executable} -c \"import sys; sys.exit('boom: no GPU')\" {{output}}"})
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 2, log(done)
    assert errors(done) == [errors(done)[0]] and "exited with 1" in errors(done)[0]
    assert "boom: no GPU" in errors(done)[0]
    kept = pq.read_table(tmp_path / "out" / "round-0" / "best.parquet").to_pylist()
    # Fixed, the loop goes on from the finished round: a copy of the model is a "trained" one.
    job["iterate"]["trainer"]["command"] = "cp -rT {model} {output}"
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 0: generation already complete" in log(done)
    assert pq.read_table(tmp_path / "out" / "round-0" / "best.parquet").to_pylist() == kept
    assert weights_sha256(tmp_path / "out" / "round-1" / "model") == weights_sha256(tiny_lm_dir)


def test_a_trainer_command_that_saves_no_model_is_one_line(tmp_path, tiny_lm_dir):
    job = iterate_job(tmp_path, tiny_lm_dir, trainer={"type": "command",
                                                      "command": "true {output}"})
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 2, log(done)
    assert len(errors(done)) == 1 and "saved no model" in errors(done)[0], done.stderr
    assert (tmp_path / "out" / "round-0" / "best.parquet").exists()
    assert not (tmp_path / "out" / "round-0" / "model").exists()


@pytest.mark.parametrize(("iterate", "expected"), [
    ({"rounds": 0}, "iterate.rounds"),
    ({"train_on": "preference"}, "add preference to output.formats"),
    ({"trainer": {"type": "command"}}, "type command needs `command`"),
    ({"trainer": {"type": "command", "command": "train {data} {out}"}}, "unknown field {out}"),
    ({"prompts": {"mode": "slice"}}, "mode slice needs per_round"),
    ({"trainer": {"args": {"learning_rat": 0.1}}}, "did you mean learning_rate"),
    ({"trainer": {"args": {"num_train_epochs": "many"}}}, "iterate.trainer.args"),
])
def test_a_bad_iterate_section_is_one_line_before_anything_runs(tmp_path, tiny_lm_dir, capsys,
                                                                 iterate, expected):
    job = iterate_job(tmp_path, tiny_lm_dir)
    job["iterate"] = {**job["iterate"], **iterate}
    assert main(["iterate", str(write_job(tmp_path / "job.yaml", job))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out" / "round-0").exists()


def test_iterate_without_an_iterate_section_says_what_to_add(tmp_path, tiny_lm_dir, capsys):
    job = iterate_job(tmp_path, tiny_lm_dir)
    del job["iterate"]
    assert main(["iterate", str(write_job(tmp_path / "job.yaml", job))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no iterate: section" in err[0]


def test_another_spec_on_the_same_loop_is_refused(reference, tmp_path):
    job, root, made, _ = reference
    changed = {**job, "search": {**job["search"], "alpha": 0.25}}
    path = write_job(tmp_path / "job.yaml", changed)
    assert yaml.safe_load(path.read_text())["output"]["path"] == str(root)
    done = cli("iterate", path)
    assert done.returncode == 2, log(done)
    assert len(errors(done)) == 1 and "different spec" in errors(done)[0]
    assert outcome(root) == made


def test_train_from_base_with_sliced_prompts_and_a_command_trainer(tmp_path, tiny_lm_dir):
    """ReST-EM's shape: every round trains the base model on its own slice of prompts; the
    command gets the round's file and start model (it records them beside a copy)."""
    script = ('import shutil, sys; data, start, out = sys.argv[1:]; '
              'shutil.copytree(start, out, dirs_exist_ok=True); '
              'open(out + "/made-from", "w").write(start + " " + data)')
    job = iterate_job(tmp_path, tiny_lm_dir, train_from="base",
                      prompts={"mode": "slice", "per_round": 3},
                      trainer={"type": "command",
                               "command": f"{sys.executable} -c '{script}' {{data}} "
                                          "{model} {output}"})
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    root = tmp_path / "out"
    for r in (0, 1):
        best = pq.read_table(root / f"round-{r}" / "best.parquet", columns=["id"])
        assert best.column("id").to_pylist() == [f"q{i}" for i in range(3 * r, 3 * r + 3)]
        start, data = (root / f"round-{r}" / "model" / "made-from").read_text().split()
        assert start == str(tiny_lm_dir)  # the base, in round 1 too
        assert data == str(root / f"round-{r}" / "sft_prompt_completion.parquet")
    record = json.loads((root / "iterate.json").read_text())
    assert record["rounds"][1]["policy"]["path"] == str(root / "round-0" / "model")
    assert record["rounds"][1]["training"]["from"]["path"] == str(tiny_lm_dir)


def test_a_trainer_the_cluster_cannot_place_is_refused_before_generating(tmp_path,
                                                                         tiny_lm_dir):
    job = iterate_job(tmp_path, tiny_lm_dir)
    job["iterate"]["trainer"]["num_cpus"] = 999
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 2, log(done)
    assert len(errors(done)) == 1 and "iterate.trainer.num_cpus: 999 asked" in errors(done)[0]
    assert not (tmp_path / "out" / "round-0").exists()


def test_sigterm_while_training_stops_the_trainer_and_resumes(tmp_path, tiny_lm_dir):
    """A stop during training cancels the task; the trainer's process dies with its worker
    (no trainer left holding a GPU); the next run trains the round again, generation kept."""
    pid_file = tmp_path / "trainer.pid"
    script = ("import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
              "time.sleep(120)")
    job = iterate_job(tmp_path, tiny_lm_dir, rounds=1, trainer={
        "type": "command",
        "command": f"{sys.executable} -c {shlex.quote(script)} {pid_file} {{output}}"})
    path = write_job(tmp_path / "job.yaml", job)
    proc = start_run(path, tmp_path / "log", "iterate")
    try:
        wait_for(pid_file.exists, proc, tmp_path / "log", "the trainer started", 120)
        time.sleep(0.5)  # the pid is written whole
        trainer = int(pid_file.read_text())
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, (tmp_path / "log").read_text()
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(trainer), "the trainer outlived its cancelled task"
    assert took < 30, took
    assert "stopped by SIGTERM" in (tmp_path / "log").read_text()
    assert not (tmp_path / "out" / "round-0" / "model").exists()
    job["iterate"]["trainer"]["command"] = "cp -rT {model} {output}"
    done = iterate_cli(job, tmp_path)
    assert done.returncode == 0, log(done)
    assert "round 0: generation already complete" in log(done)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False
