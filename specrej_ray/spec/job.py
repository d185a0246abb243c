"""The whole job spec (JobSpec): its sections, their cross-checks and its fingerprint."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from specrej_ray.spec.base import _Strict
from specrej_ray.spec.inputs import GeneratorSpec, PromptsSpec, RewardSpec
from specrej_ray.spec.iterate import IterateSpec
from specrej_ray.spec.running import ClusterSpec, OutputSpec
from specrej_ray.spec.search import SearchSpec


class JobSpec(_Strict):
    name: str = Field("specrej", description="Job name (logs, run.json).")
    seed: int = Field(0, ge=0, description="Seed of every candidate's random stream.")
    prompts: PromptsSpec
    generator: GeneratorSpec
    reward: list[RewardSpec] = Field(
        description="One reward (a mapping) or several (a list, each with a weight)."
    )
    search: SearchSpec = Field(default_factory=SearchSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    output: OutputSpec
    iterate: IterateSpec | None = Field(
        None, description="Expert iteration (`specrej-ray iterate`): rounds of generate, "
        "train on the best, generate again with the trained policy; see "
        "docs/expert-iteration.md. `run` ignores it.")

    @field_validator("reward", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, dict) else v

    @field_validator("reward")
    @classmethod
    def _unique_names(cls, v: list[RewardSpec]) -> list[RewardSpec]:
        if not v:
            raise ValueError("list at least one reward")
        labels = [r.label for r in v]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"two rewards are named {label!r}; give them distinct `name`s")
        return v

    @model_validator(mode="after")
    def _shared_gpu_fits(self) -> JobSpec:
        """A generator and the reward actors placed with it share one GPU by fractions, and
        Ray cannot split a fraction across GPUs: the fractions must add up to at most 1."""
        g = self.cluster.gpus_per_generator
        with_gen = [r for r in self.reward if r.placement == "with_generator"]
        parts = [x for x in [g] + [r.num_gpus for r in with_gen for _ in range(r.pool_size)]
                 if 0 < x < 1]
        if sum(parts) > 1 + 1e-9:
            raise ValueError(
                f"cluster.gpus_per_generator and the num_gpus of rewards with placement "
                f"with_generator share one GPU, but their fractions add up to {sum(parts):g}; "
                "lower them (or pool_size) to at most 1 together"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel_gpus(self) -> JobSpec:
        k, g = self.generator.tensor_parallel_size, self.cluster.gpus_per_generator
        if k > 1 and g not in (0, k):
            raise ValueError(
                f"cluster.gpus_per_generator is {g:g}, but with generator.tensor_parallel_size "
                f"{k} a generator takes {k} GPUs, one per bundle; leave it 0 or set {k}")
        return self

    @model_validator(mode="after")
    def _auto_calibrates_sbon(self) -> JobSpec:
        if self.search.calibrates and self.search.mode == "bon":
            raise ValueError("search.schedule: auto chooses how SBoN rejects, and search.mode "
                             "is bon; use mode sbon or a fixed schedule")
        return self

    @model_validator(mode="after")
    def _decisions_within_response(self) -> JobSpec:
        tokens, most = self.search.decision_tokens, self.generator.sampling.max_new_tokens
        if tokens and tokens[-1] > most:
            raise ValueError(
                f"search.schedule.tokens: decision at {tokens[-1]} tokens is past "
                f"generator.sampling.max_new_tokens ({most}); drop it or raise max_new_tokens"
            )
        return self

    @model_validator(mode="after")
    def _draws_know_when_a_prompt_has_enough(self) -> JobSpec:
        if self.search.draws is None:
            return self
        if len(self.reward) != 1 and self.search.draws.until == "rule":
            raise ValueError("search.draws until: rule judges a prompt by its own finished "
                             "rewards, one reward's; use one reward or until: kept")
        none = [r.label for r in self.reward if r.reward_ceiling is None]
        if self.search.draws.until == "kept" and none:
            raise ValueError(f"search.draws (until: kept) stops a prompt once a response "
                             f"reaches the reward's ceiling, and {', '.join(none)} has none; "
                             "use rewards with one (instructions; a callable with "
                             "reward.ceiling), until: rule, or drop search.draws")
        f = self.output.filters
        if self.search.draws.until == "kept" and len(self.reward) > 1 and \
                (f.min_reward is not None or f.min_margin is not None):
            raise ValueError("search.draws with several rewards cannot judge "
                             "output.filters.min_reward or min_margin before a prompt ends "
                             "(its combined scores move with every candidate); drop them or "
                             "use one reward")
        if self.search.mode == "bon" and self.search.branch:
            raise ValueError("search.branch gives the rows a decision frees to children, and "
                             "search.mode bon takes no decision; use mode sbon or drop branch")
        return self

    @model_validator(mode="after")
    def _iterate_trains_on_a_written_file(self) -> JobSpec:
        if self.iterate is not None and self.iterate.train_on not in self.output.formats:
            raise ValueError(f"iterate.train_on is {self.iterate.train_on}, which output.formats "
                             f"({', '.join(self.output.formats) or 'none'}) does not write; add "
                             f"{self.iterate.train_on} to output.formats")
        if (self.iterate is not None and self.iterate.reward == "policy"
                and not any(r.type == "lm_likelihood" and r.model == self.generator.model
                            for r in self.reward)):
            raise ValueError("iterate.reward is policy, but no lm_likelihood reward uses "
                             "generator.model; set reward.model to it or use fixed")
        if (self.iterate is not None and self.iterate.evaluate is not None
                and not any(r.type == "instructions" for r in self.reward)):
            raise ValueError("iterate.evaluate scores the instructions of its prompts with the "
                             "spec's reward of type instructions, and there is none; add one "
                             "or drop iterate.evaluate")
        return self

    @property
    def reward_label(self) -> str:
        """One string naming the reward (or the weighted ensemble) for outputs."""
        if len(self.reward) == 1:
            return self.reward[0].label
        parts = " + ".join(f"{r.weight:g}*{r.label}" for r in self.reward)
        return f"{self.search.reward_combine}({parts})"

    def fingerprint(self) -> str:
        """Hash of every field that changes results (not where or how fast they are made)."""
        blob = json.dumps(fingerprinted(self.model_dump(mode="json")), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def fingerprinted(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a dumped spec (`model_dump(mode="json")`, e.g. an output's manifest's)
    that its fingerprint hashes: what a resume must find unchanged."""
    return _without(data, _NOT_IN_FINGERPRINT)


def _without(data: Any, exclude: Any) -> Any:
    # Pydantic's `exclude` rules: True drops a field, a set drops those fields of a mapping,
    # "__all__" applies to every item of a list.
    if isinstance(exclude, set):
        exclude = dict.fromkeys(exclude, True)
    if isinstance(data, list) and "__all__" in exclude:
        return [_without(item, exclude["__all__"]) for item in data]
    if not isinstance(data, dict):
        return data
    return {k: _without(v, exclude[k]) if k in exclude else v for k, v in data.items()
            if exclude.get(k) is not True}


# Settings that change how fast or where results are made, never what they are.
_NOT_IN_FINGERPRINT: dict[str, Any] = {
    "name": True,
    "cluster": True,
    "output": True,
    "iterate": True,  # each round's spec is a plain run's; the loop keeps its own record
    "generator": {"threads"},
    "reward": {"__all__": {"batch_size", "pool_size", "num_cpus", "num_gpus", "threads", "cache_gb",
                           "placement"}},
    "search": {"kv_budget_gb", "gpu_memory_utilization", "refill"},
}
