"""The shadow Best-of-N audit (`search.audit_fraction`): a run measuring its own quality.

A seeded share of prompts also runs as a shadow Best-of-N task beside the real one. With
candidate identity the shadow's candidate k is the same sample as the run's candidate k, so
the shadow holds exactly what the rejected candidates would have become had they decoded to
the end. The run's answer for such a prompt is still the real task's; the shadow only gives
the Best-of-N scores that the paper's normalized score (eq. 6) compares it with, and its
tokens are counted apart. Decoding the shadow as its own task repeats the survivors' tokens
(they are in both); in exchange the audited answer is the run's own, produced by the very
engine path every other prompt takes, for any schedule (memory ones included).

Pure: whether a run audits, which prompts, one prompt's record, the run's summary and its
verdict.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.quality.identity import compare
from specrej_ray.quality.stats import CONFIDENCE, bootstrap
from specrej_ray.search.metrics import normalized_score
from specrej_ray.spec import JobSpec, SearchSpec

# Fewer scored prompts than this give no verdict: a bootstrap over 2 or 3 prompts is too
# narrow to trust.
MIN_VERDICT = 5
SHADOW = "#shadow-bon"  # suffix of a shadow task's id (its samples are the prompt's own)


def why_off(search: SearchSpec) -> str | None:
    """Why a run with these settings audits nothing (None: it audits)."""
    if search.audit_fraction == 0:
        return "search.audit_fraction is 0"
    if search.mode == "bon":
        return "mode bon: every answer is Best-of-N's already"
    if search.n == "auto":
        return ("n: auto sizes N from memory per prompt, so a shadow Best-of-N would not hold "
                "the same candidates")
    return None


def picked(prompt_id: str, fraction: float, seed: int) -> bool:
    """Whether the audit takes this prompt: a hash of the seed and the id, so the same
    prompts are audited on every generator and in every resume."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{seed}\x00{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def shadow_id(prompt_id: str) -> str:
    return prompt_id + SHADOW


def record(run: PromptResult, shadow: PromptResult, setting: dict | None = None) -> dict:
    """One audited prompt: the normalized score of the run's answer against the shadow's
    Best-of-N (None when either has no finished candidate, or when candidate identity
    failed, which would make the comparison meaningless), the tokens each decoded, and the
    candidates whose identity failed. `setting`: what the run ran with (alpha, schedule)."""
    same = compare(run, shadow)
    finals = [c.final_score for c in shadow.candidates
              if c.finished and c.final_score is not None]
    score = None
    if run.best is not None and finals and same.holds:
        score = normalized_score(finals, shadow.candidates[run.best].final_score)
    return {"prompt_id": run.prompt_id, "score": score, "tokens": run.tokens_decoded,
            "shadow_tokens": shadow.tokens_decoded, "identity_mismatches": same.mismatches,
            "first_mismatch": same.first_mismatch, "setting": setting}


def summarize(records: Sequence[dict], target: float) -> dict:
    """The audit of a run: mean normalized score with its bootstrap interval over the
    audited prompts, and a verdict on the target: `met` (the interval's low end reaches it),
    `missed` (its high end is below it), `unsure`, or `too few` (under MIN_VERDICT scored
    prompts)."""
    scores = [r["score"] for r in records if r["score"] is not None]
    ci = bootstrap(scores)
    if len(scores) < MIN_VERDICT:
        verdict = "too few"
    elif ci.high < target:
        verdict = "missed"
    elif ci.low >= target:
        verdict = "met"
    else:
        verdict = "unsure"
    return {"prompts": len(records), "scored": len(scores),
            "score": None if not scores else ci.value,
            "low": None if not scores else ci.low, "high": None if not scores else ci.high,
            "confidence": CONFIDENCE, "target": target, "verdict": verdict,
            "tokens": sum(r["tokens"] for r in records),
            "shadow_tokens": sum(r["shadow_tokens"] for r in records),
            "identity_mismatches": sum(r["identity_mismatches"] for r in records)}


def line(audit: dict, decoded: int | None = None) -> str:
    """The audit in one line, as the end-of-run summary and the report print it;
    `decoded`: every token the run decoded (for the audit's share of it)."""
    if not audit["prompts"]:
        return "audit: no prompt audited (search.audit_fraction)"
    cost = f"{audit['shadow_tokens']} shadow tokens"
    if decoded:
        cost += f", {audit['shadow_tokens'] / decoded:.1%} of the run's decoded tokens"
    if audit["score"] is None:
        return f"audit: {audit['prompts']} prompt(s), none scored ({cost})"
    text = (f"audit: normalized score {audit['score']:.1f} ({audit['confidence']:.0%} CI "
            f"{audit['low']:.1f}-{audit['high']:.1f}) on {audit['scored']} audited prompt(s) "
            f"vs target {audit['target']:g}: {audit['verdict']} ({cost})")
    if audit["identity_mismatches"]:
        text += (f"; WARNING: {audit['identity_mismatches']} candidate(s) differ from their "
                 "shadow, so candidate identity failed (please report it)")
    return text


def audit_summary(spec: JobSpec, records: list[dict]) -> dict:
    """run.json's `audit`: the audit's settings and, when it ran, its summary."""
    s = spec.search
    off = why_off(s)
    return {"fraction": s.audit_fraction, "off": off,
            **(summarize(records, s.target_score) if off is None else {})}


def audit_picker(spec: JobSpec):
    """Which of a shard's prompts the audit takes (None: the run audits nothing)."""
    if why_off(spec.search) is not None:
        return None
    fraction, seed = spec.search.audit_fraction, spec.seed
    return lambda shard: [t.prompt_id for t in shard.tasks
                          if picked(t.prompt_id, fraction, seed)]
