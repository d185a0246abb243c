"""The self-contained report page: inline CSS, figures as data: URIs, no scripts or links.

Every value from the run is escaped: prompt ids and error reasons are user data.
"""

from __future__ import annotations

import base64
from html import escape

from specrej_ray.numbers import fmt
from specrej_ray.quality import stats
from specrej_ray.report.analysis import MIN_PAIRS, Analysis
from specrej_ray.report.text import (
    correlation_sentence,
    counts_line,
    quality_lines,
    tokens_sentence,
)

CSS = """
body { font-family: system-ui, sans-serif; max-width: 980px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.25em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; height: auto; display: block; margin: 0.8em 0; }
.note { color: #555; font-size: 0.92em; }
.warn { background: #fff4e0; border-left: 4px solid #e69b00; padding: 0.4em 0.8em; }
"""


def img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}">'


def table(header: list[str], rows: list[list[str]], numeric: tuple[int, ...] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{escape(c)}</td>' if i in numeric else f"<td>{escape(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(a: Analysis, figures: dict[str, bytes]) -> str:
    f = a.facts
    sections = [
        f"<h1>specrej-ray report: {escape(f['spec name'])}</h1>",
        f'<p class="sub">{escape(a.run.location)}</p>',
        _overview(a),
        "<h2>Run</h2>",
        table(["field", "value"], [[k, v] for k, v in f.items()]),
        _rewards(a, figures),
        _correlations(a, figures),
        _calibration(a),
        _tokens(a, figures),
        _outcomes(a, figures),
        _errors(a),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>specrej-ray report: {escape(f['spec name'])}</title>"
        f"<style>{CSS}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )


def _overview(a: Analysis) -> str:
    bullets = [
        f"{a.prompts} prompts done; {a.candidates} candidates ({a.finished} finished, "
        f"{a.rejected} stopped early)",
        tokens_sentence(a),
        *([a.draws.sentence()] if a.draws else []),
        correlation_sentence(a),
        *quality_lines(a),
        f"{len(a.errors)} skipped prompt(s) or failed shard(s)",
    ]
    warn = ""
    if not a.sbon:
        warn = (
            '<p class="warn">This run used <b>mode bon</b>: Speculative Rejection (SBoN) was '
            "not used; every candidate ran to the end.</p>"
        )
    return warn + "<ul>" + "".join(f"<li>{escape(b)}</li>" for b in bullets) + "</ul>"


def _rewards(a: Analysis, figures: dict[str, bytes]) -> str:
    return (
        "<h2>Reward distribution</h2>"
        + img(figures["rewards"], "histograms of final reward")
        + f"<p>Mean final reward of the chosen responses: {fmt(stats.mean(a.best_rewards))} "
        f"({len(a.best_rewards)} prompts); of all finished candidates: "
        f"{fmt(stats.mean(a.finished_scores))} ({len(a.finished_scores)} candidates).</p>"
    )


def _correlations(a: Analysis, figures: dict[str, bytes]) -> str:
    pearson, kendall = a.correlation_values("pearson"), a.correlation_values("kendall")
    rows = [[c.prompt_id, str(c.pairs), fmt(c.pearson), fmt(c.kendall)] for c in a.correlations]
    rows += [
        ["mean", "", fmt(stats.mean(pearson)), fmt(stats.mean(kendall))],
        ["median", "", fmt(stats.median(pearson)), fmt(stats.median(kendall))],
    ]
    first = a.rounds[0].label if a.rounds else "the first decision"
    return (
        "<h2>Partial vs final reward (the paper's Figure 2)</h2>"
        + img(figures["partial_vs_final"], "scatter of partial against final reward")
        + '<p class="note">Each point is a finished candidate\'s score at a decision point '
        "against its final score; candidates stopped early have no final score and are not "
        "shown. So the points are mostly the survivors of earlier decisions, a "
        "range-restricted sample: correlations over them understate how well partial scores "
        "rank all N candidates (a <code>mode bon</code> run scores every candidate to the "
        "end). The r in the legend is pooled over all prompts, so differences between prompts "
        "add to it; rejection only ranks candidates within a prompt, which the table below "
        "measures.</p>"
        + f"<p>Per-prompt correlation between the partial score at {escape(first)} and the "
        f"final score, over that prompt's candidates that have both (<i>pairs</i>); prompts "
        f"with fewer than {MIN_PAIRS} pairs show n/a and are left out of the mean and "
        "median.</p>"
        + table(["prompt", "pairs", "Pearson r", "Kendall tau-b"], rows, numeric=(1, 2, 3))
    )


def _calibration(a: Analysis) -> str:
    """schedule auto's evidence: every setting it weighed and the partial-final
    correlations on the calibration prompts."""
    c = a.run.info.get("calibration")
    if not c:
        return ""
    rows = [[f"{s['alpha']:g}", ", ".join(map(str, s["schedule"])), fmt(s["token_rate"]),
             fmt(s["mean_score"]), f"{fmt(s['low'])}-{fmt(s['high'])}"]
            for s in sorted(c["settings"], key=lambda s: s["token_rate"])]
    corr = [[str(r["tokens"]), fmt(r["pearson"]), fmt(r["kendall"]), fmt(r["live"])]
            for r in c["correlations"]]
    return (
        "<h2>schedule auto: the choice and its evidence</h2>"
        + f"<p>{escape(quality_lines(a)[0])}</p>"
        + '<p class="note">Each setting replayed on the calibration prompts\' Best-of-N '
        "candidates; the interval is a 95% bootstrap over prompts and candidate subsets. "
        "The cheapest setting whose low end reaches the target is chosen.</p>"
        + table(["alpha", "decisions at", "token rate", "normalized score", "95% CI"], rows,
                numeric=(2, 3))
        + table(["tokens", "Pearson (partial vs final)", "Kendall tau-b", "live candidates"],
                corr, numeric=(1, 2, 3))
    )


def _tokens(a: Analysis, figures: dict[str, bytes]) -> str:
    if a.sbon:
        note = (
            '<p class="note">The Best-of-N figure is an estimate from this run\'s own candidates: '
            "finished candidates count as they are; a stopped candidate is counted at the mean "
            "length of its prompt's finished candidates that outlived it. A "
            "<code>--set search.mode=bon</code> run measures it exactly.</p>"
        )
    else:
        note = '<p class="warn">Mode bon: SBoN was not used; there is nothing to compare.</p>'
    return (
        "<h2>Tokens generated vs Best-of-N</h2>"
        + f"<p>{escape(tokens_sentence(a))}</p>"
        + note
        + img(figures["tokens"], "tokens generated per prompt")
    )


def _outcomes(a: Analysis, figures: dict[str, bytes]) -> str:
    return (
        "<h2>Candidates stopped and finished</h2>"
        + img(figures["outcomes"], "candidates stopped per decision and finish reasons")
        + f"<p>Stopped: {escape(counts_line(a.stopped_per_round, 'decision '))}. "
        f"Finished by reason: {escape(counts_line(a.finish_reasons))}.</p>"
        + (
            f"<p>Prompts without any finished response: {escape(', '.join(a.no_response))}</p>"
            if a.no_response
            else ""
        )
    )


def _errors(a: Analysis) -> str:
    if not a.errors:
        return "<h2>Failures and skipped prompts</h2><p>None: errors.jsonl is empty.</p>"
    rows = [[e.kind, e.where, e.ids, e.reason] for e in a.errors]
    return f"<h2>Failures and skipped prompts ({len(a.errors)})</h2>" + table(
        ["kind", "row / shard", "id(s)", "reason"], rows
    )
