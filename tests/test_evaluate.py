"""`specrej-ray evaluate` end to end on tiny models, in this process: every figure of every
model and decoding, each from the responses written beside it; the sampled response is the
job's candidate 0, the greedy one temperature 0; user mistakes as one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from specrej_ray.cli import main
from specrej_ray.job.local import load_local
from specrej_ray.models.identity import weights_sha256
from specrej_ray.quality.instruction_eval import METRICS, Response, figures
from specrej_ray.reward.instructions import follows, parse_row
from specrej_ray.spec import load_spec
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.tiny import save_tiny_lm

ROWS = [
    {"id": "a", "prompt": "Write anything.",
     "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
     "kwargs": [{}, {}]},
    {"id": "b", "prompt": "Write more.",
     "instruction_id_list": ["keywords:letter_frequency"],
     "kwargs": [{"letter": "e", "let_frequency": 1, "let_relation": "at least"}]},
    {"id": "c", "prompt": "Write less.",
     "instruction_id_list": ["length_constraints:number_words", "punctuation:no_comma"],
     "kwargs": [{"num_words": 3, "relation": "less than"}, {}]},
]
BY_ID = {r["id"]: r for r in ROWS}


def job_dict(tmp, model, **sections) -> dict:
    prompts = write_jsonl(tmp / "prompts.jsonl", ROWS)
    job = tiny_job(tmp, model, prompts, reward={"type": "instructions"}, **sections)
    job["generator"]["sampling"] = {"max_new_tokens": 12, "temperature": 0.9}
    return job


def evaluate(capsys, *argv) -> tuple[int, str, str]:
    threads = torch.get_num_threads()  # evaluate sets the spec's threads; leave others theirs
    try:
        code = main(["evaluate", *map(str, argv)])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_lm_dir):
    tmp = tmp_path_factory.mktemp("evaluate")
    other = save_tiny_lm(tmp / "other-lm", seed=1)
    path = write_job(tmp / "job.yaml", job_dict(tmp, tiny_lm_dir))
    return tmp, path, other


@pytest.fixture(scope="module")
def evaluated(two_models, tiny_lm_dir):
    tmp, path, other = two_models
    out = tmp / "results"
    code = main(["evaluate", str(path), "--model", str(tiny_lm_dir), "--model", str(other),
                 "--out", str(out)])
    assert code == 0
    return json.loads((out / "eval.json").read_text()), out


def responses(model: dict, decoding: str) -> list[Response]:
    return [Response(r["prompt_id"], tuple(r["strict"]), tuple(r["loose"]), r["tokens"],
                     r["text"]) for r in model["responses"][decoding]]


def test_every_figure_of_every_model_and_decoding(evaluated, tiny_lm_dir, two_models):
    report, out = evaluated
    ref, other = report["models"]
    assert [ref["path"], other["path"]] == [str(tiny_lm_dir), str(two_models[2])]
    assert ref["sha256"] == weights_sha256(tiny_lm_dir) != other["sha256"]
    assert report["prompts"] == 3 and report["instructions"] == 5
    assert report["reference"] == ref["label"]
    assert report["bootstrap"]["resamples"] >= 2000
    assert report["command"].startswith("specrej-ray evaluate ")
    for m in (ref, other):
        assert set(m["decodings"]) == {"greedy", "sampled"}
        for d in m["decodings"].values():
            assert set(d["figures"]) == set(METRICS)
            for i in d["figures"].values():
                assert i["low"] <= i["value"] <= i["high"]
    assert all(d["against_reference"] is None for d in ref["decodings"].values())
    assert all(set(d["against_reference"]) == set(METRICS)
               for d in other["decodings"].values())
    md = (out / "eval.md").read_text()
    assert "Against" in md and "prompt strict %" in md and ref["label"] in md
    assert "## By instruction (strict)" in md
    for m in (ref, other):  # each decoding's responses, counted on their rows' instructions
        for decoding, got in m["decodings"].items():
            want: dict[str, dict[str, int]] = {}
            for r in responses(m, decoding):
                ids = BY_ID[r.prompt_id]["instruction_id_list"]
                for i, strict, loose in zip(ids, r.strict, r.loose, strict=True):
                    c = want.setdefault(i, {"strict": 0, "loose": 0, "of": 0})
                    c["strict"], c["loose"], c["of"] = \
                        c["strict"] + strict, c["loose"] + loose, c["of"] + 1
            assert got["by_instruction"] == want
    counts = ref["decodings"]["greedy"]["by_instruction"]["punctuation:no_comma"]
    assert f"| `punctuation:no_comma` | {counts['strict']}/2 |" in md
    assert (out / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_figures_are_the_written_responses(evaluated):
    report, _ = evaluated
    ref, other = report["models"]
    for m in (ref, other):
        for decoding, got in m["decodings"].items():
            rs = responses(m, decoding)
            assert [r.prompt_id for r in rs] == ["a", "b", "c"]
            for r in rs:
                row = BY_ID[r.prompt_id]
                parsed = parse_row(row["instruction_id_list"], row["kwargs"], row["prompt"])
                assert list(r.strict) == follows(parsed, r.text)
                assert list(r.loose) == follows(parsed, r.text, loose=True)
                assert 1 <= r.tokens <= 12
            assert {k: v["value"] for k, v in got["figures"].items()} == \
                pytest.approx(figures(rs))
    for decoding, got in other["decodings"].items():
        mine, theirs = figures(responses(other, decoding)), figures(responses(ref, decoding))
        assert {k: v["value"] for k, v in got["against_reference"].items()} == \
            pytest.approx({k: mine[k] - theirs[k] for k in METRICS})


def test_sampled_is_the_jobs_candidate_0_and_greedy_is_temperature_0(evaluated, two_models):
    report, _ = evaluated
    _, path, _ = two_models
    spec = load_spec(path, ["search.mode=bon", "search.n=3", "search.bounds=false"])
    job = load_local(spec)
    tasks = job.engine_tasks()
    sampled = [r.candidates[0].text for r in job.engine.run(tasks)]
    greedy = [r.candidates[0].text
              for r in job.engine.with_sampling(temperature=0.0).run(job.engine_tasks())]
    ref = report["models"][0]
    assert [r.text for r in responses(ref, "sampled")] == sampled
    assert [r.text for r in responses(ref, "greedy")] == greedy
    assert sampled != greedy


def test_the_spec_model_and_a_prompt_file_with_a_limit(two_models, tmp_path, capsys):
    _, path, _ = two_models
    other = write_jsonl(tmp_path / "held_out.jsonl", [{**r, "id": f"x-{r['id']}"} for r in ROWS])
    code, out, err = evaluate(capsys, path, "--prompts", other, "--limit", 2, "--out", tmp_path)
    assert code == 0, err
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["prompts"] == 2 and len(report["models"]) == 1
    assert [r["prompt_id"] for r in report["models"][0]["responses"]["greedy"]] == \
        ["x-a", "x-b"]
    assert report["settings"]["prompts"] == {"path": str(other), "offset": 0, "limit": 2}
    assert "evaluate: 2 prompts" in err and "greedy: 2/2 prompts" in err
    assert f"wrote {tmp_path / 'eval.json'}" in out and "prompt strict %" in out


@pytest.mark.parametrize(("change", "argv", "expected"), [
    ("no_instructions", [], "reward: the evaluation scores each prompt's verifiable "
     "instructions with the spec's reward of type instructions, and the spec has none"),
    (None, ["--model", "/no/such/model"], "--model: '/no/such/model' does not exist"),
    (None, ["--prompts", "/no/such.jsonl"], "--prompts: '/no/such.jsonl' does not exist"),
    ("bad_row", [], "prompts.path: "),
    (None, ["--limit", "0"], "--limit: must be at least 1"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, tiny_lm_dir, capsys, change, argv,
                                             expected):
    job = job_dict(tmp_path, tiny_lm_dir)
    if change == "no_instructions":
        job["reward"] = {"type": "lm_likelihood", "model": str(tiny_lm_dir)}
    if change == "bad_row":
        write_jsonl(tmp_path / "prompts.jsonl",
                    [*ROWS, {"id": "bad", "prompt": "x", "instruction_id_list": ["foo:bar"],
                             "kwargs": [{}]}])
    path = write_job(tmp_path / "job.yaml", job)
    code, _, err = evaluate(capsys, path, *argv, "--out", tmp_path / "o")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("specrej-ray: error: "), err
    assert expected in lines[0], lines[0]
    if change == "bad_row":
        assert "row 4 (id 'bad')" in lines[0] and "unknown instruction id" in lines[0]
    assert not (tmp_path / "o").exists()  # refused before anything was made


def test_validate_checks_the_iterate_evaluation_prompts(tmp_path, tiny_lm_dir, capsys):
    held = write_jsonl(tmp_path / "held_out.jsonl", ROWS)
    job = job_dict(tmp_path, tiny_lm_dir, output={"path": str(tmp_path / "out"),
                                                  "formats": ["sft"]})
    job["iterate"] = {"evaluate": {"prompts": str(held), "limit": 2}}
    assert main(["validate", str(write_job(tmp_path / "job.yaml", job))]) == 0
    assert "ok: iterate.evaluate: 2 prompts with instructions" in capsys.readouterr().out
    write_jsonl(held, [ROWS[0], {**ROWS[1], "instruction_id_list": ["foo:bar"]}])
    assert main(["validate", str(write_job(tmp_path / "job.yaml", job))]) == 2
    err = capsys.readouterr().err
    assert "iterate.evaluate.prompts: " in err and "row 2 (id 'b')" in err, err
    job["iterate"]["evaluate"]["prompts"] = str(tmp_path / "none.jsonl")
    assert main(["validate", str(write_job(tmp_path / "job.yaml", job))]) == 2
    assert "iterate.evaluate.prompts: '" in capsys.readouterr().err
