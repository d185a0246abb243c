"""What both backends share beyond the contract (engine.protocol): their set-up (settings,
rewards, stop checker, schedule), their intake of tasks (those given, then those `more` hands
over between steps), the same engine (model, cache) with other search or sampling settings
(bench arms, tune), one prompt alone, and the config each prompt works with. A backend gives
`_copy(sampling, search)` and `chunk`, its KV allocation unit in tokens, and calls `_set_up`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Generic, TypeVar

from specrej_ray.engine.decisions import Decisions, PromptConfig
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.scoring import RewardSet
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.stopping import StopChecker
from specrej_ray.engine.task import Choice, EngineTask, SearchParams
from specrej_ray.search.schedule import make_schedule

S = TypeVar("S", bound=Decisions)


class Intake(Generic[S]):
    """A run's tasks as the backend's prompt states, in arrival order: the tasks given, then
    the ones `more` hands over (asked each time `arrived` is)."""

    def __init__(self, state: Callable[[EngineTask], S], tasks: Iterable[EngineTask],
                 more: Callable[[], Iterable[EngineTask]] | None) -> None:
        self._state, self._more = state, more
        self.states = [state(t) for t in tasks]
        self._handed = 0

    def arrived(self) -> list[S]:
        """The states not handed out yet: at first the given tasks', then what `more` brings."""
        if self._more is not None:
            self.states += [self._state(t) for t in self._more()]
        new = self.states[self._handed :]
        self._handed = len(self.states)
        return new

    def results(self) -> list[PromptResult]:
        """Every state's result, in task order."""
        return [s.result for s in self.states]


class EngineBase:
    chunk: int

    def _set_up(self, tokenizer, sampling: SamplingParams, search: SearchParams,
                rewards: RewardSet | None, eos_ids: Iterable[int]) -> None:
        """The settings, the rewards, the stop checker (EOS and stop strings, none of them
        when sampling ignores EOS), the engine's own schedule, one config per task choice."""
        self.tokenizer = tokenizer
        self.sampling, self.search = sampling, search
        self.rewards = rewards or RewardSet()
        eos = set() if sampling.ignore_eos else set(eos_ids)
        self.stopper = StopChecker(tokenizer, eos, () if sampling.ignore_eos else sampling.stop)
        self.schedule = make_schedule(search.alpha, search.decision_tokens,
                                      search.min_decision_tokens)
        self._configs: dict[Choice | None, PromptConfig] = {}

    def with_search(self, **changes):
        return self._copy(self.sampling, replace(self.search, **changes))

    def with_sampling(self, **changes):
        return self._copy(replace(self.sampling, **changes), self.search)

    def best_of_n(self, n: int | None = None, **changes):
        """Plain Best-of-N: every candidate to its end (no rule, no bounds), the reference
        that calibration, audits and the bench measure against."""
        return self.with_search(n=self.search.n if n is None else n, alpha=0.0,
                                bounds_every=0, **changes)

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
            own = choice is None or choice.bounds  # a shadow Best-of-N runs every candidate
            self._configs[choice] = PromptConfig(
                s.n, alpha, schedule, self.sampling.max_new_tokens, s.overlap_tokens,
                self.rewards, self.stopper, self.chunk, s.bounds_every if own else 0, s.keep,
                s.draws if own else None, s.seed if own and s.branch else None)
        return self._configs[choice]
