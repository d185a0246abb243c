"""What the vLLM backend counts beyond EngineStats: its requests, aborts, preemptions and
prefix-cache hits (run.json and the bench report them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class VllmStats:
    block_size: int = 0  # tokens per KV block (the cache's unit; prefix caching shares full ones)
    requests: int = 0  # requests sent (a candidate sends one per stretch between decisions)
    aborted: int = 0  # requests stopped by us: rejected, paused, cut at a stop string
    preemptions: int = 0  # requests vLLM preempted (it recomputes them)
    prompt_tokens: int = 0  # prompt tokens of the requests sent
    cached_tokens: int = 0  # of which vLLM's prefix cache held
    # Requests that continue a candidate past a decision: their prompts carry its tokens, so
    # what the cache did not hold is re-prefilled (at most a block each when its blocks
    # stayed cached: the partial tail block is never cached).
    continuations: int = 0
    reprefill_tokens: int = 0  # their prompt tokens the cache did not hold
    max_reprefill: int = 0  # the most one continuation re-prefilled
    peak_usage: float = 0.0  # the highest share of KV blocks in use after a step
    # KV usage weighted by each step's time (EngineStats.occupancy weights steps alike, and
    # a run's tail has many short steps of few rows)
    usage_seconds: float = 0.0
    step_seconds: float = 0.0
    score_wait_seconds: float = 0.0  # nothing ran while scores were out

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def time_usage(self) -> float:
        return self.usage_seconds / self.step_seconds if self.step_seconds else 0.0

    def step(self, usage: float, seconds: float) -> None:
        self.peak_usage = max(self.peak_usage, usage)
        self.usage_seconds += usage * seconds
        self.step_seconds += seconds

    @property
    def mean_reprefill(self) -> float:
        return self.reprefill_tokens / self.continuations if self.continuations else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_hit_rate": round(self.prefix_hit_rate, 4),
                "mean_reprefill": round(self.mean_reprefill, 2),
                "time_usage": round(self.time_usage, 4)}
