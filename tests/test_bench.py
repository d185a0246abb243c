"""`specrej-ray bench` end to end on the tiny model, and its pure parts on hand-built numbers.

The report's fields are checked, never its speed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from specrej_ray.benchmark import BenchError, parse_n_list
from specrej_ray.benchmark.matched import BonPoint, matched_speedup
from specrej_ray.benchmark.roofline import DecodeShape, Peak, decode_roofline
from specrej_ray.benchmark.scores import mean_best_reward, paired_normalized_scores
from specrej_ray.cli import main
from specrej_ray.engine.sequence import Candidate, PromptResult
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
        code = main(["bench", str(job_path), "--n-list", "2,4", "--batch", "4",
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


def test_sbon_is_paired_with_best_of_n_at_its_n(bench):
    _, report, _ = bench
    by_name = arms(report)
    for name in ("sbon", "sbon-norefill"):
        a = by_name[name]
        assert a["vs"] == "bon-4"
        per_prompt = a["normalized_score"]["per_prompt"]
        assert set(per_prompt) == {p["id"] for p in PROMPTS}
        # Candidate identity: SBoN's best is one of Best-of-4's candidates.
        assert all(0 <= s <= 100 for s in per_prompt.values())
        assert a["token_rate"] <= 1 and a["speedup"] > 0
    # Refill changes the schedule of the batch, never the candidates.
    assert by_name["sbon"]["best_reward"] == by_name["sbon-norefill"]["best_reward"]
    assert "first reward" in report["reward_note"]


def test_matched_speedup_fields(bench):
    _, report, _ = bench
    m, by_name = report["matched"], arms(report)
    # Best-of-4 holds SBoN's candidates, so some Best-of-N up to 4 matches its reward.
    assert m["n"] in (2, 4)
    assert by_name[f"bon-{m['n']}"]["mean_best_reward"] >= m["sbon_reward"]
    assert m["speedup"] == pytest.approx(by_name[f"bon-{m['n']}"]["seconds"] / m["sbon_seconds"])
    assert m["note"]


def test_throughput_and_roofline(bench):
    _, report, _ = bench
    t = report["throughput"]
    assert t["batch"] == 4 and t["new_tokens"] == 10
    for side in ("engine", "generate"):  # EOS suppressed: every row runs to the end
        assert t[side]["tokens"] == 4 * 10 and t[side]["tokens_per_s"] > 0
    assert t["ratio"] == pytest.approx(t["engine"]["tokens_per_s"] / t["generate"]["tokens_per_s"])
    r = report["roofline"]
    assert r["peak"]["flops_per_s"] > 0 and r["peak"]["bytes_per_s"] > 0
    assert r["tokens_per_s"] > 0 and r["bound"] in ("compute", "memory")
    assert set(r["fraction_of_bound"]) == {"engine", "model.generate"}
    assert any("tokens/s" in line and "bound" in line for line in r["lines"])


def test_files_targets_and_machine(bench):
    _, report, out = bench
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| sbon |" in md and "### Targets" in md and "### Roofline" in md
    assert len(report["targets"]) == 5
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
    assert code == 0 and report["throughput"] is None and report["roofline"] is None
    assert report["prompts"] == 1 and {a["name"] for a in report["arms"]} == ARMS - {"bon-2"}


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--n-list", "8,x"], "--n-list '8,x'"),
        (["--n-list", "0,4"], "positive integers"),
        (["--batch", "0"], "--batch 0"),
        (["--set", "search.mode=bon"], "search.mode is bon"),
    ],
)
def test_user_errors_exit_2_with_one_line(job_path, capsys, argv, expected):
    code = main(["bench", str(job_path), *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and expected in err[0], err


def test_parse_n_list():
    assert parse_n_list("8, 16,32") == (8, 16, 32)
    for bad in ("", "8,,16", "-1", "a"):
        with pytest.raises(BenchError):
            parse_n_list(bad)


# -- pure parts ---------------------------------------------------------------------------

def test_matched_picks_the_smallest_n_that_reaches_sbon():
    bon = [BonPoint(32, 0.9, 40.0), BonPoint(8, 0.5, 10.0), BonPoint(16, 0.8, 20.0)]
    m = matched_speedup(bon, sbon_reward=0.8, sbon_seconds=4.0)
    assert (m.n, m.bon_seconds, m.speedup, m.lower_bound) == (16, 20.0, 5.0, None)
    assert "Best-of-16" in m.note


def test_matched_without_a_match_gives_a_lower_bound():
    bon = [BonPoint(8, 0.5, 10.0), BonPoint(128, 0.7, 60.0)]
    m = matched_speedup(bon, sbon_reward=0.8, sbon_seconds=5.0)
    assert m.n is None and m.speedup is None and m.lower_bound == 12.0
    assert "Best-of-N up to 128 did not reach SBoN's reward" in m.note


def test_matched_skips_missing_rewards():
    bon = [BonPoint(8, math.nan, 1.0), BonPoint(16, 1.0, 8.0)]
    assert matched_speedup(bon, 0.9, 2.0).n == 16
    assert matched_speedup(bon, math.nan, 2.0).n is None


def result(pid: str, scores: list[float | None], best: int | None) -> PromptResult:
    cands = [Candidate(k, tokens=[1, 2], finish_reason="eos" if s is not None else None,
                       rejected_round=None if s is not None else 1, final_score=s,
                       components={} if s is None else {"r": s})
             for k, s in enumerate(scores)]
    return PromptResult(pid, cands, best, len(cands), 1, 1, 3, 1.0, 0.1)


def test_paired_normalized_scores_use_bons_range():
    bon = [result("p", [0.0, 1.0, 2.0, 4.0], 3), result("q", [1.0, 1.0], 0)]
    sbon = [result("p", [None, None, 2.0, None], 2), result("q", [1.0, None], 0),
            result("z", [3.0], 0)]  # no BoN twin: no score
    scores = paired_normalized_scores(sbon, bon, "r")
    assert scores == {"p": pytest.approx(50.0), "q": 100.0}
    assert mean_best_reward(sbon + [result("none", [None], None)], "r") == pytest.approx(2.0)


def test_roofline_arithmetic():
    shape = DecodeShape(weight_params=1000, gathered_params=500, dtype_bytes=4, layers=2,
                        heads=4, head_dim=8, kv_bytes_per_token=64)
    peak = Peak("cpu", "float32", 2048, flops_per_s=1e6, bandwidth_bytes=2**20, bytes_per_s=1e5)
    r = decode_roofline(shape, peak, batch=4, prompt_tokens=10, new_tokens=20)
    assert r.context == 20  # 10 + 20 / 2
    assert r.bytes_per_step == 1000 * 4 + 4 * 20 * 64
    assert r.flops_per_step == 2 * 1000 * 4 + 4 * 2 * 4 * 8 * 20 * 4
    assert r.bound == "memory" and r.step_seconds == pytest.approx(r.bytes_per_step / 1e5)
    assert r.tokens_per_s == pytest.approx(4 / r.step_seconds)
    assert any("9.12 kB" in line for line in r.lines)  # 4,000 + 5,120 bytes, written out
    assert any("500 parameters are gathered" in line for line in r.lines)
