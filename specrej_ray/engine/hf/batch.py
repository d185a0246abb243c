"""What passes between the hf engine's scheduler and its model runner: the step as decided
(`Batch`), and the step's draws (`Drawn`); and the scheduler's admission as it stood before a
prefill (`Checkpoint`), to roll back to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from specrej_ray.engine.hf.block_manager import StepSlots

if TYPE_CHECKING:  # the scheduler's objects, only read here
    from specrej_ray.engine.hf.prompt_state import Admission, Group, PromptState


@dataclass(frozen=True)
class Checkpoint:
    """The scheduler as it stood at one point of schedule(), to roll admission back to."""

    running: int  # prompts running then (the ones after them came from `waiting` since)
    prompts: list[tuple[PromptState, Admission]]  # each running prompt's admission then
    stalls: int
    evictions: int
    held: int  # the cache's slots then


@dataclass(frozen=True)
class Prefill:
    """A prompt to prefill before the step decodes: the slots its prefix's K/V go to, and the
    pool size they need. `before` is the scheduler just before it was admitted."""

    prompt: PromptState
    before: Checkpoint
    slots: np.ndarray
    pool: int


@dataclass(frozen=True)
class Streams:
    """Whose random streams a step's draws come from, a row each: its prompt's stream key,
    its candidate index, and the step it draws (engine.sampling.candidate_uniforms)."""

    pkeys: np.ndarray
    index: np.ndarray
    step: np.ndarray


@dataclass
class Batch:
    """One step as the scheduler decided it; the engine runs it in this order: every prefill,
    then one decode of the `decode` groups (their tokens `feed`, at `slots`, the pool grown
    to `pool` through `growth`), then a draw for every row of the `draw` groups from `streams`
    (a group with no token yet draws from its prompt's logits, a replaying group draws
    nothing). No group at all: nothing can move until scores come in."""

    prefills: list[Prefill]
    groups: list[Group]  # every group that steps, in step order
    decode: list[Group] = field(default_factory=list)
    draw: list[Group] = field(default_factory=list)
    slots: StepSlots | None = None
    feed: np.ndarray | None = None
    streams: Streams | None = None
    growth: tuple[int, ...] = ()
    pool: int = 0
    prefilled: int = 0  # prefills run so far (the engine counts; an error stops it short)

    def __post_init__(self) -> None:
        self.decode = [g for g in self.groups if g.decodes]
        self.draw = [g for g in self.groups if g.draws_token]


class Drawn(NamedTuple):
    """A step's draws, rows in the order of Batch.draw's groups."""

    tokens: np.ndarray
    logprobs: np.ndarray | None  # the drawn tokens' own, when a reward is free (self-scored)
