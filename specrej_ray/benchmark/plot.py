"""The bench figure: mean best reward vs wall-clock, one point per arm (PNG bytes)."""

from __future__ import annotations

import math

from matplotlib.ticker import FuncFormatter

from specrej_ray.report.plots import BEST, BON, figure, png


def reward_vs_time(arms: list[dict], reward: str) -> bytes:
    """BoN arms joined by a line and labelled with N; SBoN arms as stars (hollow: no refill)."""
    fig, ax = figure(height=5)
    points = [a for a in arms if not math.isnan(_num(a["mean_best_reward"]))]
    bon = sorted((a for a in points if a["kind"] == "bon"), key=lambda a: a["n"])
    if bon:
        ax.plot([a["seconds"] for a in bon], [a["mean_best_reward"] for a in bon], color=BON,
                marker="o", label="Best-of-N")
        for a in bon:
            ax.annotate(f"N={a['n']}", (a["seconds"], a["mean_best_reward"]),
                        textcoords="offset points", xytext=(5, -12), fontsize="small")
    for a in (a for a in points if a["kind"] == "sbon"):
        filled = a["refill"]
        ax.scatter([a["seconds"]], [a["mean_best_reward"]], marker="*", s=220, zorder=3,
                   color=BEST if filled else "white", edgecolors=BEST,
                   label=f"SBoN N={a['n']}, alpha {a['alpha']:g}"
                   + ("" if filled else ", no refill"))
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")  # 20, not 2 x 10^1
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.set(title="Mean best reward vs wall-clock (same engine, prompts and seed)",
           xlabel="wall-clock seconds (log scale)", ylabel=f"mean best reward: {reward}")
    ax.legend(loc="lower right")
    return png(fig)


def _num(value: float | None) -> float:
    return math.nan if value is None else value
