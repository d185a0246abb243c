"""A candidate response and a prompt's result: plain records the engine fills in."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Status(Enum):
    LIVE = "live"  # still decoding (or waiting for a decision)
    FINISHED = "finished"  # EOS, a stop string or max_new_tokens: its reward is final
    REJECTED = "rejected"  # stopped by a decision
    PRUNED = "pruned"  # stopped by bounds: it can no longer be in what the job keeps
    STOPPED = "stopped"  # its prompt had what the job keeps (search.draws): not needed


@dataclass
class Candidate:
    index: int
    tokens: list[int] = field(default_factory=list)
    status: Status = Status.LIVE
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished
    rejected_round: int | None = None  # decision round (1-based) that stopped it
    partial_scores: list[tuple[int, float]] = field(default_factory=list)  # (tokens, score)
    final_score: float | None = None
    components: dict[str, float] = field(default_factory=dict)  # final score per reward model
    text: str = ""
    # Untempered log-probability of each token under the generator, kept when a reward is
    # the generator's own likelihood (scored from these, with no second forward pass).
    logprobs: list[float] = field(default_factory=list)
    # What a reward scored in the engine keeps of the final response (reward.instructions:
    # each instruction's verdict, strict or loose as the reward scores), by reward name.
    details: dict[str, list[dict]] = field(default_factory=dict)
    # search.branch: the candidate this one continues, from its first `forked_at` tokens.
    parent: int | None = None
    forked_at: int | None = None

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def live(self) -> bool:
        return self.status is Status.LIVE

    @property
    def rejected(self) -> bool:
        return self.status is Status.REJECTED

    @property
    def pruned(self) -> bool:
        return self.status is Status.PRUNED

    @property
    def stopped(self) -> bool:
        return self.status is Status.STOPPED

    @property
    def in_play(self) -> bool:
        """Live or finished: ranked at decisions, eligible as the best."""
        return self.status is Status.LIVE or self.status is Status.FINISHED

    def finish(self, reason: str, text: str) -> None:
        self.status, self.finish_reason, self.text = Status.FINISHED, reason, text

    def prune(self, text: str) -> None:
        """Stop it where it stands: bounds showed it cannot be in what the job keeps."""
        self.status, self.finish_reason, self.text = Status.PRUNED, None, text

    def stop(self, at: int, text_of) -> None:
        """Stop it at `at` tokens (cut back if longer): its prompt had what the job keeps by
        then (engine.draws); scores taken past `at` go."""
        del self.tokens[at:]
        del self.logprobs[at:]
        self.status, self.finish_reason, self.rejected_round = Status.STOPPED, None, None
        self.partial_scores = [(t, s) for t, s in self.partial_scores if t < at]
        self.components, self.final_score, self.text = {}, None, text_of(self.tokens)

    def child(self, index: int, at: int) -> Candidate:
        """A new candidate continuing this one's first `at` tokens (search.branch)."""
        return Candidate(index, tokens=self.tokens[:at], logprobs=self.logprobs[:at],
                         partial_scores=[(t, s) for t, s in self.partial_scores if t <= at],
                         parent=self.index, forked_at=at)

    def reject(self, round_: int, at: int, text_of) -> int:
        """Stop it, cut back to `at` tokens (it may have decoded on while the scores were
        out); returns the tokens cut."""
        cut = len(self.tokens) - at
        del self.tokens[at:]
        del self.logprobs[at:]
        self.status, self.finish_reason, self.rejected_round = Status.REJECTED, None, round_
        self.text = text_of(self.tokens)
        return cut


@dataclass
class PromptResult:
    prompt_id: str
    candidates: list[Candidate]
    best: int | None  # index into candidates of the highest final reward, None if none finished
    n0: int  # candidates started together in the first group
    waves: int  # groups of fresh candidates started
    rounds: int  # decision rounds
    prompt_tokens: int
    seconds: float  # from its first step to its result
    score_seconds: float  # decoding stood still waiting for its scores
    discarded_tokens: int = 0  # decoded past a decision by candidates it then rejected
    replayed_tokens: int = 0  # decoded again after the cache lost them (eviction, OOM)
    engine_seconds: float = 0.0  # its share of the batch's step time, by rows, plus prefill
    bounds_checks: int = 0  # times its candidates' bounds were asked for
    bounds_seconds: float = 0.0  # spent on them (the reward's bounds and the pruning rule)
    # With search.draws: why it stopped drawing (engine.draws: KEPT, CAP) and how many
    # draws it made; None without (the outputs then carry neither).
    stop_reason: str | None = None
    draws: int | None = None
    branched: bool = False  # search.branch on: its candidates say their parents

    @property
    def tokens_generated(self) -> int:
        return sum(len(c.tokens) for c in self.candidates)

    @property
    def tokens_decoded(self) -> int:
        """Decode work spent on it: kept tokens, discarded ones and replays."""
        return self.tokens_generated + self.discarded_tokens + self.replayed_tokens

    @property
    def finished(self) -> int:
        return sum(c.finished for c in self.candidates)

    @property
    def rejected(self) -> int:
        return sum(c.rejected for c in self.candidates)

    @property
    def pruned(self) -> int:
        return sum(c.pruned for c in self.candidates)

    @property
    def stopped(self) -> int:
        return sum(c.stopped for c in self.candidates)
