"""The output is a Hugging Face dataset: README.md's configs load with `datasets`, one per
parquet file, the card's body says what made the data, and it is rewritten on resume and
written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from datasets import Features, get_dataset_config_names, load_dataset

from specrej_ray.data.card import card_text, configs
from specrej_ray.data.output import OutputDir
from specrej_ray.distributed.driver import run_job
from specrej_ray.models.identity import weights_sha256
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_jsonl

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

        def torn(path, data, **kw):
            Path(path).write_bytes(data[:5])
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(out.out.fs, "pipe_file", torn)
        with pytest.raises(Exception, match="No space left"):
            out.write_card("---\nconfigs: []\n---\n# a card\n")
    left = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert "README.md" not in left
    assert not [n for n in left if "tmp" in n], left


def test_a_readme_of_the_users_own_is_left_alone(tmp_path):
    said = []
    with OutputDir.open(str(tmp_path / "o"), "resume", "f" * 16, {}) as out:
        out.write_run_info({"files": []})
        (tmp_path / "o" / "README.md").write_text("mine")
        out.write_card("---\n---\n# card\n", echo=said.append)
    assert (tmp_path / "o" / "README.md").read_text() == "mine"
    assert len(said) == 1 and "not one specrej-ray wrote" in said[0]


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
        ds = load_dataset("parquet", data_files=files, split="train")
        table = pq.read_table(fs.open(files["train"], "rb"))
        assert ds.num_rows == table.num_rows > 0 and ds.column_names == table.column_names
    sizes = {i["config_name"]: i["splits"][0]["num_examples"] for i in front["dataset_info"]}
    assert sizes == {"best": 4, "preference": 4, "candidates": 4 * 6}
