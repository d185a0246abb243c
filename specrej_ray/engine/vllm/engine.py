"""VllmEngine: speculative rejection inside vLLM's continuous batch, under the contract every
backend meets (engine.protocol.GenerationEngine).

`run(tasks)` loops: hand vLLM the next prompt's candidates while its scheduler can admit them
(refill), `LLMEngine.step()`, give each candidate its new tokens (prompt_requests), then let
every prompt apply the scores that are in (aborting the losers), open the decisions that are
due and send its parked candidates on. When nothing runs and scores are out, it waits for
the oldest. The sampling is ours (candidate_sampler), so results equal the hf engine's.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable

from specrej_ray.engine.base import EngineBase, Intake
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.engine.stats import EngineStats
from specrej_ray.engine.task import EngineTask, SearchParams
from specrej_ray.engine.vllm.candidate_sampler import draw_args
from specrej_ray.engine.vllm.probe import EngineProbe
from specrej_ray.engine.vllm.prompt_requests import PromptRequests
from specrej_ray.engine.vllm.vllm_internals import shutdown, token_prompt
from specrej_ray.engine.vllm.vllm_stats import VllmStats
from specrej_ray.search.schedule import MemorySchedule


class EngineStuck(RuntimeError):
    """vLLM stopped moving: requests are in but no step gives them tokens."""


class VllmEngine(EngineBase):
    backend = "vllm"

    def __init__(self, llm, tokenizer, sampling: SamplingParams, search: SearchParams,
                 rewards: RewardSet | None, eos_ids: set[int], *, stuck_steps: int = 1000,
                 owner: bool = True) -> None:
        self.llm = llm
        self._set_up(tokenizer, sampling, search, rewards, eos_ids)
        self.eos_ids = self.stopper.eos_ids
        self.probe = EngineProbe(llm)
        self.chunk = self.probe.block_size
        self.stuck_steps = stuck_steps  # steps with requests in and no token out
        self.owner = owner  # whether close() shuts vLLM down (copies share it)
        self._ids = itertools.count()
        self._requests: dict[str, tuple[PromptRequests, Candidate]] = {}
        # requests whose prefix-cache hits are not counted yet: (prompt length, continues)
        self._uncounted: dict[str, tuple[int, bool]] = {}
        self.reset_stats()

    # -- the contract -------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return str(self.llm.vllm_config.device_config.device_type)

    def kv_capacity_tokens(self) -> int:
        return self.probe.capacity_tokens

    def reset_stats(self) -> None:
        self.stats = EngineStats(self.kv_capacity_tokens())
        self.vllm = VllmStats(block_size=self.probe.block_size)

    def close(self) -> None:
        if self.owner:
            shutdown(self.llm)

    def _copy(self, sampling: SamplingParams, search: SearchParams) -> VllmEngine:
        return VllmEngine(self.llm, self.tokenizer, sampling, search, self.rewards,
                          self.eos_ids, stuck_steps=self.stuck_steps, owner=False)

    def run(self, tasks: Iterable[EngineTask], refill: bool = True,
            on_result: Callable[[PromptResult], None] | None = None,
            more: Callable[[], Iterable[EngineTask]] | None = None) -> list[PromptResult]:
        """Every task's result, in task order; see engine.protocol."""
        _same_threads_here()
        intake = Intake(self._state, tasks, more)
        queue, active = deque(), []
        step, idle = 0, 0
        try:
            while True:
                queue.extend(intake.arrived())
                self._admit(queue, active, refill)
                if not active:
                    break
                if self.llm.has_unfinished_requests():
                    step += 1
                    idle = 0 if self._step(step) else idle + 1
                    if idle >= self.stuck_steps:
                        raise EngineStuck(
                            f"vLLM made {idle} steps without a token for "
                            f"{len(self._requests)} requests; is max_model_len or the KV "
                            "cache too small for a prompt?")
                else:
                    self._wait_for_scores(active)
                pressure = self._memory(active) and self.probe.pressure()
                for p in list(active):
                    p.after_step(pressure, self._abort)
                    self._send(p)
                    if p.done:
                        active.remove(p)
                        self._finished(p, on_result)
        finally:
            if self._requests:  # an error: nothing of ours may keep running in vLLM
                self._abort([c for _, c in self._requests.values()])
            self.stats.evictions = self.vllm.preemptions
        return intake.results()

    # -- internals ---------------------------------------------------------------------------

    def _state(self, task: EngineTask) -> PromptRequests:
        return PromptRequests(self._config(task.choice), task, self.kv_capacity_tokens(),
                              self.probe.block_size)

    def _admit(self, queue: deque, active: list, refill: bool) -> None:
        """Hand vLLM the next prompt while its scheduler has admitted everything it has
        (refill), or when nothing runs (refill off): vLLM's own scheduler then fills the
        batch as blocks come free."""
        while queue and (not active or (refill and self.probe.waiting() == 0)):
            p = queue.popleft()
            active.append(p)
            self._send(p)

    def _send(self, p: PromptRequests) -> None:
        """Requests for the prompt's candidates that may move, each to its limit."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        logprobs = 0 if p.self_scored else None  # the drawn token's own, for self-likelihood
        for c, end in p.to_submit():
            rid = f"{p.prompt_id}#{c.index}#{next(self._ids)}"  # never reused (vLLM #23697)
            params = VllmParams(
                temperature=0.0, max_tokens=end - len(c.tokens), ignore_eos=True,
                logprobs=logprobs, detokenize=False, output_kind=RequestOutputKind.DELTA,
                extra_args=draw_args(self.search.seed, p.pkey, c.index, len(p.input_ids),
                                     self.sampling))
            prompt = p.input_ids + c.tokens
            self.llm.add_request(rid, token_prompt(prompt), params)
            self.vllm.prompt_tokens += len(prompt)
            self._uncounted[rid] = (len(prompt), bool(c.tokens))
            p.running[c.index] = rid
            self._requests[rid] = (p, c)
            self.vllm.requests += 1

    def _step(self, step: int) -> bool:
        """One vLLM step; whether it gave any token."""
        t0 = time.perf_counter()
        outputs = self.llm.step()
        seconds = time.perf_counter() - t0
        done, rows = [], 0
        for out in outputs:
            owner = self._requests.get(out.request_id)
            if owner is None:
                continue  # aborted meanwhile
            p, c = owner
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            rows += 1 if tokens else 0
            if tokens and out.request_id in self._uncounted:
                self._count_cached(out.request_id, out.num_cached_tokens or 0)
            stop = p.take(c, tokens, _logprobs(completion, tokens), step)
            if out.finished:
                done.append(out.request_id)
            elif stop:
                self._abort([c])
        for rid in done:
            p, c = self._requests.pop(rid)
            p.ended(c)
            self._forget(rid)
        self._count(outputs, rows, seconds)
        return rows > 0

    def _count_cached(self, rid: str, cached: int) -> None:
        """A request's prefix-cache hits, known with its first token."""
        length, continues = self._uncounted.pop(rid)
        v = self.vllm
        v.cached_tokens += cached
        if continues:
            v.continuations += 1
            v.reprefill_tokens += length - cached
            v.max_reprefill = max(v.max_reprefill, length - cached)

    def _count(self, outputs, rows: int, seconds: float) -> None:
        st, probe = self.stats, self.probe
        probe.count_preemptions()
        self.vllm.preemptions = probe.preemptions
        if not rows:
            return
        st.decode_steps += 1
        st.row_steps += rows
        used = round(probe.usage() * probe.capacity_tokens)
        st.kv_token_steps += used
        st.alloc_token_steps += used
        st.budget_token_steps += probe.capacity_tokens
        self.vllm.step(probe.usage(), seconds)
        share = seconds / rows
        for out in outputs:
            owner = self._requests.get(out.request_id)
            if owner is not None:
                owner[0].engine_seconds += share

    def _abort(self, candidates: list[Candidate]) -> None:
        """Stop these candidates' requests now; their blocks go back to vLLM at once."""
        ids = []
        for rid, (p, c) in list(self._requests.items()):
            if any(c is x for x in candidates):
                ids.append(rid)
                del self._requests[rid]
                p.ended(c)
                self._forget(rid)
        if ids:
            self.llm.abort_request(ids)
            self.vllm.aborted += len(ids)

    def _forget(self, rid: str) -> None:
        self.probe.forget(rid)
        self._uncounted.pop(rid, None)

    def _wait_for_scores(self, active: list[PromptRequests]) -> None:
        waiting = [p for p in active if p.waiting]
        if not waiting:
            raise EngineStuck("the vLLM engine cannot move: no request runs and no score "
                              "is out")
        t0 = time.perf_counter()
        waiting[0].wait_and_apply(self._abort)
        self.vllm.score_wait_seconds += time.perf_counter() - t0

    def _memory(self, active: list[PromptRequests]) -> bool:
        return any(isinstance(p.cfg.schedule, MemorySchedule) for p in active)

    def _finished(self, p: PromptRequests, on_result) -> None:
        self.stats.count_finished(p.result)
        self.stats.prefill_tokens += p.prompt_tokens
        if on_result is not None:
            on_result(p.result)


def _same_threads_here() -> None:
    """OpenMP's thread count is per thread: one that did not set it (the generator actor's
    engine thread) has the machine's cores, and vLLM's CPU attention then plans for more
    threads than torch runs it with ('Check failed: thread_num == thread_num (2 vs. 1)').
    Set this thread's to torch's."""
    import torch

    torch.set_num_threads(torch.get_num_threads())


def _logprobs(completion, tokens: list[int]) -> list[float] | None:
    """The drawn tokens' log-probabilities (raw: before our processor), when asked for."""
    if completion.logprobs is None:
        return None
    return [entry[t].logprob for entry, t in zip(completion.logprobs, tokens, strict=True)]
