"""A reward's answer that is in only after some looks (a slow reward actor), for the tests of
decoding while scores are out."""

from __future__ import annotations


class Late:
    """An answer from a slow reward: in only after `polls` looks."""

    def __init__(self, rows, polls: int) -> None:
        self.rows, self.polls = rows, polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def result(self):
        return self.rows
