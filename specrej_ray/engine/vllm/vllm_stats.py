"""What the vLLM backend counts beyond EngineStats: its requests, aborts, preemptions and
prefix-cache hits (run.json and the bench report them)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class VllmStats:
    requests: int = 0  # requests sent (a candidate sends one per stretch between decisions)
    aborted: int = 0  # requests stopped by us: rejected, paused, cut at a stop string
    preemptions: int = 0  # requests vLLM preempted (it recomputes them)
    prompt_tokens: int = 0  # prompt tokens of the requests sent
    cached_tokens: int = 0  # of which vLLM's prefix cache held
    peak_usage: float = 0.0  # the highest share of KV blocks in use after a step
    score_wait_seconds: float = 0.0  # nothing ran while scores were out

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prefix_hit_rate": round(self.prefix_hit_rate, 4)}
