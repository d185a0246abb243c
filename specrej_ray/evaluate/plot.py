"""eval.png: strict accuracy by model (or round), prompt- and instruction-level, greedy and
sampled, each with its 95% bootstrap interval over prompts as error bars."""

from __future__ import annotations

from typing import Any

from specrej_ray.figures import canvas, png

LEVELS = (("prompt_strict", "prompt-level strict accuracy"),
          ("instruction_strict", "instruction-level strict accuracy"))
STYLES = {"greedy": ("tab:blue", "o"), "sampled": ("tab:orange", "s")}


def accuracy_png(report: dict[str, Any], xlabel: str = "model") -> bytes:
    fig = canvas(4.5)
    axes = fig.subplots(1, len(LEVELS), sharey=True)
    labels = [m["label"] for m in report["models"]]
    xs = list(range(len(labels)))
    for ax, (metric, title) in zip(axes, LEVELS, strict=True):
        for k, (decoding, (color, marker)) in enumerate(STYLES.items()):
            got = [m["decodings"][decoding]["figures"][metric] for m in report["models"]]
            values = [100 * g["value"] for g in got]
            low = [v - 100 * (g["low"] if g["low"] is not None else g["value"])
                   for v, g in zip(values, got, strict=True)]
            high = [100 * (g["high"] if g["high"] is not None else g["value"]) - v
                    for v, g in zip(values, got, strict=True)]
            shift = (k - 0.5) * 0.08  # side by side, so the bars do not hide each other
            ax.errorbar([x + shift for x in xs], values, yerr=[low, high], color=color,
                        marker=marker, capsize=4, label=decoding)
        ax.set_xticks(xs, labels, rotation=15 if len(labels) > 4 else 0)
        ax.set_xlim(-0.5, len(xs) - 0.5)
        ax.set(title=title, xlabel=xlabel)
        ax.grid(axis="y", color="lightgray", linewidth=0.5)
    axes[0].set_ylabel(f"% ({report['prompts']} prompts; bars: "
                       f"{report['bootstrap']['confidence']:.0%} bootstrap interval)")
    axes[0].legend(fontsize="small")
    return png(fig)
