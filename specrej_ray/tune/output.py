"""tune's results: the terminal table, the `--set` line to paste, and tune.json."""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from specrej_ray.quality.calibration import Assessed, Choice
from specrej_ray.search.counterfactual import SettingResult
from specrej_ray.tune.collect import Collected, Correlation


@dataclass(frozen=True)
class TuneReport:
    settings: dict[str, Any]  # the command's options and the spec fields that matter
    prompts: list[Collected]
    baseline: SettingResult  # Best-of-N itself: alpha 0, no decision
    results: list[SettingResult]  # alphas x schedules, in the table's order
    assessed: list[Assessed]  # the same settings on resampled candidates, in the same order
    recommended: SettingResult | None
    auto: Choice  # what `schedule: auto` would run with this target
    correlation: list[Correlation]

    def assessed_for(self, r: SettingResult) -> Assessed:
        """The resampled figures of result r (one of `results`)."""
        return next(a for x, a in zip(self.results, self.assessed, strict=True) if x is r)


def overrides(r: SettingResult, mode: str) -> list[str]:
    """`--set` values that make a run use setting r (parsed as YAML by spec.parse_override)."""
    tokens = ", ".join(str(t) for t in r.schedule)
    sets = [f"search.alpha={r.alpha!r}", f"search.schedule={{tokens: [{tokens}]}}"]
    return sets + (["search.mode=sbon"] if mode != "sbon" else [])


def set_line(values: list[str]) -> str:
    return " ".join(f"--set {shlex.quote(v)}" for v in values)


def _schedule(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, s)) + "]" if s else "none"


def _num(x: float, digits: int) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def table(rep: TuneReport) -> str:
    s, b = rep.settings, rep.baseline
    lines = [
        f"Counterfactual analysis: {len(rep.prompts)} prompts, N={s['n']}, "
        f"max_new_tokens={s['max_new_tokens']}, reward {s['reward']}",
        f"Best-of-N baseline: {b.bon_tokens} tokens (token rate 1.000, score 100.0)",
        "",
        f"{'alpha':>5}  {'schedule':<12} {'token rate':>11} {'mean score':>11} {'min score':>10}"
        f" {'resampled':>10} {'95% CI':>12}",
    ]
    for r, a in zip(rep.results, rep.assessed, strict=True):
        mark = "  <- recommended" if r is rep.recommended else ""
        ci = f"{_num(a.low, 1)}-{_num(a.high, 1)}"
        lines.append(f"{r.alpha:>5g}  {_schedule(r.schedule):<12} {r.token_rate:>11.3f} "
                     f"{_num(r.mean_score, 1):>11} {_num(r.min_score, 1):>10} "
                     f"{_num(a.resampled, 1):>10} {ci:>12}{mark}")
    lines += ["", _recommendation(rep), f"schedule: auto at this target: {rep.auto.reason}", "",
              "Partial vs final reward, candidates still live at t (mean over prompts):",
              f"{'t':>5} {'prompts':>7} {'live':>5} {'pearson':>7} {'kendall':>7}"]
    for c in rep.correlation:
        lines.append(f"{c.tokens:>5} {c.prompts:>7} {_num(c.live, 1):>5} "
                     f"{_num(c.pearson, 2):>7} {_num(c.kendall, 2):>7}")
    return "\n".join(lines)


def _recommendation(rep: TuneReport) -> str:
    target, r = rep.settings["target"], rep.recommended
    if r is None:
        return (f"No setting reaches a resampled score >= {target:g}; nothing is "
                "recommended (try lower --alphas, later --decisions or a lower --target).")
    a = rep.assessed_for(r)
    return (f"Recommended (lowest token rate with resampled score >= {target:g}): alpha "
            f"{r.alpha:g}, decisions at {_schedule(r.schedule)}: token rate {r.token_rate:.3f}, "
            f"resampled score {a.resampled:.1f} (95% CI {a.low:.1f}-{a.high:.1f}), mean score "
            f"{r.mean_score:.1f} on these candidates\n  "
            + set_line(overrides(r, rep.settings["mode"])))


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x


def _setting(r: SettingResult, a: Assessed | None = None) -> dict[str, Any]:
    d = asdict(r)
    d["schedule"] = list(r.schedule)
    d["scores"] = list(r.scores)
    if a is not None:
        d |= {"resampled": _finite(a.resampled), "low": _finite(a.low), "high": _finite(a.high)}
    return d


def to_json(rep: TuneReport) -> dict[str, Any]:
    rec = rep.recommended
    recommendation = None
    if rec is not None:
        sets = overrides(rec, rep.settings["mode"])
        recommendation = {**_setting(rec, rep.assessed_for(rec)),
                          "overrides": sets, "set": set_line(sets)}
    auto = rep.auto.chosen
    return {
        "settings": rep.settings,
        "baseline": _setting(rep.baseline),
        "results": [_setting(r, a) for r, a in zip(rep.results, rep.assessed, strict=True)],
        "recommendation": recommendation,
        "auto": {"reason": rep.auto.reason,
                 "chosen": None if auto is None else {"alpha": auto.setting.alpha,
                                                      "schedule": list(auto.setting.schedule)}},
        "correlation": [{**asdict(c), "pearson": _finite(c.pearson),
                         "kendall": _finite(c.kendall), "live": _finite(c.live)}
                        for c in rep.correlation],
        "prompts": [
            {"id": c.prompt_id, "seconds": c.seconds, "lengths": list(c.data.lengths),
             "final": list(c.data.final),
             "partial": {str(t): list(v) for t, v in c.data.partial.items()}}
            for c in rep.prompts
        ],
    }
