"""tune.png: the token rate / score trade-off of every setting, and correlation vs length.

Drawn with matplotlib's object API on the Agg canvas, never pyplot (as report/plots.py).
"""

from __future__ import annotations

import math

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specrej_ray.figures import png
from specrej_ray.tune.output import TuneReport


def tune_png(rep: TuneReport) -> bytes:
    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    _tradeoff(left, rep)
    _correlation(right, rep)
    return png(fig)


def _tradeoff(ax: Axes, rep: TuneReport) -> None:
    # The resampled score, which the recommendation reads; 100 is Best-of-N by definition.
    alphas = list(dict.fromkeys(r.alpha for r in rep.results))
    for i, alpha in enumerate(alphas):
        label: str | None = f"alpha {alpha:g}"
        # One decision: circles; two: triangles (the second decision costs a reward pass).
        for n, marker in ((1, "o"), (2, "^")):
            pts = [a for a in rep.assessed
                   if a.setting.alpha == alpha and len(a.setting.schedule) == n]
            if pts:
                ax.scatter([a.token_rate for a in pts], [a.resampled for a in pts],
                           color=f"C{i % 10}", marker=marker, alpha=0.75, label=label)
                label = None  # one legend entry per alpha
    b = rep.baseline
    ax.scatter([b.token_rate], [b.mean_score], color="tab:gray", marker="s", label="Best-of-N")
    target = rep.settings["target"]
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
    r = rep.recommended
    if r is not None:
        a = rep.assessed_for(r)
        ax.scatter([r.token_rate], [a.resampled], s=250, facecolors="none", edgecolors="red",
                   linewidths=2, label=f"recommended: alpha {r.alpha:g}, {list(r.schedule)}")
    ax.legend(fontsize="small", loc="lower right")
    ax.set(title=f"Counterfactual SBoN on {len(rep.prompts)} prompts "
           "(o: one decision, ^: two)",
           xlabel="token rate (SBoN tokens / Best-of-N tokens)",
           ylabel="normalized score on resampled candidates (100 = Best-of-N)")


def _correlation(ax: Axes, rep: TuneReport) -> None:
    ts = [c.tokens for c in rep.correlation]
    for name, values in (("Pearson r", [c.pearson for c in rep.correlation]),
                         ("Kendall tau-b", [c.kendall for c in rep.correlation])):
        ax.plot(ts, values, marker="o", label=name)  # NaN leaves a gap
    if all(math.isnan(v) for c in rep.correlation for v in (c.pearson, c.kendall)):
        ax.text(0.5, 0.5, "undefined: fewer than 2 live candidates that differ",
                ha="center", va="center", transform=ax.transAxes)
    ax.axhline(0, color="lightgray", linewidth=1, zorder=0)
    ax.set_ylim(-1.05, 1.05)
    ax.set_xticks(ts)
    ax.legend(fontsize="small")
    ax.set(title="Partial vs final reward (live candidates)",
           xlabel="decision length t (generated tokens)", ylabel="correlation")
