"""`specrej-ray bench` end to end on the tiny model, and its pure parts on hand-built numbers.

The report's fields are checked, never its speed.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from specrej_ray.benchmark import BenchError, parse_n_list
from specrej_ray.benchmark.hardware import DecodeShape, Peak, decode_roofline
from specrej_ray.benchmark.quality import (
    matched,
    normalized_scores,
    speedups,
)
from specrej_ray.cli import main
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.quality.identity import Identity, identity
from specrej_ray.quality.stats import Interval, bootstrap
from tests.conftest import tiny_job, write_job, write_jsonl

PROMPTS = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Count to three."},
           {"id": "c", "prompt": "Name a colour."}]
ARMS = {"sbon", "sbon-norefill", "bon-2", "bon-4"}


def byte_reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Exact and batch-independent (a model's float noise could put SBoN a hair over BoN)."""
    return [(sum(r.encode()) % 1009) / 1009 for r in responses]


@pytest.fixture(scope="module")
def job_path(tmp_path_factory, tiny_lm_dir):
    tmp = tmp_path_factory.mktemp("bench")
    prompts = write_jsonl(tmp / "prompts.jsonl", PROMPTS)
    job = tiny_job(tmp, tiny_lm_dir, prompts,
                   search={"n": 4, "alpha": 0.5, "schedule": {"tokens": [3, 6]}},
                   reward={"type": "callable", "function": "tests.test_bench:byte_reward"})
    job["generator"]["sampling"]["max_new_tokens"] = 10
    return write_job(tmp / "job.yaml", job)


@pytest.fixture(scope="module")
def bench(job_path):
    out = job_path.parent / "results"
    threads = torch.get_num_threads()  # bench sets the spec's threads; leave others theirs
    try:
        code = main(["bench", str(job_path), "--n-list", "2,4", "--batch", "2,4",
                     "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads((out / "bench.json").read_text()), out


def arms(report: dict) -> dict[str, dict]:
    return {a["name"]: a for a in report["arms"]}


def test_every_arm_is_measured(bench):
    code, report, _ = bench
    assert code == 0
    assert set(arms(report)) == ARMS
    assert report["prompts"] == len(PROMPTS)
    for a in report["arms"]:
        assert a["seconds"] > 0 and a["tokens"] > 0, a["name"]
        assert 0 < a["occupancy"] <= 1, a["name"]
        assert a["decode_steps"] > 0 and a["mean_best_reward"] is not None
        assert set(a["best_reward"]) == {p["id"] for p in PROMPTS}
    assert arms(report)["sbon"]["refill"] and not arms(report)["sbon-norefill"]["refill"]


def test_every_arm_is_paired_with_best_of_n_at_the_spec_n(bench):
    _, report, _ = bench
    assert report["reference"] == "bon-4"
    ids = {p["id"] for p in PROMPTS}
    for a in report["arms"]:
        ns = a["normalized_score"]
        assert set(ns["per_prompt"]) == ids, a["name"]
        assert ns["low"] <= ns["mean"] <= ns["high"]
        assert a["token_rate"] > 0 and a["speedup"] > 0
        sp = a["speedup_per_prompt"]
        assert sp["low"] <= sp["value"] <= sp["high"]
        assert set(a["cost_seconds"]) == ids and all(v > 0 for v in a["cost_seconds"].values())
    by_name = arms(report)
    ref = by_name["bon-4"]
    assert ref["normalized_score"]["mean"] == 100 and ref["token_rate"] == 1
    for name in ("sbon", "sbon-norefill"):
        a = by_name[name]
        # Candidate identity: SBoN's best is one of Best-of-4's candidates.
        assert all(0 <= v <= 100 for v in a["normalized_score"]["per_prompt"].values())
        assert a["decoded_tokens"] == a["tokens"] + a["discarded_tokens"] + a["replayed_tokens"]
    # Refill changes the schedule of the batch, never the candidates.
    assert by_name["sbon"]["best_reward"] == by_name["sbon-norefill"]["best_reward"]
    assert "first reward" in report["reward_note"] and "eq. 6" in report["score_note"]


def test_candidate_identity_is_checked_and_holds(bench):
    _, report, _ = bench
    checks = report["identity"]
    for name in ("sbon", "sbon-norefill"):
        c = checks[name]
        assert c["mismatches"] == 0 and c["first_mismatch"] is None
        assert c["finished_equal"] + c["rejected_prefix"] == 4 * len(PROMPTS)
        assert c["rejected_prefix"] > 0
    assert checks["refill_changes_nothing"]


def test_matched_speedup_fields(bench):
    _, report, _ = bench
    m = report["matched"]
    assert m["note"] and m["summary"]
    if m["n"] is not None:  # between two grid points
        assert m["bracket"][0] <= m["n"] <= m["bracket"][1]
        assert m["low"] <= m["speedup"] <= m["high"]
    else:
        assert m["bound"]


def test_throughput_and_roofline_at_each_batch(bench):
    _, report, _ = bench
    assert [t["batch"] for t in report["throughput"]] == [2, 4]
    for t in report["throughput"]:
        assert t["new_tokens"] == 10
        for side in ("engine", "generate"):  # EOS suppressed: every row runs to the end
            assert t[side]["tokens"] == t["batch"] * 10 and t[side]["tokens_per_s"] > 0
        assert t["ratio"] == pytest.approx(t["engine"]["tokens_per_s"]
                                           / t["generate"]["tokens_per_s"])
        assert t["engine_mean_rows"] == pytest.approx(t["batch"])  # the budget holds them all
    assert [r["batch"] for r in report["roofline"]] == [2, 4]
    for r in report["roofline"]:
        assert r["peak"]["flops_per_s"] > 0 and r["peak"]["bytes_per_s"] > 0
        assert r["tokens_per_s"] > 0 and r["bound"] in ("compute", "memory")
        assert set(r["fraction_of_bound"]) == {"engine", "model.generate"}


def test_files_targets_and_machine(bench):
    _, report, out = bench
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| sbon |" in md and "### Targets" in md and "### Roofline" in md
    assert "Candidate identity, sbon vs bon-4: holds" in md
    names = [t["name"] for t in report["targets"]]
    assert names[0].startswith("KV bytes held never exceed the budget")
    assert report["targets"][0]["status"] == "met"
    assert sum("model.generate at batch" in n for n in names) == 2
    for t in report["targets"]:
        assert t["status"] in ("met", "not met") or t["status"].startswith("n/a"), t
    assert report["machine"]["cores"] >= 1 and report["machine"]["versions"]["torch"]
    assert report["command"].startswith("specrej-ray bench ")


def test_skips_leave_those_sections_out(job_path, tmp_path):
    threads = torch.get_num_threads()
    try:
        code = main(["bench", str(job_path), "--n-list", "4", "--prompts", "1",
                     "--skip-throughput", "--skip-roofline", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert code == 0 and report["throughput"] == [] and report["roofline"] == []
    assert report["prompts"] == 1 and {a["name"] for a in report["arms"]} == ARMS - {"bon-2"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--n-list", "8,x"], "--n-list '8,x'"),
        (["--n-list", "0,4"], "positive integers"),
        (["--batch", "0"], "--batch '0'"),
        (["--batch", "16,x"], "--batch '16,x'"),
        (["--set", "search.mode=bon"], "search.mode is bon"),
        (["--set", "search.n=auto"], "search.n is auto"),
        (["--calibration", "x.jsonl"], "only schedule auto calibrates"),
    ],
)
def test_user_errors_exit_2_with_one_line(job_path, capsys, argv, expected):
    code = main(["bench", str(job_path), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and expected in err[0], err


def run_auto_bench(job_path, out, *extra):
    threads = torch.get_num_threads()
    try:
        code = main(["bench", str(job_path), "--n-list", "4", "--skip-throughput",
                     "--skip-roofline", "--out", str(out), "--set", "search.schedule=auto",
                     "--set", "search.calibration_prompts=1", "--set", "search.target_score=0",
                     *extra])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return json.loads((out / "bench.json").read_text())


def test_the_auto_arm_calibrates_chooses_and_the_sbon_arms_run_its_choice(job_path, tmp_path):
    report = run_auto_bench(job_path, tmp_path)
    by_name = arms(report)
    assert set(by_name) == ARMS - {"bon-2"} | {"auto"}
    auto = report["auto"]
    run = auto["choice"]["run_with"]
    assert auto["calibration_prompts"] == ["a"] and not auto["held_out"]
    assert auto["choice"]["how"] == "chosen", json.dumps(auto["choice"])[:3000]
    assert run["alpha"] > 0  # target 0: anything goes
    assert auto["calibration_seconds"] > 0 and auto["matched"]["summary"]
    # The calibration prompt is Best-of-N's own answer; the SBoN arms ran the choice.
    assert by_name["auto"]["normalized_score"]["per_prompt"]["a"] == 100
    assert by_name["auto"]["alpha"] == by_name["sbon"]["alpha"] == run["alpha"]
    assert by_name["auto"]["best_reward"]["b"] == by_name["sbon"]["best_reward"]["b"]
    names = [t["name"] for t in report["targets"] if t["name"].startswith("auto:")]
    assert len(names) == 4
    for a in report["arms"]:
        assert a["rewards"] and a["score_seconds"] >= 0
    assert "### schedule: auto" in (tmp_path / "bench.md").read_text()


def test_the_auto_arm_can_calibrate_on_held_out_prompts(job_path, tmp_path):
    held = write_jsonl(tmp_path / "held.jsonl", [{"id": "h1", "prompt": "Say bye."},
                                                 {"id": "h2", "prompt": "Count to two."}])
    report = run_auto_bench(job_path, tmp_path / "out", "--calibration", str(held))
    assert report["auto"]["calibration_prompts"] == ["h1"] and report["auto"]["held_out"]
    assert set(arms(report)["auto"]["best_reward"]) == {p["id"] for p in PROMPTS}
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": "a", "prompt": "Say hi."}])
    threads = torch.get_num_threads()
    try:
        code = main(["bench", str(job_path), "--set", "search.schedule=auto", "--calibration",
                     str(clash), "--out", str(tmp_path / "x")])
    finally:
        torch.set_num_threads(threads)
    assert code == 2


def test_parse_n_list():
    assert parse_n_list("8, 16,32") == (8, 16, 32)
    for bad in ("", "8,,16", "-1", "a"):
        with pytest.raises(BenchError):
            parse_n_list(bad)


# -- pure parts on hand-built arms ----------------------------------------------------------


def result(pid: str, scores: list[float | None], best: int | None, seconds: float = 1.0,
           tokens: list[list[int]] | None = None) -> PromptResult:
    cands = [Candidate(k, tokens=list(tokens[k]) if tokens else [1, 2],
                       status=Status.FINISHED if s is not None else Status.REJECTED,
                       finish_reason="eos" if s is not None else None,
                       rejected_round=None if s is not None else 1, final_score=s,
                       components={} if s is None else {"r": s})
             for k, s in enumerate(scores)]
    return PromptResult(pid, cands, best, len(cands), 1, 1, 3, seconds, 0.0,
                        engine_seconds=seconds)


def test_normalized_scores_are_eq_6_against_the_reference():
    bon = [result("p", [0.0, 1.0, 2.0, 4.0], 3), result("q", [1.0, 1.0], 0)]
    sbon = [result("p", [None, None, 2.0, None], 2), result("q", [1.0, None], 0),
            result("z", [3.0], 0)]  # no reference twin: no score
    assert normalized_scores(sbon, bon, "r") == {"p": pytest.approx(50.0), "q": 100.0}


def test_identity_counts_equal_finished_and_prefix_rejected():
    bon = [result("p", [1.0, 2.0, 3.0], 2, tokens=[[5, 6, 7], [5, 8], [9, 9, 9]])]
    good = [result("p", [1.0, None, 3.0], 2, tokens=[[5, 6, 7], [5], [9, 9, 9]])]
    bad = [result("p", [1.0, None, 3.0], 2, tokens=[[5, 6, 7], [6], [9, 9]])]
    assert identity(good, bon) == Identity(2, 1, 0, None)
    got = identity(bad, bon)
    assert (got.mismatches, got.first_mismatch, got.holds) == (2, "p/1", False)


def _arms(rewards: dict[int, list[float]], times: dict[int, float], sbon: list[float],
          sbon_time: float):
    """Best-of-N arms and an SBoN arm on len(sbon) prompts: per-prompt best reward and cost."""
    bon = {n: [result(f"p{i}", [r], 0, times[n] / len(rs)) for i, r in enumerate(rs)]
           for n, rs in rewards.items()}
    s = [result(f"p{i}", [r], 0, sbon_time / len(sbon)) for i, r in enumerate(sbon)]
    return bon, s


def test_matched_reward_is_interpolated_in_log_n():
    # Mean rewards 1 at N=8 and 2 at N=32; SBoN's 1.5 sits halfway in log N: N = 16.
    bon, sbon = _arms({8: [1.0] * 10, 32: [2.0] * 10}, {8: 10.0, 32: 40.0}, [1.5] * 10, 5.0)
    m = matched(bon, sbon, "r")
    assert m.bracket == (8, 32) and m.n == pytest.approx(16.0)
    # Time interpolated the same way: 10 s at 8, 40 s at 32 -> 20 s at 16; over 5 s.
    assert m.speedup.value == pytest.approx(4.0)
    assert m.speedup.low == pytest.approx(4.0) and m.speedup.high == pytest.approx(4.0)


def test_matched_reward_bootstrap_widens_with_prompt_noise():
    rng = random.Random(1)
    noisy = [1.5 + rng.uniform(-0.4, 0.4) for _ in range(20)]
    bon, sbon = _arms({8: [1.0] * 20, 32: [2.0] * 20}, {8: 10.0, 32: 40.0}, noisy, 5.0)
    m = matched(bon, sbon, "r")
    assert m.speedup.low < m.speedup.value < m.speedup.high


def test_matched_reward_outside_the_grid_is_a_bound():
    bon, sbon = _arms({8: [1.0] * 3, 16: [2.0] * 3}, {8: 10.0, 16: 20.0}, [3.0] * 3, 4.0)
    m = matched(bon, sbon, "r")
    assert m.n is None and m.speedup is None and "at least" in m.bound and "= 5.00" in m.bound
    bound = matched(bon, sbon, "r", "the bounds arm").bound  # names the arm it is about
    assert "SBoN" not in bound and bound.endswith("time over the bounds arm's = 5.00")
    low, _ = _arms({8: [1.0] * 3, 16: [2.0] * 3}, {8: 10.0, 16: 20.0}, [0.5] * 3, 4.0)
    m = matched(low, _arms({8: [1.0]}, {8: 1.0}, [0.5] * 3, 4.0)[1], "r")
    assert m.n is None and "at or below Best-of-8" in m.bound


def test_speedups_give_totals_and_the_per_prompt_mean():
    ref = [result("a", [1.0], 0, 8.0), result("b", [1.0], 0, 2.0)]
    arm = [result("a", [1.0], 0, 2.0), result("b", [1.0], 0, 2.0)]
    s = speedups(arm, ref)
    assert s.totals.value == pytest.approx(10 / 4)
    assert s.per_prompt.value == pytest.approx((4 + 1) / 2)
    assert s.per_prompt.low <= s.per_prompt.value <= s.per_prompt.high


def test_bootstrap_interval_brackets_the_mean():
    ci = bootstrap([1.0, 2.0, 3.0, 4.0, 10.0])
    assert ci.low < ci.value == 4.0 < ci.high
    assert bootstrap([5.0] * 7) == Interval(5.0, 5.0, 5.0)
    assert math.isnan(bootstrap([]).value)


def test_roofline_counts_the_shared_prompt_once():
    shape = DecodeShape(weight_params=1000, gathered_params=500, dtype_bytes=4, layers=2,
                        heads=4, head_dim=8, kv_bytes_per_token=64)
    peak = Peak("cpu", "float32", 2048, flops_per_s=1e6, bandwidth_bytes=2**20, bytes_per_s=1e5)
    r = decode_roofline(shape, peak, batch=4, prompt_tokens=10, new_tokens=20)
    assert r.context == 20  # 10 + 20 / 2
    assert r.bytes_per_step == 1000 * 4 + (10 + 4 * 10) * 64
    assert r.flops_per_step == 2 * 1000 * 4 + 4 * 2 * 4 * 8 * 20 * 4
    assert r.bound == "memory" and r.step_seconds == pytest.approx(r.bytes_per_step / 1e5)
    assert r.tokens_per_s == pytest.approx(4 / r.step_seconds)
    assert any("7.2 kB" in line for line in r.lines)  # 4,000 + 3,200 bytes, written out
    assert any("500 parameters are gathered" in line for line in r.lines)


@pytest.fixture(scope="module")
def vllm_bench(tmp_path_factory):
    """The bench with --engines hf,vllm on the vLLM tiny model (vLLM's CPU attention needs a
    head of 64)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs it)")
    from tests.helpers.vllm_engines import tiny_vllm_dir

    tmp = tmp_path_factory.mktemp("vllm-bench")
    model = tiny_vllm_dir(tmp / "lm")
    job = tiny_job(tmp, model, write_jsonl(tmp / "prompts.jsonl", PROMPTS),
                   search={"n": 4, "alpha": 0.5, "schedule": {"tokens": [3, 6]},
                           "kv_budget_gb": 0.0625},
                   reward={"type": "callable", "function": "tests.test_bench:byte_reward"})
    job["generator"].update(vllm={"enforce_eager": True, "max_model_len": 256})
    job["generator"]["sampling"]["max_new_tokens"] = 10
    path, out = write_job(tmp / "job.yaml", job), tmp / "results"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", str(path), "--n-list", "2,4", "--engines", "hf,vllm",
                     "--skip-throughput", "--skip-roofline", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads((out / "bench.json").read_text()), out


def test_vllm_arms_run_beside_the_hf_ones(vllm_bench):
    code, report, out = vllm_bench
    assert code == 0
    e = report["engines"]
    rows = {(a["engine"], a["name"]): a for a in e["arms"]}
    assert set(rows) == {("hf", "sbon"), ("hf", "bon-4"), ("vllm", "vllm:sbon"),
                         ("vllm", "vllm:bon-2"), ("vllm", "vllm:bon-4"), ("vllm", "vllm-n4")}
    for (engine, _), a in rows.items():
        ref = "bon-4" if engine == "hf" else "vllm:bon-4"
        assert a["reference"] == ref
        assert (a["vllm"] is not None) == (engine == "vllm")
        assert a["decoded_tokens"] == a["tokens"] + a["discarded_tokens"] + a["replayed_tokens"]
        if engine == "vllm":
            assert set(a["vllm"]) >= {"preemptions", "prefix_hit_rate", "requests"}
    assert rows[("vllm", "vllm:bon-4")]["normalized_score"]["mean"] == 100
    # the vLLM backend's Best-of-N is the hf engine's, candidate for candidate; SBoN on vLLM
    # keeps Best-of-N's text for its finished candidates
    assert e["identity"]["bon_candidates_equal_across_engines"] == "12/12"
    ident = e["identity"]["vllm_sbon_vs_vllm_bon"]
    assert ident["mismatches"] == 0 and ident["finished_equal"] > 0
    assert rows[("vllm", "vllm:sbon")]["tokens"] == rows[("hf", "sbon")]["tokens"]
    assert {"hf", "vllm"} == set(e["matched"])
    assert "### Engines side by side" in (out / "bench.md").read_text()
    # issue 20's targets are reported beside the others, each with its figure
    named = {t["name"]: t for t in report["targets"]}
    users = named["SBoN on vLLM vs Best-of-4 on vLLM the users' way (n=4), wall-clock"]
    v, u = rows[("vllm", "vllm:sbon")], rows[("vllm", "vllm-n4")]
    assert f"{u['seconds'] / v['seconds']:.2f}x" in users["measured"]
    assert users["status"].startswith("n/a")  # its goal is at 512 tokens
    reprefill = named["SBoN on vLLM: survivors re-prefill at most one block per decision"]
    assert f"over {v['vllm']['continuations']} continuations" in reprefill["measured"]
    assert v["vllm"]["continuations"] > 0 and v["vllm"]["block_size"] > 0


@pytest.mark.parametrize("engines", ["vllm", "hf,tgi"])
def test_engines_must_include_hf_and_be_known(job_path, capsys, engines):
    code = main(["bench", str(job_path), "--engines", engines])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and f"--engines {engines}" in err[0], err


INSTRUCTED = [
    {"id": "a", "prompt": "Write anything.",
     "instruction_id_list": ["punctuation:no_comma", "change_case:english_lowercase"],
     "kwargs": [{}, {}]},
    {"id": "b", "prompt": "Write more.",
     "instruction_id_list": ["keywords:letter_frequency", "punctuation:no_comma"],
     "kwargs": [{"letter": "e", "let_frequency": 1, "let_relation": "at least"}, {}]},
    {"id": "c", "prompt": "Write less.",
     "instruction_id_list": ["length_constraints:number_words"],
     "kwargs": [{"num_words": 3, "relation": "less than"}]},
]


@pytest.fixture(scope="module")
def bounds_bench(tmp_path_factory, tiny_lm_dir):
    """The bench with a reward that gives bounds: SBoN, bounds alone and both, beside BoN."""
    tmp = tmp_path_factory.mktemp("bounds-bench")
    prompts = write_jsonl(tmp / "prompts.jsonl", INSTRUCTED)
    job = tiny_job(tmp, tiny_lm_dir, prompts, reward={"type": "instructions"},
                   search={"n": 8, "alpha": 0.5, "schedule": {"tokens": [4]},
                           "bounds_every": 2})
    job["generator"]["sampling"]["max_new_tokens"] = 16
    out = tmp / "results"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", str(write_job(tmp / "job.yaml", job)), "--n-list", "4,8",
                     "--skip-throughput", "--skip-roofline", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    return code, json.loads((out / "bench.json").read_text()), out


def test_bounds_arms_run_beside_sbon_and_match_best_of_n(bounds_bench):
    code, report, out = bounds_bench
    assert code == 0
    by_name = arms(report)
    assert set(by_name) == {"sbon", "bounds", "sbon+bounds", "bon-4", "bon-8"}
    bounds = by_name["bounds"]
    assert report["identity"]["bounds_answers_are_best_of_n"]
    assert set(bounds["normalized_score"]["per_prompt"].values()) == {100.0}
    assert bounds["pruned"] > 0 and bounds["bounds_checks"] > 0
    assert bounds["token_rate"] < 1 and by_name["bon-8"]["pruned"] == 0
    low, high = bounds["token_rate_ci"]["low"], bounds["token_rate_ci"]["high"]
    assert low <= bounds["token_rate"] <= high
    assert set(report["matched_arms"]) == {"sbon", "bounds", "sbon+bounds"}
    for arm, label in [("sbon", "SBoN's"), ("bounds", "the bounds arm's"),
                       ("sbon+bounds", "the sbon+bounds arm's")]:  # each note names its arm
        assert report["matched_arms"][arm]["note"].startswith(f"{label} mean reward")
    names = [t["name"] for t in report["targets"]]
    assert any(n.startswith("bounds alone: normalized score exactly 100") for n in names)
    assert "| bounds | 2 |" in (out / "bench.md").read_text()
