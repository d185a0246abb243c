"""What a run may touch at output.path (issue 24): an output is ours only by its manifest,
--overwrite checks every input before it removes anything and removes only what the manifest
lists, no link is followed, and a refused run leaves the directory exactly as it was.

Each test is a case found by trying the CLI as a hostile user would; they run `run` in this
process and refuse before any model loads or Ray starts, so they need no cluster.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from specrej_ray.cli import main
from specrej_ray.data import dataset
from specrej_ray.data.output import OutputDir, check_output, content_key
from specrej_ray.data.prompts import Prompt
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.spec import OutputSpec
from tests.conftest import tiny_job, write_job, write_jsonl

QUIET = lambda *a, **k: None  # noqa: E731
PROV = {"generator": "g", "reward_model": "r", "fingerprint": "f1"}


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root, links not followed: kind and bytes (or the link's target)."""
    if not os.path.lexists(root):
        return {}
    found: dict[str, tuple] = {".": ("dir",)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                found[rel] = ("dir",)
            else:
                found[rel] = ("file", path.read_bytes())
        dirs[:] = [d for d in dirs if not (Path(folder) / d).is_symlink()]
    return found


def keys_of(prompts: list[Prompt]) -> dict[str, str]:
    return {p.id: content_key(p.text, p.system, [len(p.text)]) for p in prompts}


def shard_rows(prompts: list[Prompt], answer: str,
               score: float = 1.0) -> tuple[list[dict], list[dict]]:
    """One finished candidate a prompt, its text `answer` + the prompt."""
    best, cands = [], []
    for p in prompts:
        cand = Candidate(0, tokens=[1, 2], status=Status.FINISHED, finish_reason="eos",
                         final_score=score, text=f"{answer} {p.text}")
        b, c = dataset.result_rows(p, PromptResult(p.id, [cand], 0, n0=1, waves=1, rounds=0,
                                                   prompt_tokens=3, seconds=0.0,
                                                   score_seconds=0.0))
        best.append(b)
        cands += c
    return best, cands


def finished_output(out: Path, fingerprint: str = "f1") -> Path:
    """An output of ours with two prompts' results, written as a run writes it (no model)."""
    prompts = [Prompt(f"p{i}", f"Question {i}?", None, i + 1) for i in range(2)]
    keys = keys_of(prompts)
    best, cands = shard_rows(prompts, "answer to")
    with OutputDir.open(str(out), "resume", fingerprint, {}, echo=QUIET) as outdir:
        outdir.resume(keys)
        outdir.write_shard("s0", keys, best, cands)
        outdir.assemble(keys, OutputSpec(path=str(out)), PROV)
        outdir.write_errors("p.jsonl", [], [])
        outdir.write_run_info({"fingerprint": fingerprint})
    return out


@pytest.fixture
def job(tmp_path, tiny_lm_dir):
    """A spec on the tiny model whose output is tmp_path/out; `run` it with extra args."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Say hello."}])
    path = write_job(tmp_path / "job.yaml", tiny_job(tmp_path, tiny_lm_dir, prompts))

    def run(*args: str) -> int:
        return main(["run", str(path), *args])

    return run


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specrej-ray: error: "), err
    return err[0]


# --- case 1: --overwrite checks every input before it removes anything ---


@pytest.mark.parametrize("bad", ["generator.model", "every row", "prompts inside"])
def test_overwrite_with_a_bad_input_leaves_the_dataset_whole(tmp_path, job, capsys, bad):
    out = finished_output(tmp_path / "out")
    (out / "report.html").write_text("<html>the report</html>")
    before = snapshot(out)
    if bad == "generator.model":
        args = ["--set", f"generator.model={tmp_path / 'typo'}"]
    elif bad == "every row":
        rows = write_jsonl(tmp_path / "bad.jsonl", [{"id": "x", "prompt": "  "}])
        args = ["--set", f"prompts.path={rows}"]
    else:
        (out / "best.jsonl").write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
        before = snapshot(out)
        args = ["--set", f"prompts.path={out / 'best.jsonl'}"]
    assert job("--overwrite", *args) == 2
    _one_line(capsys)
    assert snapshot(out) == before


def test_overwrite_removes_only_what_the_manifest_lists(tmp_path):
    out = finished_output(tmp_path / "out")
    (out / "notes.txt").write_text("mine")  # a user's file beside our results
    (out / "shards" / "mydata.txt").write_text("mine too")
    with OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        assert (out / "best.parquet").exists()  # nothing removed before the first write
        outdir.write_shard("s1", {}, [], [])
    assert {p.name for p in out.iterdir()} == {"manifest.json", "shards", "notes.txt"}
    assert sorted(p.name for p in (out / "shards").iterdir()) == [
        "mydata.txt", "s1.best.parquet", "s1.candidates.parquet", "s1.json"]
    from specrej_ray.data.output_guard import FORMAT, LAYOUT

    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["format"], manifest["layout"], manifest["fingerprint"]) == (FORMAT, LAYOUT,
                                                                                "f2")


def test_the_manifest_lists_every_name_before_it_is_written_and_the_report_too(tmp_path):
    out = finished_output(tmp_path / "out")
    files = set(json.loads((out / "manifest.json").read_text())["files"])
    assert files == {p.name for p in out.iterdir()} - {"report.html"}
    from specrej_ray.data.output_guard import write_report

    write_report(dataset.locate(str(out)), "<html>a report of the data below</html>")
    assert "report.html" in json.loads((out / "manifest.json").read_text())["files"]
    with OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert not (out / "report.html").exists()  # it described data that is gone


def test_an_output_of_before_the_files_list_resumes_and_owns_what_it_could_have_written(
        tmp_path):
    out = finished_output(tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    legacy = {k: manifest[k] for k in ("layout", "fingerprint", "spec")}  # as written then
    (out / "manifest.json").write_text(json.dumps(legacy))
    (out / "report.html").write_text("old report")
    (out / "notes.txt").write_text("mine")
    with OutputDir.open(str(out), "resume", "f1", {}, echo=QUIET) as outdir:
        assert outdir.records.keys() == {"s0"}
    with OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert {p.name for p in out.iterdir()} == {"manifest.json", "shards", "notes.txt"}


# --- case 2 and 3: a directory is ours only by its manifest ---


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("theirs", [
    {"notes.txt": "x", "run.json": '{"mine": 1}', "shards/mydata.txt": "data",
     "errors.jsonl": '{"e": 1}'},
    {"index.html": "<html>", "manifest.json": '{"name": "web"}', "src/app.js": "1;"},
    {"manifest.json": "{not json", "best.parquet": "x"},  # torn, and no shard record of ours
])
def test_a_directory_that_is_not_ours_is_refused_and_left_as_it_was(tmp_path, job, capsys,
                                                                   theirs, overwrite):
    out = tmp_path / "out"
    for name, text in theirs.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    before = snapshot(out)
    assert job(*(["--overwrite"] if overwrite else [])) == 2
    line = _one_line(capsys)
    assert "did not write" in line and "--overwrite" not in line
    assert snapshot(out) == before  # no lock file either


def test_a_refused_run_on_an_empty_directory_leaves_it_empty(tmp_path, job, capsys):
    (tmp_path / "out").mkdir()
    assert job("--set", f"generator.model={tmp_path / 'typo'}") == 2
    assert list((tmp_path / "out").iterdir()) == []
    assert job("--set", f"generator.model={tmp_path / 'typo'}") == 2
    assert list((tmp_path / "out").iterdir()) == []


def test_a_refused_run_does_not_leave_the_directory_it_made(tmp_path, job, capsys):
    assert job("--set", f"generator.model={tmp_path / 'typo'}") == 2
    assert not (tmp_path / "out").exists()


# --- cases 4 and 5: no link followed, no file where a folder belongs ---


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("where", ["shards", "best.parquet", "shards/s0.json", "notes"])
def test_a_link_inside_the_output_is_refused_and_its_target_untouched(tmp_path, job, capsys,
                                                                       where, overwrite):
    out = finished_output(tmp_path / "out")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "important.txt").write_text("keep")
    link = out / where
    if where == "shards":
        for f in link.iterdir():
            f.unlink()
        link.rmdir()
    elif link.exists():
        link.unlink()
    link.symlink_to(target if where in ("shards", "notes") else target / "important.txt")
    before, outside = snapshot(out), snapshot(target)
    assert job(*(["--overwrite"] if overwrite else [])) == 2
    line = _one_line(capsys)
    assert f"{out / where} is a symbolic link" in line
    assert snapshot(out) == before and snapshot(target) == outside


@pytest.mark.parametrize("where", ["/proc/1", "a folder of the user's"])
def test_a_folder_not_ours_is_called_so_whatever_links_it_holds(tmp_path, where):
    """output.path=/proc/1 said `/proc/1/cwd is a symbolic link`: true, and beside the
    point. A kernel's folder is refused as one; a user's folder that is not ours is refused
    as not ours, its links unread."""
    if where == "/proc/1":
        if not os.path.isdir(where):
            pytest.skip("no /proc here")
        out = where
        expected = (f"output.path: cannot write to {out}: {out} is on the kernel's proc "
                    "filesystem, which holds no files of a user; choose another location")
    else:
        out = str(tmp_path / "theirs")
        os.mkdir(out)
        os.symlink(tmp_path, os.path.join(out, "a-link"))
        expected = (f"output.path: {out} is a non-empty directory that specrej-ray did not "
                    "write (it has no manifest.json of specrej-ray's); choose a new or empty "
                    "path")
    with pytest.raises(dataset.OutputError) as e:
        check_output(out)
    assert str(e.value) == expected


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_named_shards_is_one_line_and_kept(tmp_path, job, capsys, overwrite):
    out = finished_output(tmp_path / "out")
    for f in (out / "shards").iterdir():
        f.unlink()
    (out / "shards").rmdir()
    (out / "shards").write_text("a file of the user's")
    before = snapshot(out)
    assert job(*(["--overwrite"] if overwrite else [])) == 2
    assert "shards is a file, where specrej-ray keeps its shards folder" in _one_line(capsys)
    assert snapshot(out) == before


def test_a_folder_where_a_file_of_ours_belongs_is_refused(tmp_path):
    out = finished_output(tmp_path / "out")
    (out / "best.parquet").unlink()
    (out / "best.parquet").mkdir()
    from specrej_ray.data.output_guard import survey

    with pytest.raises(dataset.OutputError, match="best.parquet is a folder, where"):
        survey(dataset.locate(str(out)))


@pytest.mark.parametrize("goes", ["shards", "best.parquet", "shards/s0.json"])
def test_a_name_removed_while_the_output_is_surveyed_is_not_refused(tmp_path, monkeypatch,
                                                                    goes):
    """Another run's --overwrite removes a name between the survey's listing and its look at
    the name: what is gone is not refused (a racing writer once called shards/ a file)."""
    from specrej_ray.data import output_guard

    out = finished_output(tmp_path / "out")
    (out / "shards" / "s0.json").write_text("{}")
    kind = output_guard._kind

    def removed_before_the_look(entry: os.DirEntry) -> str:
        if Path(entry.path) == out / goes:
            shutil.rmtree(entry.path) if entry.is_dir() else os.unlink(entry.path)
        return kind(entry)

    monkeypatch.setattr(output_guard, "_kind", removed_before_the_look)
    output_guard.survey(dataset.locate(str(out)))
    assert not (out / goes).exists()


def test_leftovers_go_at_the_first_write_and_only_names_of_ours(tmp_path):
    out = finished_output(tmp_path / "out")
    (out / "shards" / "mydata.txt").write_text("mine")
    (out / "shards" / ".s9.json.tmp-1-abc").write_text("half")
    before = snapshot(out)
    with OutputDir.open(str(out), "resume", "f1", {}, echo=QUIET):
        pass  # a run refused (or stopped) before it writes changes nothing
    assert snapshot(out) == before
    with OutputDir.open(str(out), "resume", "f1", {}, echo=QUIET) as outdir:
        outdir.write_run_info({"fingerprint": "f1"})
    assert (out / "shards" / "mydata.txt").read_text() == "mine"
    assert not (out / "shards" / ".s9.json.tmp-1-abc").exists()


def test_an_overwrite_cut_short_while_removing_keeps_the_old_names_listed(tmp_path,
                                                                        monkeypatch):
    """The new manifest lists the earlier names until they are gone: a removal that fails
    half way (a store error, a kill) leaves them for the next --overwrite, never unowned."""
    import specrej_ray.data.output as output_module
    from specrej_ray.data.output_guard import remove_owned

    out = finished_output(tmp_path / "out")
    old = {p.name for p in out.iterdir()}

    def half(location, names):
        remove_owned(location, {"best.parquet"})
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(output_module, "remove_owned", half)
    with pytest.raises(dataset.OutputError, match="cannot write the earlier results") as e, \
            OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert "\n" not in str(e.value)
    listed = set(json.loads((out / "manifest.json").read_text())["files"])
    assert old - {"best.parquet"} <= listed
    monkeypatch.undo()
    with OutputDir.open(str(out), "overwrite", "f2", {}, echo=QUIET) as outdir:
        outdir.write_shard("s1", {}, [], [])
    assert {p.name for p in out.iterdir()} == {"manifest.json", "shards"}


@pytest.mark.parametrize("name", [".specrej-lock", "report.html"])
def test_report_never_writes_through_a_link(tmp_path, name):
    from specrej_ray.data.output_guard import write_report

    out = finished_output(tmp_path / "out")
    victim = tmp_path / "victim.txt"
    victim.write_text("theirs")
    (out / name).symlink_to(victim)
    with pytest.raises(dataset.OutputError, match=f"{name} is a symbolic link"):
        write_report(dataset.locate(str(out)), "<html></html>")
    assert victim.read_text() == "theirs" and (out / name).is_symlink()


# --- issue 44: where an output may be, and who holds it, told by validate as by run ---


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("where", ["shards/nested", "nested", "deeper/still/nested"])
def test_an_output_inside_another_is_refused_before_anything_is_written(tmp_path, job, capsys,
                                                                         command, where):
    """output.path in a finished output's shards/ (which it made unresumable) or anywhere
    below that output: one line, and both outputs are left as they were."""
    out = finished_output(tmp_path / "theirs")
    before = snapshot(out)
    args = ["--set", f"output.path={out / where}"]
    code = job(*args) if command == "run" else main(["validate", str(tmp_path / "job.yaml"),
                                                     *args])
    assert code == 2
    assert _one_line(capsys) == (f"specrej-ray: error: output.path: {out / where} is inside "
                                 f"{out}, the output of another specrej-ray run; choose a "
                                 "path outside it")
    assert snapshot(out) == before


def test_an_output_holding_another_in_a_folder_is_refused(tmp_path, job, capsys):
    """Around: an output of ours with another output in a top-level folder (one made there
    before the check existed). A foreign folder holding an output is refused by the guard."""
    out = finished_output(tmp_path / "out", fingerprint="other")
    inner = out / "inner"
    shutil.copytree(finished_output(tmp_path / "elsewhere"), inner)
    assert job() == 2
    assert _one_line(capsys) == (f"specrej-ray: error: output.path: {tmp_path / 'out'} holds "
                                 f"another specrej-ray output in {tmp_path / 'out'}/inner; "
                                 "move that one out first, or choose another output.path")
    around = tmp_path / "around"
    shutil.copytree(finished_output(tmp_path / "x"), around / "a" / "b")
    assert job("--set", f"output.path={around}") == 2
    assert "is a non-empty directory that specrej-ray did not write" in _one_line(capsys)


def test_an_output_inside_another_on_an_object_store_is_refused():
    from specrej_ray.data.output import check_output
    from specrej_ray.data.output_place import check_not_nested

    url = "memory://nest-test/finished"
    with OutputDir.open(url, "resume", "f1", {}, echo=QUIET) as outdir:
        outdir.resume({})
        outdir.write_run_info({"fingerprint": "f1"})  # its manifest goes first
    check_output("memory://nest-test/beside")
    for inner in (f"{url}/shards/nested", f"{url}/a/b"):
        with pytest.raises(dataset.OutputError, match=f"^output.path: {inner} is inside "
                           f"{url}, the output of another specrej-ray run"):
            check_not_nested(dataset.locate(inner))


@pytest.mark.parametrize("path", ["/proc/specrej-test/out", "/sys/specrej-test"])
def test_a_path_on_a_kernel_filesystem_is_refused_by_validate_as_by_run(tmp_path, job, capsys,
                                                                       path):
    """As root, the permission check lets /proc and /sys through, and the run's mkdir fails."""
    if not os.path.isdir("/" + path.split("/")[1]):
        pytest.skip("no such kernel filesystem here")
    lines = []
    for command in ("validate", "run"):
        assert main([command, str(tmp_path / "job.yaml"), "--set", f"output.path={path}"]) == 2
        lines.append(_one_line(capsys))
    assert lines[0] == lines[1]
    assert f"output.path: cannot create {path}: /" in lines[0]
    assert "kernel's" in lines[0]


def test_validate_names_the_run_that_holds_the_output(tmp_path, job, capsys):
    from specrej_ray.data.output_lock import take_lock

    out = finished_output(tmp_path / "out")
    with take_lock(dataset.locate(str(out)), "the-other-run"):
        lines = []
        for command in ("validate", "run"):
            assert main([command, str(tmp_path / "job.yaml"), "--set",
                         "output.if_exists=resume"]) == 2
            lines.append(_one_line(capsys))
    assert lines[0] == lines[1]
    assert lines[0].startswith(f"specrej-ray: error: output.path: {out} is in use by pid "
                               f"{os.getpid()} on ")
    assert "('the-other-run')" in lines[0]
    assert main(["validate", str(tmp_path / "job.yaml"), "--set", "output.if_exists=resume",
                 "--set", "name=x"]) == 2  # free again: now its other spec is what is wrong
    assert "holds results of a different spec" in _one_line(capsys)


def test_a_lease_on_an_object_store_is_read_not_taken():
    from specrej_ray.data.output_lock import OutputInUse, check_free, take_lock

    out = dataset.locate("memory://held-test/out")
    out.fs.makedirs(out.root, exist_ok=True)
    check_free(out)  # no lease: free
    held = r"^output.path: memory://held-test/out is in use by pid \d+ on .* \('the-holder'\)"
    with take_lock(out, "the-holder"), pytest.raises(OutputInUse, match=held):
        check_free(out)
    check_free(out)  # released, and the check took nothing: free again
    with take_lock(out, "the-next"):
        pass
