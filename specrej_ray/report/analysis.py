"""The report's numbers, derived from a loaded run: plain data, no plotting or HTML."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from specrej_ray.quality import stats
from specrej_ray.quality.summary import estimate_bon_tokens
from specrej_ray.report.data import RunData

# Below this many (partial, final) pairs a per-prompt correlation says nothing; shown as n/a.
MIN_PAIRS = 3


@dataclass
class PromptCorrelation:
    prompt_id: str
    pairs: int  # candidates with both a first-decision partial score and a final score
    pearson: float | None
    kendall: float | None


@dataclass
class RoundFit:
    """Least-squares line of final on partial score at one decision round (1-based)."""

    round: int
    label: str
    points: list[tuple[float, float]]  # (partial, final)
    line: tuple[float, float] | None  # (slope, intercept)
    pearson: float | None


@dataclass
class PromptTokens:
    prompt_id: str
    generated: int
    bon_estimate: int


@dataclass
class ErrorRow:
    kind: str  # "skipped prompt" or "failed shard"
    where: str  # row number or shard id
    ids: str
    reason: str


@dataclass
class DrawSummary:
    """search.draws: why the prompts stopped drawing, and how many candidates they drew."""

    reasons: dict[str, int]  # stop reason -> prompts
    drawn: list[int]  # candidates drawn, per prompt

    def sentence(self) -> str:
        why = ", ".join(f"{n} {reason}" for reason, n in self.reasons.items())
        drawn = self.drawn
        return (f"per-prompt budgets: prompts stopped drawing {why}; candidates drawn per "
                f"prompt {sum(drawn) / len(drawn):.1f} on average ({min(drawn)}-{max(drawn)})"
                if drawn else "per-prompt budgets: no prompt")


@dataclass
class Analysis:
    run: RunData
    facts: dict[str, str]
    sbon: bool
    prompts: int
    candidates: int
    finished: int
    rejected: int
    no_response: list[str]  # prompt ids without any finished candidate
    best_rewards: list[float]
    finished_scores: list[float]
    rounds: list[RoundFit]
    correlations: list[PromptCorrelation]
    tokens: list[PromptTokens]
    tokens_generated: int
    tokens_discarded: int  # decoded past a decision by candidates it rejected (overlap)
    tokens_bon_estimate: int
    stopped_per_round: dict[int, int]
    finish_reasons: dict[str, int]
    errors: list[ErrorRow] = field(default_factory=list)
    draws: DrawSummary | None = None  # with search.draws

    def correlation_values(self, name: str) -> list[float]:
        values = (getattr(c, name) for c in self.correlations)
        return [v for v in values if v is not None]


def analyze(run: RunData) -> Analysis:
    cands = run.candidates
    search = run.info["spec"].get("search", {})
    finished = [c for c in cands if c["status"] == "finished"]
    by_prompt = _group(cands)
    tokens = _tokens(by_prompt)
    return Analysis(
        run=run,
        facts=_facts(run.info),
        sbon=search.get("mode") != "bon",
        prompts=len(run.best),
        candidates=len(cands),
        finished=len(finished),
        rejected=sum(c["status"] == "rejected" for c in cands),
        no_response=[b["id"] for b in run.best if b["reward"] is None],
        best_rewards=[b["reward"] for b in run.best if b["reward"] is not None],
        finished_scores=[c["final_score"] for c in finished if c["final_score"] is not None],
        rounds=_round_fits(cands),
        correlations=[_prompt_correlation(pid, group) for pid, group in by_prompt.items()],
        tokens=tokens,
        tokens_generated=sum(c["num_tokens"] for c in cands),
        tokens_discarded=sum(b.get("tokens_discarded") or 0 for b in run.best),
        # The same call `specrej-ray run` prints, so the two totals agree.
        tokens_bon_estimate=estimate_bon_tokens(cands) if cands else 0,
        stopped_per_round=dict(
            sorted(Counter(c["rejected_round"] for c in cands if c["status"] == "rejected").items())
        ),
        finish_reasons=dict(Counter(c["finish_reason"] or "none" for c in finished).most_common()),
        errors=[_error_row(e) for e in run.errors],
        draws=_draws(run.best),
    )


def _draws(best: list[dict[str, Any]]) -> DrawSummary | None:
    """The prompts' stops, where the run drew per-prompt (best.parquet's stop_reason)."""
    if not best or "stop_reason" not in best[0]:
        return None
    return DrawSummary(dict(Counter(b["stop_reason"] for b in best).most_common()),
                       [b["n"] for b in best])


def _group(cands: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Candidates per prompt, prompts in file order (the order of best.parquet)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in cands:
        groups[c["prompt_id"]].append(c)
    return dict(groups)


def _pairs(cands: list[dict[str, Any]], round_index: int) -> list[tuple[float, float]]:
    """(partial score at decision `round_index` (0-based), final score) per finished candidate.

    A candidate's k-th partial score is from the k-th decision point: it was live at every
    decision before the one that stopped it, and finished ones are not rescored.
    """
    return [
        (c["partial_scores"][round_index]["score"], c["final_score"])
        for c in cands
        if c["final_score"] is not None and len(c["partial_scores"] or []) > round_index
    ]


def _prompt_correlation(prompt_id: str, cands: list[dict[str, Any]]) -> PromptCorrelation:
    pairs = _pairs(cands, 0)
    if len(pairs) < MIN_PAIRS:
        return PromptCorrelation(prompt_id, len(pairs), None, None)
    xs, ys = [p for p, _ in pairs], [f for _, f in pairs]
    return PromptCorrelation(
        prompt_id, len(pairs), stats.pearson(xs, ys), stats.kendall_tau_b(xs, ys)
    )


def _round_fits(cands: list[dict[str, Any]]) -> list[RoundFit]:
    depth = max((len(c["partial_scores"] or []) for c in cands), default=0)
    fits = []
    for k in range(depth):
        points = _pairs(cands, k)
        xs, ys = [p for p, _ in points], [f for _, f in points]
        lengths = [
            c["partial_scores"][k]["tokens"] for c in cands if len(c["partial_scores"] or []) > k
        ]
        fits.append(
            RoundFit(
                round=k + 1,
                label=_decision_label(k + 1, lengths),
                points=points,
                line=stats.least_squares(xs, ys),
                pearson=stats.pearson(xs, ys),
            )
        )
    return fits


def _decision_label(round_number: int, lengths: list[int]) -> str:
    """'decision 1 at 16 tokens'; a memory schedule decides at lengths that vary by prompt."""
    lo, hi = min(lengths), max(lengths)
    span = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"decision {round_number} at {span} tokens"


def _tokens(by_prompt: dict[str, list[dict[str, Any]]]) -> list[PromptTokens]:
    return [
        PromptTokens(pid, sum(c["num_tokens"] for c in group), estimate_bon_tokens(group))
        for pid, group in by_prompt.items()
    ]


def _facts(info: dict[str, Any]) -> dict[str, str]:
    spec = info["spec"]
    search = spec.get("search", {})
    schedule = search.get("schedule")
    if isinstance(schedule, dict) and "tokens" in schedule:
        schedule = "tokens " + ", ".join(str(t) for t in schedule["tokens"])
    seconds = info.get("seconds") or {}
    versions = info.get("versions") or {}
    facts = {
        "spec name": str(info.get("name", spec.get("name", "?"))),
        "fingerprint": str(info.get("fingerprint", "?")),
        "mode": str(search.get("mode", "?")),
        "N": str(search.get("n", "?")),
        "alpha": str(search.get("alpha", "?")),
        "schedule": str(schedule),
        "generator": str(spec.get("generator", {}).get("model", "?")),
        "reward": _reward_name(spec.get("reward")),
        "wall-clock": _seconds(seconds),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        + (f", python {info['python']}" if info.get("python") else ""),
    }
    return facts


def _reward_name(reward: Any) -> str:
    # A list of rewards (an ensemble) is planned; name each component.
    items = reward if isinstance(reward, list) else [reward]
    names = []
    for r in items:
        if isinstance(r, dict):
            names.append(f"{r.get('type', '?')}: {r.get('model') or r.get('function') or '?'}")
    return "; ".join(names) or "?"


def _seconds(seconds: dict[str, Any]) -> str:
    # A resumed run's run.json times only its own invocation, not the shards done before.
    parts = [f"{k} {float(v):.1f} s" for k, v in seconds.items() if isinstance(v, int | float)]
    return ", ".join(parts) + " (this invocation)" if parts else "?"


def _error_row(e: dict[str, Any]) -> ErrorRow:
    if "shard" in e:
        ids = ", ".join(str(i) for i in e.get("prompt_ids") or [])
        return ErrorRow("failed shard", str(e["shard"]), ids, str(e.get("reason", "")))
    return ErrorRow(
        "skipped prompt", str(e.get("row", "")), str(e.get("id") or ""), str(e.get("reason", ""))
    )
