"""The engine: speculative rejection for a stream of prompts in one running batch.

`Engine.step()` is, as nano-vllm's:

    batch = scheduler.schedule()         decide: admission, reservations, the budget guard,
                                         every slot the step takes
    drawn = model runner on the batch    run: prefill, decode, sample (`_run`)
    scheduler.postprocess(batch, drawn)  each prompt takes its tokens
    reward phase                         each prompt's bounds, scores sent and polled: never
                                         waits, unless no row could move (`_rewards`)
    scheduler.release()                  the cache follows: rows and prefixes no longer needed
                                         leave it; the prompts that finished

`Engine.run(tasks)` steps until every task has its result. Prompts of different lengths,
admitted at different steps, share the batch (cross-prompt refill); an out-of-memory error
while running a batch halves the budget and the rows in the cache come back by replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from specrej_ray.engine.base import EngineBase, Intake
from specrej_ray.engine.hf.batch import Batch, Drawn
from specrej_ray.engine.hf.block_manager import CHUNK
from specrej_ray.engine.hf.model_runner import ModelRunner
from specrej_ray.engine.hf.prompt_state import Group, PromptState
from specrej_ray.engine.hf.scheduler import EngineOOMError, Scheduler
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet, ScoreError
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stats import EngineStats
from specrej_ray.engine.stopping import eos_token_ids
from specrej_ray.engine.task import Choice, EngineTask, ScoreFn, SearchParams, SubmitFn

__all__ = ["Choice", "Engine", "EngineOOMError", "EngineStats", "EngineTask", "RewardSet",
           "ScoreError", "ScoreFn", "SearchParams", "SubmitFn"]

class Engine(EngineBase):
    backend = "hf"
    chunk = CHUNK

    def __init__(self, model, tokenizer, sampling: SamplingParams, search: SearchParams,
                 rewards: RewardSet | None = None, *, runner: ModelRunner | None = None) -> None:
        self.runner = runner or ModelRunner(model)
        self._set_up(tokenizer, sampling, search, rewards, eos_token_ids(self.model, tokenizer))
        self.budget = search.budget_tokens  # halved by an out-of-memory back-off
        self.memory_plan = None  # engine.hf.memory.MemoryPlan, when a planner sized the budget
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
        self.runner.pool.clear()

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
        self.scheduler = Scheduler(self.runner.pool.n_layers, self.budget, refill, self.chunk)
        intake = Intake(self._state, tasks, more)
        try:
            while True:
                for state in intake.arrived():
                    self.scheduler.add(state)
                if not self.scheduler.has_work():
                    break
                for state in self.step():
                    self._finished(state, on_result)
        finally:
            self.runner.pool.clear()
            self.stats.stalls += self.scheduler.stalls
            self.stats.evictions += self.scheduler.evictions
        return intake.results()

    def step(self) -> list[PromptState]:
        """One step of the running batch; the prompts that finished in it."""
        batch = self.scheduler.schedule()
        try:
            drawn = self._run(batch)
        except Exception as e:
            if not _is_oom(e):
                raise
            self._back_off(e, batch)
        else:
            self.scheduler.postprocess(batch, drawn)
            self._count(batch.decode)
        self._rewards(moved=bool(batch.groups))
        return self.scheduler.release()

    # -- internals ------------------------------------------------------------------------

    def _state(self, task: EngineTask) -> PromptState:
        return PromptState(self._config(task.choice), task, self.scheduler.room)

    def _run(self, batch: Batch) -> Drawn | None:
        """The model runner's part of a step: every prefill, then the decode and the draws."""
        self.runner.pool.expect(batch.growth)
        for prefill in batch.prefills:
            self._prefill(prefill)
            batch.prefilled += 1
        return self._decode_and_draw(batch) if batch.groups else None

    def _rewards(self, moved: bool) -> None:
        """The reward phase: every prompt's bound checks, the scores it sends for and those
        that came in. It waits only when no row could move this step: for the oldest
        prompt whose scores are out."""
        if not moved:
            waiting = self.scheduler.waiting_on_rewards()
            if waiting is None:
                raise RuntimeError("the engine cannot move: no row fits and no score is out")
            waiting.wait()
        for p in list(self.scheduler.running):
            p.reward_step()

    def _prefill(self, prefill) -> None:
        p, t0 = prefill.prompt, time.perf_counter()
        p.first_logits = self.runner.prefill(prefill.slots, prefill.pool, p.input_ids)
        p.engine_seconds += time.perf_counter() - t0
        self.stats.prefill_tokens += p.prompt_tokens

    def _decode_and_draw(self, batch: Batch) -> Drawn | None:
        """Decode the groups that feed a token, draw for every row that draws one, and charge
        each prompt its rows' share of the step's time."""
        t0 = time.perf_counter()
        for g in batch.decode:
            if not g.draws_token:
                g.prompt.replayed += len(g)
        logits = (self.runner.decode(batch.slots, batch.feed, batch.pool) if batch.decode
                  else None)
        drawn = None
        if batch.draw:
            rows = self._drawing_rows(logits, batch.decode, batch.draw)
            tokens = self.runner.sample(rows, batch.streams, self.sampling, self.search.seed)
            logprobs = self.runner.logprobs(rows, tokens) if self.rewards.any_free else None
            drawn = Drawn(tokens, logprobs)
        seconds = time.perf_counter() - t0
        rows = sum(len(g) for g in batch.groups)
        for g in batch.groups:
            g.prompt.engine_seconds += seconds * len(g) / rows
        return drawn

    @staticmethod
    def _drawing_rows(logits, decode: list[Group], draw: list[Group]) -> torch.Tensor:
        """The logits of the drawing groups' rows, in their order: the decoded rows (all of
        them, most steps), or a selection with the prompt's logits for groups with no token
        yet."""
        if draw == decode:
            return logits
        sources = [] if logits is None else [logits]
        where, at = {}, 0
        for g in decode:
            where[g] = at
            at += len(g)
        index = []
        for g in draw:
            if not g.decodes:
                sources.append(g.prompt.first_logits[None])
                index.append(np.full(len(g), at))
                at += 1
            else:
                index.append(np.arange(where[g], where[g] + len(g)))
        every = torch.cat(sources)
        return every.index_select(0, torch.from_numpy(np.concatenate(index)).to(every.device))

    def _back_off(self, error: Exception, batch: Batch) -> None:
        self.scheduler.back_off(error, batch)
        self.runner.pool.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # give the freed blocks back before the rows return
        self.budget = self.stats.budget_tokens = self.scheduler.budget
        self.stats.oom_backoffs += 1

    def _count(self, decoded: list[Group]) -> None:
        if not decoded:
            return
        st, s = self.stats, self.scheduler
        st.decode_steps += 1
        st.row_steps += sum(len(g) for g in decoded)
        st.kv_token_steps += s.real_tokens()
        st.alloc_token_steps += s.blocks.tokens()
        st.budget_token_steps += self.budget
        st.peak_kv_bytes = max(st.peak_kv_bytes, self.runner.pool.peak_bytes)

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
