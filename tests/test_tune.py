"""`specrej-ray tune` end to end on the tiny model, and the replay against the real engine."""

from __future__ import annotations

import json

import pytest

from specrej_ray.cli import main
from specrej_ray.job.local import load_local
from specrej_ray.search.counterfactual import replay
from specrej_ray.spec import load_spec
from specrej_ray.tune.collect import collect
from specrej_ray.tune.options import DEFAULT_ALPHAS
from tests.conftest import tiny_job, write_job, write_jsonl
from tests.helpers.runs import cli

PROMPTS = [{"id": "a", "prompt": "Say hi."}, {"id": "b", "prompt": "Count to three."},
           {"id": "c", "prompt": "Name a colour."}]
# Many one-character stop strings make the random model's candidates end at varied lengths,
# some before a decision: the finished-candidate paths then run too.
STOPS = list("aeiouy0123456789")
GRID = (4, 8)


def make_job(folder, tiny_lm_dir):
    prompts = write_jsonl(folder / "prompts.jsonl", PROMPTS)
    job = tiny_job(folder, tiny_lm_dir, prompts)
    job["generator"]["sampling"]["stop"] = STOPS
    return write_job(folder / "job.yaml", job)


@pytest.fixture
def job_path(tmp_path, tiny_lm_dir):
    return make_job(tmp_path, tiny_lm_dir)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_lm_dir):
    """A job and the tune.json of one tune of it, generated once for the --from tests."""
    folder = tmp_path_factory.mktemp("saved")
    job = make_job(folder, tiny_lm_dir)
    assert main(["tune", str(job), "--decisions", "4,8", "--out", str(folder / "first")]) == 0
    return job, folder / "first" / "tune.json"


def run_tune(capsys, *argv) -> tuple[int, list[str], str]:
    code = main(["tune", *map(str, argv)])
    out = capsys.readouterr()
    return code, [line for line in out.err.splitlines() if line.strip()], out.out


def test_tune_end_to_end(tmp_path, job_path, capsys):
    out = tmp_path / "tuned"
    code, err, stdout = run_tune(capsys, job_path, "--decisions", "4,8", "--out", out)
    assert code == 0, err
    assert [line for line in err if line.startswith("tune: prompt")][-1].startswith(
        "tune: prompt 3/3 c:")
    assert "token rate" in stdout and "pearson" in stdout

    report = json.loads((out / "tune.json").read_text())
    assert report["settings"]["decisions"] == list(GRID)
    assert report["settings"]["n"] == 6 and report["settings"]["target"] == 99.0
    prompts = report["prompts"]
    assert [p["id"] for p in prompts] == ["a", "b", "c"]
    for p in prompts:
        assert len(p["lengths"]) == 6 and all(1 <= n <= 12 for n in p["lengths"])
        for t in GRID:
            for n, part, fin in zip(p["lengths"], p["partial"][str(t)], p["final"], strict=True):
                if n <= t:  # finished by t: one reward, so its partial score is its final one
                    assert part == pytest.approx(fin)
    bon_tokens = sum(sum(p["lengths"]) for p in prompts)

    base = report["baseline"]
    assert base["alpha"] == 0 and base["schedule"] == []
    assert base["token_rate"] == 1.0 and base["mean_score"] == 100.0
    assert base["sbon_tokens"] == base["bon_tokens"] == bon_tokens

    results = report["results"]
    expected = {(a, s) for a in DEFAULT_ALPHAS for s in [(4,), (8,), (4, 8)]}
    assert sorted((r["alpha"], tuple(r["schedule"])) for r in results) == sorted(expected)
    for r in results:
        assert 0 < r["token_rate"] <= 1
        assert r["bon_tokens"] == bon_tokens
        assert r["token_rate"] == pytest.approx(r["sbon_tokens"] / bon_tokens)
        assert len(r["scores"]) == 3 and max(r["scores"]) <= 100 + 1e-9
        assert r["min_score"] == min(r["scores"])
        assert r["mean_score"] == pytest.approx(sum(r["scores"]) / 3)

    check_recommendation(report, job_path, stdout)

    assert [c["tokens"] for c in report["correlation"]] == list(GRID)
    for c in report["correlation"]:
        for name in ("pearson", "kendall"):
            assert c[name] is None or -1 <= c[name] <= 1

    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_recommendation(report: dict, job_path, stdout: str) -> None:
    rec, target = report["recommendation"], report["settings"]["target"]
    for r in report["results"]:
        assert r["low"] <= r["high"] and 0 <= r["resampled"] <= 100 + 1e-9
    reaching = [r for r in report["results"] if r["resampled"] >= target]
    if rec is None:
        assert not reaching and "nothing is recommended" in stdout
        return
    assert rec["resampled"] >= target
    assert rec["token_rate"] == min(r["token_rate"] for r in reaching)
    assert rec["set"] in stdout
    # The printed overrides must configure a run with exactly this setting.
    spec = load_spec(job_path, rec["overrides"])
    assert spec.search.alpha == rec["alpha"] and spec.search.mode == "sbon"
    assert spec.search.decision_tokens == rec["schedule"]


def test_unreachable_target_recommends_nothing(tmp_path, job_path, capsys):
    out = tmp_path / "tuned"
    code, err, stdout = run_tune(capsys, job_path, "--decisions", "4", "--alphas", "0.9",
                                 "--prompts", "1", "--target", "101", "--out", out)
    assert code == 0, err
    report = json.loads((out / "tune.json").read_text())
    assert report["recommendation"] is None
    assert [(r["alpha"], r["schedule"]) for r in report["results"]] == [(0.9, [4])]
    check_recommendation(report, job_path, stdout)


def test_replay_matches_a_live_run(job_path):
    """SBoN run by the engine on the same candidates rejects, spends and returns what the
    counterfactual replay says (one reward, one wave)."""
    spec = load_spec(job_path, ["search.mode=bon"])
    job = load_local(spec)
    collected = collect(job, (4, 5, 7, 8), 3, progress=lambda line: None)
    bon = job.engine
    lengths_seen, stopped = set(), 0
    for alpha, schedule in [(0.5, (4, 8)), (0.8, (5,)), (0.7, (7,)), (0.9, (5, 7))]:
        sbon = bon.with_search(alpha=alpha, decision_tokens=schedule)
        for task, got in zip(job.engine_tasks(3), collected, strict=True):
            live = sbon.generate(task.prompt_id, task.input_ids, task.score)
            assert live.n0 == sbon.search.n  # one wave (the replay holds for waves too)
            want = replay(got.data, alpha, schedule)
            rejected = {c.index: len(c.tokens) for c in live.candidates
                        if c.rejected_round is not None}
            assert rejected == want.rejected
            assert live.tokens_generated == want.sbon_tokens
            assert live.best == want.best
            lengths_seen.update(got.data.lengths)
            stopped += len(rejected)
    assert stopped and min(lengths_seen) <= 8 < max(lengths_seen)  # finished before deciding


def test_from_replays_a_saved_tune_without_generating(tmp_path, saved, capsys, monkeypatch):
    job_path, first = saved
    saved = json.loads(first.read_text())

    def no_generation(*args, **kwargs):
        raise AssertionError("--from generated candidates")

    monkeypatch.setattr("specrej_ray.job.local.load_local", no_generation)
    again = tmp_path / "again"
    code, err, stdout = run_tune(capsys, job_path, "--from", first, "--decisions", "8",
                                 "--prompts", "2", "--target", "50", "--out", again)
    assert code == 0, err
    report = json.loads((again / "tune.json").read_text())
    assert [p["id"] for p in report["prompts"]] == ["a", "b"]
    assert report["prompts"] == saved["prompts"][:2]
    assert report["settings"]["decisions"] == [8] and report["settings"]["prompts"] == 2
    assert report["settings"]["from"] == str(first)
    assert {tuple(r["schedule"]) for r in report["results"]} == {(8,)}
    check_recommendation(report, job_path, stdout)
    # The same candidates replay to the same tokens as in the first tune's two prompts.
    lengths = [p["lengths"] for p in saved["prompts"][:2]]
    assert report["baseline"]["bon_tokens"] == sum(map(sum, lengths))


@pytest.mark.parametrize(("args", "expected"), [
    (["--set", "search.n=5"], "made with search.n=6, the job has 5; tune the job again"),
    (["--set", "seed=3"], "made with seed=0, the job has 3"),
    (["--decisions", "6"], "--decisions: 6 was not scored in"),
    (["--prompts", "4"], "holds 3 prompts, not 4"),
    (["--set", "reward={type: callable, function: 'tests.test_tune:constant_reward'}"],
     "the job has 'callable(tests.test_tune:constant_reward)'; tune the job again"),
])
def test_from_refuses_what_the_saved_candidates_cannot_answer(tmp_path, saved, capsys, args,
                                                              expected):
    job_path, first = saved
    code, err, _ = run_tune(capsys, job_path, "--from", first, "--out", tmp_path / "t", *args)
    assert code == 2 and len(err) == 1, err
    assert expected in err[0] and err[0].startswith("specrej-ray: error: ")


def test_from_never_replaces_its_own_file(saved, capsys):
    job_path, first = saved
    before = first.read_bytes()
    code, err, _ = run_tune(capsys, job_path, "--from", first, "--prompts", "1",
                            "--out", first.parent)
    assert code == 2 and len(err) == 1, err
    assert "would replace --from" in err[0] and first.read_bytes() == before


def edited(saved, edit) -> str:
    data = json.loads(saved[1].read_text())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda d: d["prompts"][1]["partial"].pop("8"), "prompt b is malformed (no partial "
     "scores at 8 tokens)"),
    (lambda d: d["prompts"][0]["final"].pop(), "prompt a is malformed (6 lengths but 5 final"),
    (lambda d: d["settings"].pop("seed"), "records no seed"),
    (lambda d: d["settings"].update(decisions=[]), "records no decision lengths"),
])
def test_from_an_edited_tune_json_exits_2_naming_what_is_wrong(tmp_path, saved, capsys, edit,
                                                               expected):
    path = tmp_path / "tune.json"
    path.write_text(edited(saved, edit))
    code, err, _ = run_tune(capsys, saved[0], "--from", path, "--out", tmp_path / "t")
    assert code == 2 and len(err) == 1, err
    assert expected in err[0]


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot read it"), ("{", "not JSON"), ('{"settings": {}}', "not a tune.json"),
    ('{"settings": {}, "prompts": [{"final": [NaN]}]}', "not JSON (NaN is not a score"),
])
def test_from_a_file_that_is_not_a_tune_json_exits_2(tmp_path, job_path, capsys, content,
                                                     expected):
    path = tmp_path / "tune.json"
    if content is not None:
        path.write_text(content)
    code, err, _ = run_tune(capsys, job_path, "--from", path)
    assert code == 2 and len(err) == 1, err
    assert f"--from {path}: {expected}" in err[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["--alphas", "0.5,x"], "--alphas: 'x' is not a number"),
    (["--alphas", "0.5,1.5"], "--alphas: 1.5 is not in [0, 1)"),
    (["--alphas", "0.5,,0.7"], "--alphas: empty item"),
    (["--decisions", "4,12"], "--decisions: 12 is not below generator.sampling.max_new_tokens"),
    (["--decisions", "-4"], "--decisions: '-4' is not a positive integer"),
    (["--prompts", "0"], "--prompts: must be at least 1"),
    (["--target", "nan"], "--target: must be a number, got nan"),
    (["--set", "output.path=memory://somewhere"], "output.path is a URL"),
])
def test_bad_options_exit_2_with_one_line(job_path, capsys, args, expected):
    code, err, _ = run_tune(capsys, job_path, *args)
    assert code == 2
    assert len(err) == 1, err
    assert expected in err[0] and err[0].startswith("specrej-ray: error: ")


def constant_reward(prompts: list[str], responses: list[str]) -> list[float]:
    return [1.0] * len(responses)


def test_a_constant_reward_gives_null_correlations_and_full_scores(tmp_path, job_path, capsys):
    out = tmp_path / "tuned"
    reward = f"reward={{type: callable, function: '{__name__}:constant_reward'}}"
    code, err, stdout = run_tune(capsys, job_path, "--decisions", "4,8", "--alphas", "0.5",
                                 "--prompts", "2", "--out", out, "--set", reward)
    assert code == 0, err
    report = json.loads((out / "tune.json").read_text())
    assert all(c["pearson"] is None and c["kendall"] is None for c in report["correlation"])
    assert "n/a" in stdout
    # Every candidate is as good as any other: nothing SBoN stops can cost score.
    assert all(r["mean_score"] == 100.0 for r in report["results"])


def test_a_run_after_tune_on_the_same_path_starts_beside_tunes_folder(tmp_path, job_path,
                                                                      capsys, ray_cluster):
    """tune's default folder is <output.path>/tune: the run that follows on a fresh path
    starts beside it (it was refused as a folder specrej-ray did not write), never lists it
    as its own, and an --overwrite leaves it."""
    code, _, _ = run_tune(capsys, job_path, "--decisions", "4", "--alphas", "0.5")
    out = tmp_path / "out"
    assert code == 0 and sorted(p.name for p in (out / "tune").iterdir()) == [
        "tune.json", "tune.png"]
    tuned = (out / "tune" / "tune.json").read_bytes()
    for argv in (["run", job_path], ["run", job_path, "--overwrite"]):
        done = cli(*argv)
        assert done.returncode == 0, done.stderr
        assert (out / "best.parquet").exists()
        assert (out / "tune" / "tune.json").read_bytes() == tuned
        assert "tune" not in json.loads((out / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("extra", ["notes.txt", "tune/notes.txt"])
def test_a_tune_folder_beside_anything_else_is_still_refused(tmp_path, job_path, capsys, extra):
    out = tmp_path / "out"
    (out / "tune").mkdir(parents=True)
    (out / "tune" / "tune.json").write_text(json.dumps({"settings": {}, "results": []}))
    (out / extra).write_text("mine")
    done = cli("validate", job_path)
    assert done.returncode == 2
    assert "is a non-empty directory that specrej-ray did not write" in done.stderr
