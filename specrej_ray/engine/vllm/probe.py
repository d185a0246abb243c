"""What the vLLM backend reads of vLLM's scheduler: its KV capacity and use, the requests it
cannot admit yet, and the preemptions it made (vLLM recomputes a preempted request; we
count them, they are never silent).

vLLM has no public API for these in process: they are read from the engine core's
scheduler, which runs in our process (VLLM_ENABLE_V1_MULTIPROCESSING=0; with tensor
parallelism only the workers are remote), through vllm_internals.SchedulerView, which fails
at start-up with one line where a vLLM no longer has them.
"""

from __future__ import annotations

from specrej_ray.engine.vllm.vllm_internals import SchedulerView


class EngineProbe:
    def __init__(self, llm) -> None:
        self.scheduler = SchedulerView(llm)
        cache = llm.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        # vLLM keeps one block aside (its null block): the rest is the room
        self.num_blocks = int(cache.num_gpu_blocks) - 1
        self.preemptions = 0
        self._seen: dict[str, int] = {}  # request id -> preemptions counted

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def free_blocks(self) -> int:
        return self.scheduler.free_blocks()

    def usage(self) -> float:
        """Share of the KV blocks in use (cached blocks nobody holds count as free)."""
        return 1.0 - self.free_blocks() / self.num_blocks if self.num_blocks else 0.0

    def waiting(self) -> int:
        return self.scheduler.waiting()

    def running(self) -> int:
        return self.scheduler.running()

    def pressure(self) -> bool:
        """The cache is about to run out: requests wait that it cannot admit, or the free
        blocks are fewer than the running rows that need a new block for their next token."""
        if self.waiting():
            return True
        need = sum(1 for n in self.scheduler.running_computed_tokens()
                   if n % self.block_size == 0)
        return self.free_blocks() < need

    def count_preemptions(self) -> None:
        """Add the preemptions made since the last call (read per request, as vLLM keeps
        them on the request)."""
        for rid, now in self.scheduler.preemptions():
            before = self._seen.get(rid, 0)
            if now > before:
                self.preemptions += now - before
                self._seen[rid] = now

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
