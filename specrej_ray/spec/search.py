"""The spec's search section: N, alpha, the schedule, calibration and the audit."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from specrej_ray.spec.base import _Strict


class TokensSchedule(_Strict):
    tokens: list[int] = Field(
        min_length=1, description="Generated lengths at which to score and reject (Algorithm 1)."
    )

    @field_validator("tokens")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(t < 1 for t in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(
                "decision tokens must be positive and strictly increasing, e.g. [32, 64]"
            )
        return v


class DrawsSpec(_Strict):
    """Per-prompt budgets: candidates drawn in waves until the prompt has what the outputs
    keep (docs/draws.md)."""

    until: Literal["kept", "rule"] = Field(
        "kept",
        description="kept: until a finished response at the reward's ceiling, with "
        "`preference` a rejected side and with `top_k` k responses the filters keep; then "
        "the prompt's live candidates stop and its rows go to the other prompts. Needs "
        "rewards with a ceiling (reward.ceiling). rule: for rewards without one, after each "
        "draw, stop once another candidate is expected to add at most `cost` of the spread "
        "of the prompt's own finished rewards (Pandora's box, search/pandora.py) "
        "(docs/draws.md).",
    )
    cost: float = Field(
        0.05, gt=0, description="until rule: what a candidate costs, as a share of the "
        "standard deviation of the prompt's finished rewards.",
    )
    max_n: int = Field(
        ge=1, description="The most candidates a prompt draws in all (at least search.n)."
    )
    wave: int | None = Field(
        None, ge=1, description="Candidates each draw after the first adds (default: search.n); "
        "each draw runs the rule's decisions among its own candidates.",
    )


class SearchSpec(_Strict):
    mode: Literal["sbon", "bon"] = Field(
        "sbon", description="sbon: speculative rejection; bon: plain Best-of-N (alpha ignored)."
    )
    n: int | Literal["auto"] = Field(
        16,
        description="Candidates per prompt (the N of Best-of-N), or `auto`: as many as the KV "
        "budget holds up to the first decision (t1 of a tokens schedule, `min_decision_tokens` "
        "of the memory schedule, max_new_tokens with mode bon), as the NeurIPS paper sizes "
        "its batch. With "
        "`auto` N depends on the device, so a job resumed on another device may mix Ns.",
    )
    alpha: float = Field(
        0.5, ge=0.0, lt=1.0, description="Fraction of in-play candidates rejected per decision."
    )
    schedule: Literal["memory", "auto"] | TokensSchedule = Field(
        "memory",
        description="`memory` (NeurIPS version): decide at `min_decision_tokens`, then whenever "
        "the live candidates' KV cache would outgrow the prompt's share of the budget; or "
        "`{tokens: [t1, t2, ...]}` (workshop Algorithm 1): decide at fixed generated lengths; "
        "or `auto`: the first `calibration_prompts` prompts run as Best-of-N (their answers "
        "are exact and kept), their candidates choose the cheapest alpha and tokens schedule "
        "whose normalized score keeps its 95% lower bound at `target_score`, and the rest of "
        "the job runs with it (docs/calibration.md). Either way all live candidates of a "
        "prompt meet at a decision and one cut-off ranks them all.",
    )
    target_score: float = Field(
        99.0, ge=0, le=100,
        description="The normalized score (paper eq. 6, against Best-of-N on the same "
        "candidates, mean over prompts) the run aims at: with schedule auto, a chosen "
        "setting's 95% bootstrap lower bound must reach it; the audit (`audit_fraction`) "
        "warns when its interval lies below it. 0 takes the cheapest setting calibrated.",
    )
    calibration_prompts: int = Field(
        8, ge=1,
        description="schedule auto: how many of the job's first prompts calibrate (run as "
        "Best-of-N, their prefixes scored at 8, 16, 32, 64 and 128 tokens). More prompts give a "
        "tighter bound, so a cheaper setting can qualify.",
    )
    calibration_fallback: Literal["bon", "closest"] = Field(
        "bon",
        description="schedule auto, when no setting reaches the target: `bon` runs the rest as "
        "Best-of-N (the target is then met by construction); `closest` runs the setting with "
        "the highest lower bound, and says so.",
    )
    audit_fraction: float = Field(
        0.02, ge=0, le=1,
        description="Share of prompts (chosen by a hash of `seed` and the prompt id) that also "
        "run a shadow Best-of-N: the same N candidates decoded to the end, by candidate "
        "identity, so the run measures its own normalized score (paper eq. 6) on real "
        "prompts. The answers stay the run's; the shadow's tokens are counted apart "
        "(run.json `audit`). The summary warns when the score's 95% interval lies below "
        "`target_score`; with `schedule: auto` the job then recalibrates on the audited "
        "prompts. 0 turns it off; mode bon and `n: auto` are never audited "
        "(docs/calibration.md).",
    )
    min_decision_tokens: int = Field(
        16,
        ge=1,
        description="Memory schedule: the first decision's length. With a fixed N a prompt's "
        "share is what its N candidates hold at this length (capped by the device budget), "
        "so later decisions fall where the survivors have grown back into it (about every "
        "doubling at alpha 0.5) and a large device holds several prompts; with `n: auto` "
        "the share is the whole budget, as in the paper.",
    )
    kv_budget_gb: float = Field(
        2.0,
        gt=0,
        description="KV-cache budget in GiB on CPU (CUDA sizes it from free memory); it bounds "
        "the rows the running batch holds.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of free CUDA memory given to the KV cache."
    )
    refill: bool = Field(
        True,
        description="Admit the next prompt's candidates into the running batch as soon as "
        "rejected and finished ones leave room (cross-prompt refill); results are the same "
        "either way.",
    )
    bounds: bool = Field(
        True,
        description="Stop a candidate as soon as its reward's bounds show it can no longer be "
        "in what the job keeps (the best, or the `output.top_k` best after the output filters): "
        "lossless, beyond the paper's rule, which still applies to what bounds leave. Needs a "
        "single reward that gives bounds (reward.type instructions); a preference pair's "
        "rejected side is then the worst candidate that finished (docs/rewards.md).",
    )
    bounds_every: int = Field(
        8, ge=1, description="With `bounds`: generated tokens between two checks of a prompt's "
        "candidates (each check scores every live candidate's text so far).",
    )
    draws: DrawsSpec | None = Field(
        None,
        description="Per-prompt budgets (off when absent): a prompt draws search.n candidates, "
        "then `wave` more at a time, until it has what the outputs keep or has drawn `max_n`; "
        "it stops at the shortest length at which it had it, so its result is the same "
        "whatever shares its batch (docs/draws.md). Needs a fixed n.",
    )
    branch: bool = Field(
        False,
        description="The rows a decision's rejections free go to children of its survivors "
        "(parents drawn in proportion to rank, never one whose bound cannot reach the best), "
        "each continuing its parent's text from the decision on a random stream of its own "
        "and sharing its parent's KV cache; off: they go to the other prompts (refill). "
        "Narrows diversity: docs/draws.md.",
    )
    reward_combine: Literal["zscore", "rank"] = Field(
        "zscore",
        description="With several rewards: weighted sum of per-prompt z-scores, or weighted "
        "average of per-prompt ranks.",
    )

    @field_validator("n", mode="before")
    @classmethod
    def _n_count_or_auto(cls, v: Any) -> Any:
        # One line for a bad value, instead of one per arm of the union.
        if isinstance(v, bool):
            raise ValueError("expected a number, not true/false")
        if v == "auto" or (isinstance(v, int) and v >= 1):
            return v
        raise ValueError("must be a positive integer or auto")

    @model_validator(mode="after")
    def _draws_fit(self) -> SearchSpec:
        if self.draws is None:
            return self
        if self.n == "auto":
            raise ValueError("search.draws needs a fixed search.n (the first draw), not auto")
        if self.draws.max_n < self.n:
            raise ValueError(f"search.draws.max_n ({self.draws.max_n}) is below search.n "
                             f"({self.n}), the first draw")
        return self

    @property
    def n_or_none(self) -> int | None:
        """N for the engine: None for `auto` (sized from the KV budget per prompt)."""
        return None if self.n == "auto" else self.n

    @property
    def effective_alpha(self) -> float:
        return 0.0 if self.mode == "bon" else self.alpha

    @property
    def decision_tokens(self) -> list[int] | None:
        return None if isinstance(self.schedule, str) else list(self.schedule.tokens)

    @property
    def calibrates(self) -> bool:
        """schedule auto: the job chooses its alpha and schedule from calibration prompts."""
        return self.schedule == "auto"
