"""OutputDir without Ray: one writer per location, results tied to prompt content, shard
records that survive a change of shard size, and damage found on resume."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import fsspec
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from specrej_ray.data import dataset
from specrej_ray.data.output import OutputDir, check_output, content_key
from specrej_ray.data.output_lock import Lease, OutputInUse
from specrej_ray.data.prompts import Prompt
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.spec import OutputSpec, validate_spec
from specrej_ray.spec.job import _NOT_IN_FINGERPRINT, fingerprinted
from tests.conftest import tiny_job

QUIET = lambda *a, **k: None  # noqa: E731
PROV = {"generator": "g", "reward_model": "r", "fingerprint": "f1"}


def _open(path, policy="resume", fingerprint="f1", spec=None, echo=QUIET):
    return OutputDir.open(str(path), policy, fingerprint, spec or {}, label="test", echo=echo)


def _prompts(n: int, edit: dict[int, str] | None = None) -> list[Prompt]:
    edit = edit or {}
    return [Prompt(f"p{i}", edit.get(i, f"Question {i}?"), None, i + 1) for i in range(n)]


def _keys(prompts: list[Prompt]) -> dict[str, dict[str, str]]:
    return {p.id: content_key(p.text, p.system, [len(p.text)]) for p in prompts}


def _write(outdir: OutputDir, shard_id: str, prompts: list[Prompt], tag: str = "",
           candidates: int = 1) -> None:
    """A finished shard whose answers say which prompt text (and writer) made them; with
    `candidates` > 1, each prompt's later candidates score lower (a preference pair)."""
    best, cands = [], []
    for p in prompts:
        made = [Candidate(i, tokens=[1, 2], status=Status.FINISHED, finish_reason="eos",
                          final_score=1.0 - i / 2,
                          text=f"answer {i} to {p.text}{tag}" if i else f"answer to {p.text}{tag}")
                for i in range(candidates)]
        result = PromptResult(p.id, made, 0, n0=candidates, waves=1, rounds=0,
                              prompt_tokens=3, seconds=0.0, score_seconds=0.0)
        b, c = dataset.result_rows(p, result)
        best.append(b)
        cands += c
    outdir.write_shard(shard_id, {p.id: _keys([p])[p.id] for p in prompts}, best, cands)


def _best(path) -> list[dict]:
    return pq.read_table(path / "best.parquet", columns=["id", "prompt", "response"]).to_pylist()


# --- one writer ---


def test_a_second_open_is_refused_naming_the_holder(tmp_path):
    with _open(tmp_path / "out"):
        with pytest.raises(OutputInUse) as e:
            _open(tmp_path / "out")
        message = str(e.value)
        assert "\n" not in message and f"pid {os.getpid()}" in message
        assert message.startswith(f"output.path: {tmp_path / 'out'} is in use by")
    with _open(tmp_path / "out"):  # released on close
        pass


@pytest.mark.slow  # the holder is a process of its own
def test_a_lock_held_by_another_process_is_refused_and_freed_when_it_dies(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from specrej_ray.data.output import OutputDir;"
         f"d = OutputDir.open({str(out)!r}, 'resume', 'f1', {{}}, label='holder');"
         "print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputInUse, match=f"pid {holder.pid} .*'holder'"):
            _open(out, "overwrite", "f2")  # --overwrite is refused too
        holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel drops the lock
        holder.wait(timeout=30)
        with _open(out):
            pass
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_run_refused_by_a_holder_leaves_the_directory_the_holder_just_made(tmp_path,
                                                                             monkeypatch):
    """Two runs see no directory; the other makes it and locks it, and is about to write.
    The refused run must not remove that (still empty) directory: the holder's first write
    failed with "No such file or directory" once in a full suite run."""
    import fcntl

    from specrej_ray.data import output

    out = tmp_path / "out"
    real = output.take_lock
    held = []

    def other_run_first(location, *args, **kwargs):
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the holder: locked, nothing written
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
        return real(location, *args, **kwargs)

    monkeypatch.setattr(output, "take_lock", other_run_first)
    try:
        with pytest.raises(OutputInUse):
            _open(out, "overwrite", "f2")
        assert out.is_dir()
    finally:
        for fd in held:
            os.close(fd)


def test_racing_writers_never_mix_rows(tmp_path):
    """20 tries of two runs started at once on one output, each with its own spec and
    --overwrite: every time, the dataset is one writer's alone, whole, with no duplicate."""
    out = tmp_path / "out"
    prompts = _prompts(6)
    for attempt in range(20):
        start = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def run(tag: str, out=out, start=start, outcome=outcome) -> None:
            start.wait()
            try:
                with _open(out, "overwrite", fingerprint=tag) as outdir:
                    for i in range(0, 6, 2):
                        _write(outdir, f"s{i}-{tag}", prompts[i:i + 2], tag=f" by {tag}")
                    outdir.assemble(_keys(prompts), OutputSpec(path=str(out)),
                                    {**PROV, "fingerprint": tag})
                outcome[tag] = "wrote"
            except OutputInUse:
                outcome[tag] = "refused"
            except Exception as e:  # any other end is a failure of the race, not a refusal
                outcome[tag] = repr(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in ("A", "B")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert "wrote" in outcome.values(), attempt
        assert set(outcome.values()) <= {"wrote", "refused"}, (attempt, outcome)
        rows = pq.read_table(out / "best.parquet").to_pylist()
        writers = {r["fingerprint"] for r in rows}
        manifest = json.loads((out / "manifest.json").read_text())
        assert len(writers) == 1 and writers == {manifest["fingerprint"]}, attempt
        assert {r["response"].rsplit(" by ", 1)[1] for r in rows} == writers, attempt
        assert sorted(r["id"] for r in rows) == [p.id for p in prompts], attempt


# --- results tied to content ---


def test_an_edited_prompt_is_regenerated_and_its_old_result_never_used(tmp_path):
    out = tmp_path / "out"
    prompts = _prompts(4)
    with _open(out) as outdir:
        _write(outdir, "s0", prompts[:2])
        _write(outdir, "s1", prompts[2:])
    edited = _prompts(4, edit={1: "A different question?"})
    with _open(out) as outdir:
        found = outdir.resume(_keys(edited))
        assert found.changed == ["p1"] and set(found.done) == {"p0", "p2", "p3"}
        # Before p1 is regenerated, the dataset leaves it out rather than use the stale row.
        outdir.assemble(_keys(edited), OutputSpec(path=str(out)), PROV)
        assert [r["id"] for r in _best(out)] == ["p0", "p2", "p3"]
        _write(outdir, "s2", [edited[1]])
        outdir.assemble(_keys(edited), OutputSpec(path=str(out)), PROV)
    assert [(r["id"], r["response"]) for r in _best(out)] == [
        ("p0", "answer to Question 0?"), ("p1", "answer to A different question?"),
        ("p2", "answer to Question 2?"), ("p3", "answer to Question 3?")]


def test_a_change_of_tokens_alone_counts_as_a_changed_prompt():
    # The same text under another chat template or tokenizer is another input.
    assert content_key("hi", None, [1, 2]) != content_key("hi", None, [1, 2, 3])
    assert content_key("hi", None, [1, 2])["text"] == content_key("hi", None, [1, 2, 3])["text"]
    assert content_key("hi", "sys", [1])["text"] != content_key("hi", None, [1])["text"]


def test_finished_prompts_are_kept_across_a_change_of_shard_size(tmp_path):
    out = tmp_path / "out"
    prompts = _prompts(6)
    with _open(out) as outdir:  # shard size 4: one shard finished, the other not yet
        _write(outdir, "size4-0", prompts[:4])
    with _open(out) as outdir:  # rerun with shard size 1: only the missing two are done
        found = outdir.resume(_keys(prompts))
        assert set(found.done) == {"p0", "p1", "p2", "p3"} and found.changed == []
        for p in prompts[4:]:
            _write(outdir, f"size1-{p.id}", [p])
        outdir.assemble(_keys(prompts), OutputSpec(path=str(out)), PROV)
    assert [r["id"] for r in _best(out)] == [p.id for p in prompts]
    records = sorted(p.name for p in (out / "shards").glob("*.json"))
    assert records == ["size1-p4.json", "size1-p5.json", "size4-0.json"]


def test_after_resume_the_run_keeps_one_shard_number_a_prompt(tmp_path):
    # resume() binds the output to the run's prompts: the records drop their copies of the
    # prompts' keys, and each shard written then supplies what no shard supplied yet. What
    # is assembled equals what a fresh reader of the records works out.
    out = tmp_path / "out"
    prompts = _prompts(6, edit={1: "Edited?"})
    with _open(out) as outdir:
        _write(outdir, "a", _prompts(3))  # p1 under its old text
    with _open(out) as outdir:
        keys = _keys(prompts)
        found = outdir.resume(keys)
        assert set(found.done) == {"p0", "p2"} and found.changed == ["p1"]
        assert outdir.shard_keys == {}  # no copy of the prompts' keys per shard
        _write(outdir, "b", [prompts[1], prompts[3]])
        _write(outdir, "c", [prompts[3], prompts[4], prompts[5]], tag=" (again)")
        bound = outdir._supply(keys)
        assert dict(bound) == {"p0": "a", "p1": "b", "p2": "a", "p3": "b", "p4": "c",
                               "p5": "c"}
        assert set(found.done) == {"p0", "p2"}  # what resume found stays as it was
        with pytest.raises(ValueError, match="not the ones resume"):
            outdir.assemble(_keys(prompts[:5]), OutputSpec(path=str(out)), PROV)
        outdir.assemble(keys, OutputSpec(path=str(out)), PROV)
    with _open(out) as fresh:
        assert dict(fresh.resume(_keys(prompts)).done) == dict(bound)
    assert [r["response"] for r in _best(out)][1] == "answer to Edited?"


# --- damage found on resume ---


def test_a_truncated_shard_is_dropped_and_its_prompts_regenerated(tmp_path):
    out = tmp_path / "out"
    prompts = _prompts(4)
    with _open(out) as outdir:
        _write(outdir, "s0", prompts[:2])
        _write(outdir, "s1", prompts[2:])
    damaged = out / "shards" / "s1.candidates.parquet"
    damaged.write_bytes(damaged.read_bytes()[:50])
    with _open(out) as outdir:
        found = outdir.resume(_keys(prompts))
        assert set(found.done) == {"p0", "p1"}
        assert found.dropped == ["s1: s1.candidates.parquet is truncated"]
        outdir.write_run_info({})  # its files are cleared at the run's first write
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "s0.best.parquet", "s0.candidates.parquet", "s0.json"]


def test_leftovers_of_a_killed_write_are_cleared(tmp_path):
    out = tmp_path / "out"
    prompts = _prompts(2)
    with _open(out) as outdir:
        _write(outdir, "s0", prompts[:1])
        _write(outdir, "s1", prompts[1:])
    # Killed after its files but before its record; and a temp file mid-write.
    (out / "shards" / "s1.json").unlink()
    (out / "shards" / ".s2.best.parquet.tmp-1-abc").write_bytes(b"half")
    with _open(out) as outdir:
        assert set(outdir.resume(_keys(prompts)).done) == {"p0"}
        outdir.write_run_info({})  # cleared at the run's first write
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "s0.best.parquet", "s0.candidates.parquet", "s0.json"]


def test_a_truncated_manifest_is_rebuilt_from_the_shard_records(tmp_path):
    out = tmp_path / "out"
    prompts = _prompts(2)
    with _open(out) as outdir:
        _write(outdir, "s0", prompts)
    text = (out / "manifest.json").read_text()
    (out / "manifest.json").write_text(text[: len(text) // 2])
    said = []
    with _open(out, echo=said.append) as outdir:
        assert set(outdir.resume(_keys(prompts)).done) == {"p0", "p1"}
        outdir.assemble(_keys(prompts), OutputSpec(path=str(out)), PROV)
    assert "unreadable; rebuilding it" in said[0]
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == "f1"
    (out / "manifest.json").write_text("{")
    (out / "shards" / ".s9.json.tmp-1-abc").write_bytes(b"half")
    with pytest.raises(dataset.OutputError, match="holds shards of another spec"):
        _open(out, fingerprint="f2")  # the shards say which spec made them
    assert (out / "shards" / ".s9.json.tmp-1-abc").exists()  # a refused run changes nothing


def test_an_output_of_the_older_layout_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"fingerprint": "f1", "spec": {},
                                                   "shards": {"s0": ["p0"]}}))
    (out / "shards" / "s0.best.parquet").write_bytes(b"their results")
    with pytest.raises(dataset.OutputError, match="older specrej-ray .*--overwrite"):
        _open(out)
    assert (out / "shards" / "s0.best.parquet").read_bytes() == b"their results"  # kept


def test_a_copied_output_resumed_with_other_prompts_names_only_what_blocks_it(tmp_path):
    """A new output.path alone is accepted (a copied output resumes); the refusal of one
    whose prompts.path changed too names prompts.path only (it said `output.path,
    prompts.path`, though output.path is not what blocks the resume)."""
    job = tiny_job(tmp_path, tmp_path / "model", tmp_path / "a.jsonl")
    first = validate_spec(job)
    with _open(tmp_path / "out", fingerprint=first.fingerprint(),
               spec=first.model_dump(mode="json")) as outdir:
        _write(outdir, "s0", _prompts(1))
    copy = shutil.copytree(tmp_path / "out", tmp_path / "copy")
    moved = validate_spec(dict(job, output={"path": str(copy)}))
    with _open(copy, fingerprint=moved.fingerprint(), spec=moved.model_dump(mode="json")):
        pass
    other = validate_spec(dict(job, output={"path": str(copy)},
                               prompts={"path": str(tmp_path / "b.jsonl"), "id_field": "id"}))
    with pytest.raises(dataset.OutputError) as e:
        _open(copy, fingerprint=other.fingerprint(), spec=other.model_dump(mode="json"))
    assert "holds results of a different spec (changed: prompts.path);" in str(e.value)


def test_fingerprinted_fields_are_what_the_fingerprint_hashes(tmp_path):
    spec = validate_spec(tiny_job(tmp_path, tmp_path / "model", tmp_path / "a.jsonl"))
    dumped = spec.model_dump(mode="json")
    assert fingerprinted(dumped) == spec.model_dump(mode="json", exclude=_NOT_IN_FINGERPRINT)
    assert "output" not in fingerprinted(dumped) and "prompts" in fingerprinted(dumped)


class FullFS(MemoryFileSystem):
    """A store that runs out of space after `room` more parquet files. In this process's
    memory, as memory:// is: no other run can race for its lease (no 2-s settle)."""

    protocol = ("fullmem", "memory")
    room = 10**9

    def _open(self, path, mode="rb", **kwargs):
        if ("w" in mode or "a" in mode) and ".parquet" in path:
            FullFS.room -= 1
            if FullFS.room < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
        return super()._open(path, mode, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        with self._open(path, "wb") as f:
            f.write(value)


def test_a_full_disk_stops_with_one_line_and_keeps_finished_shards():
    fsspec.register_implementation("fullmem", FullFS, clobber=True)
    url = f"fullmem://full-{time.monotonic_ns()}/out"
    prompts = _prompts(4)
    FullFS.room = 10**9
    with _open(url) as outdir:
        _write(outdir, "s0", prompts[:2])
        FullFS.room = 1  # the next shard's first file fits, its second does not
        with pytest.raises(dataset.OutputError) as e:
            _write(outdir, "s1", prompts[2:])
    message = str(e.value)
    assert "\n" not in message and "No space left on device" in message
    assert "s1.best.parquet" in message and "run again to resume" in message
    FullFS.room = 10**9
    fs, root = fsspec.core.url_to_fs(url)
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.find(root))
    assert not [n for n in left if ".tmp-" in n]
    with _open(url) as outdir:  # the finished shard is kept; the half one is cleared
        assert set(outdir.resume(_keys(prompts)).done) == {"p0", "p1"}
        outdir.write_run_info({})  # (at the run's first write)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(root + "/shards")) == [
        "s0.best.parquet", "s0.candidates.parquet", "s0.json"]


# --- leases (object stores) ---


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_live_lease_is_refused_a_stale_one_taken_over_and_a_lost_one_noticed():
    out = dataset.locate(f"memory://lease-{time.monotonic_ns()}/out")
    out.fs.makedirs(out.root, exist_ok=True)
    clock = Clock()
    lease = dict(ttl_s=60, settle_s=0, clock=clock, heartbeat=False)
    first = Lease(out, "first", echo=QUIET, **lease)
    clock.now += 30
    with pytest.raises(OutputInUse, match="'first'.*renewed 30 s ago"):
        Lease(out, "second", echo=QUIET, **lease)
    clock.now += 31  # no heartbeat for 61 s: stale
    said = []
    second = Lease(out, "second", echo=said.append, **lease)
    assert "taking over the stale lease" in said[0] and "'first'" in said[0]
    first.renew()  # the first run wakes up: it must notice and stop writing
    with pytest.raises(OutputInUse, match="taken over by .*'second'"):
        first.check()
    second.check()
    first.release()  # not its lease any more: left alone
    assert json.loads(out.fs.cat_file(out.path(".specrej-lease.json")))["run"] == "second"
    second.release()
    assert not out.fs.exists(out.path(".specrej-lease.json"))


# --- what validate can tell without writing ---


def test_check_output_refuses_what_a_run_could_not_create(tmp_path):
    check_output(str(tmp_path / "new" / "deeper"))  # folders a run would make: fine
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(dataset.OutputError, match=r"a-file is a file, not a folder") as e:
        check_output(str(tmp_path / "a-file" / "out"))
    assert "\n" not in str(e.value)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("x")
    with pytest.raises(dataset.OutputError, match="specrej-ray did not write") as e:
        check_output(str(tmp_path / "theirs"))
    assert "--overwrite" not in str(e.value)  # it would not be ours after it either
    assert not (tmp_path / "new").exists()  # nothing was written
