"""What an incremental scorer is fed (a response's token stream, one request's items) and
what it counts: plain data, torch-free, so a reward that scores text (a Python callable)
counts its requests without importing the model code."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stream:
    held: list[int]
    prefix: int
    targets: list[int] = field(default_factory=list)  # likelihood rewards
    suffix: list[int] = field(default_factory=list)  # classifier rewards


@dataclass(frozen=True)
class Item:
    """One response of a request: the candidate it belongs to, and its stream (None: score
    it in full)."""

    key: int
    stream: Stream | None


@dataclass
class Stats:
    requests: int = 0
    tokens: int = 0  # reward-model tokens fed (prefix once per prompt, feeds, suffixes)
    full_tokens: int = 0  # what full re-scoring of the same requests would have fed
    fallbacks: int = 0  # responses scored in full (no stream, or no room)
    evicted: int = 0  # prompts forgotten to stay within cache_bytes
