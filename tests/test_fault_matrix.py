"""The fault matrix on a local Ray cluster with the tiny model: each fault ends in a resumed
run whose dataset is identical to an undisturbed one, or in a one-line refusal that loses
nothing. docs/reliability.md lists every case with the test that shows it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from specrej_ray.data import dataset
from specrej_ray.distributed.driver import run_job
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers import zygote
from tests.helpers.runs import cli, cli_env, dataset_rows, shard_records
from tests.test_output_dir import FullFS

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
IDS = [f"q{i}" for i in range(5)]
QUIET = {"echo": lambda *a, **k: None}



@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_lm_dir, ray_cluster):
    """The job and the dataset of an undisturbed run of it."""
    tmp = tmp_path_factory.mktemp("reference")
    prompts = write_jsonl(tmp / "p.jsonl", [{"id": i, "prompt": f"Tell me about {i}."}
                                            for i in IDS])
    job = tiny_job(tmp, tiny_lm_dir, prompts, cluster={"shard_size": 2})
    run_job(validate_spec(job), **QUIET)
    return job, dataset_rows(Path(job["output"]["path"]))


def _job_at(reference, tmp_path: Path, **sections) -> dict:
    job, _ = reference
    return {**job, "output": {"path": str(tmp_path / "out")}, **sections}


def _crashed_run(job: dict, tmp_path: Path, pattern: str, nth: int = 1) -> None:
    """A driver that dies at a write: a process of its own (its death is the subject)."""
    path = write_job(tmp_path / "job.yaml", job)
    done = zygote.run([sys.executable, "-m", "tests.helpers.crash", str(path), pattern,
                       str(nth)], cwd=REPO, env=cli_env(), timeout=300)
    assert done.returncode == 137, done.stdout + done.stderr


def test_driver_killed_while_writing_a_shard_record_resumes_identically(reference, tmp_path):
    job = _job_at(reference, tmp_path)
    _crashed_run(job, tmp_path, "shards/*.json", nth=2)
    out = tmp_path / "out"
    assert len(shard_records(out)) == 1  # the second record never appeared
    assert [p.name for p in (out / "shards").glob(".*.tmp-*")]  # its temp copy did
    info = run_job(validate_spec(job), **QUIET)
    assert len(info["shard_seconds"]) == 2  # the cut shard and the one never started
    assert dataset_rows(out) == reference[1]
    assert not list(out.rglob(".*.tmp-*"))


def test_driver_killed_while_assembling_resumes_identically(reference, tmp_path):
    job = _job_at(reference, tmp_path)
    run_job(validate_spec(job), **QUIET)
    (tmp_path / "out" / "best.parquet").unlink()
    (tmp_path / "out" / "best.jsonl").unlink()
    _crashed_run(job, tmp_path, "best.jsonl")  # every shard done: only assembly runs
    # Killed while its set was moved into place: run.json says so.
    crashed = json.loads((tmp_path / "out" / "run.json").read_text())
    assert crashed["set"]["state"] == "publishing"
    assert crashed["invocations"][-1]["status"] == "publishing"
    info = run_job(validate_spec(job), **QUIET)
    assert info["set"]["state"] == "complete"
    assert [i["status"] for i in info["invocations"]] == ["completed", "killed", "completed"]
    assert info["shard_seconds"] == {}  # nothing regenerated
    assert dataset_rows(tmp_path / "out") == reference[1]
    assert (tmp_path / "out" / "best.jsonl").exists()
    assert not list((tmp_path / "out").glob(".*.tmp-*"))


def test_a_corrupt_shard_found_on_resume_is_regenerated_identically(reference, tmp_path):
    job = _job_at(reference, tmp_path)
    run_job(validate_spec(job), **QUIET)
    out = tmp_path / "out"
    victim = sorted((out / "shards").glob("*.best.parquet"))[1]
    victim.write_bytes(victim.read_bytes()[:-20])
    said: list[str] = []
    info = run_job(validate_spec(job), echo=lambda *a, **k: said.append(" ".join(a)))
    shard = victim.name.removesuffix(".best.parquet")
    assert list(info["shard_seconds"]) == [shard]
    assert info["shards_dropped"] == [f"{shard}: {victim.name} is truncated"]
    assert any(f"regenerating shard {shard}" in line for line in said)
    assert dataset_rows(out) == reference[1]


def test_an_edited_prompt_is_regenerated_and_reported(reference, tmp_path):
    rows = [{"id": i, "prompt": f"Tell me about {i}."} for i in IDS]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    job = _job_at(reference, tmp_path, cluster={"shard_size": 1},
                  prompts={"path": str(path), "id_field": "id"})
    run_job(validate_spec(job), **QUIET)
    was_best, was_cands = dataset_rows(tmp_path / "out")
    rows[2]["prompt"] = "Something else entirely."
    write_jsonl(path, rows)  # the same file, edited in place; q2 keeps its id
    info = run_job(validate_spec(job), **QUIET)
    assert info["regenerated"] == {"prompts": 1, "ids": ["q2"]} and len(info["shard_seconds"]) == 1
    best, cands = dataset_rows(tmp_path / "out")
    assert [r["prompt"] for r in best] == [r["prompt"] for r in rows]
    assert "Something else entirely." in best[2]["messages"][0]["content"]
    unchanged = lambda rs, key: [r for r in rs if r[key] != "q2"]  # noqa: E731
    assert unchanged(best, "id") == unchanged(was_best, "id")
    assert unchanged(cands, "prompt_id") == unchanged(was_cands, "prompt_id")
    assert [c["prompt_id"] for c in cands].count("q2") == job["search"]["n"]


def test_a_new_shard_size_keeps_every_finished_prompt(reference, tmp_path):
    job = _job_at(reference, tmp_path)
    run_job(validate_spec(job), **QUIET)
    resized = {**job, "cluster": {"shard_size": 3}}
    info = run_job(validate_spec(resized), **QUIET)
    assert info["shard_seconds"] == {}  # nothing regenerated
    assert dataset_rows(tmp_path / "out") == reference[1]
    ids = [i for pids in shard_records(tmp_path / "out").values() for i in pids]
    assert sorted(ids) == IDS  # no prompt recorded twice


def test_a_full_disk_stops_the_run_and_the_rerun_completes_identically(reference, tmp_path):
    fsspec.register_implementation("fullmem", FullFS, clobber=True)
    url = f"fullmem://matrix-{time.monotonic_ns()}/out"
    job = _job_at(reference, tmp_path, output={"path": url})
    FullFS.room = 2  # the first shard's two files fit, the next shard's do not
    try:
        with pytest.raises(dataset.OutputError) as e:
            run_job(validate_spec(job), **QUIET)
        assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
        fs, root = fsspec.core.url_to_fs(url)
        assert len([p for p in fs.find(root + "/shards") if p.endswith(".json")]) == 1
        FullFS.room = 10**9
        info = run_job(validate_spec(job), **QUIET)
        assert len(info["shard_seconds"]) == 2  # the first shard was kept
        best = dataset.read_table(dataset.locate(url), "best.parquet").to_pylist()
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in best] == reference[1][0]
    finally:
        FullFS.room = 10**9


def test_a_full_disk_while_the_final_files_are_written_leaves_none_of_them(reference,
                                                                          tmp_path):
    """The probe's case: the disk fills after every shard is written, with some of the final
    files written. None of them is visible, run.json records the failure (`set.state:
    none`), and the rerun writes the set an undisturbed run writes."""
    fsspec.register_implementation("fullmem", FullFS, clobber=True)
    url = f"fullmem://matrix-{time.monotonic_ns()}/out"
    job = _job_at(reference, tmp_path, output={"path": url})
    FullFS.room = 3 * 2 + 3  # the three shards' files, then three of the six final ones
    try:
        with pytest.raises(dataset.OutputError) as e:
            run_job(validate_spec(job), **QUIET)
        assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
        fs, root = fsspec.core.url_to_fs(url)
        names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        assert names == ["manifest.json", "run.json", "shards"]
        recorded = json.loads(fs.cat_file(f"{root}/run.json"))
        assert recorded["set"] == {"id": None, "state": "none", "files": {}}
        assert recorded["invocations"][-1]["status"] == "failed"
        assert recorded["invocations"][-1]["reason"] == str(e.value)
        FullFS.room = 10**9
        info = run_job(validate_spec(job), **QUIET)
        assert info["shard_seconds"] == {} and info["set"]["state"] == "complete"
        best = dataset.read_table(dataset.locate(url), "best.parquet").to_pylist()
        assert [{k: v for k, v in r.items() if k != "seconds"} for r in best] == reference[1][0]
    finally:
        FullFS.room = 10**9


def test_a_second_run_on_a_held_output_is_refused_at_once(reference, tmp_path):
    job = _job_at(reference, tmp_path)
    first = write_job(tmp_path / "first.yaml", job)
    other = write_job(tmp_path / "other.yaml", {**job, "search": {**job["search"],
                                                                  "alpha": 0.7}})
    lock = tmp_path / "out" / ".specrej-lock"
    # The holder is another process (a lock is between processes); the second start is
    # refused before it needs Ray, in this process.
    holder = zygote.launch([sys.executable, "-m", "specrej_ray.cli", "run", str(first)],
                           cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text()) and time.monotonic() < deadline:
            assert holder.poll() is None, holder.stdout.read()
            time.sleep(0.05)
        started = time.monotonic()
        second = cli("run", other, "--overwrite")
        refused_in = time.monotonic() - started
        assert holder.poll() is None, "the first run ended before the second was refused"
    finally:
        out, _ = holder.communicate(timeout=300)
    print(f"\nsecond run refused in {refused_in:.1f} s")
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"is in use by pid {holder.pid}" in lines[0] and "'tiny'" in lines[0]
    assert holder.returncode == 0, out
    assert dataset_rows(tmp_path / "out") == reference[1]  # the first run's dataset, untouched
