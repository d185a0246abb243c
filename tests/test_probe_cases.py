"""Cases a hostile probe of the build found to hold (issue 31, point 8), kept as tests where
tests/test_output_guard.py and the others did not cover them already: a manifest whose
`files` list names paths outside the output, files outside hard-linked to ours, an
output.path that is itself a link, prompts reached through a linked alias of the output, and
a 2 GB sparse prompt file of NULs.

All of them refuse (or finish) before a model loads or Ray starts, or use OutputDir
directly, so none needs a cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from specrej_ray.data import dataset
from specrej_ray.data.output import OutputDir, check_output
from specrej_ray.data.output_guard import inside, remove_owned, survey
from specrej_ray.data.prompts import Prompt, RowProblem
from specrej_ray.spec import OutputSpec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli
from tests.test_output_guard import (
    PROV,
    QUIET,
    finished_output,
    keys_of,
    shard_rows,
    snapshot,
)

# finished_output's two prompts, and a third that only a rerun has.
PROMPTS = [Prompt(f"p{i}", f"Question {i}?", None, i + 1) for i in range(3)]


def rerun(out: Path, policy: str, fingerprint: str) -> None:
    """What a second run writes, as it writes it: a new shard of all three prompts, the
    assembled files, errors.jsonl and run.json (each different from the first run's)."""
    keys = keys_of(PROMPTS)
    best, cands = shard_rows(PROMPTS, "another answer to", score=0.5)
    with OutputDir.open(str(out), policy, fingerprint, {}, echo=QUIET) as outdir:
        outdir.resume(keys)
        outdir.write_shard("s1", keys, best, cands)
        outdir.assemble(keys, OutputSpec(path=str(out)), PROV)
        outdir.write_errors("p.jsonl", [RowProblem(9, "q", "prompt is empty")], [])
        outdir.write_run_info({"fingerprint": fingerprint, "rerun": True})


def outside(tmp_path: Path, out: Path) -> dict[str, tuple]:
    """Everything under tmp_path but the output folder itself (links not followed)."""
    name = out.relative_to(tmp_path).parts[0]
    return {k: v for k, v in snapshot(tmp_path).items()
            if k != name and not k.startswith(f"{name}/")}


def one_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    assert lines[0].startswith("specrej-ray: error: ") and "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def job(tmp_path, tiny_lm_dir):
    """Write a spec on the tiny model (output tmp_path/out unless given) and return its path."""

    def make(prompts: Path | None = None, output: Path | None = None) -> Path:
        prompts = prompts or write_jsonl(tmp_path / "p.jsonl",
                                         [{"id": "a", "prompt": "Say hello."}])
        spec = tiny_job(tmp_path, tiny_lm_dir, prompts)
        if output is not None:
            spec["output"] = {"path": str(output)}
        return write_job(tmp_path / "job.yaml", spec)

    return make


# --- 1: a manifest's `files` list is only ever names inside the output ---

HOSTILE = ["..", ".", "", "/", "../victim", "../victims", "../victims/one.txt",
           "shards/../../victim", "./../victim"]


def hostile_output(tmp_path: Path) -> Path:
    """An output of ours whose manifest lists paths outside it, beside files there."""
    out = finished_output(tmp_path / "out")
    (tmp_path / "victim").write_text("keep me")
    (tmp_path / "victims").mkdir()
    (tmp_path / "victims" / "one.txt").write_text("keep me too")
    (tmp_path / "abs").mkdir()
    (tmp_path / "abs" / "victim").write_text("absolute")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] += [*HOSTILE, str(tmp_path / "abs" / "victim"), str(tmp_path / "abs"),
                          str(tmp_path)]
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_hostile_files_list_is_not_owned(tmp_path):
    """Only names the output holds at its top count as ours, whatever the list says."""
    out = hostile_output(tmp_path)
    found = survey(dataset.locate(str(out)))
    assert found.manifest is not None  # ours: the list is the one --overwrite follows
    assert found.owned() == {p.name for p in out.iterdir()}


@pytest.mark.parametrize("name", ["../victim", "../victims", "shards/../../victim",
                                  "./../victim"])
def test_removal_refuses_a_name_that_leads_outside(tmp_path, name):
    """The second guard: remove_owned checks each path's folder lies inside the output
    (real paths), so a name that got past the first still removes nothing outside."""
    out = hostile_output(tmp_path)
    location = dataset.locate(str(out))
    before = outside(tmp_path, out)
    with pytest.raises(dataset.OutputError, match="lies outside") as e:
        inside(location, location.path(name))
    assert "\n" not in str(e.value)
    with pytest.raises(dataset.OutputError, match="lies outside"):
        remove_owned(location, {name})
    assert outside(tmp_path, out) == before


def test_overwrite_of_a_hostile_manifest_removes_nothing_outside(tmp_path):
    """`run --overwrite` (OutputDir with if_exists overwrite, removing at its first write)
    removes the output's own names and leaves every file outside as it was."""
    out = hostile_output(tmp_path)
    (out / "notes.txt").write_text("the user's")  # not listed: stays
    before = outside(tmp_path, out)
    with OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert outside(tmp_path, out) == before
    assert (tmp_path / "victim").read_text() == "keep me"
    assert {p.name for p in out.iterdir()} == {"manifest.json", "shards", "notes.txt"}
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == "f2"


# --- 2: a file outside hard-linked to one of ours keeps its bytes ---

LINKED = ["best.parquet", "candidates.parquet", "errors.jsonl", "run.json", "manifest.json",
          "shards/s0.best.parquet", "shards/s0.json"]


@pytest.mark.parametrize(("policy", "fingerprint"), [("resume", "f1"), ("overwrite", "f2")])
def test_a_rerun_never_writes_through_a_hard_link(tmp_path, policy, fingerprint):
    """Every file is written under a temp name and renamed over ours (or ours is removed
    first), so a hard link from outside keeps the old bytes, never the new ones."""
    out = finished_output(tmp_path / "out")
    keep = tmp_path / "backup"
    keep.mkdir()
    for name in LINKED:
        os.link(out / name, keep / name.replace("/", "_"))
    before = snapshot(keep)
    old_best = (out / "best.parquet").read_bytes()
    rerun(out, policy, fingerprint)
    assert snapshot(keep) == before
    assert (out / "best.parquet").read_bytes() != old_best  # the rerun did rewrite it
    for name in ("best.parquet", "candidates.parquet", "errors.jsonl", "run.json"):
        assert (out / name).stat().st_nlink == 1, name  # a new file, not the linked one


def test_a_hard_linked_lock_file_is_not_written_through(tmp_path):
    """A .specrej-lock in the output hard-linked to a file outside: taking the output must
    not truncate and rewrite the outside file (it did: O_NOFOLLOW stops symbolic links
    only; the owner's JSON is now written to a new file renamed over the name)."""
    out = finished_output(tmp_path / "out")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, out / ".specrej-lock")
    try:
        with OutputDir.open(str(out), "resume", "f1", {}, echo=QUIET):
            pass
    except dataset.OutputError:
        pass  # a refusal is as good, as long as the file is left alone
    assert victim.read_text() == "precious"


# --- 3: an output.path that is itself a link ---


def test_an_output_path_linked_to_an_output_is_followed_and_only_its_target_written(tmp_path):
    """The link is followed (only links *inside* the output are refused): a resume and an
    --overwrite through it write and remove in the target alone, and the link stays."""
    out = finished_output(tmp_path / "out")
    alias = tmp_path / "alias"
    alias.symlink_to(out)
    (tmp_path / "neighbour.txt").write_text("mine")
    before = outside(tmp_path, out)
    check_output(str(alias))
    with OutputDir.open(str(alias), "resume", "f1", {}, echo=QUIET) as outdir:
        assert set(outdir.records) == {"s0"}  # the target's results, found through the link
        outdir.write_run_info({"fingerprint": "f1", "via": "alias"})
    assert json.loads((out / "run.json").read_text())["via"] == "alias"
    with OutputDir.open(str(alias), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert {p.name for p in out.iterdir()} == {"manifest.json", "shards"}
    assert outside(tmp_path, out) == before  # the link included: still a link to out
    assert os.readlink(alias) == str(out)


@pytest.mark.parametrize("target", ["foreign", "file", "dangling"])
def test_an_output_path_linked_to_what_a_run_must_not_use_is_one_line(tmp_path, job, target):
    """A link to a folder of the user's, to a file or to nothing: `run` refuses in one line
    and neither the link nor its target changes (a dangling link is not made a folder)."""
    alias = tmp_path / "alias"
    if target == "foreign":
        (tmp_path / "theirs").mkdir()
        (tmp_path / "theirs" / "thesis.tex").write_text("precious")
        alias.symlink_to(tmp_path / "theirs")
    elif target == "file":
        (tmp_path / "theirs.txt").write_text("precious")
        alias.symlink_to(tmp_path / "theirs.txt")
    else:
        alias.symlink_to(tmp_path / "nowhere")
    path = job(output=alias)
    before = snapshot(tmp_path)
    line = one_line(cli("run", path))
    assert line.startswith("specrej-ray: error: output.path: ") and str(alias) in line
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "nowhere").exists()


# --- 4: prompts inside the output, reached through a linked alias ---


@pytest.mark.parametrize("linked", ["prompts", "output"])
@pytest.mark.parametrize("command", ["validate", "run", "run --overwrite"])
def test_prompts_inside_the_output_through_a_link_are_refused(tmp_path, job, command, linked):
    """check_prompts_outside compares real paths: a prompt file inside the output is
    refused whether the prompts' path or output.path goes through a linked folder."""
    out = finished_output(tmp_path / "out")
    (out / "best.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    view = tmp_path / "view"
    view.symlink_to(out)
    if linked == "prompts":
        path = job(prompts=view / "best.jsonl")
    else:
        path = job(prompts=out / "best.jsonl", output=view)
    before = snapshot(tmp_path)
    line = one_line(cli(*command.split(), path))
    assert "prompts.path:" in line and "is inside output.path" in line
    assert snapshot(tmp_path) == before


# --- 5: a 2 GB sparse file of NULs as prompts ---


class PeakRss:
    """This process's resident memory, sampled every 20 ms while the block runs."""

    def __enter__(self) -> PeakRss:
        self.proc, self.start = psutil.Process(), psutil.Process().memory_info().rss
        self.peak, self._stop = self.start, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> int:
        return (self.peak - self.start) >> 20


@pytest.mark.slow  # reads past 2 GB of NULs (from the page cache: no disk), twice
def test_a_2gb_sparse_nul_prompt_file_is_refused_without_holding_it(tmp_path, job):
    """The file is one 2 GB "line": streamed 1 MiB at a time and skipped as too long, so
    `run` and `validate` refuse in the same line (exit 2, nothing written); the
    process never holds the file (its memory grows by far less than 2 GB)."""
    prompts = tmp_path / "p.jsonl"
    with open(prompts, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    path = job(prompts=prompts)
    started = time.monotonic()
    with PeakRss() as rss:
        done = cli("run", path)
    seconds = time.monotonic() - started
    line = one_line(done)
    assert "all 1 row(s)" in line and "row 1: line is over the 1 MiB limit" in line
    out = tmp_path / "out"
    assert not out.exists()  # a run that finishes no prompt on a fresh path leaves nothing
    with PeakRss() as rss_validate:
        done = cli("validate", path)
    assert one_line(done) == line  # validate refuses as run does, before torch (issue 44)
    growth = max(rss.growth_mib, rss_validate.growth_mib)
    print(f"2 GB NUL prompts: run refused in {seconds:.1f} s, peak RSS growth {growth} MiB")
    assert growth < 1024
