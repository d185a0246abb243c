"""The engine: speculative rejection for a stream of prompts in one running batch.

Each prompt is a PromptState stepping its own waves and decisions; the engine keeps one
Batch of rows from as many prompts as the KV budget holds, admitting the next prompt's
wave as soon as rejection and finished candidates leave room (cross-prompt refill).
An out-of-memory error halves the budget and restarts the waves that were in the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from specrej_ray.engine.batch import Batch, Row
from specrej_ray.engine.prompt_state import PromptState
from specrej_ray.engine.runner import prefill
from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next
from specrej_ray.engine.scoring import ScoreError, ScoreFn, SubmitFn
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stopping import StopChecker, eos_token_ids
from specrej_ray.search.combine import combine
from specrej_ray.search.schedule import make_schedule

__all__ = ["Engine", "EngineOOMError", "EngineStats", "EngineTask", "RewardSet", "ScoreError",
           "ScoreFn", "SearchParams", "SubmitFn"]


class EngineOOMError(Exception):
    """Out of memory with a single candidate in the batch: halving cannot help."""


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
    """One prompt for Engine.run: its id, token ids and the scorer of its responses.

    With `submit`, decisions send their texts there and decoding goes on until the answer
    is needed; `score` then only serves the final scores of the last finished candidates.
    """

    prompt_id: str
    input_ids: list[int]
    score: ScoreFn
    submit: SubmitFn | None = None


@dataclass
class EngineStats:
    """Counters over decode steps since the engine was built (or reset_stats)."""

    budget_tokens: int  # the device budget (lower after an out-of-memory back-off)
    decode_steps: int = 0
    row_steps: int = 0  # rows in the batch, summed over decode steps
    kv_token_steps: int = 0  # real KV tokens held by the batch, summed over decode steps
    padded_token_steps: int = 0  # KV slots including left padding, summed over decode steps
    budget_token_steps: int = 0  # the budget, summed over decode steps
    prompts: int = 0
    oom_backoffs: int = 0
    discarded_tokens: int = 0  # decoded while a decision's scores were out, then rejected

    @property
    def mean_rows(self) -> float:
        return self.row_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def occupancy(self) -> float:
        """KV tokens in use over the budget, averaged over decode steps: the live rows over
        the rows the budget allows at the rows' current lengths."""
        if not self.budget_token_steps:
            return 0.0
        return self.kv_token_steps / self.budget_token_steps

    @property
    def padding(self) -> float:
        """Share of the batch's KV slots that are left padding (memory refill costs)."""
        if not self.padded_token_steps:
            return 0.0
        return 1.0 - self.kv_token_steps / self.padded_token_steps

    def step(self, batch: Batch) -> None:
        self.decode_steps += 1
        self.row_steps += len(batch)
        self.kv_token_steps += batch.kv_tokens()
        self.padded_token_steps += len(batch) * batch.columns
        self.budget_token_steps += self.budget_tokens


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
        self.budget = search.budget_tokens  # KV tokens the batch may hold; halved on OOM
        self.memory_plan = None  # engine.memory.MemoryPlan, when a planner sized the budget
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = EngineStats(self.budget)

    def generate(self, prompt_id: str, input_ids: list[int], score: ScoreFn) -> PromptResult:
        """One prompt alone."""
        return self.run([EngineTask(prompt_id, input_ids, score)])[0]

    def run(
        self,
        tasks: Iterable[EngineTask],
        refill: bool = True,
        on_result: Callable[[PromptResult], None] | None = None,
        more: Callable[[], Iterable[EngineTask]] | None = None,
    ) -> list[PromptResult]:
        """Every task's result, in task order; `on_result` hears of each as it finishes.

        refill=False runs one wave of one prompt at a time (the batch shrinks to nothing
        before the next starts); refill=True admits waves while the budget has room.
        `more`, asked before every step, hands over tasks that arrived meanwhile: they queue
        behind the others and join the running batch as room appears (a generator's next
        shard, before its current one drains). Their results come last in the list.
        """
        states = [self._state(t) for t in tasks]
        waiting, batch = deque(states), Batch()
        flight: list[PromptState] = []  # prompts with a wave in the batch or scores out
        while True:
            if more is not None:
                fresh = [self._state(t) for t in more()]
                states += fresh
                waiting.extend(fresh)
            if not (waiting or flight):
                break
            try:
                self._admit(waiting, flight, batch, refill)
                if batch:
                    self._step(batch, flight)
                else:  # nothing to decode: only answers can move things on
                    for state in flight:
                        state.close(wait=True)
            except Exception as e:
                if not _is_oom(e):
                    raise
                self._back_off(batch, waiting, flight, e)
            self._end_waves(flight, waiting, on_result)
        return [s.result for s in states]

    def _state(self, task: EngineTask) -> PromptState:
        return PromptState(self, task.prompt_id, task.input_ids, task.score, task.submit)

    def _admit(self, waiting: deque[PromptState], flight: list[PromptState], batch: Batch,
               refill: bool) -> None:
        while waiting:
            state = waiting[0]
            size = state.next_wave_size(self.budget)
            if flight:
                held = sum(s.reserved() for s in flight)
                if not refill or held + state.first_reservation(size) > self.budget:
                    return
            waiting.popleft()
            flight.append(state)
            wave = state.start_wave(size, self.budget)
            logits, cache = prefill(self.model, state.input_ids, size)
            batch.add([Row(state, c) for c in wave], cache, logits,
                      state.prompt_tokens)

    def _step(self, batch: Batch, flight: list[PromptState]) -> None:
        """Sample a token per row, let each prompt take its rows' tokens, prune, decode."""
        rows, device = batch.rows, batch.logits.device
        u = candidate_uniforms(
            self.search.seed,
            torch.tensor([r.owner.pkey for r in rows], device=device),
            torch.tensor([r.candidate.index for r in rows], device=device),
            torch.tensor([len(r.candidate.tokens) for r in rows], device=device),
        )
        tokens = sample_next(batch.logits, self.sampling, u).tolist()
        for state, positions in _owners(batch).items():
            state.step([rows[i].candidate for i in positions], [tokens[i] for i in positions])
        for state in flight:
            state.close(wait=False)
        keep = [i for i, r in enumerate(rows) if r.candidate.live]
        batch.keep(keep)
        if batch:
            batch.decode(self.model, [tokens[i] for i in keep])
            self.stats.step(batch)

    def _end_waves(self, flight: list[PromptState], waiting: deque[PromptState],
                   on_result: Callable[[PromptResult], None] | None) -> None:
        # A prompt with waves left goes first, so prompts finish in order when they can.
        for state in reversed([s for s in flight if s.wave_done]):
            flight.remove(state)
            state.end_wave()
            if state.done:
                self.stats.prompts += 1
                self.stats.discarded_tokens += state.discarded
                if on_result is not None:
                    on_result(state.result)
            else:
                waiting.appendleft(state)

    def _back_off(self, batch: Batch, waiting: deque, flight: list[PromptState], error) -> None:
        """Halve the budget (from what the batch held) and restart the waves in flight."""
        rows, held = len(batch), batch.kv_tokens()
        batch.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        in_flight = list(flight)
        flight.clear()
        if rows <= 1 and not any(len(s.wave) > 1 for s in in_flight):
            raise EngineOOMError(
                f"out of memory with one candidate in the batch ({error}); use a smaller "
                "model, dtype or generator.sampling.max_new_tokens"
            ) from error
        for state in reversed(in_flight):
            state.restart_wave()
            waiting.appendleft(state)
        self.budget = max(1, min(self.budget, max(held, 2 * rows)) // 2)
        self.stats.budget_tokens = self.budget
        self.stats.oom_backoffs += 1


def _owners(batch: Batch) -> dict[PromptState, list[int]]:
    """Each prompt in the batch with its rows' positions, in order of first appearance."""
    owners: dict[PromptState, list[int]] = {}
    for i, row in enumerate(batch.rows):
        owners.setdefault(row.owner, []).append(i)
    return owners


def _is_oom(e: Exception) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text
                                           or "can't allocate memory" in text)
