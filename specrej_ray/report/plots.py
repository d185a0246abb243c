"""The report's figures, each rendered to PNG bytes.

Built on specrej_ray.figures (matplotlib's object API, never pyplot).
"""

from __future__ import annotations

from matplotlib.axes import Axes

from specrej_ray.figures import ALL, BEST, BON, canvas, figure, png
from specrej_ray.report.analysis import PromptTokens, RoundFit

# Beyond this many prompts one bar pair per prompt is unreadable; plot the ratio's histogram.
MAX_BARS = 60


def reward_histogram(best: list[float], finished: list[float]) -> bytes:
    fig, ax = figure()
    if not finished:
        _empty(ax, "no finished candidates")
    else:
        lo, hi = min(finished + best), max(finished + best)
        bins = [lo + (hi - lo) * i / 30 for i in range(31)] if hi > lo else 10
        # Weights make both histograms shares of their own group, so 21 best responses and
        # 95 finished candidates compare on one axis.
        groups = (
            (finished, ALL, 0.5, f"all finished candidates (n={len(finished)})"),
            (best, BEST, 0.6, f"chosen (best) responses (n={len(best)})"),
        )
        for values, color, alpha, label in groups:
            if values:
                weights = [1 / len(values)] * len(values)
                ax.hist(values, bins=bins, weights=weights, color=color, alpha=alpha, label=label)
                ax.axvline(sum(values) / len(values), color=color, linestyle="--", linewidth=1.5)
        ax.legend(title="dashed lines: means", loc="upper left")
    ax.set(
        title="Final reward: chosen responses vs all finished candidates",
        xlabel="final reward",
        ylabel="share of the group",
    )
    return png(fig)


def partial_vs_final(rounds: list[RoundFit]) -> bytes:
    fig, ax = figure(height=5.5)
    points = [p for r in rounds for p in r.points]
    if not points:
        _empty(ax, "no finished candidate has a partial score")
    else:
        colors = [f"C{i % 10}" for i in range(len(rounds))]
        for fit, color in zip(rounds, colors, strict=True):
            if not fit.points:
                continue
            xs, ys = [p for p, _ in fit.points], [f for _, f in fit.points]
            # Pooled over prompts: differences between prompts count too (see the table).
            r = f", pooled r={fit.pearson:.2f}" if fit.pearson is not None else ""
            ax.scatter(
                xs, ys, s=18, alpha=0.6, color=color, label=f"{fit.label} ({len(xs)} candidates{r})"
            )
            if fit.line is not None:
                slope, intercept = fit.line
                x0, x1 = min(xs), max(xs)
                ax.plot(
                    [x0, x1],
                    [slope * x0 + intercept, slope * x1 + intercept],
                    color=color,
                    linewidth=2,
                    label=f"least squares: final = {slope:.2f} x partial "
                    f"{'+' if intercept >= 0 else '-'} {abs(intercept):.2f}",
                )
        lo = min(min(p, f) for p, f in points)
        hi = max(max(p, f) for p, f in points)
        ax.plot(
            [lo, hi], [lo, hi], color="lightgray", linewidth=1, zorder=0, label="partial = final"
        )
        ax.legend(fontsize="small", loc="upper left")
    ax.set(
        title="Partial reward at each decision vs final reward (finished candidates)",
        xlabel="partial reward (score of the response so far at the decision)",
        ylabel="final reward (complete response)",
    )
    return png(fig)


def tokens_per_prompt(tokens: list[PromptTokens], sbon: bool) -> bytes:
    fig, ax = figure(height=5)
    if not tokens:
        _empty(ax, "no prompts")
        ax.set(title="Tokens generated per prompt")
    elif len(tokens) > MAX_BARS:
        rates = [t.generated / t.bon_estimate for t in tokens if t.bon_estimate]
        ax.hist(rates, bins=30, color=ALL)
        ax.set(
            title="Token rate per prompt: generated / Best-of-N estimate",
            xlabel="tokens generated / estimated Best-of-N tokens",
            ylabel="prompts",
        )
    else:
        xs = list(range(len(tokens)))
        width = 0.4 if sbon else 0.8
        ax.bar(
            [x - width / 2 if sbon else x for x in xs],
            [t.generated for t in tokens],
            width=width,
            color=ALL,
            label="generated" + (" (Speculative Rejection)" if sbon else " (Best-of-N, mode bon)"),
        )
        if sbon:
            ax.bar(
                [x + width / 2 for x in xs],
                [t.bon_estimate for t in tokens],
                width=width,
                color=BON,
                label="Best-of-N on the same candidates (estimate)",
            )
        ax.set_xticks(xs, [t.prompt_id for t in tokens], rotation=60, ha="right", fontsize="small")
        ax.margins(y=0.2)  # room for the legend above the tallest bars
        ax.legend(loc="upper center", ncols=2)
        ax.set(title="Tokens generated per prompt", xlabel="prompt id", ylabel="tokens")
    return png(fig)


def outcomes(stopped: dict[int, int], reasons: dict[str, int]) -> bytes:
    fig = canvas(3.8)
    left, right = fig.subplots(1, 2)
    _bars(
        left,
        [f"decision {k}" for k in stopped],
        list(stopped.values()),
        ALL,
        "no candidate was stopped",
    )
    left.set(
        title="Candidates stopped at each decision",
        xlabel="decision round",
        ylabel="candidates stopped",
    )
    _bars(right, list(reasons), list(reasons.values()), BEST, "no finished candidates")
    right.set(
        title="Finished candidates by finish reason", xlabel="finish reason", ylabel="candidates"
    )
    return png(fig)


def _bars(ax: Axes, labels: list[str], values: list[int], color: str, empty: str) -> None:
    if not values:
        _empty(ax, empty)
        return
    bars = ax.bar(labels, values, color=color)
    ax.bar_label(bars)
    ax.margins(y=0.15)


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
