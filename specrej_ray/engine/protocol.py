"""The contract every generator backend meets (GenerationEngine): the generator actor, bench
and tune hold one of these, built by job.engines.make_engine, and never a backend's class.

A backend runs EngineTasks (engine.task) to PromptResults (engine.sequence) with the
algorithm inside its own batch, counts EngineStats (engine.stats), and states its KV
capacity. The properties every backend must have (alpha 0 equals Best-of-N, pruning never
changes a survivor, a rejected candidate is a prefix of Best-of-N's) are one parametrized
suite: tests/test_backend_properties.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stats import EngineStats
from specrej_ray.engine.task import EngineTask, SearchParams


class GenerationEngine(Protocol):
    backend: str  # its name in generator.engine (hf, vllm)
    search: SearchParams  # the engine's own settings (a task's Choice may override them)
    tokenizer: Any  # the generator's tokenizer (rewards with its vocabulary take ids)
    stats: EngineStats  # counters since the engine was built

    def run(self, tasks: Iterable[EngineTask], refill: bool = True,
            on_result: Callable[[PromptResult], None] | None = None,
            more: Callable[[], Iterable[EngineTask]] | None = None) -> list[PromptResult]:
        """Every task's result, in task order; `on_result` hears of each as it finishes;
        `more`, asked between steps, hands over tasks that arrived meanwhile."""
        ...

    def kv_capacity_tokens(self) -> int:
        """The KV cache's room, in token slots (what n0 and the memory schedule size to)."""
        ...

    @property
    def device(self) -> str: ...

    def close(self) -> None:
        """Free what the engine holds (its cache, its workers)."""
        ...

