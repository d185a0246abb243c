"""The output is a Hugging Face dataset: README.md's configs load with `datasets`, one per
parquet file, the card's body says what made the data, and it is rewritten on resume and
written whole or not at all."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from datasets import Features, get_dataset_config_names, load_dataset

from specrej_ray.data import output as output_module
from specrej_ray.data.card import card_text, configs
from specrej_ray.data.output import OutputDir
from specrej_ray.data.prompts import Prompt
from specrej_ray.distributed.driver import run_job
from specrej_ray.models.identity import weights_sha256
from specrej_ray.spec import OutputSpec, validate_spec
from tests.conftest import tiny_job, write_jsonl
from tests.test_output_dir import PROV, _keys, _open, _prompts, _write

QUIET = dict(echo=lambda *a, **k: None)


def front_matter(path: Path) -> dict:
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_configs_one_per_parquet_file_best_first_and_default():
    files = ["best.parquet", "best.jsonl", "candidates.parquet", "preference.parquet",
             "preference.jsonl", "sft_messages.parquet"]
    got = configs(files)
    assert [c["config_name"] for c in got] == ["best", "sft_messages", "preference",
                                              "candidates"]
    assert [c.get("default", False) for c in got] == [True, False, False, False]
    assert got[2]["data_files"] == [{"split": "train", "path": "preference.parquet"}]


def test_card_body_names_models_settings_counts_audit_and_command():
    info = {"name": "j", "fingerprint": "f" * 16, "files": ["best.parquet"],
            "spec": {"search": {"n": 16, "mode": "sbon", "alpha": 0.5,
                                "schedule": "auto"},
                     "generator": {"sampling": {"temperature": 0.8, "top_p": 0.95,
                                                "max_new_tokens": 96}}},
            "models": {"generator": {"model": "org/gen", "revision": "a" * 40,
                                     "sha256": None},
                       "rewards": [{"model": "/m/rm", "revision": None, "sha256": "b" * 64}]},
            "calibration": {"run_with": {"alpha": 0.7, "tokens": [32]}, "prompts": [1, 2],
                            "reason": "kept 99.5"},
            "counts": {"prompts": 10, "tokens_generated": 900, "tokens_discarded": 100},
            "failed_shards": [{"shard": "s", "prompt_ids": ["x", "y"]}], "skipped": 3,
            "seconds": {"total": 20.0, "shards": 10.0}, "invocations": [{}],
            "seconds_all_invocations": 20.0,
            "audit": {"off": None, "score": 99.2, "low": 98.0, "high": 99.9, "prompts": 7,
                      "scored": 7,
                      "confidence": 0.95, "target": 99.0, "verdict": "kept"},
            "command": "specrej-ray run job.yaml --set search.n=16"}
    text = card_text(info)
    for expected in ("`org/gen` (revision `" + "a" * 40, "`/m/rm` (weights sha256 `" + "b" * 16,
                     "N = 16", "alpha 0.5", "schedule auto chose alpha 0.7, tokens [32]",
                     "10 done, 2 failed, 3 skipped", "100 tokens/s", "99.2 [98.0, 99.9]",
                     "specrej-ray run job.yaml --set search.n=16"):
        assert expected in text, expected


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_lm_dir, ray_cluster):
    tmp = tmp_path_factory.mktemp("card")
    prompts = write_jsonl(tmp / "p.jsonl", [{"id": f"q{i}", "prompt": f"Say {i}."}
                                            for i in range(6)])
    job = tiny_job(tmp, tiny_lm_dir, prompts,
                   output={"path": str(tmp / "out"),
                           "formats": ["sft", "preference", "top_k"]})
    run_job(validate_spec(job), about={"command": "specrej-ray run tiny.yaml"}, **QUIET)
    return tmp, job


@pytest.mark.ray
def test_every_config_loads_with_datasets_with_the_files_rows_and_columns(finished):
    tmp, _ = finished
    out = tmp / "out"
    names = [c["config_name"] for c in front_matter(out / "README.md")["configs"]]
    assert names == ["best", "sft_messages", "sft_prompt_completion", "preference", "top_k",
                     "candidates"]
    assert get_dataset_config_names(str(out)) == names
    for name in names:
        table = pq.read_table(out / f"{name}.parquet")
        ds = load_dataset(str(out), name, split="train")
        assert ds.num_rows == table.num_rows > 0, name
        assert ds.features == Features.from_arrow_schema(table.schema), name
        assert ds.to_list() == table.to_pylist(), name
    default = load_dataset(str(out), split="train")  # no name: the default config, best
    assert default.column_names == pq.read_table(out / "best.parquet").column_names


@pytest.mark.ray
def test_the_card_names_the_models_by_hash_and_the_command(finished, tiny_lm_dir):
    tmp, _ = finished
    text = (tmp / "out" / "README.md").read_text()
    digest = weights_sha256(tiny_lm_dir)
    assert f"`{tiny_lm_dir}` (weights sha256 `{digest[:16]}`)" in text
    assert "specrej-ray run tiny.yaml" in text
    info = json.loads((tmp / "out" / "run.json").read_text())
    assert info["models"]["generator"]["sha256"] == digest
    assert "README.md" in json.loads((tmp / "out" / "manifest.json").read_text())["files"]


@pytest.mark.ray
def test_the_card_is_rewritten_on_resume(finished):
    tmp, job = finished
    write_jsonl(tmp / "p.jsonl", [{"id": f"q{i}", "prompt": f"Say {i}."} for i in range(8)])
    run_job(validate_spec(job), **QUIET)
    assert "- prompts: 8 done" in (tmp / "out" / "README.md").read_text()
    assert load_dataset(str(tmp / "out"), split="train").num_rows == 8


def test_the_card_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    spec = {"format": "x"}
    with OutputDir.open(str(tmp_path / "o"), "resume", "f" * 16, spec) as out:
        out.write_run_info({"files": []})
        pipe = out.out.fs.pipe_file

        def torn(path, data, **kw):  # the card only: the manifest is written around it
            if ".README.md." not in path:
                return pipe(path, data, **kw)
            Path(path).write_bytes(data[:5])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(out.out.fs, "pipe_file", torn)
        with pytest.raises(Exception, match="No space left"):
            out.write_card("---\nconfigs: []\n---\n# a card\n")
    left = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert "README.md" not in left
    assert not [n for n in left if "tmp" in n], left


# --- every config on the card loads (outputs made as run_job makes them, without Ray) ---

FORMATS = ["sft", "preference", "top_k"]
Shards = list[tuple[list[Prompt], int]]  # each shard's prompts, and candidates per prompt


def finish(outdir: OutputDir, current: list[Prompt], echo=QUIET["echo"]) -> dict:
    """What run_job does at the end (job/finish.py): the files for `current` and the card
    staged, then published as one set with run.json."""
    spec = OutputSpec(path=outdir.out.root, formats=FORMATS)
    with outdir.staging() as final:
        made = outdir.assemble(_keys(current), spec, PROV, into=final)
        info = {"name": "t", "files": made.files}
        outdir.write_card(card_text(info, outdir.table_stats(made.files, final)), echo=echo,
                          into=final)
        return outdir.publish(final, lambda listing: {**info, "set": listing})


def made(out: Path, shards: Shards, current: list[Prompt], echo=QUIET["echo"]) -> Path:
    """An output whose shards hold `shards`, finished for the prompts `current`."""
    with _open(out) as outdir:
        for i, (prompts, candidates) in enumerate(shards):
            _write(outdir, f"s{i}", prompts, candidates=candidates)
    with _open(out) as outdir:
        finish(outdir, current, echo)
    return out


PROMPTS = _prompts(6)
OUTPUTS = {  # case -> (shards, the run's prompts)
    "finished": ([(PROMPTS, 2)], PROMPTS),
    # a SIGTERM after 4 prompts of 10, each with one finished candidate: no pair
    "stopped after a few prompts": ([(PROMPTS[:4], 1)], _prompts(10)),
    "no preference pair": ([(PROMPTS, 1)], PROMPTS),
    # the pairs come only after the first window (WINDOW is 2 here)
    "no pair in the first window": ([(PROMPTS[:2], 1), (PROMPTS[2:], 2)], PROMPTS),
    # every prompt edited since its results, and every shard of this run failed
    "failed": ([(PROMPTS, 2)], _prompts(6, {i: f"Edited {i}?" for i in range(6)})),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_every_config_on_the_card_loads_and_every_file_with_rows_is_one(case, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import
    monkeypatch.setattr(output_module, "WINDOW", 2)
    shards, current = OUTPUTS[case]
    out = made(tmp_path / "out", shards, current)
    listed = [c["config_name"] for c in front_matter(out / "README.md")["configs"]]
    rows = {f.stem: pq.ParquetFile(f).metadata.num_rows for f in out.glob("*.parquet")}
    for name in listed:
        ds = load_dataset(str(out), name, split="train", cache_dir=str(tmp_path / "hf"))
        assert ds.num_rows == rows[name], name
    assert sorted(listed) == sorted(stem for stem, n in rows.items() if n), rows
    expected = {"finished": 6, "stopped after a few prompts": 5,
                "no preference pair": 5, "no pair in the first window": 6, "failed": 0}
    assert len(listed) == expected[case]
    if not listed:
        assert "nothing to load" in (out / "README.md").read_text()


# --- the card is ours only while it is as we wrote it ---


def card_and_notes(out: Path, current: list[Prompt] = PROMPTS) -> tuple[str, list[str]]:
    """Finish `out` again (nothing new to generate): what README.md says, the lines said."""
    said: list[str] = []
    with _open(out) as outdir:
        finish(outdir, current, said.append)
    return (out / "README.md").read_text(), said


def test_the_manifest_holds_the_digest_of_the_card_as_written(tmp_path):
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    manifest = json.loads((out / "manifest.json").read_text())
    digest = hashlib.sha256((out / "README.md").read_bytes()).hexdigest()
    assert manifest["card_sha256"] == {"README.md": [digest]}
    assert "README.md" in manifest["files"]


def test_an_unedited_card_is_replaced_as_before(tmp_path):
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    before = (out / "README.md").read_text()
    text, said = card_and_notes(out, PROMPTS[:5])  # one prompt fewer: another card
    assert text != before and "num_examples: 5" in text and said == []
    assert not (out / "README.specrej.md").exists()


def test_an_edited_card_is_kept_and_the_new_one_written_beside_it(tmp_path):
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    (out / "README.md").write_text("my notes")
    text, said = card_and_notes(out)
    assert text == "my notes"
    assert said == [f"[specrej] {out / 'README.md'} was edited since specrej-ray wrote it: "
                    f"kept; the new card is {out / 'README.specrej.md'}"]
    assert "pretty_name: t" in (out / "README.specrej.md").read_text()
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert "README.specrej.md" in files and "README.md" not in files
    # A later run keeps it too, and says so again.
    text, said = card_and_notes(out)
    assert text == "my notes" and len(said) == 1 and "kept" in said[0]


def test_a_run_killed_between_the_card_and_its_digest_still_knows_its_card(tmp_path,
                                                                          monkeypatch):
    """The manifest lists the old and the new digest while the card is replaced: a run
    killed after the rename, before the manifest names the new one alone, leaves a card
    that the next run replaces (it is not taken for the user's)."""
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    recorded = OutputDir._card_written

    def killed_after_the_card(self, name, digests):
        if (out / "README.md").read_text() != before:
            raise KeyboardInterrupt
        recorded(self, name, digests)

    before = (out / "README.md").read_text()
    monkeypatch.setattr(OutputDir, "_card_written", killed_after_the_card)
    with pytest.raises(KeyboardInterrupt):
        card_and_notes(out, PROMPTS[:5])  # one prompt fewer: another card
    monkeypatch.undo()
    assert "num_examples: 5" in (out / "README.md").read_text()  # the new card, in place
    text, said = card_and_notes(out, PROMPTS[:4])
    assert "num_examples: 4" in text and said == []
    assert not (out / "README.specrej.md").exists()


def test_a_card_listed_without_a_digest_by_an_older_run_is_kept(tmp_path):
    """An older specrej-ray listed README.md but recorded no digest: whether it was edited
    cannot be told, and losing the user's words cannot be undone; a second card can."""
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["card_sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = (out / "README.md").read_text()
    text, said = card_and_notes(out)
    assert text == before and (out / "README.specrej.md").exists()
    assert len(said) == 1 and "kept no digest" in said[0]


def test_a_readme_of_the_users_own_is_kept_and_the_card_written_beside_it(tmp_path):
    said = []
    with OutputDir.open(str(tmp_path / "o"), "resume", "f" * 16, {}) as out:
        out.write_run_info({"files": []})
        (tmp_path / "o" / "README.md").write_text("mine")
        out.write_card("---\n---\n# card\n", echo=said.append)
    assert (tmp_path / "o" / "README.md").read_text() == "mine"
    assert (tmp_path / "o" / "README.specrej.md").read_text() == "---\n---\n# card\n"
    assert len(said) == 1 and "is not the card specrej-ray wrote: kept" in said[0]


def test_once_the_users_readme_is_gone_the_card_is_readme_again(tmp_path):
    out = made(tmp_path / "out", [(PROMPTS, 2)], PROMPTS)
    (out / "README.md").write_text("my notes")
    card_and_notes(out)
    (out / "README.md").unlink()
    text, said = card_and_notes(out)
    assert "pretty_name: t" in text and said == []
    assert not (out / "README.specrej.md").exists()  # no stale second card
    assert "README.specrej.md" not in json.loads((out / "manifest.json").read_text())["files"]


def test_an_overwrite_keeps_an_edited_card_and_replaces_an_unedited_one(tmp_path):
    edited = made(tmp_path / "edited", [(PROMPTS, 2)], PROMPTS)
    (edited / "README.md").write_text("my notes")
    unedited = made(tmp_path / "unedited", [(PROMPTS, 2)], PROMPTS)
    for out in (edited, unedited):
        said: list[str] = []
        with _open(out, "overwrite", fingerprint="f2") as outdir:
            _write(outdir, "s0", PROMPTS[:3], candidates=2)
            finish(outdir, PROMPTS[:3], said.append)
        card = out / "README.md"
        if out is edited:
            assert card.read_text() == "my notes" and len(said) == 1
            assert (out / "README.specrej.md").exists()
        else:
            assert card.read_text().startswith("---\n") and said == []
            assert not (out / "README.specrej.md").exists()
        assert pq.read_metadata(out / "best.parquet").num_rows == 3


@pytest.mark.ray
def test_on_an_object_store_each_config_loads_from_the_cards_data_files(tmp_path, tiny_lm_dir,
                                                                          ray_cluster):
    """`datasets` reads a card's configs only from a local directory or the Hub; on an fsspec
    URL each config is its data_files, read with the parquet builder (docs/outputs.md)."""
    import fsspec

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Say {i}."}
                                                 for i in range(4)])
    url = "memory://card-test/out"
    job = tiny_job(tmp_path, tiny_lm_dir, prompts, output={"path": url,
                                                           "formats": ["preference"]})
    run_job(validate_spec(job), **QUIET)
    fs = fsspec.filesystem("memory")
    card = fs.cat(f"{url}/README.md").decode()
    front = yaml.safe_load(card.split("---\n")[1])
    for config in front["configs"]:
        files = {d["split"]: f"{url}/{d['path']}" for d in config["data_files"]}
        # A cache of its own: `datasets` keys a memory:// file by its path alone (no mtime
        # or ETag there), so a shared cache would serve an earlier run's table.
        ds = load_dataset("parquet", data_files=files, split="train",
                          cache_dir=str(tmp_path / "hf-cache"))
        table = pq.read_table(fs.open(files["train"], "rb"))
        assert ds.num_rows == table.num_rows > 0 and ds.column_names == table.column_names
    sizes = {i["config_name"]: i["splits"][0]["num_examples"] for i in front["dataset_info"]}
    assert sizes == {"best": 4, "preference": 4, "candidates": 4 * 6}
