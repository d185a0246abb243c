"""Speculative rejection for one prompt: batched decoding with in-place KV pruning."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from specrej_ray.engine.runner import decode, keep_rows, prefill
from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, prompt_key, sample_next
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.engine.stopping import StopChecker, eos_token_ids
from specrej_ray.search.combine import combine
from specrej_ray.search.rejection import best_index, decide
from specrej_ray.search.schedule import first_horizon, make_schedule, wave_size

# Scores one prompt's responses (partial or complete): a row per response, a score per
# reward of the RewardSet, in order.
ScoreFn = Callable[[list[str]], list[list[float]]]


class ScoreError(Exception):
    """A reward returned something that cannot be ranked (NaN, inf, wrong count)."""


@dataclass(frozen=True)
class RewardSet:
    """The rewards a ScoreFn returns, and how their scores combine into one."""

    names: tuple[str, ...] = ("reward",)
    weights: tuple[float, ...] = (1.0,)
    method: str = "zscore"  # see search.combine

    def combine(self, rows: list[list[float]]) -> list[float]:
        return combine(rows, self.weights, self.method)


@dataclass(frozen=True)
class SearchParams:
    n: int
    alpha: float  # 0 = Best-of-N
    decision_tokens: tuple[int, ...] | None  # None = memory schedule
    min_decision_tokens: int
    budget_tokens: int  # KV budget, in tokens summed over rows
    seed: int


@dataclass(frozen=True)
class EngineTask:
    """One prompt for Engine.run: its id, token ids and the scorer of its responses."""

    prompt_id: str
    input_ids: list[int]
    score: ScoreFn


@dataclass
class EngineStats:
    """Counters over decode steps since the engine was built (or reset_stats)."""

    budget_tokens: int
    decode_steps: int = 0
    row_steps: int = 0  # rows in the batch, summed over decode steps
    kv_token_steps: int = 0  # KV tokens held by the batch, summed over decode steps
    prompts: int = 0

    @property
    def mean_rows(self) -> float:
        return self.row_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def occupancy(self) -> float:
        """KV tokens in use over the budget, averaged over decode steps: the live rows over
        the rows the budget allows at the rows' current lengths."""
        if not self.decode_steps:
            return 0.0
        return self.kv_token_steps / (self.decode_steps * self.budget_tokens)

    def step(self, rows: int, kv_tokens: int) -> None:
        self.decode_steps += 1
        self.row_steps += rows
        self.kv_token_steps += kv_tokens


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        sampling: SamplingParams,
        search: SearchParams,
        rewards: RewardSet | None = None,
    ) -> None:
        self.model = model
        self.sampling = sampling
        self.search = search
        self.rewards = rewards or RewardSet()
        self.stopper = StopChecker(tokenizer, eos_token_ids(model, tokenizer), sampling.stop)
        self.schedule = make_schedule(
            list(search.decision_tokens) if search.decision_tokens else None,
            search.min_decision_tokens,
        )
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = EngineStats(self.search.budget_tokens)

    def run(self, tasks: Iterable[EngineTask], refill: bool = True) -> list[PromptResult]:
        """Every task's result, in task order."""
        return [self.generate(t.prompt_id, t.input_ids, t.score) for t in tasks]

    def generate(self, prompt_id: str, input_ids: list[int], score: ScoreFn) -> PromptResult:
        start = time.perf_counter()
        run = _PromptRun(self, prompt_id, input_ids, score)
        s = self.search
        horizon = first_horizon(
            list(s.decision_tokens) if s.decision_tokens else None,
            s.min_decision_tokens,
            self.sampling.max_new_tokens,
            s.alpha,
        )
        candidates = [Candidate(k) for k in range(s.n)]
        sizes: list[int] = []
        while sum(sizes) < s.n:
            first = sum(sizes)
            sizes.append(wave_size(s.n - first, s.budget_tokens, len(input_ids), horizon))
            run.wave(candidates[first : first + sizes[-1]])
        run.finalize([c for c in candidates if c.finished])
        best = best_index(
            [c.final_score if c.final_score is not None else float("-inf") for c in candidates],
            [c.finished for c in candidates],
        )
        self.stats.prompts += 1
        return PromptResult(
            prompt_id=prompt_id,
            candidates=candidates,
            best=best,
            n0=sizes[0],
            waves=len(sizes),
            rounds=run.rounds,
            prompt_tokens=len(input_ids),
            seconds=time.perf_counter() - start,
            score_seconds=run.score_seconds,
        )


class _PromptRun:
    """The state of one prompt's generation: its key, scorer and counters."""

    def __init__(self, engine: Engine, prompt_id: str, input_ids: list[int], score: ScoreFn):
        self.e = engine
        self.prompt_id = prompt_id
        self.input_ids = input_ids
        self.pkey = prompt_key(prompt_id)
        self._score = score
        self.rounds = 0
        self.score_seconds = 0.0

    def wave(self, wave: list[Candidate]) -> None:
        """Generate a group of candidates that share one batch until all are done."""
        e, p = self.e, len(self.input_ids)
        rows = list(wave)
        logits, cache = prefill(e.model, self.input_ids, len(rows))
        index = torch.tensor([c.index for c in rows], device=logits.device)
        for step in range(e.sampling.max_new_tokens):
            u = candidate_uniforms(e.search.seed, self.pkey, index, step)
            tokens = sample_next(logits, e.sampling, u).tolist()
            self._append(rows, tokens, last=step + 1 == e.sampling.max_new_tokens)
            live = sum(c.live for c in rows)
            if (
                e.search.alpha > 0
                and live
                and e.schedule.should_decide(step + 1, live, p + step, e.search.budget_tokens)
            ):
                self._decide([c for c in wave if c.rejected_round is None])
            keep = [i for i, c in enumerate(rows) if c.live]
            if not keep:
                return
            keep_rows(cache, keep, len(rows))
            e.stats.step(len(keep), len(keep) * (p + step + 1))
            rows = [rows[i] for i in keep]
            index = index[keep]
            logits = decode(
                e.model, torch.tensor([tokens[i] for i in keep], device=index.device), cache
            )

    def _append(self, rows: list[Candidate], tokens: list[int], last: bool) -> None:
        for c, t in zip(rows, tokens, strict=True):
            c.tokens.append(t)
            c.finish_reason = self.e.stopper.reason(c.tokens) or ("length" if last else None)
            if c.finished:
                c.text = self.e.stopper.text(c.tokens)

    def _decide(self, in_play: list[Candidate]) -> None:
        """Score everything in play; reject the live candidates outside the top (1 - alpha)."""
        self.rounds += 1
        self.score_unscored([c for c in in_play if c.finished])
        live = [c for c in in_play if c.live]
        fresh = iter(self._checked([self.e.stopper.text(c.tokens) for c in live], live))
        rows = [self._row(c) if c.finished else next(fresh) for c in in_play]
        scores = self.e.rewards.combine(rows)
        for c, s in zip(in_play, scores, strict=True):
            if c.live:
                c.partial_scores.append((len(c.tokens), s))
        decision = decide(scores, [c.finished for c in in_play], self.e.search.alpha)
        for i in decision.rejected:
            c = in_play[i]
            c.rejected_round = self.rounds
            c.text = self.e.stopper.text(c.tokens)

    def finalize(self, finished: list[Candidate]) -> None:
        """Final scores: the rewards combined over all of the prompt's finished candidates."""
        self.score_unscored(finished)
        combined = self.e.rewards.combine([self._row(c) for c in finished])
        for c, s in zip(finished, combined, strict=True):
            c.final_score = s

    def score_unscored(self, finished: list[Candidate]) -> None:
        todo = [c for c in finished if not c.components]
        for c, row in zip(todo, self._checked([c.text for c in todo], todo), strict=True):
            c.components = dict(zip(self.e.rewards.names, row, strict=True))

    def _row(self, c: Candidate) -> list[float]:
        return [c.components[name] for name in self.e.rewards.names]

    def _checked(self, texts: list[str], cands: list[Candidate]) -> list[list[float]]:
        if not texts:
            return []
        t0 = time.perf_counter()
        rows = [[float(s) for s in row] for row in self._score(texts)]
        self.score_seconds += time.perf_counter() - t0
        names = self.e.rewards.names
        if len(rows) != len(texts) or any(len(r) != len(names) for r in rows):
            raise ScoreError(
                f"rewards {', '.join(names)} returned {len(rows)} score rows for {len(texts)} "
                f"responses of prompt {self.prompt_id!r}"
            )
        for c, row in zip(cands, rows, strict=True):
            for name, s in zip(names, row, strict=True):
                if not math.isfinite(s):
                    raise ScoreError(
                        f"reward {name} gave {s} for prompt {self.prompt_id!r} "
                        f"candidate {c.index}; a reward must return finite numbers"
                    )
        return rows
