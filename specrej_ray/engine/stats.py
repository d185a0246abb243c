"""An engine's counters (EngineStats), what run.json and the bench report of every backend."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters since the engine was built (or reset_stats); token figures are KV slots."""

    budget_tokens: int  # the device budget (lower after an out-of-memory back-off)
    decode_steps: int = 0
    row_steps: int = 0  # rows fed, summed over decode steps
    kv_token_steps: int = 0  # tokens the cache held (prefixes once per prompt), summed
    alloc_token_steps: int = 0  # slots the cache had allocated (with chunk slack), summed
    budget_token_steps: int = 0  # the budget, summed over decode steps
    peak_kv_bytes: int = 0  # the cache's high-water mark, transients included
    prompts: int = 0
    prefill_tokens: int = 0
    oom_backoffs: int = 0
    discarded_tokens: int = 0  # decoded past a decision by candidates it then rejected
    replayed_tokens: int = 0  # decoded again after their cache was evicted
    stalls: int = 0  # prompt-steps held back because their growth did not fit
    evictions: int = 0  # rows taken out of the cache to let others move
    pruned: int = 0  # candidates stopped by bounds (search.bounds)
    bounds_checks: int = 0  # prompt-checks of bounds
    bounds_seconds: float = 0.0  # spent asking for bounds and applying them

    def count_finished(self, result) -> None:
        """A prompt's result (engine.sequence.PromptResult) is in: its share of the counts
        every backend keeps the same way."""
        self.prompts += 1
        self.discarded_tokens += result.discarded_tokens
        self.pruned += result.pruned
        self.bounds_checks += result.bounds_checks
        self.bounds_seconds += result.bounds_seconds

    @property
    def mean_rows(self) -> float:
        return self.row_steps / self.decode_steps if self.decode_steps else 0.0

    @property
    def occupancy(self) -> float:
        """KV tokens in use over the budget, averaged over decode steps."""
        return self.kv_token_steps / self.budget_token_steps if self.budget_token_steps else 0.0

    @property
    def allocated(self) -> float:
        """Allocated KV slots over the budget, averaged over decode steps."""
        return self.alloc_token_steps / self.budget_token_steps if self.budget_token_steps \
            else 0.0

    @property
    def slack(self) -> float:
        """Share of the allocated slots not (yet) holding a token: the chunks' tails."""
        return 1.0 - self.kv_token_steps / self.alloc_token_steps if self.alloc_token_steps \
            else 0.0
