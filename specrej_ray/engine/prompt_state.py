"""One prompt's speculative rejection as a state machine the engine steps.

A prompt runs its N candidates in waves (as many as its KV budget holds at once); one wave
is in the batch at a time. After every decode step the engine hands the prompt its rows;
the prompt appends their tokens, holds a decision when its schedule says so, and reports
which rows live on. Nothing here depends on what else shares the batch, so a prompt's
result is the same alone or mixed with others (candidate identity).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from specrej_ray.engine.sampling import prompt_key
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.search.rejection import best_index, decide
from specrej_ray.search.schedule import first_horizon, wave_size

if TYPE_CHECKING:
    from specrej_ray.engine.generate import Engine, ScoreFn


class ScoreError(Exception):
    """A reward returned something that cannot be ranked (NaN, inf, wrong count)."""


class PromptState:
    def __init__(self, engine: Engine, prompt_id: str, input_ids: list[int], score: ScoreFn):
        self.e = engine
        self.prompt_id = prompt_id
        self.input_ids = input_ids
        self.pkey = prompt_key(prompt_id)
        self._score = score
        self.candidates = [Candidate(k) for k in range(engine.search.n)]
        self.sizes: list[int] = []  # wave sizes so far
        self.wave: list[Candidate] = []  # the wave in the batch, empty between waves
        self.rounds = 0
        self.score_seconds = 0.0
        self.started = 0.0  # when the first wave entered the batch
        self.result: PromptResult | None = None

    # -- planning ------------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def budget(self, device_budget: int) -> int:
        """KV tokens this prompt's candidates may hold together.

        The memory schedule gives a prompt what its N rows need up to the first decision
        (capped by the device): then the first decision falls at min_decision_tokens, the
        later ones when the survivors have grown into the same budget, and a large device
        holds several prompts instead of never deciding. Other schedules may use the device.
        """
        s = self.e.search
        if s.decision_tokens is None and s.alpha > 0:
            return min(device_budget, s.n * (self.prompt_tokens + s.min_decision_tokens))
        return device_budget

    def next_wave_size(self, device_budget: int) -> int:
        done = sum(self.sizes)
        return wave_size(self.e.search.n - done, self.budget(device_budget), self.prompt_tokens,
                         self._horizon())

    def start_wave(self, size: int, device_budget: int) -> list[Candidate]:
        first = sum(self.sizes)
        if not self.sizes:
            self.started = time.perf_counter()
        self.sizes.append(size)
        self.wave = self.candidates[first : first + size]
        self._wave_budget = self.budget(device_budget)
        self._rounds_before = self.rounds
        return self.wave

    def restart_wave(self) -> None:
        """Forget the wave in the batch (it was lost to an out-of-memory error)."""
        first = sum(self.sizes) - len(self.wave)
        for c in self.wave:
            self.candidates[c.index] = Candidate(c.index)
        del self.sizes[-1]
        self.rounds = self._rounds_before
        self.wave = []
        assert first == sum(self.sizes)

    def reserved(self) -> int:
        """KV tokens the wave may grow to before its next decision (or its end)."""
        live = [c for c in self.wave if c.live]
        if not live:
            return 0
        grown = len(live[0].tokens)
        s, max_new = self.e.search, self.e.sampling.max_new_tokens
        if s.alpha == 0:
            horizon = max_new
        elif s.decision_tokens is None:
            return min(self._wave_budget, len(live) * (self.prompt_tokens + max_new))
        else:
            horizon = next((t for t in s.decision_tokens if t > grown), max_new)
        return len(live) * (self.prompt_tokens + min(horizon, max_new))

    def first_reservation(self, size: int) -> int:
        return size * (self.prompt_tokens + self._horizon())

    def _horizon(self) -> int:
        s = self.e.search
        return first_horizon(s.decision_tokens, s.min_decision_tokens,
                             self.e.sampling.max_new_tokens, s.alpha)

    # -- stepping ------------------------------------------------------------------------

    def step(self, rows: list[Candidate], tokens: list[int]) -> None:
        """Append this step's tokens to the wave's rows in the batch, then maybe decide."""
        e = self.e
        last = len(rows[0].tokens) + 1 == e.sampling.max_new_tokens
        for c, t in zip(rows, tokens, strict=True):
            c.tokens.append(t)
            c.finish_reason = e.stopper.reason(c.tokens) or ("length" if last else None)
            if c.finished:
                c.text = e.stopper.text(c.tokens)
        generated = len(rows[0].tokens)
        live = sum(c.live for c in rows)
        if (
            e.search.alpha > 0
            and live
            and e.schedule.should_decide(generated, live, self.prompt_tokens + generated - 1,
                                         self._wave_budget)
        ):
            self._decide([c for c in self.wave if c.rejected_round is None])

    @property
    def wave_done(self) -> bool:
        return bool(self.wave) and not any(c.live for c in self.wave)

    def end_wave(self) -> None:
        self.wave = []
        if sum(self.sizes) == self.e.search.n:
            self._finish()

    @property
    def done(self) -> bool:
        return self.result is not None

    def _decide(self, in_play: list[Candidate]) -> None:
        """Score everything in play; reject the live candidates outside the top (1 - alpha)."""
        self.rounds += 1
        self._score_unscored([c for c in in_play if c.finished])
        live = [c for c in in_play if c.live]
        fresh = iter(self._checked([self.e.stopper.text(c.tokens) for c in live], live))
        rows = [self._row(c) if c.finished else next(fresh) for c in in_play]
        scores = self.e.rewards.combine(rows)
        for c, s in zip(in_play, scores, strict=True):
            if c.live:
                c.partial_scores.append((len(c.tokens), s))
        decision = decide(scores, [c.finished for c in in_play], self.e.search.alpha)
        for i in decision.rejected:
            c = in_play[i]
            c.rejected_round = self.rounds
            c.text = self.e.stopper.text(c.tokens)

    def _finish(self) -> None:
        """Final scores: the rewards combined over all of the prompt's finished candidates."""
        finished = [c for c in self.candidates if c.finished]
        self._score_unscored(finished)
        combined = self.e.rewards.combine([self._row(c) for c in finished])
        for c, s in zip(finished, combined, strict=True):
            c.final_score = s
        best = best_index(
            [c.final_score if c.final_score is not None else float("-inf")
             for c in self.candidates],
            [c.finished for c in self.candidates],
        )
        self.result = PromptResult(
            prompt_id=self.prompt_id,
            candidates=self.candidates,
            best=best,
            n0=self.sizes[0],
            waves=len(self.sizes),
            rounds=self.rounds,
            prompt_tokens=self.prompt_tokens,
            seconds=time.perf_counter() - self.started,
            score_seconds=self.score_seconds,
        )

    def _score_unscored(self, finished: list[Candidate]) -> None:
        todo = [c for c in finished if not c.components]
        for c, row in zip(todo, self._checked([c.text for c in todo], todo), strict=True):
            c.components = dict(zip(self.e.rewards.names, row, strict=True))

    def _row(self, c: Candidate) -> list[float]:
        return [c.components[name] for name in self.e.rewards.names]

    def _checked(self, texts: list[str], cands: list[Candidate]) -> list[list[float]]:
        if not texts:
            return []
        t0 = time.perf_counter()
        rows = [[float(s) for s in row] for row in self._score(texts)]
        self.score_seconds += time.perf_counter() - t0
        names = self.e.rewards.names
        if len(rows) != len(texts) or any(len(r) != len(names) for r in rows):
            raise ScoreError(
                f"rewards {', '.join(names)} returned {len(rows)} score rows for {len(texts)} "
                f"responses of prompt {self.prompt_id!r}"
            )
        for c, row in zip(cands, rows, strict=True):
            for name, s in zip(names, row, strict=True):
                if not math.isfinite(s):
                    raise ScoreError(
                        f"reward {name} gave {s} for prompt {self.prompt_id!r} "
                        f"candidate {c.index}; a reward must return finite numbers"
                    )
        return rows
