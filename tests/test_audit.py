"""The shadow Best-of-N audit: which prompts, what a shadow is (the run's own candidates run to
the end), the record and verdict, recalibration under schedule auto, and a run end to end."""

from __future__ import annotations

import json
import random

import pytest

from specrej_ray.distributed.driver import run_job
from specrej_ray.engine.sequence import Candidate, PromptResult, Status
from specrej_ray.engine.task import Choice, EngineTask
from specrej_ray.quality import audit
from specrej_ray.quality.auto_schedule import Calibration
from specrej_ray.quality.calibrate import table_json
from specrej_ray.search.counterfactual import PromptCandidates
from specrej_ray.spec import validate_spec
from tests.conftest import text_score, tiny_job, write_jsonl
from tests.helpers.engines import engine
from tests.helpers.runs import dataset_rows

QUIET = {"echo": lambda *a, **k: None}


# -- which prompts ---------------------------------------------------------------------------


def test_picked_takes_about_the_fraction_stably_and_by_seed():
    ids = [f"p{i}" for i in range(4000)]
    share = sum(audit.picked(i, 0.1, seed=0) for i in ids) / len(ids)
    assert 0.08 < share < 0.12
    assert [audit.picked(i, 0.1, 0) for i in ids] == [audit.picked(i, 0.1, 0) for i in ids]
    assert [audit.picked(i, 0.1, 0) for i in ids] != [audit.picked(i, 0.1, 1) for i in ids]
    assert not any(audit.picked(i, 0.0, 0) for i in ids)
    assert all(audit.picked(i, 1.0, 0) for i in ids)


def test_runs_that_cannot_be_audited_say_why(tmp_path, tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hi."}])

    def why(**search):
        spec = validate_spec(tiny_job(tmp_path, tiny_lm_dir, prompts, search=search))
        return audit.why_off(spec.search)

    assert why() is None
    assert "audit_fraction is 0" in why(audit_fraction=0)
    assert "mode bon" in why(mode="bon")
    assert "n: auto" in why(n="auto")


# -- a prompt's record and the verdict --------------------------------------------------------


def cand(index, tokens, status=Status.FINISHED, score=None) -> Candidate:
    return Candidate(index, list(tokens), status, final_score=score)


def result(pid, cands) -> PromptResult:
    finals = [c.final_score if c.finished else float("-inf") for c in cands]
    best = max(range(len(cands)), key=lambda k: finals[k]) if any(c.finished for c in cands) \
        else None
    return PromptResult(pid, cands, best, len(cands), 1, 1, 3, 0.0, 0.0)


SHADOW = result("p" + audit.SHADOW, [cand(0, [1, 2, 3], score=0.0), cand(1, [4, 5, 6], score=1.0),
                                     cand(2, [7, 8], score=0.5)])


def test_record_scores_the_runs_answer_against_the_shadows_candidates():
    # The run kept candidates 0 and 2 (its best: 2) and rejected 1 after two tokens.
    run = result("p", [cand(0, [1, 2, 3], score=0.2), cand(1, [4, 5], Status.REJECTED),
                       cand(2, [7, 8], score=0.9)])
    rec = audit.record(run, SHADOW, {"alpha": 0.5, "schedule": [2]})
    # Eq. 6 on the shadow's final scores: (0.5 - 0) / (1 - 0).
    assert rec["score"] == pytest.approx(50.0)
    assert rec["tokens"] == 7 and rec["shadow_tokens"] == 8
    assert rec["identity_mismatches"] == 0 and rec["setting"]["schedule"] == [2]


def test_a_shadow_that_is_not_the_runs_candidates_voids_the_score():
    run = result("p", [cand(0, [1, 2, 3], score=0.2), cand(1, [4, 9], Status.REJECTED),
                       cand(2, [7, 8], score=0.9)])
    rec = audit.record(run, SHADOW)
    assert rec["score"] is None and rec["identity_mismatches"] == 1
    assert rec["first_mismatch"] == "p/1"


def records(scores):
    return [{"prompt_id": f"p{i}", "score": s, "tokens": 10, "shadow_tokens": 30,
             "identity_mismatches": 0} for i, s in enumerate(scores)]


@pytest.mark.parametrize("scores, verdict", [
    ([100.0] * 6, "met"),
    ([60.0, 70.0, 65.0, 80.0, 75.0, 70.0], "missed"),
    ([100.0, 50.0, 100.0, 100.0, 100.0, 90.0], "unsure"),
    ([50.0, 40.0, 60.0], "too few"),
])
def test_the_verdict_follows_the_interval(scores, verdict):
    s = audit.summarize(records(scores), target=99)
    assert s["verdict"] == verdict
    assert s["low"] <= s["score"] <= s["high"]
    assert s["score"] == pytest.approx(sum(scores) / len(scores))
    assert s["shadow_tokens"] == 30 * len(scores) and s["prompts"] == len(scores)


def test_the_line_states_score_interval_verdict_and_cost():
    s = audit.summarize(records([60.0, 70.0, 65.0, 80.0, 75.0, 70.0]), target=99)
    text = audit.line(s, decoded=360)
    assert "normalized score 70.0" in text and "missed" in text
    assert "180 shadow tokens, 50.0% of the run's decoded tokens" in text
    assert "none scored" in audit.line(audit.summarize(records([None]), 99))
    assert "no prompt audited" in audit.line(audit.summarize([], 99))


# -- a shadow in the engine ------------------------------------------------------------------


def test_a_shadow_task_draws_the_real_tasks_candidates(lm):
    """Beside the real SBoN task in one batch, a Best-of-N task drawing the same prompt's
    samples holds the same candidates run to the end; with its own id's samples it would
    not (so the check can fail)."""
    ids = lm[1]("<|user|>Tell me something.<|assistant|>", add_special_tokens=False).input_ids
    eng = engine(lm, n=8, alpha=0.5, decisions=(6, 12))
    bon = Choice(0.0, None)
    real, shadow, stranger = eng.run([
        EngineTask("p", ids, text_score),
        EngineTask("p" + audit.SHADOW, ids, text_score, choice=bon, samples_of="p"),
        EngineTask("q", ids, text_score, choice=bon),
    ])
    assert real.rejected > 0 and shadow.finished == 8
    rec = audit.record(real, shadow)
    assert rec["identity_mismatches"] == 0 and rec["score"] is not None
    assert rec["shadow_tokens"] > rec["tokens"]
    assert audit.record(real, stranger)["identity_mismatches"] > 0


# -- recalibration ---------------------------------------------------------------------------


class FakeOutput:
    def __init__(self) -> None:
        self.records: dict[str, dict] = {}
        self.written: list[dict] = []

    def calibration(self):
        return self.written[-1] if self.written else None

    def write_calibration(self, data) -> None:
        self.written.append(json.loads(json.dumps(data)))


def table(rng, noise):
    finals = [rng.gauss(0, 1) for _ in range(16)]
    return table_json(PromptCandidates(
        tuple(rng.randint(30, 40) for _ in finals), tuple(finals),
        {t: [f + rng.gauss(0, noise) for f in finals] for t in (8, 16)}))


def test_audits_that_miss_recalibrate_on_calibration_and_audited_prompts(tmp_path,
                                                                         tiny_lm_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "Hi."}])
    job = tiny_job(tmp_path, tiny_lm_dir, prompts,
                   search={"n": 16, "schedule": "auto", "target_score": 90})
    job["generator"]["sampling"]["max_new_tokens"] = 20  # calibration scores 8 and 16 tokens
    spec = validate_spec(job)
    rng = random.Random(0)
    out = FakeOutput()
    cal = Calibration(spec, out, ["c0", "c1", "c2"], 1, lambda *a: None)
    # Calibration prompts whose partial rewards rank perfectly: an early, harsh cut qualifies.
    choice = cal.choice({f"c{i}": table(rng, 0.0) for i in range(3)})
    assert choice.alpha > 0
    run = out.written[-1]["run_with"]
    setting = {"alpha": run["alpha"], "schedule": run["schedule"]}
    # Audits of another setting say nothing about this one; too few say nothing either.
    other = [dict(r, setting={"alpha": 0.1, "schedule": [8]}) for r in records([10.0] * 6)]
    assert cal.audited(other, {}) is None
    few = [dict(r, setting=setting) for r in records([10.0] * 3)]
    assert cal.audited(few, {}) is None and len(out.written) == 1
    # Audited prompts whose partial rewards are noise: the choice missed; recalibrate.
    more = [dict(r, prompt_id=f"a{i}", setting=setting) for i, r in
            enumerate(records([20.0, 30.0, 25.0]))]
    noisy = {f"a{i}": table(rng, 50.0) for i in range(3)}
    again = cal.audited(more, noisy)
    assert again is not None and len(out.written) == 2
    data = out.written[-1]
    assert data["recalibrations"][0]["was"] == run
    assert data["recalibrations"][0]["audit"]["verdict"] == "missed"
    assert data["recalibrations"][0]["prompts"] == 6  # 3 calibration + 3 audited
    assert sorted(data["recalibrations"][0]["audited"]) == ["a0", "a1", "a2", "p0", "p1", "p2"]
    # The new choice starts with no audits of its own.
    assert cal.audited([], {}) is None


# -- a run -----------------------------------------------------------------------------------


@pytest.mark.ray
def test_an_audited_run_measures_itself_and_keeps_its_own_answers(tmp_path, tiny_lm_dir,
                                                                  ray_cluster):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"Tell me {i}."}
                                                 for i in range(5)])

    def run(name, fraction):
        spec = tiny_job(tmp_path, tiny_lm_dir, prompts,
                        search={"n": 6, "alpha": 0.5, "schedule": {"tokens": [4, 8]},
                                "audit_fraction": fraction})
        spec["output"]["path"] = str(tmp_path / name)
        return run_job(validate_spec(spec), **QUIET)

    audited, plain = run("audited", 1.0), run("plain", 0.0)
    a = audited["audit"]
    assert a["off"] is None and a["prompts"] == 5 and a["scored"] == 5
    assert a["identity_mismatches"] == 0 and a["shadow_tokens"] > a["tokens"]
    assert a["low"] <= a["score"] <= a["high"] <= 100
    assert plain["audit"] == {"fraction": 0.0, "off": "search.audit_fraction is 0"}
    # Shadows never become answers or candidates: both datasets are the same.
    # (the fingerprint differs: under schedule auto an audit can change later settings)
    assert _answers(tmp_path / "audited") == _answers(tmp_path / "plain")
    records = [json.loads(p.read_text()) for p in (tmp_path / "audited" / "shards").glob("*.json")]
    assert sorted(r["prompt_id"] for rec in records for r in rec["audit"]) == \
        [f"q{i}" for i in range(5)]


def _answers(out) -> tuple[list[dict], list[dict]]:
    best, candidates = dataset_rows(out)
    return tuple([{k: v for k, v in r.items() if k != "fingerprint"} for r in rows]
                 for rows in (best, candidates))
