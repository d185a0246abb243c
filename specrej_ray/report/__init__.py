"""`specrej-ray report OUTPUT`: a self-contained HTML page and a text summary of a finished run.

Pipeline: data (load the files) -> analysis (numbers) -> plots (PNG bytes) -> html (the page);
text renders the same numbers for the terminal.
"""

from __future__ import annotations

import fsspec

from specrej_ray.data.dataset import locate
from specrej_ray.data.output_guard import REPORT
from specrej_ray.data.output_guard import write_report as write_output_report
from specrej_ray.errors import OutputError
from specrej_ray.report import plots
from specrej_ray.report.analysis import Analysis, analyze
from specrej_ray.report.data import ReportError, load_run
from specrej_ray.report.html import render
from specrej_ray.report.text import text_summary

__all__ = ["Analysis", "ReportError", "build_analysis", "text_summary", "write_report"]


def build_analysis(output: str) -> Analysis:
    """Load the run at OUTPUT (a path or fsspec URL) and compute the report's numbers."""
    return analyze(load_run(str(output)))


def figures(a: Analysis) -> dict[str, bytes]:
    return {
        "rewards": plots.reward_histogram(a.best_rewards, a.finished_scores),
        "partial_vs_final": plots.partial_vs_final(a.rounds),
        "tokens": plots.tokens_per_prompt(a.tokens, a.sbon),
        "outcomes": plots.outcomes(a.stopped_per_round, a.finish_reasons),
    }


def write_report(a: Analysis, out_file: str | None = None) -> str:
    """Write the HTML page (default OUTPUT/report.html) and return where it went.

    Returns a string, not a Path: OUTPUT may be a URL such as s3://bucket/run.
    """
    out = locate(a.run.location)
    target = out_file or out.url_of(REPORT)
    page = render(a, figures(a))
    try:
        if out_file is None:  # into the output: listed in its manifest (output_guard)
            write_output_report(out, page)
        else:
            with fsspec.open(target, "w", encoding="utf-8") as f:
                f.write(page)
    except OutputError as e:
        raise ReportError(f"{e}; or pass --out FILE") from None
    except OSError as e:
        raise ReportError(f"{target}: cannot write the report: {e.strerror or e}") from None
    return target
