"""One prompt's speculative rejection as vLLM requests (the hf engine's PromptState, for a
batch that vLLM schedules).

Each live candidate runs as one request up to the prompt's current limit (the next decision
length; `cap` tokens past an open decision; max_new_tokens) and parks there: its request ends
and its blocks go back to vLLM. A parked candidate goes on as a new request whose prompt
carries its tokens (prefix caching finds the blocks it had filled; candidate_sampler keeps its
random stream, so where it paused changes nothing). A decision opens when every live candidate
is parked at a decision length (the tokens schedule; the memory schedule's first decision),
or, under the memory schedule, when the engine says its KV cache is about to run out and the
prompt's live candidates stand at one length. The losers' running requests are aborted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specrej_ray.engine.decisions import Decisions, PromptConfig
from specrej_ray.engine.sampling import prompt_key
from specrej_ray.engine.sequence import Candidate
from specrej_ray.engine.task import EngineTask
from specrej_ray.search.schedule import Layout, MemorySchedule


class PromptRequests(Decisions):
    def __init__(self, cfg: PromptConfig, task: EngineTask, capacity: int, block: int) -> None:
        self.task = task
        self.pkey = prompt_key(task.samples_of or task.prompt_id)  # its random streams' key
        layout = Layout(len(task.input_ids), block)
        cap = cfg.overlap_tokens if task.overlaps else 0
        n = cfg.n or cfg.schedule.auto_n(capacity, layout, cap, cfg.max_new_tokens)
        super().__init__(cfg, task, n, layout, cap, cfg.schedule.kv_share(
            capacity, n, layout, cap, cfg.max_new_tokens))
        self.running: dict[int, str] = {}  # candidate index -> its request id
        self.first_step: int | None = None  # the engine step that drew its first token
        self.n0 = 0  # candidates that drew their first token in that step
        self.cached_tokens = 0  # prompt tokens of its requests that vLLM found cached
        self._gone: list[Candidate] = []  # children undone while their requests ran

    # -- what the engine asks ---------------------------------------------------------------

    def to_submit(self) -> list[tuple[Candidate, int]]:
        """Live candidates with no request that may move now, and the length to run to."""
        limit = self.limit()
        return [(c, limit) for c in self.candidates
                if c.live and c.index not in self.running and len(c.tokens) < limit]

    def take(self, c: Candidate, tokens: list[int], logprobs: list[float] | None,
             step: int) -> bool:
        """A request's new tokens; True when it must stop now (finished, or past the limit
        of a decision opened since it was sent)."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
        if not c.tokens and tokens:
            if self.first_step is None:
                self.first_step = step
            self.n0 += step == self.first_step
        for i, t in enumerate(tokens):
            if self.append(c, t, logprobs[i] if logprobs is not None else None):
                return True
        return len(c.tokens) >= self.limit()

    def ended(self, c: Candidate) -> None:
        """Its request is over (finished, parked or aborted)."""
        self.running.pop(c.index, None)

    def after_step(self, pressure: bool, abort: Callable[[list[Candidate]], None]) -> None:
        """Stop the candidates bounds rule out and apply scores that are in (aborting their
        requests), open a decision when one is due; when nothing is left, send for the final
        scores, and finish once they are in. Never waits."""
        pruned = self.prune_by_bounds(self._live())
        running = [c for c in pruned if c.index in self.running]
        if running:
            abort(running)
        self.close(wait=False, abort=abort)
        self.draws_step()
        self._stop_past_limit(abort)
        self._maybe_decide(pressure, abort)
        if not self.waiting and self.may_finish and self.result is None and not self._live():
            self.send_final(n0=self.n0, waves=1)
        self.apply_final(wait=False)

    def _stop_past_limit(self, abort: Callable[[list[Candidate]], None]) -> None:
        """Requests that must end: at or past a limit that came down (search.draws' stop),
        or of candidates that stopped or left (a draw's stop undoes children)."""
        limit = self.limit()
        late = [c for c in self.candidates + self._gone if c.index in self.running and
                (not c.live or len(c.tokens) >= limit)]
        self._gone = []
        if late:
            abort(late)

    def children_gone(self, children: list[Candidate]) -> None:
        self._gone += children

    def wait_and_apply(self, abort: Callable[[list[Candidate]], None]) -> None:
        """Block until the scores that are out are in, and apply them."""
        if self.open is not None:
            self.close(wait=True, abort=abort)
        else:
            self.wait()

    def close(self, wait: bool, abort: Callable[[list[Candidate]], None] | None = None) -> None:
        rejected = self.apply_open(wait)
        running = [c for c in rejected if c.index in self.running]
        if running and abort is not None:
            abort(running)

    # -- decisions --------------------------------------------------------------------------

    def _maybe_decide(self, pressure: bool, abort: Callable[[list[Candidate]], None]) -> None:
        s = self.cfg.schedule
        if self.open is not None or not s.decides or \
                (self.draws is not None and self.draws.stop_at is not None):
            return
        live = self._live()
        lengths = {len(c.tokens) for c in live}
        if len(lengths) != 1:
            return
        length = lengths.pop()
        if length >= self.cfg.max_new_tokens:
            return
        if self._on_memory(s):
            # vLLM's cache is about to run out and this prompt's rows stand together
            due = pressure and len(live) > 1
        else:
            parked = not any(c.index in self.running for c in live)
            due = parked and s.decide_now(self.cohort(len(live), length), self.layout)
        if due:
            self.open_decision(length)
            self.close(wait=False, abort=abort)

    def _on_memory(self, s) -> bool:
        """Past the memory schedule's first decision: later ones come from vLLM's KV use."""
        return isinstance(s, MemorySchedule) and self.decided_at >= s.min_decision_tokens
