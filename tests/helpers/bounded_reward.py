"""A random reward that carries bounds, for the engines' pruning tests: each prompt gets a few
character constraints, and its score is the share it follows, as reward.instructions scores
instructions. Absent-constraints, once broken, stay broken; present-constraints, once met,
stay met; short-constraints break once the text is long enough."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from specrej_ray.engine.scoring import RewardSet

# Characters the tiny random model's byte-level text often holds.
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " "
REWARDS = RewardSet(("checks",), (1.0,), "zscore", (), (True,))


@dataclass(frozen=True)
class Constraint:
    kind: str  # "absent" | "present" | "short"
    chars: frozenset[str]
    limit: int = 0

    def follows(self, text: str) -> bool:
        if self.kind == "short":
            return len(text) < self.limit
        hit = any(ch in self.chars for ch in text)
        return hit if self.kind == "present" else not hit

    def verdict(self, settled: str) -> bool | None:
        """True / False when every text starting with `settled` follows / breaks it."""
        if self.kind == "short":
            return False if len(settled) >= self.limit else None
        if not any(ch in self.chars for ch in settled):
            return None
        return self.kind == "present"


class BoundedChecks:
    """engine.task.LocalScores over one prompt's constraints."""

    rewards = (0,)

    def __init__(self, constraints: list[Constraint]) -> None:
        self.constraints = constraints

    @classmethod
    def drawn(cls, seed: int, count: int = 3, size: int = 12) -> BoundedChecks:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            kind = rng.choice(["absent", "present", "short"])
            out.append(Constraint(kind, frozenset(rng.sample(ALPHABET, size)),
                                  rng.randint(8, 30)))
        return cls(out)

    def score(self, texts: list[str]) -> list[list[float]]:
        return [[sum(c.follows(t) for c in self.constraints) / len(self.constraints)]
                for t in texts]

    def details(self, text: str) -> dict[str, list[dict]]:
        return {"checks": [{"id": c.kind, "followed": c.follows(text)}
                           for c in self.constraints]}

    def bounds(self, texts: list[str], keys: list[int]) -> list[list[tuple[float, float]]]:
        n, rows = len(self.constraints), []
        for t in texts:
            verdicts = [c.verdict(t) for c in self.constraints]
            met, broken = verdicts.count(True), verdicts.count(False)
            rows.append([(met / n, (n - broken) / n)])
        return rows
