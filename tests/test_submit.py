"""`specrej-ray submit`: ids, entrypoints and runtime envs; a real job on a `ray start` cluster."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import requests

from specrej_ray.cli import main
from specrej_ray.distributed import submit as submit_module
from specrej_ray.distributed.submit import (
    SubmitError,
    build_runtime_env,
    choose_id,
    entrypoint,
    spec_in_working_dir,
    submission_id,
)
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [{"id": f"q{i}", "prompt": f"What is {i} times two?"} for i in range(3)]


def _spec(tmp_path, tiny_lm_dir, **sections):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    return validate_spec(tiny_job(tmp_path, tiny_lm_dir, prompts, **sections))


def test_submission_id_is_deterministic(tmp_path, tiny_lm_dir):
    a = _spec(tmp_path, tiny_lm_dir, name="my job/1")
    sid = submission_id(a)
    assert sid == submission_id(_spec(tmp_path, tiny_lm_dir, name="my job/1"))
    assert sid.startswith("specrej-my-job-1-") and len(sid.rsplit("-", 1)[1]) == 12
    # What changes results, or where they go, changes the id; speed settings do not.
    assert sid != submission_id(_spec(tmp_path, tiny_lm_dir, name="my job/1", seed=1))
    other_out = {"path": str(tmp_path / "elsewhere")}
    assert sid != submission_id(_spec(tmp_path, tiny_lm_dir, name="my job/1", output=other_out))
    assert sid == submission_id(
        _spec(tmp_path, tiny_lm_dir, name="my job/1", cluster={"shard_size": 3}))


def test_choose_id_reuses_live_jobs_and_retries_failed_ones():
    assert choose_id("s", {}) == ("s", None)
    assert choose_id("s", {"s": "RUNNING"}) == ("s", "RUNNING")
    assert choose_id("s", {"s": "SUCCEEDED"}) == ("s", "SUCCEEDED")
    assert choose_id("s", {"s": "FAILED"}) == ("s-r1", None)
    assert choose_id("s", {"s": "STOPPED", "s-r1": "FAILED", "s-r2": "PENDING"}) == ("s-r2",
                                                                                    "PENDING")


def test_entrypoint_quotes_every_argument():
    cmd = entrypoint("jobs/my job.yaml", ["output.path=/data/a b", "search.alpha=0.7;rm -rf /"])
    assert shlex.split(cmd) == ["specrej-ray", "run", "jobs/my job.yaml", "--set",
                                "output.path=/data/a b", "--set", "search.alpha=0.7;rm -rf /"]


def test_spec_must_be_inside_the_working_dir(tmp_path):
    (tmp_path / "wd" / "jobs").mkdir(parents=True)
    job = tmp_path / "wd" / "jobs" / "a.yaml"
    assert spec_in_working_dir(job, tmp_path / "wd") == "jobs/a.yaml"
    with pytest.raises(SubmitError, match="outside the working directory"):
        spec_in_working_dir(tmp_path / "b.yaml", tmp_path / "wd")


def test_runtime_env_merges_the_file(tmp_path):
    import yaml

    extra = yaml.safe_load((REPO / "jobs" / "runtime_env.yaml").read_text())
    env = build_runtime_env(tmp_path, {**extra, "excludes": ["data/raw"]})
    assert env["working_dir"] == str(tmp_path)
    assert env["env_vars"]["TRANSFORMERS_VERBOSITY"] == "error"
    assert {".venv", "out", ".git", "__pycache__", "data/raw"} <= set(env["excludes"])
    with pytest.raises(SubmitError, match="working_dir"):
        build_runtime_env(tmp_path, {"working_dir": "/elsewhere"})


def test_unreachable_address_is_one_line_exit_2(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    spec = _spec(tmp_path, tiny_lm_dir)
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, Path(spec.prompts.path)))
    monkeypatch.chdir(tmp_path)
    code = main(["submit", str(job), "--address", f"http://127.0.0.1:{_free_port()}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("specrej-ray: error: cannot reach the Ray job")


def test_bad_spec_is_rejected_before_connecting(tmp_path, tiny_lm_dir, capsys, monkeypatch):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    job = write_job(tmp_path / "job.yaml",
                    tiny_job(tmp_path, tiny_lm_dir, prompts, search={"alpah": 0.5}))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(job), "--address", "http://127.0.0.1:1"]) == 2
    assert "search.alpah: unknown key" in capsys.readouterr().err


class AgentLateClient:
    """A job server whose head agent is not up for the first `late` submissions (Ray 2.60's
    answer then: a 500 with this text)."""

    def __init__(self, late: int) -> None:
        self.late, self.calls, self.submitted = late, 0, []

    def list_jobs(self) -> list:
        return []

    def submit_job(self, **job) -> str:
        self.calls += 1
        if self.calls <= self.late:
            raise RuntimeError("Request failed with status code 500: No available agent to "
                               "submit job, please try again later..")
        self.submitted.append(job["submission_id"])
        return job["submission_id"]


def _submit_to(client, monkeypatch, tmp_path, tiny_lm_dir, lines: list[str]) -> int:
    monkeypatch.setattr(submit_module, "connect", lambda address: client)
    monkeypatch.setattr(submit_module, "AGENT_RETRY_S", 0.01)
    spec = _spec(tmp_path, tiny_lm_dir, output={"path": str(tmp_path / "out")})
    job = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir,
                                                   Path(spec.prompts.path)))
    return submit_module.submit(spec, job, [], "http://127.0.0.1:1", working_dir=tmp_path,
                                wait=False, echo=lambda *a, **k: lines.append(" ".join(a)))


def test_a_submission_before_the_head_agent_is_up_is_sent_again(tmp_path, tiny_lm_dir,
                                                                monkeypatch):
    client, lines = AgentLateClient(late=3), []
    assert _submit_to(client, monkeypatch, tmp_path, tiny_lm_dir, lines) == 0
    assert client.calls == 4 and len(client.submitted) == 1
    waiting = [line for line in lines if "job agent is not up yet" in line]
    assert len(waiting) == 1  # one line, not one a try


def test_no_head_agent_within_the_wait_is_one_line(tmp_path, tiny_lm_dir, monkeypatch):
    monkeypatch.setattr(submit_module, "AGENT_WAIT_S", 0.05)
    client, lines = AgentLateClient(late=10**6), []
    with pytest.raises(SubmitError) as e:
        _submit_to(client, monkeypatch, tmp_path, tiny_lm_dir, lines)
    assert len(str(e.value).splitlines()) == 1 and "No available agent" in str(e.value)
    assert client.submitted == []


# ---- integration: a real `ray start --head` cluster on loopback ---------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_env() -> dict[str, str]:
    """One environment for the cluster, the client and (inherited) the job: auth disabled the
    same way everywhere, no RAY_ADDRESS, and .venv/bin on PATH so `specrej-ray` resolves."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_API_SERVER"))}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


@pytest.fixture(scope="module")
def ray_head():
    """`ray start --head --block` in its own process group and temp dir (so a later
    in-process `ray.init()` never finds it); stopped by signalling that group, not with
    `ray stop`, which would also stop every other Ray instance on the machine."""
    temp_dir = tempfile.mkdtemp(prefix="srj-ray-")  # short: Ray's unix sockets live here
    port, dash = _free_port(), _free_port()
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
           f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           "--include-dashboard=true", "--num-cpus=4", "--num-gpus=0",
           "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
           f"--ray-client-server-port={_free_port()}",
           f"--dashboard-agent-listen-port={_free_port()}",
           f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
           "--object-store-memory=100000000", "--disable-usage-stats"]
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 (closed in teardown)
    proc = subprocess.Popen(cmd, env=_cluster_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited {proc.returncode}: "
                            f"{(Path(temp_dir) / 'ray-start.log').read_text()[-2000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{address}/api/version", timeout=2).status_code < 500:
                    break
            if time.monotonic() > deadline:
                pytest.fail("the Ray job server did not come up within 90 s")
            time.sleep(0.5)
        yield address
    finally:
        _stop_group(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGINT `ray start --block` (it then stops its own node's processes), then SIGKILL
    whatever of its process group is left. (SIGTERM would first wait for a node drain.)"""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _submit(workdir: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specrej_ray.cli", "submit", *args],
                          cwd=workdir, env=_cluster_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.ray
def test_submit_runs_the_job_on_a_ray_start_cluster(ray_head, tmp_path, tiny_lm_dir):
    # Everything the job reads is inside the uploaded working dir, by relative path.
    workdir = tmp_path / "project"
    (workdir / "jobs").mkdir(parents=True)
    shutil.copytree(tiny_lm_dir, workdir / "models" / "tiny-lm")
    write_jsonl(workdir / "prompts.jsonl", PROMPTS)
    job = tiny_job(workdir, Path("models/tiny-lm"), Path("prompts.jsonl"), name="submit-test")
    write_job(workdir / "jobs" / "tiny.yaml", job)
    out = tmp_path / "dataset"  # absolute: the job's own working dir copy is temporary

    args = ["jobs/tiny.yaml", "--address", ray_head, "--set", f"output.path={out}",
            "--runtime-env", str(REPO / "jobs" / "runtime_env.yaml"), "--timeout", "180"]
    first = _submit(workdir, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "submitted specrej-submit-test-" in first.stdout
    assert "SUCCEEDED" in first.stdout
    table = pq.read_table(out / "best.parquet")
    assert sorted(table.column("id").to_pylist()) == [p["id"] for p in PROMPTS]

    # The same spec again: the finished job is reported, not run a second time.
    again = _submit(workdir, *args, timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already submitted and is SUCCEEDED" in again.stdout
    jobs = requests.get(f"{ray_head}/api/jobs/", timeout=10).json()
    assert len([j for j in jobs if j["submission_id"].startswith("specrej-submit-test-")]) == 1
