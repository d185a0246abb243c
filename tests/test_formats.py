"""Training formats and filters, on hand-made candidates (no Ray, no models)."""

from __future__ import annotations

import json

import pytest
from datasets import List, Value, load_dataset

from specrej_ray.data import dataset, formats
from specrej_ray.data.output import OutputDir, content_key
from specrej_ray.data.prompts import Prompt
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.spec import OutputSpec, SpecError, validate_spec

PROV = {"generator": "gen-x", "reward_model": "lm_likelihood(rm-y)", "fingerprint": "f00d"}
PROMPTS = [
    {"id": "a", "prompt": "What is 2+2?", "system": "Be brief."},
    {"id": "b", "prompt": "Name a colour.", "system": None},
]
TURN = {"role": Value("string"), "content": Value("string")}


def cand(pid, k, score, text=None, status="finished", reason="eos"):
    return {
        "prompt_id": pid,
        "candidate": k,
        "status": status,
        "finish_reason": reason if status == "finished" else None,
        "text": f"{pid}-answer-{k}" if text is None else text,
        "final_score": score if status == "finished" else None,
        "num_tokens": 3 + k,
    }


def options(**kw) -> OutputSpec:
    filters = kw.pop("filters", {})
    return OutputSpec(path="unused", filters=filters, **kw)


def derive(cands, prompts=PROMPTS, **kw) -> formats.Derived:
    return formats.derive(prompts, cands, options(**kw), PROV)


# --- TRL's documented dataset types, checked by schema (trl itself is not installed) ---


def is_turn_list(value, roles) -> bool:
    return (
        isinstance(value, list)
        and [t["role"] for t in value] == roles
        and all(set(t) == {"role", "content"} and isinstance(t["content"], str) for t in value)
    )


def prompt_roles(row_prompt) -> list[str]:
    return ["system", "user"] if row_prompt[0]["role"] == "system" else ["user"]


def check_trl_language_modeling(row) -> None:
    msgs = row["messages"]
    roles = prompt_roles(msgs)
    assert is_turn_list(msgs, [*roles, "assistant"])


def check_trl_prompt_completion(row) -> None:
    assert is_turn_list(row["prompt"], prompt_roles(row["prompt"]))
    assert row["prompt"][-1]["role"] == "user"
    assert is_turn_list(row["completion"], ["assistant"])


def check_trl_preference(row) -> None:
    assert is_turn_list(row["prompt"], prompt_roles(row["prompt"]))
    assert row["prompt"][-1]["role"] == "user"
    assert is_turn_list(row["chosen"], ["assistant"])
    assert is_turn_list(row["rejected"], ["assistant"])


# --- formats ---


def test_sft_is_the_best_finished_candidate_in_both_trl_forms():
    cands = [
        cand("a", 0, 0.1),
        cand("a", 1, 0.9),
        cand("a", 2, 5.0, status="rejected"),
        cand("b", 0, -1.0),
        cand("b", 1, -0.5),
    ]
    files = derive(cands).files
    msgs, pc = files["sft_messages"], files["sft_prompt_completion"]
    assert [r["id"] for r in msgs] == ["a", "b"] and [r["id"] for r in pc] == ["a", "b"]
    assert msgs[0]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "a-answer-1"},
    ]
    assert pc[1]["prompt"] == [{"role": "user", "content": "Name a colour."}]
    assert pc[1]["completion"] == [{"role": "assistant", "content": "b-answer-1"}]
    assert [r["reward"] for r in msgs] == [0.9, -0.5]
    for row in msgs:
        check_trl_language_modeling(row)
    for row in pc:
        check_trl_prompt_completion(row)


def test_ties_go_to_the_lower_candidate_index():
    files = derive([cand("a", 3, 1.0), cand("a", 1, 1.0), cand("a", 2, 0.0)]).files
    assert files["sft_messages"][0]["candidate"] == 1
    assert [r["candidate"] for r in files["top_k"]] == [1, 3, 2]


def test_best_vs_worst_pairs_record_the_margin():
    cands = [cand("a", k, s) for k, s in enumerate([0.5, 2.0, -1.0, 1.0])]
    (row,) = derive(cands).files["preference"]
    check_trl_preference(row)
    assert row["chosen"][0]["content"] == "a-answer-1"
    assert row["rejected"][0]["content"] == "a-answer-2"
    assert (row["chosen_reward"], row["rejected_reward"], row["margin"]) == (2.0, -1.0, 3.0)
    assert (row["chosen_candidate"], row["rejected_candidate"]) == (1, 2)


def test_best_vs_each_takes_up_to_k_others_lowest_reward_first():
    cands = [cand("a", k, s) for k, s in enumerate([0.5, 2.0, -1.0, 1.0, 0.0])]
    rows = derive(cands, pairs="best_vs_each", pairs_k=3).files["preference"]
    assert [r["rejected_candidate"] for r in rows] == [2, 4, 0]
    assert all(r["chosen_candidate"] == 1 for r in rows)
    assert [r["margin"] for r in rows] == [3.0, 2.0, 1.5]
    every = derive(cands, pairs="best_vs_each").files["preference"]
    assert [r["rejected_candidate"] for r in every] == [2, 4, 0, 3]


def test_a_single_finished_candidate_makes_no_pair():
    cands = [cand("a", 0, 1.0), cand("a", 1, 0.0, status="rejected")]
    derived = derive(cands, prompts=PROMPTS[:1])
    assert derived.files["preference"] == []
    assert len(derived.files["sft_messages"]) == 1
    assert derived.filters["prompts_without_row"] == {"sft": 0, "preference": 1, "top_k": 0}


def test_top_k_ranks_the_best_k():
    cands = [cand("a", k, s) for k, s in enumerate([0.3, 0.9, 0.1, 0.7, 0.5])]
    cands.append(cand("a", 5, 9.9, status="rejected"))
    rows = derive(cands, top_k=3).files["top_k"]
    assert [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["candidate"] for r in rows] == [1, 3, 4]
    assert [r["reward"] for r in rows] == [0.9, 0.7, 0.5]
    assert rows[0]["response"] == "a-answer-1" and rows[0]["system"] == "Be brief."
    assert len(derive(cands[:2], top_k=3).files["top_k"]) == 2


def test_only_the_formats_asked_for_and_provenance_on_every_row():
    cands = [cand("a", 0, 1.0), cand("a", 1, 0.0)]
    assert set(derive(cands, formats=["top_k"]).files) == {"top_k"}
    assert set(derive(cands, formats=[]).files) == set()
    files = derive(cands).files
    assert set(files) == {"sft_messages", "sft_prompt_completion", "preference", "top_k"}
    for stem, rows in files.items():
        assert rows, stem
        for r in rows:
            assert {k: r[k] for k in PROV} == PROV
            assert set(r) == set(formats.SCHEMAS[stem].names)  # no column lost or unwritten


# --- filters ---


def test_drop_truncated_keeps_the_best_candidate_that_ended_properly():
    cands = [
        cand("a", 0, 5.0, reason="length"),
        cand("a", 1, 1.0, reason="eos"),
        cand("a", 2, 0.5, reason="stop"),
        cand("b", 0, 3.0, reason="length"),
    ]
    kept = derive(cands).files["sft_messages"]
    assert [r["candidate"] for r in kept] == [0, 0]  # off by default
    derived = derive(cands, filters={"drop_truncated": True})
    assert [(r["id"], r["candidate"]) for r in derived.files["sft_messages"]] == [("a", 1)]
    counts = derived.filters["drop_truncated"]
    assert counts["candidates_removed"] == 2
    assert counts["prompts_without_row"] == {"sft": 1, "preference": 0, "top_k": 1}
    assert derived.filters["prompts_without_row"] == {"sft": 1, "preference": 1, "top_k": 1}


def test_min_reward_counts_and_empties_prompts():
    cands = [cand("a", 0, 0.2), cand("a", 1, 0.8), cand("a", 2, 0.6), cand("b", 0, 0.1)]
    derived = derive(cands, filters={"min_reward": 0.5})
    counts = derived.filters["min_reward"]
    assert counts["candidates_removed"] == 2
    # b loses its only candidate: no row anywhere; it never had a pair to lose.
    assert counts["prompts_without_row"] == {"sft": 1, "preference": 0, "top_k": 1}
    assert [r["reward"] for r in derived.files["top_k"]] == [0.8, 0.6]
    assert derived.files["preference"][0]["rejected_reward"] == 0.6


def test_dedupe_keeps_the_lowest_index_of_identical_texts():
    cands = [
        cand("a", 2, 0.9, text="same"),
        cand("a", 0, 0.9, text="same"),
        cand("a", 1, 0.1, text="other"),
        cand("a", 3, 0.9, text="same"),
    ]
    derived = derive(cands)
    assert derived.filters["dedupe"]["candidates_removed"] == 2
    assert [r["candidate"] for r in derived.files["top_k"]] == [0, 1]
    off = derive(cands, filters={"dedupe": False})
    assert off.filters["dedupe"]["candidates_removed"] == 0
    assert [r["candidate"] for r in off.files["top_k"]] == [0, 2, 3, 1]


def test_dedupe_after_drop_truncated_keeps_the_proper_ending():
    cands = [
        cand("a", 0, 0.9, text="same", reason="length"),
        cand("a", 1, 0.9, text="same", reason="eos"),
    ]
    derived = derive(cands, filters={"drop_truncated": True})
    assert [r["candidate"] for r in derived.files["sft_messages"]] == [1]
    assert derived.filters["dedupe"]["candidates_removed"] == 0


def test_dedupe_costing_a_pair_is_counted_for_preference_only():
    cands = [cand("a", 0, 0.9, text="same"), cand("a", 1, 0.9, text="same")]
    counts = derive(cands).filters["dedupe"]
    assert counts["prompts_without_row"] == {"sft": 0, "preference": 1, "top_k": 0}


def test_min_margin_drops_close_pairs():
    cands = [
        cand("a", 0, 1.0),
        cand("a", 1, 0.9),
        cand("a", 2, 0.2),
        cand("b", 0, 1.0),
        cand("b", 1, 0.95),
    ]
    derived = derive(cands, pairs="best_vs_each", filters={"min_margin": 0.5})
    assert [(r["id"], r["rejected_candidate"]) for r in derived.files["preference"]] == [("a", 2)]
    counts = derived.filters["min_margin"]
    assert counts == {"pairs_removed": 2, "prompts_without_row": {"preference": 1}}
    assert len(derived.files["sft_messages"]) == 2  # margins never touch SFT


def test_no_filter_counts_when_nothing_is_removed():
    derived = derive([cand("a", 0, 1.0), cand("a", 1, 0.5)], prompts=PROMPTS[:1])
    for name in (*formats.CANDIDATE_FILTERS, "min_margin"):
        removed = derived.filters[name].get("candidates_removed", 0)
        assert removed + derived.filters[name].get("pairs_removed", 0) == 0
        assert not any(derived.filters[name]["prompts_without_row"].values())


# --- spec ---


def job(**output) -> dict:
    return {
        "prompts": {"path": "p.jsonl"},
        "generator": {"model": "m"},
        "reward": {"type": "lm_likelihood", "model": "m"},
        "output": {"path": "out", **output},
    }


def test_output_defaults_and_errors_name_the_field():
    spec = validate_spec(job())
    assert spec.output.formats == ["sft", "preference", "top_k"]
    assert (spec.output.pairs, spec.output.top_k, spec.output.jsonl) == ("best_vs_worst", 4, False)
    assert spec.output.filters.dedupe and not spec.output.filters.drop_truncated
    for bad, field in (
        ({"formats": ["sft", "dpo"]}, "output.formats.1"),
        ({"pairs_k": 2}, "output.pairs_k"),
        ({"filters": {"min_margin": -1}}, "output.filters.min_margin"),
        ({"filters": {"dedup": True}}, "output.filters.dedup"),
        ({"top_k": 0}, "output.top_k"),
    ):
        with pytest.raises(SpecError) as e:
            validate_spec(job(**bad), "job.yaml")
        lines = str(e.value).splitlines()
        assert len(lines) == 1 and field in lines[0], lines


def test_formats_and_filters_do_not_change_the_fingerprint():
    base = validate_spec(job()).fingerprint()
    other = validate_spec(
        job(
            formats=["top_k"],
            jsonl=True,
            top_k=2,
            pairs="best_vs_each",
            filters={"min_reward": 1.0, "drop_truncated": True},
        )
    )
    assert other.fingerprint() == base


# --- files: assembled from shards and loaded with datasets ---


def _result(pid: str, scores: list[float | None], reasons: list[str | None]) -> PromptResult:
    cands = [
        Candidate(
            index=k,
            tokens=[1] * (k + 2),
            status=Status.FINISHED if r else Status.REJECTED,
            finish_reason=r,
            rejected_round=None if r else 1,
            partial_scores=[(2, (s or 0.0) - 1)],
            final_score=s,
            components={"rm2": 2.0 * k, "rm1": float(k)} if s else {},
            text=f"{pid} says {k}",
        )
        for k, (s, r) in enumerate(zip(scores, reasons, strict=True))
    ]
    done = [k for k, c in enumerate(cands) if c.finished]
    best = max(done, key=lambda k: cands[k].final_score)
    return PromptResult(
        pid,
        cands,
        best,
        n0=len(cands),
        waves=1,
        rounds=1,
        prompt_tokens=5,
        seconds=0.1,
        score_seconds=0.01,
    )


@pytest.fixture
def assembled(tmp_path):
    spec = {"output": {"path": str(tmp_path / "out")}}
    outdir = OutputDir.open(str(tmp_path / "out"), "resume", "f00d", spec)
    prompts = [Prompt("a", "What is 2+2?", "Be brief.", 1), Prompt("b", "Name a colour.", None, 2)]
    keys = {p.id: content_key(p.text, p.system, [1, 2]) for p in prompts}
    results = [
        _result("a", [0.5, 0.9, None, 0.1], ["eos", "length", None, "eos"]),
        _result("b", [0.3, None, 0.2, 0.4], ["eos", None, "stop", "eos"]),
    ]
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        best, cands = dataset.result_rows(p, r)
        outdir.write_shard(f"s{i}", {p.id: keys[p.id]}, [best], cands)
    output = OutputSpec(path=str(tmp_path / "out"), jsonl=True)
    made = outdir.assemble(keys, output, PROV)
    yield tmp_path / "out", outdir, keys, made
    outdir.close()


def load(path):
    return load_dataset("parquet", data_files=str(path), split="train")


EXPECTED = {
    "sft_messages": {
        "id": Value("string"),
        "messages": List(TURN),
        "reward": Value("float64"),
        "candidate": Value("int64"),
    },
    "sft_prompt_completion": {
        "id": Value("string"),
        "prompt": List(TURN),
        "completion": List(TURN),
        "reward": Value("float64"),
        "candidate": Value("int64"),
    },
    "preference": {
        "id": Value("string"),
        "prompt": List(TURN),
        "chosen": List(TURN),
        "rejected": List(TURN),
        "chosen_reward": Value("float64"),
        "rejected_reward": Value("float64"),
        "margin": Value("float64"),
        "chosen_candidate": Value("int64"),
        "rejected_candidate": Value("int64"),
    },
    "top_k": {
        "id": Value("string"),
        "rank": Value("int64"),
        "candidate": Value("int64"),
        "system": Value("string"),
        "prompt": Value("string"),
        "response": Value("string"),
        "reward": Value("float64"),
        "finish_reason": Value("string"),
        "num_tokens": Value("int64"),
    },
}
PROV_FEATURES = {k: Value("string") for k in PROV}


def test_every_format_file_loads_with_exact_columns_and_types(assembled):
    path, *_ = assembled
    for stem, features in EXPECTED.items():
        ds = load(path / f"{stem}.parquet")
        assert dict(ds.features) == {**features, **PROV_FEATURES}, stem
        assert list(ds.features) == [*features, *PROV], stem
        jsonl = [json.loads(line) for line in (path / f"{stem}.jsonl").read_text().splitlines()]
        assert jsonl == ds.to_list(), stem
    for row in load(path / "sft_messages.parquet"):
        check_trl_language_modeling(row)
    for row in load(path / "sft_prompt_completion.parquet"):
        check_trl_prompt_completion(row)
    for row in load(path / "preference.parquet"):
        check_trl_preference(row)


def test_candidates_keep_component_scores_and_provenance(assembled):
    path, _, _, made = assembled
    cands = load(path / "candidates.parquet")
    assert cands.features["component_scores"] == List(
        {"name": Value("string"), "score": Value("float64")}
    )
    rows = {(r["prompt_id"], r["candidate"]): r for r in cands}
    assert rows[("a", 3)]["component_scores"] == [
        {"name": "rm1", "score": 3.0},
        {"name": "rm2", "score": 6.0},
    ]
    assert rows[("a", 2)]["component_scores"] == []
    assert len(cands) == made.counts["candidates"] == 8
    for name in ("best.parquet", "candidates.parquet"):
        for row in load(path / name):
            assert {k: row[k] for k in PROV} == PROV


def test_records_are_unfiltered_and_formats_are(assembled):
    path, outdir, keys, _ = assembled
    output = OutputSpec(path=str(path), filters={"drop_truncated": True})
    made = outdir.assemble(keys, output, PROV)
    best = load(path / "best.parquet")
    assert best["response"] == ["a says 1", "b says 3"]  # the truncated best stays the record
    sft = load(path / "sft_messages.parquet")
    assert [m[-1]["content"] for m in sft["messages"]] == ["a says 0", "b says 3"]
    assert made.filters["drop_truncated"]["candidates_removed"] == 1
    assert made.counts == {"prompts": 2, "candidates": 8, "tokens_generated": 28,
                           "tokens_discarded": 0}


def test_a_rerun_with_fewer_formats_removes_the_stale_files(assembled):
    path, outdir, keys, made = assembled
    assert {"preference.jsonl", "top_k.parquet", "candidates.jsonl"} <= set(made.files)
    output = OutputSpec(path=str(path), formats=["sft"])
    made = outdir.assemble(keys, output, PROV)
    names = {p.name for p in path.iterdir()}
    assert {"sft_messages.parquet", "sft_prompt_completion.parquet"} <= names
    assert not names & {
        "preference.parquet",
        "top_k.parquet",
        "preference.jsonl",
        "sft_messages.jsonl",
        "candidates.jsonl",
    }
    assert set(made.files) == {
        "best.parquet",
        "best.jsonl",
        "candidates.parquet",
        "sft_messages.parquet",
        "sft_prompt_completion.parquet",
    }
