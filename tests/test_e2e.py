"""End to end on a local Ray cluster with tiny models: dataset, schema, errors, resume."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal

import pyarrow.parquet as pq
import pytest
from datasets import load_dataset

from specrej_ray.cli import main
from specrej_ray.data.output import OutputDir
from specrej_ray.distributed.driver import run_job
from specrej_ray.job.interrupt import Interrupt, Interrupted
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import shard_records

pytestmark = pytest.mark.ray

GOOD = [{"id": f"p{i}", "prompt": f"Question number {i}: what is {i} plus {i}?"}
        for i in range(5)]
BAD = [{"id": "empty", "prompt": "  "}, {"id": "p1", "prompt": "duplicate id"},
       {"id": "long", "prompt": "x" * 400}]



@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_lm_dir, ray_cluster):
    tmp = tmp_path_factory.mktemp("e2e")
    prompts = write_jsonl(tmp / "prompts.jsonl", GOOD[:3] + BAD + GOOD[3:])
    job = tiny_job(tmp, tiny_lm_dir, prompts)
    spec = validate_spec(job)
    info = run_job(spec, echo=lambda *a, **k: None)
    return tmp, job, spec, info


def test_one_row_per_valid_prompt(finished_run):
    tmp, _, _, info = finished_run
    best = load_dataset("parquet", data_files=str(tmp / "out" / "best.parquet"), split="train")
    assert best["id"] == [g["id"] for g in GOOD]
    assert {k: info["counts"][k] for k in ("prompts", "candidates")} == {
        "prompts": 5, "candidates": 5 * 6}
    assert info["counts"]["tokens_discarded"] == 0  # scores at once: nothing decoded past
    assert set(best.column_names) >= {
        "id", "prompt", "response", "reward", "messages", "n0", "rounds", "tokens_generated",
        "candidates_finished", "candidates_rejected"}
    for row in best:
        assert row["messages"][-1] == {"role": "assistant", "content": row["response"]}
        assert row["messages"][0]["role"] in ("system", "user")
        assert row["n0"] == 6 and row["rounds"] == 2
        assert row["candidates_finished"] + row["candidates_rejected"] == 6


def test_best_is_the_highest_finished_reward(finished_run):
    tmp, *_ = finished_run
    cands = load_dataset("parquet", data_files=str(tmp / "out" / "candidates.parquet"),
                         split="train").to_list()
    best = {r["id"]: r for r in pq.read_table(tmp / "out" / "best.parquet").to_pylist()}
    for pid, row in best.items():
        finished = [c for c in cands if c["prompt_id"] == pid and c["status"] == "finished"]
        top = max(finished, key=lambda c: c["final_score"])
        assert row["reward"] == top["final_score"] and row["response"] == top["text"]
        rejected = [c for c in cands if c["prompt_id"] == pid and c["status"] == "rejected"]
        assert all(c["final_score"] is None and c["partial_scores"] for c in rejected)


def test_bad_rows_go_to_the_errors_file(finished_run):
    tmp, *_ = finished_run
    errors = [json.loads(line) for line in (tmp / "out" / "errors.jsonl").read_text().splitlines()]
    rows = sorted(e["row"] for e in errors)
    assert rows == [4, 5, 6]  # empty, duplicate id, longer than the context
    assert any("context" in e["reason"] for e in errors)


def test_run_json_records_the_run(finished_run):
    tmp, _, spec, _ = finished_run
    info = json.loads((tmp / "out" / "run.json").read_text())
    assert info["fingerprint"] == spec.fingerprint()
    assert info["versions"]["torch"] and info["versions"]["ray"]
    assert info["spec"]["search"]["alpha"] == 0.5
    assert info["seconds"]["total"] > 0
    assert info["seconds"]["startup"] > 0 and info["seconds"]["shards"] > 0
    shards = info["shards"]  # p0-p4 in shards of 2
    assert sorted(r["prompts"] for r in shards.values()) == [1, 2, 2]
    for record in shards.values():
        assert record["status"] == "done" and record["attempts"] == 1
        assert record["failures"] == [] and record["seconds"] > 0
        assert len(record["actor"]) == 32 and record["generator"]  # Ray actor id, hex
    assert [i["shards_done"] for i in info["invocations"]] == [3]
    # The final files, named as one set (data/final_set.py): each in place, as listed.
    assert info["set"]["state"] == "complete"
    assert set(info["set"]["files"]) == {*info["files"], "errors.jsonl", "README.md"}
    for name, listed in info["set"]["files"].items():
        data = (tmp / "out" / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (listed["bytes"],
                                                                 listed["sha256"])
    assert info["seconds_all_invocations"] == info["invocations"][0]["seconds"]
    # The counters the actors answer with as the run ends (distributed/answers.py).
    assert [r["actors"] for r in info["rewards"]] == [1] and info["rewards"][0]["name"]
    assert all(g["engine"] for g in info["generators"].values())


def test_rerun_resumes_and_changed_spec_is_refused(finished_run, capsys):
    tmp, job, spec, _ = finished_run
    before = (tmp / "out" / "best.jsonl").read_text()
    earlier = json.loads((tmp / "out" / "run.json").read_text())
    info = run_job(spec, echo=lambda *a, **k: None)  # every shard is done: nothing to run
    assert info["shard_seconds"] == {}
    # The earlier invocations' records and wall-clock are kept and summed.
    assert info["shards"] == earlier["shards"]
    assert info["invocations"][:-1] == earlier["invocations"]
    assert info["invocations"][-1]["shards_done"] == 0
    assert info["seconds_all_invocations"] == pytest.approx(
        earlier["seconds_all_invocations"] + info["seconds"]["total"])
    assert (tmp / "out" / "best.jsonl").read_text() == before
    job_path = write_job(tmp / "job.yaml", job)
    code = main(["run", str(job_path), "--set", "search.alpha=0.7"])
    err = capsys.readouterr().err
    assert code == 2 and "changed: search.alpha" in err


def test_resumed_shard_regenerates_the_same_text(finished_run):
    tmp, job, spec, _ = finished_run
    out = tmp / "out"
    dropped = sorted(shard_records(out))[1]
    (out / "shards" / f"{dropped}.json").unlink()  # as if killed before its record was written
    before = pq.read_table(out / "best.parquet").to_pylist()
    earlier = json.loads((out / "run.json").read_text())
    info = run_job(spec, echo=lambda *a, **k: None)
    assert list(info["shard_seconds"]) == [dropped]
    rerun = info["shards"].pop(dropped)
    assert rerun["attempts"] == 1 and rerun["invocation"] == len(info["invocations"]) - 1
    assert info["shards"] == {k: v for k, v in earlier["shards"].items() if k != dropped}
    after = pq.read_table(out / "best.parquet").to_pylist()
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(after) == strip(before)


def test_overlapping_scoring_with_decoding_gives_the_same_dataset(finished_run, tmp_path):
    # Decisions go to the reward actor while the generator keeps decoding (PoolsAnswer);
    # rejected candidates are cut back, so every candidate's text and status are the same.
    tmp, job, _, _ = finished_run
    job = {**job, "cluster": {**job["cluster"], "overlap_scoring": "on"},
           "output": {"path": str(tmp_path / "out")}}
    run_job(validate_spec(job), echo=lambda *a, **k: None)

    def rows(out):
        cols = ["prompt_id", "candidate", "text", "status", "num_tokens", "rejected_round"]
        return sorted(pq.read_table(out / "candidates.parquet", columns=cols).to_pylist(),
                      key=lambda r: (r["prompt_id"], r["candidate"]))

    assert rows(tmp_path / "out") == rows(tmp / "out")


def test_a_stop_during_the_writing_is_recorded_as_interrupted(finished_run, tmp_path,
                                                              monkeypatch):
    """SIGTERM while the datasets are assembled: the files are finished (the signal is
    deferred) and run.json says `interrupted`, as the exit code (143) does."""
    tmp, job, _, _ = finished_run
    out = tmp_path / "out"
    shutil.copytree(tmp / "out", out)
    spec = validate_spec({**job, "output": {"path": str(out)}})
    stop = Interrupt()
    stop.defer()  # as cli.run does before the driver starts
    original = OutputDir.assemble

    def assemble(self, *args, **kwargs):
        stop.signum = signal.SIGTERM  # what the handler does with a signal now
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OutputDir, "assemble", assemble)
    with pytest.raises(Interrupted):
        run_job(spec, echo=lambda *a, **k: None, stop=stop)
    info = json.loads((out / "run.json").read_text())
    assert [i["status"] for i in info["invocations"]][-1] == "interrupted"
    assert pq.read_table(out / "best.parquet").num_rows == 5  # the writing was finished


def test_a_signal_once_run_json_says_completed_stops_nothing(finished_run, tmp_path,
                                                             monkeypatch):
    """SIGTERM once run.json was written as completed (the set in place, the last write):
    the run returns (exit 0) as its record says, with a line saying why; a 143 beside a
    `completed` record was the signal property's find (CI, 2026-11-27)."""
    tmp, job, _, _ = finished_run
    out = tmp_path / "out"
    shutil.copytree(tmp / "out", out)
    spec = validate_spec({**job, "output": {"path": str(out)}})
    stop = Interrupt()
    stop.defer()
    original = OutputDir.publish

    def publish(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        stop.signum = signal.SIGTERM
        return done

    monkeypatch.setattr(OutputDir, "publish", publish)
    said = []
    info = run_job(spec, echo=lambda line, **k: said.append(line), stop=stop)
    assert info["invocations"][-1]["status"] == "completed"
    assert json.loads((out / "run.json").read_text())["invocations"][-1]["status"] == "completed"
    assert said[-1] == ("[specrej] SIGTERM came once the run was complete and recorded: "
                        "nothing was stopped")
