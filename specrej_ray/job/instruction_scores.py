"""engine.task.LocalScores for reward.type instructions: one prompt's instructions checked in
the generator's process (job.local_rewards builds it)."""

from __future__ import annotations

from specrej_ray.reward.instructions import RowInstructions, follows, interval, share, verdicts
from specrej_ray.spec import RewardSpec


class InstructionScores:
    """engine.task.LocalScores for one prompt's instruction rewards: the share of its
    instructions a response follows (strict or loose, per reward), each instruction's verdict,
    and the interval the share of a response starting with a given text can still reach. A
    candidate's settled verdicts are kept between requests: only its open ones are worked out
    again as its text grows."""

    def __init__(self, rewards: list[tuple[int, RewardSpec]], rows: list[RowInstructions]):
        self.rewards = tuple(j for j, _ in rewards)
        self.specs = [r for _, r in rewards]
        self.rows = rows
        self.known: dict[tuple[int, int], list[bool | None]] = {}  # (reward, candidate)

    def score(self, texts: list[str]) -> list[list[float]]:
        return [[share(follows(row, t, spec.loose)) for row, spec in self._each()]
                for t in texts]

    def details(self, text: str) -> dict[str, list[dict]]:
        return {spec.label: [{"id": i, "followed": f} for i, f in
                             zip(row.ids, follows(row, text, spec.loose), strict=True)]
                for row, spec in self._each()}

    def bounds(self, texts: list[str], keys: list[int]) -> list[list[tuple[float, float]]]:
        out = []
        for text, key in zip(texts, keys, strict=True):
            row_out = []
            for j, (row, spec) in enumerate(self._each()):
                found = verdicts(row, text, spec.loose, self.known.get((j, key)))
                self.known[j, key] = found
                row_out.append(interval(found))
            out.append(row_out)
        return out

    def _each(self):
        return zip(self.rows, self.specs, strict=True)
