"""Candidate identity inside vLLM: a logits processor that draws each candidate's token from
its counter stream (engine.sampling), the very draw the hf engine makes.

vLLM's own seeded sampling restarts its generator with every request, and a candidate is
several requests (one per stretch between decisions), so its samples would depend on where
the decisions fell. Here a candidate's step-t token is a pure function of (seed, prompt,
candidate, t): its text is the same whatever shares the batch, a survivor is its Best-of-N
self, and a resumed job regenerates the same responses. The requests run greedy; this
processor leaves one finite logit, the drawn token. vLLM computes the reported logprobs from
the raw logits before any processor runs (logprobs_mode raw_logprobs), so they stay the
model's untempered log-probabilities, which self-likelihood scores from.

Host work (issue 30): a row's draw arguments live in tensors on the logits' device, written in
update_state when the batch changes; apply is device operations only, one vectorized draw
when every row shares one setting (the usual case: an engine's candidates share seed and
sampling), else one per distinct setting.

A row's step is prompt_len - offset + len(output tokens), and vLLM grows the output list
between calls without a batch update. Reading every row's length each step is host work per
row; instead a device counter advances by one per apply. That is exact because of how vLLM's
model runner keeps its batch (vllm_internals.BATCH_RULES, checked when the processor is made):
- every row in the batch is scheduled in the step (an unscheduled request is removed from the
  batch, and re-added, with its live output list, when scheduled again: preemption and
  resumption arrive as removed + added);
- a row past its prefill is scheduled one token a step and keeps the token sampled there
  (its output list grows by exactly one: the token, or a -1 placeholder under async
  scheduling), unless the request ends, which removes it;
- a row still in prefill is sampled but its token discarded (chunked prefill: apply runs for
  every chunk), so a fresh row's count of applies says nothing. Such rows stay "pending":
  update_state (called before every forward pass) sets their step from their live list
  until the list has grown past its length when added, i.e. their first token is in; from
  then on each apply is one more token.
Speculative decoding (several tokens a step; vLLM then skips custom processors anyway) and KV
transfer (a failed KV load truncates a row's output in place) break the rule; under those
configurations every row stays pending, read from its live list before each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next
from specrej_ray.engine.vllm import vllm_internals

# SamplingParams.extra_args[KEY] of a candidate's request: see draw_args.
KEY = "specrej"
NAME = f"{__name__}:CandidateSampler"  # how vLLM's workers load it


def draw_args(seed: int, pkey: int, index: int, offset: int,
              sampling: SamplingParams) -> dict:
    """What the processor needs of a request: its stream (seed, prompt key, candidate index),
    where its response starts in the request's prompt (`offset`: a request that continues a
    candidate carries its earlier tokens in the prompt), and the sampling settings."""
    return {KEY: {"seed": seed, "pkey": pkey, "index": index, "offset": offset,
                  "temperature": sampling.temperature, "top_p": sampling.top_p,
                  "top_k": sampling.top_k}}


Setting = tuple[int, float, float, int]  # (seed, temperature, top_p, top_k)


class CandidateSampler(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        vllm_internals.check()  # the batch rules the step count relies on
        self.device = torch.device(device)
        self._pin = is_pin_memory and self.device.type != "cpu"
        scheduler = getattr(vllm_config, "scheduler_config", None)
        capacity = max(int(getattr(scheduler, "max_num_seqs", 0) or 0), 1)
        # See the module's docstring: where one apply is not one token, read every row.
        self._resync_all = (getattr(vllm_config, "speculative_config", None) is not None
                            or getattr(vllm_config, "kv_transfer_config", None) is not None)
        # Host mirror of the rows (changed only by batch updates). gid -1: not ours.
        self._pkey = np.zeros(capacity, np.int64)
        self._index = np.zeros(capacity, np.int64)
        self._base = np.zeros(capacity, np.int64)  # prompt_len - offset
        self._gid = np.full(capacity, -1, np.int64)
        self._outputs: list[list[int] | None] = [None] * capacity  # vLLM's live lists
        self._pending: dict[int, int] = {}  # row -> its output length when added
        # Distinct settings of the live rows: setting -> gid, gid -> (setting, rows using it)
        self._gids: dict[Setting, int] = {}
        self._settings: dict[int, tuple[Setting, int]] = {}
        self._next_gid = 0
        # On the device: pkey and candidate index (rows 0, 1), the step of the next draw.
        self._args = torch.zeros((2, capacity), dtype=torch.int64, device=self.device)
        self._step = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        # What apply draws: per distinct setting, its rows (None: rows 0..batch-1, all ours)
        self._plan: list[tuple[int, SamplingParams, torch.Tensor | None]] = []
        self._batch = 0

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    # -- batch changes (host) ----------------------------------------------------------------

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self._apply_update(batch_update)
        if self._pending:
            self._sync_pending()

    def _apply_update(self, update: BatchUpdate) -> None:
        top = max([i for i, *_ in update.added] + [max(a, b) for a, b, _ in update.moved],
                  default=-1)
        if top >= len(self._gid):
            self._grow(top + 1)
        if update.removed:
            self._clear_rows(update.removed)
        for i, params, prompt, output in update.added:
            self._clear(i)
            args = (params.extra_args or {}).get(KEY) if params is not None else None
            if args is not None:
                self._set(i, args, len(prompt or ()), output)
        if update.moved:
            self._move(update.moved)
        self._args = self._to_device(np.stack([self._pkey, self._index]))
        self._batch = update.batch_size
        self._plan = self._make_plan(update.batch_size)

    def _move(self, moved: Sequence[tuple[int, int, MoveDirectionality]]) -> None:
        """The moves as one permutation: row b's content comes from row src[b] (-1: none).
        Per move a few integer operations (a condense moves a row per hole), then one gather
        per array."""
        src = list(range(len(self._gid)))
        for a, b, how in moved:
            if how is MoveDirectionality.SWAP:
                src[a], src[b] = src[b], src[a]
            else:
                if src[b] >= 0 and self._gid[src[b]] >= 0:  # overwritten (vLLM: a hole)
                    self._clear(src[b])
                src[b], src[a] = src[a], -1
        take = np.asarray(src, np.int64)
        empty = take < 0
        take[empty] = 0
        self._pkey, self._index, self._base = (self._pkey[take], self._index[take],
                                               self._base[take])
        self._gid = np.where(empty, -1, self._gid[take])
        self._outputs = [None if j < 0 else self._outputs[j] for j in src]
        if self._pending:
            where = {j: i for i, j in enumerate(src) if j in self._pending}
            self._pending = {where[j]: n for j, n in self._pending.items() if j in where}
        self._step = self._step[self._to_device(take)]

    def _set(self, i: int, args: dict, prompt_len: int, output: list[int]) -> None:
        setting = (int(args["seed"]), float(args["temperature"]), float(args["top_p"]),
                   int(args["top_k"]))
        gid = self._gids.get(setting)
        if gid is None:
            gid = self._gids[setting] = self._next_gid
            self._next_gid += 1
            self._settings[gid] = (setting, 0)
        self._settings[gid] = (setting, self._settings[gid][1] + 1)
        self._gid[i] = gid
        self._pkey[i], self._index[i] = int(args["pkey"]), int(args["index"])
        self._base[i] = prompt_len - int(args["offset"])
        self._outputs[i] = output
        self._pending[i] = len(output)  # its step is read from the list until a token is in

    def _clear(self, i: int) -> None:
        gid = int(self._gid[i])
        if gid >= 0:
            setting, count = self._settings[gid]
            if count == 1:
                del self._settings[gid], self._gids[setting]
            else:
                self._settings[gid] = (setting, count - 1)
        self._gid[i] = -1
        self._outputs[i] = None
        self._pending.pop(i, None)

    def _clear_rows(self, rows: Sequence[int]) -> None:
        """Forget these rows (a wave of finished candidates: counted per setting at once)."""
        at = np.asarray(rows, np.int64)
        gids = self._gid[at]
        for gid, k in zip(*np.unique(gids[gids >= 0], return_counts=True), strict=True):
            setting, count = self._settings[int(gid)]
            if count == k:
                del self._settings[int(gid)], self._gids[setting]
            else:
                self._settings[int(gid)] = (setting, count - int(k))
        self._gid[at] = -1
        for i in rows:
            self._outputs[i] = None
            self._pending.pop(i, None)

    def _grow(self, size: int) -> None:
        size = max(size, 2 * len(self._gid))
        extra = size - len(self._gid)
        self._pkey = np.concatenate([self._pkey, np.zeros(extra, np.int64)])
        self._index = np.concatenate([self._index, np.zeros(extra, np.int64)])
        self._base = np.concatenate([self._base, np.zeros(extra, np.int64)])
        self._gid = np.concatenate([self._gid, np.full(extra, -1, np.int64)])
        self._outputs += [None] * extra
        step = torch.zeros(size, dtype=torch.int64, device=self.device)
        step[: len(self._step)] = self._step
        self._step = step  # (_args is uploaded whole after every batch update)

    def _sync_pending(self) -> None:
        """Set the pending rows' steps from their live output lists (host: these rows only)."""
        rows = list(self._pending)
        lengths = [len(self._outputs[i]) for i in rows]  # type: ignore[arg-type]
        steps = self._base[rows] + np.asarray(lengths, np.int64)
        self._step[self._to_device(np.asarray(rows, np.int64))] = self._to_device(steps)
        if not self._resync_all:
            for i, n in zip(rows, lengths, strict=True):
                if n > self._pending[i]:  # its first token is in: one token per apply now
                    del self._pending[i]

    def _make_plan(self, batch: int) -> list[tuple[int, SamplingParams, torch.Tensor | None]]:
        plan: list[tuple[int, SamplingParams, torch.Tensor | None]] = []
        gids = self._gid[:batch]
        whole = len(self._settings) == 1 and batch > 0 and bool((gids >= 0).all())
        for gid, ((seed, temperature, top_p, top_k), _) in self._settings.items():
            params = SamplingParams(temperature, top_p, top_k)
            if whole:
                plan.append((seed, params, None))
            else:
                rows = np.flatnonzero(gids == gid)  # numpy, over the batch's rows at once
                if len(rows):
                    plan.append((seed, params, self._to_device(rows.astype(np.int64))))
        return plan

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        # An owned copy: the upload must not alias the host mirror (on the CPU build .to is
        # a no-op). Pinned, as vLLM's own uploads: the copy is queued, the host goes on.
        host = torch.from_numpy(np.array(a, np.int64))
        if self._pin:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    # -- the draw (device only) ------------------------------------------------------------

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Device operations only: no value is read back, nothing is uploaded. (Except what
        sample_next itself reads: nucleus sampling without top_k, top_p < 1 and top_k 0,
        picks its rows on the host in engine.sampling._top_p.)"""
        if not self._plan:
            return logits
        batch = self._batch
        pkey, index, step = self._args[0, :batch], self._args[1, :batch], self._step[:batch]
        for seed, params, rows in self._plan:
            if rows is None:  # every row is ours, one setting: the logits themselves
                view = logits[:batch]
                drawn = sample_next(view, params, candidate_uniforms(seed, pkey, index, step))
                view.fill_(float("-inf"))
                view.scatter_(1, drawn.unsqueeze(1), 0.0)
            else:
                u = candidate_uniforms(seed, pkey.index_select(0, rows),
                                       index.index_select(0, rows), step.index_select(0, rows))
                drawn = sample_next(logits.index_select(0, rows), params, u)
                logits.index_fill_(0, rows, float("-inf"))
                logits.index_put_((rows, drawn), self._zero.to(logits.dtype))
        self._step += 1  # each live row past its prefill keeps this step's token
        return logits
