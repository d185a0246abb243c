"""`specrej-ray report`: statistics, the numbers, the self-contained page and the CLI.

The run is written by hand (no Ray, no models) with values small enough to check by hand.
"""

from __future__ import annotations

import base64
import io
import json
import math
from html.parser import HTMLParser
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specrej_ray.cli import main
from specrej_ray.data.dataset import BEST_SCHEMA, CANDIDATE_SCHEMA
from specrej_ray.quality.stats import kendall_tau_b, least_squares, mean, median, pearson
from specrej_ray.report import build_analysis, text_summary, write_report

# Prompt p1: first-decision partial scores and final scores of its five finished candidates.
# Ties in both (x: 2, 2; y: 2, 2). By hand: 7 concordant pairs, 1 discordant, 1 tied in x
# only, 1 tied in y only, of 10: tau-b = (7 - 1) / sqrt((10 - 1) * (10 - 1)) = 2/3.
# Pearson: sxy = 5.8, sxx = 5.2, syy = 9.2.
P1_X = [1.0, 2.0, 2.0, 3.0, 4.0]
P1_Y = [1.0, 3.0, 2.0, 2.0, 5.0]
P1_TAU_B = 6 / 9
P1_PEARSON = 5.8 / math.sqrt(5.2 * 9.2)
ODD_ID = "p2<&>"  # markup in user data must come out escaped


def cand(pid, k, status, tokens, partials, final=None, reason=None, rejected=None, best=False):
    return {
        "prompt_id": pid,
        "candidate": k,
        "status": status,
        "finish_reason": reason,
        "rejected_round": rejected,
        "text": f"text {pid} {k}",
        "num_tokens": tokens,
        "final_score": final,
        "partial_scores": [{"tokens": t, "score": s} for t, s in partials],
        "is_best": best,
    }


def candidates() -> list[dict]:
    """Decisions at 2 and 4 tokens, max_new_tokens 6."""
    p1 = [
        # Finished by EOS between the two decisions: one partial score (at 2 tokens).
        cand("p1", k, "finished", 3, [(2, P1_X[k])], P1_Y[k], "eos")
        for k in range(3)
    ]
    p1 += [
        cand("p1", 3, "finished", 6, [(2, P1_X[3]), (4, 2.5)], P1_Y[3], "length"),
        cand("p1", 4, "finished", 6, [(2, P1_X[4]), (4, 4.5)], P1_Y[4], "length", best=True),
        cand("p1", 5, "rejected", 2, [(2, -3.0)], rejected=1),
        cand("p1", 6, "rejected", 4, [(2, 1.5), (4, -1.0)], rejected=2),
    ]
    p2 = [
        cand(ODD_ID, 0, "finished", 3, [(2, 0.5)], 0.25, "eos", best=True),
        cand(ODD_ID, 1, "finished", 3, [(2, 0.1)], 0.0, "eos"),
        cand(ODD_ID, 2, "rejected", 2, [(2, -2.0)], rejected=1),
    ]
    return p1 + p2


def best_rows() -> list[dict]:
    def row(pid: str, reward: float, tokens: int) -> dict:
        return {
            "id": pid,
            "prompt": f"prompt {pid}",
            "response": "r",
            "reward": reward,
            "messages": [],
            "finish_reason": "eos",
            "n": 4,
            "n0": 4,
            "waves": 1,
            "rounds": 2,
            "prompt_tokens": 5,
            "tokens_generated": tokens,
            "candidates_finished": 2,
            "candidates_rejected": 1,
            "seconds": 0.1,
        }

    return [row("p1", 5.0, 27), row(ODD_ID, 0.25, 8)]


ERRORS = [
    {"row": 3, "id": "p3", "source": "prompts.jsonl", "reason": "empty prompt"},
    {
        "shard": "shard-00002",
        "prompt_ids": ["p4", "p5"],
        "reason": "generator actor failed: <script>alert(1)</script>",
    },
]


def run_info(mode: str = "sbon") -> dict:
    return {
        "name": "handmade",
        "fingerprint": "abc123",
        "spec": {
            "name": "handmade",
            "generator": {"model": "tiny"},
            "reward": {"type": "lm_likelihood", "model": "tiny"},
            "search": {"mode": mode, "n": 4, "alpha": 0.5, "schedule": {"tokens": [2, 4]}},
        },
        "versions": {"specrej-ray": "0.1.0", "torch": "2.6.0"},
        "python": "3.11.7",
        "counts": {"prompts": 2, "candidates": 10},
        "skipped": 1,
        "failed_shards": [ERRORS[1]],
        "seconds": {"total": 12.5, "generate": 10.0},
    }


def write_run(
    fs,
    root: str,
    mode: str = "sbon",
    cands: list[dict] | None = None,
    best: list[dict] | None = None,
) -> None:
    """A finished run's files as the writer lays them out, plus a column from the future."""
    cands = candidates() if cands is None else cands
    best = best_rows() if best is None else best
    fs.makedirs(root, exist_ok=True)
    table = pa.Table.from_pylist(cands, schema=CANDIDATE_SCHEMA)
    table = table.append_column("future_column", pa.array([1.0] * len(cands)))
    with fs.open(f"{root}/candidates.parquet", "wb") as f:
        pq.write_table(table, f)
    with fs.open(f"{root}/best.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(best, schema=BEST_SCHEMA), f)
    with fs.open(f"{root}/run.json", "w") as f:
        json.dump(run_info(mode), f)
    with fs.open(f"{root}/errors.jsonl", "w") as f:
        f.write("".join(json.dumps(e) + "\n" for e in ERRORS))


@pytest.fixture
def run_dir(tmp_path) -> Path:
    out = tmp_path / "run"
    write_run(fsspec.filesystem("file"), str(out))
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, str]:
    """The report of the handmade run, written once (plotting takes about a second)."""
    out = tmp_path_factory.mktemp("page") / "run"
    write_run(fsspec.filesystem("file"), str(out))
    where = write_report(build_analysis(str(out)))
    return Path(where), Path(where).read_text()


# --- statistics -------------------------------------------------------------------------


def test_correlations_match_hand_computed_values_with_ties():
    assert kendall_tau_b(P1_X, P1_Y) == pytest.approx(P1_TAU_B)
    assert pearson(P1_X, P1_Y) == pytest.approx(P1_PEARSON)
    assert not math.isclose(P1_TAU_B, (7 - 1) / 10)  # tau-a would differ: ties matter here


def test_kendall_without_ties_and_reversed():
    assert kendall_tau_b([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx((5 - 1) / 6)
    assert kendall_tau_b([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_undefined_correlations_are_none():
    assert pearson([1.0], [2.0]) is None
    assert pearson([1, 1, 1], [1, 2, 3]) is None
    assert kendall_tau_b([1, 1, 1], [1, 2, 3]) is None
    assert least_squares([2, 2], [1, 3]) is None
    with pytest.raises(ValueError):
        pearson([1, 2], [1])


def test_least_squares_mean_median():
    slope, intercept = least_squares([0, 1, 2, 3], [1, 3, 5, 7])
    assert (slope, intercept) == pytest.approx((2.0, 1.0))
    slope, intercept = least_squares(P1_X, P1_Y)
    assert slope == pytest.approx(5.8 / 5.2)
    assert intercept == pytest.approx(2.6 - 5.8 / 5.2 * 2.4)
    assert median([3, 1, 2]) == 2 and median([4, 1, 3, 2]) == 2.5 and median([]) is None
    assert mean([1, 2, 6]) == 3 and mean([]) is None


# --- the numbers ------------------------------------------------------------------------


def test_analysis_numbers(run_dir):
    a = build_analysis(str(run_dir))
    assert (a.prompts, a.candidates, a.finished, a.rejected) == (2, 10, 7, 3)
    assert a.stopped_per_round == {1: 2, 2: 1}
    assert a.finish_reasons == {"eos": 5, "length": 2}
    p1, p2 = a.correlations
    assert (p1.prompt_id, p1.pairs) == ("p1", 5)
    assert p1.pearson == pytest.approx(P1_PEARSON)
    assert p1.kendall == pytest.approx(P1_TAU_B)
    assert (p2.prompt_id, p2.pairs, p2.pearson, p2.kendall) == (ODD_ID, 2, None, None)
    # Decision 1: the 7 finished candidates; decision 2: only the two that lived to 4 tokens.
    assert [len(r.points) for r in a.rounds] == [7, 2]
    assert [r.label for r in a.rounds] == ["decision 1 at 2 tokens", "decision 2 at 4 tokens"]
    # p1: 27 generated; BoN estimate 21 + 4.2 (stopped at 2: mean of 3,3,3,6,6) + 6 = 31.2.
    # p2: 8 generated; 6 + 3 = 9. Total estimate round(40.2) = 40.
    assert [(t.prompt_id, t.generated, t.bon_estimate) for t in a.tokens] == [
        ("p1", 27, 31),
        (ODD_ID, 8, 9),
    ]
    assert (a.tokens_generated, a.tokens_bon_estimate) == (35, 40)
    assert [e.kind for e in a.errors] == ["skipped prompt", "failed shard"]


def test_text_summary_has_the_counts(run_dir):
    text = text_summary(build_analysis(str(run_dir)))
    assert "fingerprint abc123, mode sbon, N=4, alpha=0.5, schedule tokens 2, 4" in text
    assert "prompts: 2 done (0 without a finished response), 1 skipped, 1 failed shard" in text
    assert "candidates: 10 (7 finished, 3 stopped early)" in text
    assert "stopped: decision 1: 2, decision 2: 1" in text
    assert "finished by reason: eos: 5, length: 2" in text
    assert "35 vs ~40 for Best-of-4 on the same candidates (estimated; 0.88x)" in text
    assert f"Pearson mean {P1_PEARSON:.3f}" in text and f"tau-b mean {P1_TAU_B:.3f}" in text
    assert "over 1 of 2 prompts (5-5 pairs each)" in text


def test_discarded_tokens_count_in_the_reports_and_the_end_of_run_summary(tmp_path):
    """Tokens decoded past a decision and then discarded are work: both totals show them
    and the token rate counts them; an older output without the column reads as none."""
    from specrej_ray.quality.summary import print_summary

    best = best_rows()
    best[0]["tokens_discarded"] = 5
    out = tmp_path / "run"
    write_run(fsspec.filesystem("file"), str(out), best=best)
    a = build_analysis(str(out))
    assert a.tokens_discarded == 5
    expected = ("35 + 5 decoded past decisions and discarded vs ~40 for Best-of-4 on the "
                "same candidates (estimated; 1.00x)")
    assert expected in text_summary(a)
    lines: list[str] = []
    print_summary(out, {**run_info(), "files": [], "filters": {}}, echo=lines.append)
    assert any(expected in line for line in lines), lines
    old = tmp_path / "old"
    write_run(fsspec.filesystem("file"), str(old),
              best=[{k: v for k, v in r.items() if k != "tokens_discarded"} for r in best_rows()])
    assert build_analysis(str(old)).tokens_discarded == 0


# --- the page ---------------------------------------------------------------------------

VOID = {"meta", "img", "br", "hr", "link", "input"}


class PageParser(HTMLParser):
    """Collects tags and attributes, and checks that elements nest and close properly."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.problems.append(f"unbalanced </{tag}>")

    def handle_data(self, data):
        self.text.append(data)


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.problems == [] and parser.stack == [], (parser.problems, parser.stack)
    return parser


def test_page_is_self_contained_and_images_decode(page):
    import matplotlib.image  # here, not at the top: every pytest worker collects this module

    where, page = page
    assert where.name == "report.html" and (where.parent / "run.json").exists()
    parser = parse(page)
    tags = [t for t, _ in parser.tags]
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    for _, attrs in parser.tags:
        for name in ("src", "href"):
            assert not (attrs.get(name) or "data:").lower().startswith(("http", "//")), attrs
    assert "http://" not in page and "https://" not in page and "url(" not in page
    images = [attrs["src"] for tag, attrs in parser.tags if tag == "img"]
    assert len(images) == 4
    for src in images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(src[len(prefix) :])))
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.std() > 0  # not a blank canvas


def test_page_lists_errors_and_correlations_escaped(page):
    _, page = page
    text = " ".join(parse(page).text)
    for expected in (
        "skipped prompt",
        "empty prompt",
        "p3",
        "failed shard",
        "shard-00002",
        "p4, p5",
    ):
        assert expected in text
    # User data is text, never markup: the reason's <script> shows up only as text.
    assert "<script>alert(1)</script>" in text and "<script>" not in page
    assert ODD_ID in text and "p2&lt;&amp;&gt;" in page
    assert f"{P1_PEARSON:.3f}" in text and f"{P1_TAU_B:.3f}" in text
    assert "n/a" in text  # p2 has only 2 pairs
    assert "pairs" in text and "SBoN was not used" not in text
    assert "handmade" in text and "abc123" in text and "torch 2.6.0" in text


def test_bon_mode_says_sbon_was_not_used(tmp_path):
    write_run(fsspec.filesystem("file"), str(tmp_path / "bon"), mode="bon")
    a = build_analysis(str(tmp_path / "bon"))
    page = Path(write_report(a)).read_text()
    assert "SBoN was not used" in page
    tokens = [line for line in text_summary(a).splitlines() if line.startswith("tokens")]
    assert tokens == [
        "tokens generated: 35 (mode bon: Speculative Rejection was not used, so "
        "this is Best-of-N's own cost)"
    ]


def test_empty_run_still_reports(tmp_path):
    write_run(fsspec.filesystem("file"), str(tmp_path / "empty"), cands=[], best=[])
    a = build_analysis(str(tmp_path / "empty"))
    page = Path(write_report(a)).read_text()
    assert len([t for t, _ in parse(page).tags if t == "img"]) == 4
    assert "prompts: 0 done" in text_summary(a)


def test_report_on_an_fsspec_url():
    fs = fsspec.filesystem("memory")
    write_run(fs, "/report-test/run")
    try:
        a = build_analysis("memory://report-test/run")
        where = write_report(a)
        assert where == "memory://report-test/run/report.html"
        assert fs.cat_file("/report-test/run/report.html").startswith(b"<!DOCTYPE html>")
    finally:
        fs.rm("/report-test", recursive=True)


# --- the command line -------------------------------------------------------------------


def test_cli_report(run_dir, tmp_path, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "candidates: 10 (7 finished, 3 stopped early)" in out.out
    assert f"report: {run_dir}/report.html" in out.out and out.err == ""
    assert (run_dir / "report.html").stat().st_size > 10_000
    other = tmp_path / "elsewhere.html"
    assert main(["report", str(run_dir), "--out", str(other)]) == 0
    assert other.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("case", ["missing", "not_ours", "broken"])
def test_cli_report_user_errors(tmp_path, capsys, case):
    target = tmp_path / "target"
    if case == "not_ours":
        target.mkdir()
        (target / "notes.txt").write_text("hello")
    elif case == "broken":
        write_run(fsspec.filesystem("file"), str(target))
        (target / "candidates.parquet").write_bytes(b"not parquet")
    assert main(["report", str(target)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("specrej-ray: error: ") and str(target) in err[0]
    assert "Traceback" not in err[0]
    assert not (target / "report.html").exists()


def test_a_file_given_for_the_output_is_called_a_file(run_dir, tmp_path, capsys):
    """It said `no such directory`: the file is there, it is just not what report takes."""
    assert main(["report", str(run_dir / "best.parquet")]) == 2
    assert capsys.readouterr().err == (
        f"specrej-ray: error: {run_dir}/best.parquet: is a file; give the run's output "
        f"folder (its output.path, which holds run.json), e.g. {run_dir}\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert main(["report", str(notes)]) == 2
    assert capsys.readouterr().err.endswith(": is a file; give the run's output folder (its "
                                            "output.path, which holds run.json)\n")


@pytest.mark.parametrize("name", ["best.parquet", "candidates.parquet", "run.json",
                                  "errors.jsonl"])
def test_an_unreadable_file_is_named(run_dir, capsys, name):
    """A truncated parquet said `Parquet magic bytes not found` and no more."""
    data = (run_dir / name).read_bytes()
    (run_dir / name).write_bytes(data[: len(data) // 2] + (b"{" if name.endswith("l") else b""))
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"specrej-ray: error: {run_dir}: cannot read {name}: "), err
    assert "\n" not in err and err.endswith("run the job again to rebuild it from its shards")
