"""Prompts handed to one engine by several callers at once (a generator's shards).

Each `submit` blocks until its own prompts are done, while one engine thread keeps a single
running batch for all of them: the next shard's prompts join the batch as room appears
instead of waiting for the current shard to drain (refill across shards). Results still come
back per call, so a shard is written only when its prompts are all done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from specrej_ray.engine.hf.engine import EngineTask
from specrej_ray.engine.sequence import PromptResult

# run(tasks, on_result, more): Engine.run with its settings bound.
RunFn = Callable[
    [list[EngineTask], Callable[[PromptResult], None], Callable[[], Iterable[EngineTask]]],
    object,
]


class _Ticket:
    """One caller's prompts: results as they finish, or the error that stopped the engine."""

    def __init__(self, tasks: list[EngineTask]) -> None:
        self.tasks = tasks
        self.ids = [t.prompt_id for t in tasks]
        self.results: dict[str, PromptResult] = {}
        self.error: BaseException | None = None
        self.done = threading.Event()

    def put(self, result: PromptResult) -> None:
        self.results[result.prompt_id] = result
        if len(self.results) == len(self.ids):
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()

    def unfinished(self) -> list[EngineTask]:
        return [t for t in self.tasks if t.prompt_id not in self.results]

    def wait(self) -> list[PromptResult]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return [self.results[i] for i in self.ids]


class TaskFeed:
    def __init__(self, run: RunFn) -> None:
        self._run = run
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pending: list[EngineTask] = []
        self._tickets: dict[str, _Ticket] = {}  # prompt id -> the call waiting for it
        self._thread: threading.Thread | None = None

    def submit(self, tasks: list[EngineTask]) -> list[PromptResult]:
        """Run these prompts with whatever else is running; their results, in order."""
        ticket = _Ticket(tasks)
        if not tasks:
            return []
        with self._lock:
            clash = [t.prompt_id for t in tasks if t.prompt_id in self._tickets]
            if clash or len(set(ticket.ids)) != len(ticket.ids):
                raise ValueError(f"prompt {(clash or ticket.ids)[0]} is already running")
            self._tickets.update((t.prompt_id, ticket) for t in tasks)
            self._pending += tasks
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="specrej-engine")
                self._thread.start()
            self._arrived.notify()
        return ticket.wait()

    def _take(self) -> list[EngineTask]:
        with self._lock:
            taken, self._pending = self._pending, []
        return taken

    def _finished(self, result: PromptResult) -> None:
        with self._lock:
            ticket = self._tickets.pop(result.prompt_id)
        ticket.put(result)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._arrived.wait()
                first, self._pending = self._pending, []
            try:
                self._run(first, self._finished, self._take)
            except BaseException as e:
                self._isolate(e)

    def _isolate(self, error: BaseException) -> None:
        """The engine stopped with several calls' prompts in its batch, and the error cannot
        tell whose prompt caused it: each call's unfinished prompts run again alone, so an
        error fails only the call it comes from (a prompt's result does not depend on what
        shares its batch, so the others' results are the same). Calls that arrive meanwhile
        wait for the next engine run."""
        with self._lock:
            waiting = {t.prompt_id for t in self._pending}  # not in the batch: left queued
            tickets = list(dict.fromkeys(
                tk for pid, tk in self._tickets.items() if pid not in waiting))
        if len(tickets) == 1:
            self._fail(tickets[0], error)
            return
        for ticket in tickets:
            try:
                self._run(ticket.unfinished(), self._finished, list)
            except BaseException as e:
                self._fail(ticket, e)

    def _fail(self, ticket: _Ticket, error: BaseException) -> None:
        with self._lock:
            for pid in ticket.ids:
                if self._tickets.get(pid) is ticket:
                    del self._tickets[pid]
        ticket.fail(error)
