"""One prompt's speculative rejection as a state machine the engine steps.

A prompt runs its N candidates in waves (as many as its KV budget holds at once); one wave
is in the batch at a time. After every decode step the engine hands the prompt its rows;
the prompt appends their tokens and opens a decision when its schedule says so. The
decision's scores may come back steps later (reward actors): meanwhile the live rows keep
decoding, and the ones it rejects are cut back to the decision's length, so the outcome is
the one an immediate answer gives. Before a step that could itself trigger a decision, the
prompt waits for the open one. Nothing here depends on what else shares the batch, so a
prompt's result is the same alone or mixed with others (candidate identity).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from specrej_ray.engine.sampling import prompt_key
from specrej_ray.engine.scoring import OpenDecision, ScoreFn, Scorer, SubmitFn
from specrej_ray.engine.sequence import Candidate, PromptResult
from specrej_ray.search.rejection import best_index, decide
from specrej_ray.search.schedule import first_horizon, wave_size

if TYPE_CHECKING:
    from specrej_ray.engine.generate import Engine


class PromptState:
    def __init__(self, engine: Engine, prompt_id: str, input_ids: list[int], score: ScoreFn,
                 submit: SubmitFn | None = None):
        self.e = engine
        self.prompt_id = prompt_id
        self.input_ids = input_ids
        self.pkey = prompt_key(prompt_id)
        self.scorer = Scorer(prompt_id, engine.rewards.names, score, submit)
        self.open: OpenDecision | None = None
        self.discarded = 0  # tokens decoded past a decision by candidates it then rejected
        self.candidates = [Candidate(k) for k in range(engine.search.n)]
        self.sizes: list[int] = []  # wave sizes so far
        self.wave: list[Candidate] = []  # the wave in the batch, empty between waves
        self._wave_budget = 0  # the wave's KV budget, fixed when it starts
        self._rounds_before = 0  # rounds before the wave (an OOM restart rewinds to it)
        self.rounds = 0
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
        for c in self.wave:
            self.candidates[c.index] = Candidate(c.index)
        del self.sizes[-1]
        self.rounds = self._rounds_before
        self.wave, self.open = [], None

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
        # With a decision open, rows it will reject still count as live: if even so the
        # schedule stays quiet it stays quiet for the survivors; if not, wait and look again.
        generated = len(rows[0].tokens)
        if self.open is not None and self._triggers(rows, generated):
            self.close(wait=True)
        if self.open is None and self._triggers(rows, generated):
            self._open_decision(generated)

    def _triggers(self, rows: list[Candidate], generated: int) -> bool:
        live = sum(c.live for c in rows)
        return (
            self.e.search.alpha > 0
            and live > 0
            and self.e.schedule.should_decide(generated, live, self.prompt_tokens + generated - 1,
                                              self._wave_budget)
        )

    def _open_decision(self, generated: int) -> None:
        """Send everything in play to the rewards (finished ones on their full text)."""
        self.rounds += 1
        in_play = [c for c in self.wave if c.rejected_round is None]
        unscored = [c for c in in_play if c.finished and not c.components]
        live = [c for c in in_play if c.live]
        texts = [c.text for c in unscored] + [self.e.stopper.text(c.tokens) for c in live]
        self.open = OpenDecision(self.rounds, generated, in_play, [c.finished for c in in_play],
                                 unscored, live, self.scorer.send(texts))

    def close(self, wait: bool) -> None:
        """Apply the open decision once its scores are in (waiting for them if `wait`)."""
        d = self.open
        if d is None or not (wait or d.answer.done()):
            return
        self.open = None
        rows = self.scorer.receive(d.answer, d.unscored + d.live)
        for c, row in zip(d.unscored, rows[: len(d.unscored)], strict=True):
            c.components = dict(zip(self.e.rewards.names, row, strict=True))
        fresh = iter(rows[len(d.unscored) :])
        ranked = [self._row(c) if was else next(fresh) for c, was in zip(d.in_play, d.finished,
                                                                         strict=True)]
        scores = self.e.rewards.combine(ranked)
        for c, was, s in zip(d.in_play, d.finished, scores, strict=True):
            if not was:
                c.partial_scores.append((d.at, s))
        for i in decide(scores, d.finished, self.e.search.alpha).rejected:
            self._reject(d.in_play[i], d.round, d.at)

    def _reject(self, c: Candidate, round_: int, at: int) -> None:
        self.discarded += len(c.tokens) - at
        del c.tokens[at:]
        c.finish_reason = None  # it may have finished while the scores were out
        c.rejected_round = round_
        c.text = self.e.stopper.text(c.tokens)

    @property
    def wave_done(self) -> bool:
        return bool(self.wave) and self.open is None and not any(c.live for c in self.wave)

    def end_wave(self) -> None:
        self.wave = []
        if sum(self.sizes) == self.e.search.n:
            self._finish()

    @property
    def done(self) -> bool:
        return self.result is not None

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
            score_seconds=self.scorer.seconds,
        )

    def _score_unscored(self, finished: list[Candidate]) -> None:
        todo = [c for c in finished if not c.components]
        rows = self.scorer.now([c.text for c in todo], todo)
        for c, row in zip(todo, rows, strict=True):
            c.components = dict(zip(self.e.rewards.names, row, strict=True))

    def _row(self, c: Candidate) -> list[float]:
        return [c.components[name] for name in self.e.rewards.names]
