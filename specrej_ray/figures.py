"""Figures as PNG bytes, shared by the report, bench and tune.

Figures are built with matplotlib's object API on the Agg canvas, never pyplot: no display,
no global figure state, and the same output headless or not.
"""

from __future__ import annotations

import io

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

BEST, ALL, BON = "tab:orange", "tab:blue", "tab:gray"


def canvas(height: float = 4.5) -> Figure:
    """A page-wide figure on the Agg canvas."""
    fig = Figure(figsize=(9, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure(height: float = 4.5) -> tuple[Figure, Axes]:
    fig = canvas(height)
    return fig, fig.add_subplot()


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()
