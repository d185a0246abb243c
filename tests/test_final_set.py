"""The final files as one set (data/final_set.py): whatever fails at whatever point of their
writing (a full disk, a rename refused, the process dying), the folder's run.json says what
its final files are, and a rerun completes the set; a run that finishes no prompt on a
location that held no results leaves nothing there. Without Ray: the shards are written by
hand and the run's end is job/finish.py, as the driver calls it."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

from specrej_ray.data.output import OutputDir
from specrej_ray.errors import OutputError
from specrej_ray.job.finish import record_failure, write_final_set
from specrej_ray.job.interrupt import Interrupt
from specrej_ray.job.run_record import RunState
from specrej_ray.spec import validate_spec
from tests.test_output_dir import FullFS, _keys, _prompts, _write

QUIET = lambda *a, **k: None  # noqa: E731
# What a run writes beside its final files: everything else at the top is a final file.
NOT_FINAL = {"manifest.json", "shards", "run.json", "calibration.json"}


def spec_at(url: str, formats: list[str] | None = None):
    return validate_spec({"name": "t", "prompts": {"path": "/nowhere/p.jsonl"},
                          "generator": {"model": "/nowhere/gen"},
                          "reward": {"type": "lm_likelihood", "model": "/nowhere/rm"},
                          "output": {"path": url, "formats": formats or ["preference"]}})


def run_end(spec, n: int, shards: dict[str, range] | None = None) -> dict:
    """A run of the first `n` prompts: it writes `shards` (id -> prompt positions), then the
    final set, as the driver does (a failed write recorded in run.json, then raised)."""
    prompts = _prompts(n)
    keys = _keys(prompts)
    with OutputDir.for_spec(spec, echo=QUIET) as outdir:
        found = outdir.resume(keys)
        state = RunState.resume(outdir.previous_run_info(), spec, outdir.records)
        times = (time.time(), time.time())
        try:
            for shard_id, at in (shards or {}).items():
                _write(outdir, shard_id, [prompts[i] for i in at], candidates=2)
            return write_final_set(spec, outdir, keys, found, ("p.jsonl", []), state,
                                   Interrupt(), {}, times, echo=QUIET)
        except OutputError as e:
            record_failure(spec, outdir, state, [], times, e)
            raise


def says(fs, root: str) -> dict | None:
    """run.json as it stands, once it is checked against the final files there: `complete`,
    each listed file in place with its size and sha256, and no other; `none` (or no
    run.json), no final file; `publishing`, the invocation that wrote it not completed."""
    fs.invalidate_cache()
    if not fs.exists(root):
        return None
    present = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    present = {n for n in present if not n.startswith(".")} - NOT_FINAL
    if "run.json" not in {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}:
        assert not present, f"final files with no run.json naming them: {sorted(present)}"
        return None
    record = json.loads(fs.cat_file(f"{root}/run.json"))
    listed = record["set"]
    if listed["state"] == "complete":
        assert present == set(listed["files"]), (sorted(present), sorted(listed["files"]))
        for name, f in listed["files"].items():
            data = fs.cat_file(f"{root}/{name}")
            assert (len(data), hashlib.sha256(data).hexdigest()) == (f["bytes"], f["sha256"])
        assert set(record["files"]) <= set(listed["files"])
    elif listed["state"] == "none":
        assert not present, sorted(present)
    else:
        assert listed["state"] == "publishing"
        assert record["invocations"][-1]["status"] in ("publishing", "failed")
    return record


def data_of(record: dict) -> dict:
    """The set's data files (the card aside: it says how long the run took)."""
    return {n: f for n, f in record["set"]["files"].items() if n != "README.md"}


class Crash(BaseException):
    """The process dying at a write: nothing of the run's handling runs (only the clean-up
    of hidden temporary files, which a real crash leaves to the next run)."""


class Faults:
    """The writes of the local filesystem (a file opened for writing, a rename, a removal;
    the lock's own file aside), counted while armed; the one numbered `at` fails: OSError
    (a full disk, a refused rename) or Crash."""

    def __init__(self, monkeypatch, at: int | None = None, crash: bool = False,
                 observe=None) -> None:
        self.at, self.crash, self.seen, self.armed = at, crash, [], False
        self.observe = observe  # called before each write
        for method in ("_open", "mv", "rm"):
            monkeypatch.setattr(LocalFileSystem, method,
                                self._wrap(method, getattr(LocalFileSystem, method)))

    def _wrap(self, method, real):
        def call(fs, path, *args, **kwargs):
            mode = args[0] if args else kwargs.get("mode", "rb")
            name = re.sub(r"-\d+-[0-9a-f]+$", "", str(args[0] if method == "mv" else path)
                          .rsplit("/", 1)[-1])
            if self.armed and (method != "_open" or "w" in mode) and "lock" not in name:
                self.seen.append(f"{method} {name}")
                if self.observe is not None:
                    self.observe()
                if len(self.seen) - 1 == self.at:
                    if self.crash:
                        raise Crash()
                    raise OSError(errno.ENOSPC if method == "_open" else errno.EIO,
                                  "No space left on device" if method == "_open"
                                  else "Input/output error")
            return real(fs, path, *args, **kwargs)

        return call

    @contextlib.contextmanager
    def armed_for(self):
        self.armed = True
        try:
            yield
        finally:
            self.armed = False


def earlier_set(tmp_path: Path) -> tuple[Path, dict]:
    base, first = earlier_set_at(str(tmp_path / "base"))
    return Path(base), first


def earlier_set_at(url: str) -> tuple[str, dict]:
    """An output whose first run completed a set of 4 prompts; the next run adds a shard
    of 2 more, so its set differs in every data file."""
    first = run_end(spec_at(url), 4, {"s0": range(2), "s1": range(2, 4)})
    with OutputDir.for_spec(spec_at(url), echo=QUIET) as outdir:
        _write(outdir, "s2", _prompts(6)[4:], candidates=2)  # done, not yet in a set
    return url, first


@pytest.fixture(scope="module")
def replacing(tmp_path_factory) -> tuple[Path, dict, dict, list[str]]:
    """earlier_set, with the set and the writes (Faults' points) of the undisturbed next
    run."""
    tmp = tmp_path_factory.mktemp("replacing")
    base, first = earlier_set(tmp)
    shutil.copytree(base, tmp / "undisturbed")
    with pytest.MonkeyPatch.context() as patch:
        faults = Faults(patch)
        with faults.armed_for():
            reference = run_end(spec_at(str(tmp / "undisturbed")), 6)
    return base, first, reference, faults.seen


def test_at_every_moment_of_the_final_write_run_json_tells_the_truth(replacing, tmp_path,
                                                                    monkeypatch):
    """Looked at before each write of a rerun (what a reader may find at any moment): the
    earlier set, complete; then run.json `publishing`, while files move; then the new set,
    complete. A reader that reads run.json, then the files, then run.json again, and finds
    it `complete` with one set id both times, has read that set."""
    base, first, reference, _ = replacing
    out = tmp_path / "out"
    shutil.copytree(base, out)
    fs = fsspec.filesystem("file")
    seen = []
    faults = Faults(monkeypatch, observe=lambda: seen.append(
        (lambda r: (r["set"]["state"], r["set"]["id"]))(says(fs, str(out)))))
    with faults.armed_for():
        run_end(spec_at(str(out)), 6)
    last = says(fs, str(out))
    seen.append(("complete", last["set"]["id"]))
    assert data_of(last) == data_of(reference)
    moments = [state if state == "publishing" else ident for state, ident in seen]
    changes = [m for i, m in enumerate(moments) if i == 0 or m != moments[i - 1]]
    assert changes == [first["set"]["id"], "publishing", last["set"]["id"]]
    assert moments.count("publishing") >= 8  # every file moved and removed in between


def replace_failing(replacing, tmp_path: Path, monkeypatch, crash: bool, pick) -> set[str]:
    """A rerun's set replacing a complete one, failing at one write of it after another
    (those `pick(points)` numbers): the earlier set stays whole and named (with the failure
    recorded, for a write that fails), or run.json says `publishing`; never files that
    run.json does not describe. Each time, the next run completes the set an undisturbed
    run makes. Returns the states the failures left."""
    base, first, reference, points = replacing
    faults = Faults(monkeypatch)
    fs = fsspec.filesystem("file")
    outcomes = set()
    for at in pick(points):
        point = points[at]
        out = tmp_path / f"at-{at}"
        shutil.copytree(base, out)
        faults.at, faults.crash, faults.seen = at, crash, []
        with faults.armed_for(), pytest.raises(Crash if crash else OutputError) as e:
            run_end(spec_at(str(out)), 6)
        record = says(fs, str(out))
        state = record["set"]["state"]
        if state == "complete" and record["set"]["id"] != reference["set"]["id"]:
            assert record["set"]["id"] == first["set"]["id"], point
        if not crash:
            assert "\n" not in str(e.value), point
            last = record["invocations"][-1]
            assert last["status"] == "failed" and last["reason"] == str(e.value), point
            assert len(record["invocations"]) == 2, point
        if state == "publishing" or state not in outcomes:  # the others resume alike
            again = run_end(spec_at(str(out)), 6)
            assert says(fs, str(out))["set"]["state"] == "complete"
            assert data_of(again) == data_of(reference), point
            # The interrupted invocation as it ended: failed, killed while its set was
            # moved (run.json said `publishing`), or not at all (killed before it wrote).
            assert {i["status"] for i in again["invocations"][1:-1]} <= {"failed", "killed"}
            assert not [p for p in out.iterdir() if ".tmp-" in p.name], point
        outcomes.add(state)
    return outcomes


def phases(points: list[str]) -> list[int]:
    """A point of each phase: a file staged, the card staged, run.json's `publishing`
    written and renamed, the first and the last file moved, `complete` written and
    renamed."""
    first = lambda what: points.index(what)  # noqa: E731
    last = lambda what: len(points) - 1 - points[::-1].index(what)  # noqa: E731
    moves = [i for i, p in enumerate(points) if p.startswith("mv ") and "json" not in p]
    return [0, first("_open .README.md.tmp"), first("_open .run.json.tmp"),
            first("mv run.json"), moves[0], moves[-1], last("_open .run.json.tmp"),
            last("mv run.json")]


def test_a_failure_in_each_phase_of_the_final_write_leaves_a_folder_that_says_what_it_holds(
        replacing, tmp_path, monkeypatch):
    assert replace_failing(replacing, tmp_path, monkeypatch, False, phases) == {
        "complete", "publishing"}


def test_a_crash_while_the_set_is_moved_leaves_a_folder_that_says_so(replacing, tmp_path,
                                                                    monkeypatch):
    """As the process dies: before run.json says `publishing` (the earlier set stands, as a
    failure before it shows), then at each step of the move."""
    assert replace_failing(replacing, tmp_path, monkeypatch, True,
                           lambda points: phases(points)[3:]) == {"complete", "publishing"}


@pytest.mark.slow  # in process, but a run at each of some 20 points, twice: about 20 s
@pytest.mark.parametrize("crash", [False, True], ids=["write-fails", "process-dies"])
def test_a_failure_at_every_point_of_the_final_write_leaves_a_folder_that_says_what_it_holds(
        replacing, tmp_path, monkeypatch, crash):
    every = lambda points: range(len(points))  # noqa: E731
    assert replace_failing(replacing, tmp_path, monkeypatch, crash, every) == {
        "complete", "publishing"}


@pytest.mark.slow  # in process, but two runs at each of some 30 points: about 20 s
def test_a_failed_first_set_leaves_no_final_file_and_records_why(tmp_path, monkeypatch):
    """No earlier set: a final write that fails at any point before run.json says
    `publishing` leaves no final file, and run.json `set.state: none` with the failure;
    after it, `publishing`. The next run completes the set."""
    faults = Faults(monkeypatch)
    shards = {"s0": range(2), "s1": range(2, 4)}
    with faults.armed_for():
        run_end(spec_at(str(tmp_path / "fresh")), 4, shards)
    fs = fsspec.filesystem("file")
    states = set()
    for at, point in enumerate(list(faults.seen)):
        out = str(tmp_path / f"at-{at}")
        faults.at, faults.seen = at, []
        with faults.armed_for(), pytest.raises(OutputError):
            run_end(spec_at(out), 4, shards)
        record = says(fs, out)
        states.add(record and record["set"]["state"])
        if record is None:  # the first shard's write failed: nothing at all is left
            assert not Path(out).exists(), point
        else:
            assert record["invocations"][-1]["status"] == "failed", point
        assert run_end(spec_at(out), 4, shards)["set"]["state"] == "complete"
        says(fs, out)
    assert states == {None, "none", "publishing"}


def test_a_run_that_finishes_no_prompt_on_a_fresh_path_leaves_nothing(tmp_path, monkeypatch):
    """A full disk at the first shard (the probe's 12 KB case: manifest.json fitted, the
    shard did not): no manifest.json, no shards/; no folder where the run made it, an empty
    one where it was there before. On a store without folders, not one object."""
    faults = Faults(monkeypatch, at=2)  # manifest.json (written, moved), then a shard file
    for made in (False, True):
        out = tmp_path / f"made-{made}"
        if made:
            out.mkdir()
        with faults.armed_for(), pytest.raises(OutputError, match="No space left on device"):
            run_end(spec_at(str(out)), 4, {"s0": range(2)})
        assert faults.seen[:3] == ["_open .manifest.json.tmp", "mv manifest.json",
                                   "_open .s0.candidates.parquet.tmp"]
        assert (list(out.iterdir()) == []) if made else not out.exists()
        faults.seen = []
    fsspec.register_implementation("fullmem", FullFS, clobber=True)
    url = f"fullmem://fresh-{uuid.uuid4().hex[:8]}/out"
    FullFS.room = 1  # the shard's first file fits, its second does not
    try:
        with pytest.raises(OutputError, match="No space left on device"):
            run_end(spec_at(url), 4, {"s0": range(2)})
    finally:
        FullFS.room = 10**9
    fs, root = fsspec.core.url_to_fs(url)
    assert fs.find(root) == []


# --- a real small filesystem --------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int) -> None:
    """A file that takes the disk's free space but `leave` bytes."""
    free = shutil.disk_usage(disk).free
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def used_by(disk: Path, make) -> int:
    """The disk's bytes that make() takes (tmpfs counts whole pages), given back after."""
    before = shutil.disk_usage(disk).used
    out = make()
    taken = shutil.disk_usage(disk).used - before
    shutil.rmtree(out)
    return taken


def test_on_a_full_tmpfs_at_several_levels_of_free_space(replacing, tmp_path):
    """A 3 MB tmpfs, filled to leave from nothing to more than a run needs (levels measured
    on it: half the shards, the shards and half the final files, four runs' worth). A rerun
    over a complete set ends with the new set, or with one line and the earlier set whole,
    named by its run.json with the failure recorded (or, with no byte for that either, its
    run.json as it was). A first run on a fresh path ends with a set, or with one line and:
    nothing at all (no room for its first shard), its finished shards and no final file, or
    run.json `none` recording the failure."""
    base, first, _, _ = replacing
    shards = {"s0": range(2), "s1": range(2, 4)}
    with tmpfs(tmp_path / "disk", "3m") as disk:

        def shards_only() -> Path:
            with OutputDir.for_spec(spec_at(str(disk / "m")), echo=QUIET) as outdir:
                for shard_id, at in shards.items():
                    _write(outdir, shard_id, [_prompts(4)[i] for i in at], candidates=2)
            return disk / "m"

        some = used_by(disk, shards_only)
        every = used_by(disk, lambda: run_end(spec_at(str(disk / "m")), 4, shards) and
                        disk / "m")
        fs = fsspec.filesystem("file")
        seen: dict[bool, set[str]] = {False: set(), True: set()}
        for leave in (0, some // 2, (every - some) // 2, some + (every - some) // 2, 4 * every):
            for fresh in (False, True):
                out = disk / f"out-{leave}-{fresh}"
                if not fresh:
                    shutil.copytree(base, out)
                fill(disk, leave)
                try:
                    ended = run_end(spec_at(str(out)), 4 if fresh else 6,
                                    shards if fresh else None)
                    assert says(fs, str(out))["set"] == ended["set"]
                    seen[fresh].add("new set")
                except OutputError as e:
                    assert "\n" not in str(e) and "No space left on device" in str(e)
                    record = says(fs, str(out))
                    if record is None:
                        seen[fresh].add("shards only" if out.exists() else "nothing")
                    elif record["set"]["state"] == "complete":
                        assert record["set"]["id"] == first["set"]["id"]
                        recorded = record["invocations"][-1].get("reason") == str(e)
                        assert recorded or record == json.loads((base / "run.json").read_text())
                        seen[fresh].add("earlier set" + ("" if recorded else ", unrecorded"))
                    else:
                        seen[fresh].add(record["set"]["state"])
                finally:
                    (disk / "filler").unlink()
                    shutil.rmtree(out, ignore_errors=True)
        assert {"earlier set", "new set"} <= seen[False] <= {
            "earlier set", "earlier set, unrecorded", "publishing", "new set"}
        assert {"nothing", "none", "new set"} <= seen[True] <= {
            "nothing", "shards only", "none", "publishing", "new set"}
