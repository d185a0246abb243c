"""What both backends share beyond the contract (engine.protocol): the same engine (model,
cache) with other search or sampling settings (bench arms, tune), one prompt alone, and the
config each prompt works with. A backend gives `_copy(sampling, search)` and `chunk`, its KV
allocation unit in tokens, and holds `sampling`, `search`, `schedule`, `rewards`, `stopper`
and `_configs`."""

from __future__ import annotations

from dataclasses import replace

from specrej_ray.engine.decisions import PromptConfig
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.task import Choice, EngineTask
from specrej_ray.search.schedule import make_schedule


class EngineBase:
    chunk: int

    def with_search(self, **changes):
        return self._copy(self.sampling, replace(self.search, **changes))

    def with_sampling(self, **changes):
        return self._copy(replace(self.sampling, **changes), self.search)

    def generate(self, prompt_id: str, input_ids: list[int], score) -> PromptResult:
        return self.run([EngineTask(prompt_id, input_ids, score)])[0]

    def _config(self, choice: Choice | None) -> PromptConfig:
        """What a prompt works with: the engine's settings, or a task's own alpha and
        decision lengths (one config per choice, shared by its prompts)."""
        if choice not in self._configs:
            s = self.search
            alpha = s.alpha if choice is None else choice.alpha
            schedule = self.schedule if choice is None else make_schedule(
                choice.alpha, choice.decision_tokens, s.min_decision_tokens)
            self._configs[choice] = PromptConfig(
                s.n, alpha, schedule, self.sampling.max_new_tokens, s.overlap_tokens,
                self.rewards, self.stopper, self.chunk, s.bounds_every, s.keep)
        return self._configs[choice]
