"""The engine: speculative rejection for a stream of prompts in one running batch.

`Engine.step()` is `scheduler.schedule()` (admission, reservations, the budget guard) ->
`model_runner` (decode, sample) -> `scheduler.postprocess()` (each prompt takes its tokens,
decides, finishes). `Engine.run(tasks)` steps until every task has its result. Prompts of
different lengths, admitted at different steps, share the batch (cross-prompt refill); an
out-of-memory error halves the budget and the rows in the cache come back by replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from specrej_ray.engine.base import EngineBase
from specrej_ray.engine.hf.kv_cache import CHUNK
from specrej_ray.engine.hf.model_runner import ModelRunner
from specrej_ray.engine.hf.prompt_state import Group, PromptConfig, PromptState
from specrej_ray.engine.hf.scheduler import EngineOOMError, Scheduler
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet, ScoreError
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stats import EngineStats
from specrej_ray.engine.stopping import StopChecker, eos_token_ids
from specrej_ray.engine.task import Choice, EngineTask, ScoreFn, SearchParams, SubmitFn
from specrej_ray.search.schedule import make_schedule

__all__ = ["Choice", "Engine", "EngineOOMError", "EngineStats", "EngineTask", "RewardSet",
           "ScoreError", "ScoreFn", "SearchParams", "SubmitFn"]

class Engine(EngineBase):
    backend = "hf"
    chunk = CHUNK

    def __init__(self, model, tokenizer, sampling: SamplingParams, search: SearchParams,
                 rewards: RewardSet | None = None, *, runner: ModelRunner | None = None) -> None:
        self.runner = runner or ModelRunner(model)
        self.tokenizer = tokenizer
        self.sampling, self.search = sampling, search
        self.rewards = rewards or RewardSet()
        eos = set() if sampling.ignore_eos else eos_token_ids(self.model, tokenizer)
        self.stopper = StopChecker(tokenizer, eos, () if sampling.ignore_eos else sampling.stop)
        self.schedule = make_schedule(search.alpha, search.decision_tokens,
                                      search.min_decision_tokens)
        self.budget = search.budget_tokens  # halved by an out-of-memory back-off
        self._configs: dict[Choice | None, PromptConfig] = {}
        self.memory_plan = None  # engine.memory.MemoryPlan, when a planner sized the budget
        self.scheduler: Scheduler | None = None
        self.reset_stats()

    @property
    def model(self):
        return self.runner.model

    @property
    def device(self) -> str:
        return str(self.model.device)

    def kv_capacity_tokens(self) -> int:
        return self.budget  # lower after an out-of-memory back-off

    def close(self) -> None:
        self.runner.kv.clear()

    def _copy(self, sampling: SamplingParams, search: SearchParams) -> Engine:
        e = Engine(self.model, self.tokenizer, sampling, search, self.rewards,
                   runner=self.runner)
        e.memory_plan = self.memory_plan
        return e

    def reset_stats(self) -> None:
        self.stats = EngineStats(self.budget)

    def run(
        self,
        tasks: Iterable[EngineTask],
        refill: bool = True,
        on_result: Callable[[PromptResult], None] | None = None,
        more: Callable[[], Iterable[EngineTask]] | None = None,
    ) -> list[PromptResult]:
        """Every task's result, in task order; `on_result` hears of each as it finishes.

        refill=False starts a prompt only when the previous ones are done; refill=True
        admits rows whenever the budget has room. `more`, asked before every step, hands
        over tasks that arrived meanwhile: they queue behind the others and join the running
        batch as room appears (a generator's next shard, before its current one drains).
        Their results come last in the list.
        """
        self.scheduler = Scheduler(self.runner.kv, self.budget, refill, self._prefill)
        states = [self._state(t) for t in tasks]
        for s in states:
            self.scheduler.add(s)
        try:
            while True:
                if more is not None:
                    for t in more():
                        states.append(self._state(t))
                        self.scheduler.add(states[-1])
                if not self.scheduler.has_work():
                    break
                for state in self.step():
                    self._finished(state, on_result)
        finally:
            self.runner.kv.clear()
            self.stats.stalls += self.scheduler.stalls
            self.stats.evictions += self.scheduler.evictions
        return [s.result for s in states]

    def step(self) -> list[PromptState]:
        """One step of the running batch; the prompts that finished in it."""
        scheduler = self.scheduler
        try:
            groups = scheduler.schedule()
            if groups:
                self._run(groups)
            elif any(p.open is not None for p in scheduler.running):
                scheduler.wait_for_scores()
            else:
                raise RuntimeError("the engine cannot move: no row fits and no score is out")
        except Exception as e:
            if not _is_oom(e):
                raise
            scheduler.back_off(e)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # give the freed blocks back before the rows return
            self.budget = self.stats.budget_tokens = scheduler.budget
            self.stats.oom_backoffs += 1
        return scheduler.postprocess()

    # -- internals ------------------------------------------------------------------------

    def _state(self, task: EngineTask) -> PromptState:
        return PromptState(self._config(task.choice), task, self.runner.kv,
                           self.scheduler.room)

    def _prefill(self, p: PromptState) -> None:
        t0 = time.perf_counter()
        p.first_logits = self.runner.prefill(p.prefix, p.input_ids)
        p.engine_seconds += time.perf_counter() - t0
        self.stats.prefill_tokens += p.prompt_tokens

    def _run(self, groups: list[Group]) -> None:
        """Decode the groups that feed a token, sample every row that draws one, and charge
        each prompt its rows' share of the step's time."""
        t0 = time.perf_counter()
        fed = [g for g in groups if not g.fresh]
        sampling = [g for g in groups if g.samples]  # before decoding moves `fed` on
        for g in fed:
            if not g.samples:
                g.prompt.replayed += len(g)
        logits = self.runner.decode(fed) if fed else None
        if sampling:
            rows = self._sampled_rows(logits, fed, sampling)
            drawn = self.runner.sample(rows, sampling, self.sampling, self.search.seed)
            logprobs = self.runner.logprobs(rows, drawn) if self.rewards.any_free else None
            at = 0
            for g in sampling:
                end = at + len(g)
                g.prompt.take(g, drawn[at:end], None if logprobs is None else logprobs[at:end])
                at = end
        seconds = time.perf_counter() - t0
        rows = sum(len(g) for g in groups)
        for g in groups:
            g.prompt.engine_seconds += seconds * len(g) / rows
        self._count(fed)

    @staticmethod
    def _sampled_rows(logits, fed: list[Group], sampling: list[Group]) -> torch.Tensor:
        """The logits of the sampling groups' rows, in their order: the decoded rows (all of
        them, most steps), or a selection with the first logits of fresh groups."""
        if sampling == fed:
            return logits
        sources = [] if logits is None else [logits]
        where, at = {}, 0
        for g in fed:
            where[g] = at
            at += len(g)
        index = []
        for g in sampling:
            if g.fresh:
                sources.append(g.prompt.first_logits[None])
                index.append(np.full(len(g), at))
                at += 1
            else:
                index.append(np.arange(where[g], where[g] + len(g)))
        every = torch.cat(sources)
        return every.index_select(0, torch.from_numpy(np.concatenate(index)).to(every.device))

    def _count(self, fed: list[Group]) -> None:
        if not fed:
            return
        st, kv = self.stats, self.runner.kv
        st.decode_steps += 1
        st.row_steps += sum(len(g) for g in fed)
        st.kv_token_steps += kv.real_tokens()
        st.alloc_token_steps += kv.tokens()
        st.budget_token_steps += self.budget
        st.peak_kv_bytes = max(st.peak_kv_bytes, kv.peak_bytes)

    def _finished(self, state: PromptState, on_result) -> None:
        self.stats.count_finished(state.result)
        self.stats.replayed_tokens += state.replayed
        if on_result is not None:
            on_result(state.result)


def _is_oom(e: Exception) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text
                                           or "can't allocate memory" in text)
