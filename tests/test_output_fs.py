"""output.path as an fsspec URL: the directory rules on memory://, and whole runs writing to
memory:// and file:// on a local Ray cluster with the tiny model."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import fsspec
import pytest
from datasets import load_dataset

from specrej_ray.data import dataset
from specrej_ray.data import output as output_module
from specrej_ray.data.output import OutputDir, content_key
from specrej_ray.data.prompts import Prompt
from specrej_ray.distributed.driver import run_job
from specrej_ray.quality.summary import print_summary
from specrej_ray.spec import OutputSpec, validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.test_formats import (
    PROV,
    _result,
    check_trl_language_modeling,
    check_trl_preference,
    check_trl_prompt_completion,
)

PROMPTS = [{"id": f"q{i}", "prompt": f"Say something about {i}."} for i in range(3)]
FORMAT_FILES = {"sft_messages", "sft_prompt_completion", "preference", "top_k"}
QUIET = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def mem_url():
    url = f"memory://specrej-test-{uuid.uuid4().hex[:8]}/out"
    yield url
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://").split("/")[0]
    if fs.exists(f"/{root}"):
        fs.rm(f"/{root}", recursive=True)


# --- the directory rules, through fsspec (no Ray) ---


def _open(url, policy, fingerprint="f1", spec=None):
    return OutputDir.open(url, policy, fingerprint, spec or {}, echo=QUIET)


def test_foreign_directory_is_refused_on_a_url(mem_url):
    out = dataset.locate(mem_url)
    out.fs.pipe_file(out.path("notes.txt"), b"mine")
    with pytest.raises(dataset.OutputError) as e:
        _open(mem_url, "overwrite")
    assert str(e.value).startswith(f"output.path: {mem_url} is a non-empty directory")
    assert out.fs.cat_file(out.path("notes.txt")) == b"mine"
    assert sorted(out.fs.ls(out.root, detail=False)) == [out.path("notes.txt")]  # no lease left


def test_a_file_at_the_url_is_refused(mem_url):
    out = dataset.locate(mem_url)
    out.fs.pipe_file(out.root, b"a file")
    with pytest.raises(dataset.OutputError, match="exists and is not a directory"):
        _open(mem_url, "resume")


def _one_shard(outdir, shard_id="s0", pid="p"):
    outdir.write_shard(shard_id, {pid: content_key(pid, None, [1])}, [], [])


def test_refuse_resume_and_overwrite_on_a_url(mem_url):
    out = dataset.locate(mem_url)
    with _open(mem_url, "refuse", spec={"search": {"alpha": 0.5}}) as first:
        _one_shard(first)
    with pytest.raises(dataset.OutputError, match="already has results"):
        _open(mem_url, "refuse")
    with _open(mem_url, "resume") as again:
        assert list(again.records) == ["s0"]
    with pytest.raises(dataset.OutputError, match=r"changed: search\.alpha"):
        _open(mem_url, "resume", "f2", {"search": {"alpha": 0.7}})
    out.fs.pipe_file(out.path("notes.txt"), b"theirs")  # not listed: never ours
    with _open(mem_url, "overwrite", "f2") as fresh:
        assert fresh.records == {}
        # Nothing is removed until its first write (every input is checked by then).
        assert out.fs.exists(out.path("shards", "s0.json"))
        assert json.loads(out.fs.cat_file(out.path("manifest.json")))["fingerprint"] == "f1"
        _one_shard(fresh, "s1")
    assert out.fs.cat_file(out.path("notes.txt")) == b"theirs"
    assert not out.fs.exists(out.path("shards", "s0.json"))
    assert json.loads(out.fs.cat_file(out.path("manifest.json")))["fingerprint"] == "f2"


def test_writes_leave_no_temporary_files(mem_url):
    out = dataset.locate(mem_url)
    with _open(mem_url, "resume") as outdir:
        outdir.write_run_info({"a": 1})
        _one_shard(outdir)
    names = {p.rsplit("/", 1)[-1] for p in out.fs.find(out.root)}
    assert names == {"manifest.json", "run.json", "s0.best.parquet", "s0.candidates.parquet",
                     "s0.json"}


def test_an_unknown_protocol_is_one_line_naming_output_path():
    with pytest.raises(dataset.OutputError) as e:
        dataset.locate("nosuchproto://bucket/out")
    assert str(e.value).startswith("output.path: cannot open nosuchproto://bucket/out")
    assert "\n" not in str(e.value)


# --- assembly in windows of prompts ---


def _interleaved_shards(url: str) -> tuple[OutputDir, dict[str, dict[str, str]]]:
    """Seven prompts in two shards that alternate, so that every window of two prompts takes
    rows from both; one prompt's candidates are all truncated, one has a rejected candidate."""
    outdir = _open(url, "resume")
    prompts = [Prompt(f"p{i}", f"Question {i}?", "Be brief." if i % 3 else None, i)
               for i in range(7)]
    keys = {p.id: content_key(p.text, p.system, [p.row]) for p in prompts}
    reasons = {3: ["length"] * 4, 5: ["eos", None, "length", "eos"]}
    for shard_id, members in (("a", prompts[0::2]), ("b", prompts[1::2])):
        rows = [dataset.result_rows(p, _result(p.id, [0.1 * p.row, 0.9, 0.5 + p.row, 0.3],
                                                  reasons.get(p.row, ["eos"] * 4)))
                for p in members]
        outdir.write_shard(shard_id, {p.id: keys[p.id] for p in members},
                           [b for b, _ in rows], [c for _, cs in rows for c in cs])
    return outdir, keys


def _files(url: str, names: list[str]) -> dict[str, object]:
    out = dataset.locate(url)
    return {name: dataset.read_table(out, name) if name.endswith(".parquet")
            else out.fs.cat_file(out.path(name)) for name in names}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_assembly_in_windows_equals_one_window(where, tmp_path, mem_url, monkeypatch):
    """Windows of two prompts over shards that interleave: every file (jsonl byte for byte)
    and every filter count as when all prompts are assembled at once."""
    url = str(tmp_path / "out") if where == "local" else mem_url
    output = OutputSpec(path=url, jsonl=True, pairs="best_vs_each",
                        filters={"drop_truncated": True, "min_margin": 0.5})
    outdir, keys = _interleaved_shards(url)
    with outdir:
        whole = outdir.assemble(keys, output, PROV)
        at_once = _files(url, whole.files)
        monkeypatch.setattr(output_module, "WINDOW", 2)
        windowed = outdir.assemble(keys, output, PROV)
    assert (windowed.counts, windowed.filters, windowed.files) == (
        whole.counts, whole.filters, whole.files)
    assert whole.filters["drop_truncated"]["prompts_without_row"]["sft"] == 1  # p3, window 2
    in_windows = _files(url, windowed.files)
    for name in whole.files:
        assert in_windows[name] == at_once[name], name
    assert at_once["best.parquet"].column("id").to_pylist() == list(keys)


# --- whole runs ---



def small_job(tmp, model_dir, url, **output):
    prompts = write_jsonl(tmp / "prompts.jsonl", PROMPTS)
    return tiny_job(
        tmp,
        model_dir,
        prompts,
        generator={"model": str(model_dir), "threads": 1, "sampling": {"max_new_tokens": 8}},
        search={"n": 4, "alpha": 0.5, "schedule": {"tokens": [4]}},
        output={"path": url, **output},
    )


@pytest.mark.ray
def test_a_run_to_memory_writes_every_file_and_reruns_from_shards(
    tmp_path, tiny_lm_dir, ray_cluster, mem_url, capsys
):
    spec = validate_spec(small_job(tmp_path, tiny_lm_dir, mem_url, jsonl=True))
    info = run_job(spec, echo=QUIET)
    out = dataset.locate(mem_url)
    assert not (tmp_path / "out").exists() and not Path("memory:").exists()
    names = {p.rsplit("/", 1)[-1] for p in out.fs.ls(out.root, detail=False)}
    assert {f"{s}.{e}" for s in FORMAT_FILES for e in ("parquet", "jsonl")} <= names
    assert {
        "best.parquet",
        "best.jsonl",
        "candidates.parquet",
        "candidates.jsonl",
        "run.json",
        "errors.jsonl",
        "manifest.json",
        "shards",
    } <= names
    run = json.loads(out.fs.cat_file(out.path("run.json")))
    assert run["filters"] == info["filters"] and set(run["files"]) <= names
    assert run["counts"]["prompts"] == 3 and run["counts"]["candidates"] == 12
    assert run["counts"]["tokens_generated"] == sum(r["tokens_generated"] for r in
                                                    dataset.read_table(out, "best.parquet")
                                                    .to_pylist())
    sft = dataset.read_table(out, "sft_messages.parquet").to_pylist()
    best = dataset.read_table(out, "best.parquet").to_pylist()
    assert [r["id"] for r in sft] == [r["id"] for r in best] == ["q0", "q1", "q2"]
    for s, b in zip(sft, best, strict=True):  # default filters never drop the best here
        assert s["messages"] == b["messages"] and s["reward"] == b["reward"]
        assert s["fingerprint"] == b["fingerprint"] == spec.fingerprint()

    print_summary(mem_url, info)
    printed = capsys.readouterr().out
    assert f"dataset: {mem_url}/best.parquet" in printed and "prompts: 3 done" in printed

    # Only formats and filters change: nothing is generated, the formats are re-derived.
    again = validate_spec(
        small_job(
            tmp_path, tiny_lm_dir, mem_url, formats=["top_k"], top_k=2, filters={"min_reward": 1e9}
        )
    )
    info2 = run_job(again, echo=QUIET)
    assert info2["shard_seconds"] == {}
    names = {p.rsplit("/", 1)[-1] for p in out.fs.ls(out.root, detail=False)}
    assert "top_k.parquet" in names and not names & {"preference.parquet", "top_k.jsonl"}
    assert dataset.read_table(out, "top_k.parquet").num_rows == 0
    finished = sum(r["candidates_finished"] for r in best)
    assert info2["filters"]["min_reward"]["candidates_removed"] == finished
    assert info2["filters"]["prompts_without_row"] == {"top_k": 3}
    assert dataset.read_table(out, "best.parquet").to_pylist() == best


@pytest.mark.ray
def test_a_run_to_a_file_url_loads_with_datasets(tmp_path, tiny_lm_dir, ray_cluster):
    target = tmp_path / "file-out"
    spec = validate_spec(
        small_job(
            tmp_path,
            tiny_lm_dir,
            f"file://{target}",
            pairs="best_vs_each",
            filters={"dedupe": False},
        )
    )
    run_job(spec, echo=QUIET)
    assert {p.name for p in target.iterdir()} >= {f"{s}.parquet" for s in FORMAT_FILES}
    assert {p.name for p in target.glob("*.jsonl")} == {"best.jsonl", "errors.jsonl"}
    load = lambda stem: load_dataset(  # noqa: E731
        "parquet", data_files=str(target / f"{stem}.parquet"), split="train"
    )
    for row in load("sft_messages"):
        check_trl_language_modeling(row)
    for row in load("sft_prompt_completion"):
        check_trl_prompt_completion(row)
    cands = load("candidates").to_list()
    pref = load("preference")
    for row in pref:
        check_trl_preference(row)
        assert row["margin"] == pytest.approx(row["chosen_reward"] - row["rejected_reward"])
    for pid in {c["prompt_id"] for c in cands}:
        finished = [c for c in cands if c["prompt_id"] == pid and c["status"] == "finished"]
        pairs = [r for r in pref if r["id"] == pid]
        assert len(pairs) == max(len(finished) - 1, 0)  # best vs each other, none removed
        top = load("top_k").filter(lambda r, pid=pid: r["id"] == pid)
        assert top["rank"] == list(range(1, min(len(finished), 4) + 1))
        assert top["reward"] == sorted(top["reward"], reverse=True)
    for c in cands:  # one entry per reward model, by name (filled by the reward side)
        names = [s["name"] for s in c["component_scores"]]
        assert names == sorted(set(names))
    assert {c["reward_model"] for c in cands} == {spec.reward_label}
