"""A property of `run` on whatever it finds at output.path (issue 24): random directory
contents (user files with our names, links in and out, files where folders belong, a foreign
manifest.json), run with and without --overwrite, with good and bad inputs. Either the run
succeeded into a directory that was ours or empty, or it exited 2 and left the directory as
it was: same names, same bytes. Nothing outside it is touched either way."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrej_ray.cli import main
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.test_output_guard import snapshot

pytestmark = pytest.mark.ray

# (kind, name, content): what a user may have put at output.path.
EXTRAS = [
    ("file", "run.json", '{"mine": 1}'),  # a user file with one of our names
    ("file", "errors.jsonl", "mine\n"),
    ("file", "notes.txt", "mine"),
    ("file", "shards/mydata.txt", "mine"),
    ("file", "manifest.json", '{"name": "web"}'),  # a foreign manifest
    ("file", "shards", "not a folder"),  # a file where our folder belongs
    ("dir", "best.parquet", ""),  # a folder where our file belongs
    ("link-in", "best.jsonl", "notes.txt"),
    ("link-out", "candidates.parquet", "outside/file.txt"),
    ("link-out", "shards", "outside/dir"),
    ("link-out", "data", "outside/dir"),
]
# Extras after which the directory is no longer one a run may use.
REFUSED = {("file", "manifest.json"), ("file", "shards"), ("dir", "best.parquet")} | {
    (kind, name) for kind, name, _ in EXTRAS if kind.startswith("link")}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_lm_dir, ray_cluster):
    """A good spec and the output a run of it wrote (copied in as an output of ours)."""
    tmp = tmp_path_factory.mktemp("prop")
    prompts = write_jsonl(tmp / "p.jsonl", [{"id": "a", "prompt": "Say hello."},
                                            {"id": "b", "prompt": "Count to three."}])
    job = tiny_job(tmp, tiny_lm_dir, prompts, search={"n": 2, "alpha": 0.5,
                                                       "schedule": {"tokens": [4]}})
    job["generator"]["sampling"]["max_new_tokens"] = 6
    write_jsonl(tmp / "bad.jsonl", [{"id": "x", "prompt": "  "}])
    assert main(["run", str(write_job(tmp / "job.yaml", job))]) == 0
    return tmp, job


def _lay_out(root: Path, base: str, extras: list[tuple[str, str, str]], template: Path,
             outside: Path) -> None:
    if base == "ours":
        shutil.copytree(template, root)
    elif base != "missing":
        root.mkdir()
        if base == "foreign":
            (root / "index.html").write_text("<html>")
    for kind, name, content in extras:
        path = root / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if kind == "file":
            path.write_text(content)
        elif kind == "dir":
            path.mkdir()
        elif kind == "link-in":
            path.symlink_to(root / content)
        else:
            path.symlink_to(outside / content.removeprefix("outside/"))


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(base=st.sampled_from(["missing", "empty", "ours", "foreign"]),
       extras=st.lists(st.sampled_from(EXTRAS), max_size=3, unique_by=lambda e: e[1]),
       inputs=st.sampled_from(["good", "bad model", "bad rows", "prompts inside"]),
       overwrite=st.booleans())
def test_a_run_either_uses_an_empty_or_own_directory_or_leaves_it_as_it_was(
        world, tmp_path_factory, capsys, base, extras, inputs, overwrite):
    tmp, job = world
    case = tmp_path_factory.mktemp("case")
    outside = case / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "keep.txt").write_text("theirs")
    (outside / "file.txt").write_text("theirs")
    out = case / "out"
    _lay_out(out, base, extras, tmp / "out", outside)
    before, outside_before = snapshot(out), snapshot(outside)

    spec = dict(job, output={"path": str(out)})
    if inputs == "bad model":
        spec["generator"] = {**job["generator"], "model": str(case / "typo")}
    elif inputs == "bad rows":
        spec["prompts"] = {**job["prompts"], "path": str(tmp / "bad.jsonl")}
    elif inputs == "prompts inside":
        spec["prompts"] = {**job["prompts"], "path": str(out / "best.jsonl")}
    code = main(["run", str(write_job(case / "job.yaml", spec)),
                 *(["--overwrite"] if overwrite else [])])
    err = capsys.readouterr().err

    assert snapshot(outside) == outside_before
    unowned = base == "foreign" or (base in ("missing", "empty") and extras)  # not empty
    refused = unowned or any((k, n) in REFUSED for k, n, _ in extras)
    if inputs == "good" and not refused:
        assert code == 0, err  # an empty directory or one of ours is used
        for kind, name, content in extras:  # a user's own file beside ours stays
            if kind == "file" and name in ("notes.txt", "shards/mydata.txt"):
                assert (out / name).read_text() == content
        return
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert snapshot(out) == before, err
