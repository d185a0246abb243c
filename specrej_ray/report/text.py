"""The plain-text summary printed by `specrej-ray report` (the page's key numbers)."""

from __future__ import annotations

from specrej_ray.numbers import fmt
from specrej_ray.quality import stats
from specrej_ray.quality.audit import line as audit_line
from specrej_ray.quality.summary import decoded_line, setting_line
from specrej_ray.report.analysis import MIN_PAIRS, Analysis


def counts_line(counts: dict, prefix: str = "") -> str:
    return ", ".join(f"{prefix}{k}: {v}" for k, v in counts.items()) or "none"


def tokens_sentence(a: Analysis) -> str:
    if not a.sbon:
        return (
            f"tokens generated: {a.tokens_generated} (mode bon: Speculative Rejection was "
            "not used, so this is Best-of-N's own cost)"
        )
    decoded = a.tokens_generated + a.tokens_discarded
    rate = decoded / a.tokens_bon_estimate if a.tokens_bon_estimate else None
    return (
        f"tokens generated: {decoded_line(a.tokens_generated, a.tokens_discarded)} vs "
        f"~{a.tokens_bon_estimate} for Best-of-{a.facts['N']} on the same candidates "
        f"(estimated; {fmt(rate, 2)}x)"
    )


def correlation_sentence(a: Analysis) -> str:
    pearson, kendall = a.correlation_values("pearson"), a.correlation_values("kendall")
    used = [c.pairs for c in a.correlations if c.pearson is not None or c.kendall is not None]
    if not used:
        return (
            f"partial vs final (first decision): n/a (no prompt has {MIN_PAIRS} or more "
            "finished candidates with a first-decision score)"
        )
    return (
        f"partial vs final (first decision): Pearson mean {fmt(stats.mean(pearson))} / median "
        f"{fmt(stats.median(pearson))}, Kendall tau-b mean {fmt(stats.mean(kendall))} / median "
        f"{fmt(stats.median(kendall))}, over {len(used)} of {len(a.correlations)} prompts "
        f"({min(used)}-{max(used)} pairs each)"
    )


def quality_lines(a: Analysis) -> list[str]:
    """What the run knows of its quality against Best-of-N: the choice schedule auto made,
    and the audit's measured score (empty when neither ran)."""
    info, lines = a.run.info, []
    calibration = info.get("calibration")
    if calibration:
        lines.append(f"schedule auto, on {len(calibration['prompts'])} calibration prompts: "
                     f"{calibration['reason']}; ran with {setting_line(calibration['run_with'])}"
                     f" ({calibration['how']})")
        for r in calibration.get("recalibrations", []):
            lines.append(f"recalibrated on {r['prompts']} prompts after the audit of "
                         f"{setting_line(r['was'])}: {r['audit']['verdict']}")
    audit = info.get("audit") or {}
    if audit.get("off") is None and "verdict" in audit:
        lines.append(audit_line(audit, a.tokens_generated + a.tokens_discarded))
    return lines


def text_summary(a: Analysis) -> str:
    f = a.facts
    skipped = sum(e.kind == "skipped prompt" for e in a.errors)
    failed = sum(e.kind == "failed shard" for e in a.errors)
    lines = [
        f"run {f['spec name']} ({a.run.location}): fingerprint {f['fingerprint']}, mode "
        f"{f['mode']}, N={f['N']}, alpha={f['alpha']}, schedule {f['schedule']}",
        f"prompts: {a.prompts} done ({len(a.no_response)} without a finished response), "
        f"{skipped} skipped, {failed} failed shard(s)",
        f"candidates: {a.candidates} ({a.finished} finished, {a.rejected} stopped early); "
        f"stopped: {counts_line(a.stopped_per_round, 'decision ')}; finished by reason: "
        f"{counts_line(a.finish_reasons)}",
        f"reward: mean of chosen {fmt(stats.mean(a.best_rewards))}, mean of all finished "
        f"{fmt(stats.mean(a.finished_scores))}",
        correlation_sentence(a),
        tokens_sentence(a),
        *([a.draws.sentence()] if a.draws else []),
        *quality_lines(a),
        f"wall-clock: {f['wall-clock']}",
    ]
    return "\n".join(lines)
