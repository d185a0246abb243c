"""A candidate response and a prompt's result: plain records the engine fills in."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Candidate:
    index: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos" | "stop" | "length"; None while live or rejected
    rejected_round: int | None = None  # decision round (1-based) that stopped it
    partial_scores: list[tuple[int, float]] = field(default_factory=list)  # (tokens, score)
    final_score: float | None = None
    components: dict[str, float] = field(default_factory=dict)  # final score per reward model
    text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def live(self) -> bool:
        return self.finish_reason is None and self.rejected_round is None


@dataclass
class PromptResult:
    prompt_id: str
    candidates: list[Candidate]
    best: int | None  # index into candidates of the highest final reward, None if none finished
    n0: int  # candidates started together in the first wave
    waves: int
    rounds: int  # decision rounds, summed over waves
    prompt_tokens: int
    seconds: float
    score_seconds: float

    @property
    def tokens_generated(self) -> int:
        return sum(len(c.tokens) for c in self.candidates)

    @property
    def finished(self) -> int:
        return sum(c.finished for c in self.candidates)

    @property
    def rejected(self) -> int:
        return sum(c.rejected_round is not None for c in self.candidates)
