"""What search.draws and search.branch add to the files (issue 56), and that without them the
files are as before: the same schemas, byte for byte the same rows."""

from __future__ import annotations

import pyarrow.parquet as pq

from specrej_ray.data import dataset
from specrej_ray.data.output import OutputDir, content_key
from specrej_ray.data.prompts import Prompt
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.spec import OutputSpec

PROV = {"generator": "g", "reward_model": "r", "fingerprint": "f1"}


def _result(stop_reason=None, draws=None, branched=False) -> PromptResult:
    cands = [Candidate(0, tokens=[1, 2], status=Status.FINISHED, finish_reason="eos",
                       final_score=1.0, text="a"),
             Candidate(1, tokens=[1], status=Status.STOPPED, text="b", parent=0, forked_at=1)]
    return PromptResult("p0", cands, 0, n0=2, waves=1, rounds=1, prompt_tokens=3, seconds=0.0,
                        score_seconds=0.0, stop_reason=stop_reason, draws=draws,
                        branched=branched)


def _run(tmp_path, search: dict, result: PromptResult) -> tuple[pq.ParquetFile, ...]:
    out, prompt = tmp_path / "out", Prompt("p0", "Q?", None, 1)
    keys = {"p0": content_key(prompt.text, None, [3])}
    with OutputDir.open(str(out), "resume", "f1", {"search": search}, label="t",
                        echo=lambda *a, **k: None) as outdir:
        best, cands = dataset.result_rows(prompt, result)
        outdir.write_shard("s0", keys, [best], cands)
        outdir.resume(keys)
        outdir.assemble(keys, OutputSpec(path=str(out)), PROV)
    return pq.ParquetFile(out / "best.parquet"), pq.ParquetFile(out / "candidates.parquet")


def test_without_draws_or_branching_the_files_are_as_before(tmp_path):
    best, cands = _run(tmp_path, {}, _result())
    provenance = {"generator", "reward_model", "fingerprint"}
    assert [f for f in best.schema_arrow.names if f not in provenance] == \
        dataset.BEST_SCHEMA.names
    assert [f for f in cands.schema_arrow.names if f not in provenance] == \
        dataset.CANDIDATE_SCHEMA.names
    row, rows = dataset.result_rows(Prompt("p0", "Q?", None, 1), _result())
    assert set(row) == set(dataset.BEST_SCHEMA.names)
    assert all(set(r) == set(dataset.CANDIDATE_SCHEMA.names) for r in rows)


def test_draws_and_branching_record_each_prompts_stop_and_each_candidates_parent(tmp_path):
    search = {"draws": {"until": "kept", "max_n": 8}, "branch": True}
    best, cands = _run(tmp_path, search, _result("kept", 2, branched=True))
    assert best.read().select(["stop_reason", "draws"]).to_pylist() == \
        [{"stop_reason": "kept", "draws": 2}]
    assert cands.read().select(["candidate", "status", "stop_reason", "parent",
                                "forked_at"]).to_pylist() == [
        {"candidate": 0, "status": "finished", "stop_reason": "kept", "parent": None,
         "forked_at": None},
        {"candidate": 1, "status": "stopped", "stop_reason": "kept", "parent": 0,
         "forked_at": 1}]
