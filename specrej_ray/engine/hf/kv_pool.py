"""The device side of the KV cache: one slot pool per layer, and cascade attention over it.

Every K/V the running batch holds lives in one pool per layer ([kv heads, slots, dim]). Which
slot holds what is the block manager's (engine.hf.block_manager), decided by the scheduler; the
model runner hands this pool the slot tables of each forward, and the pool only reads them.

A decode step attends in a fixed number of operations per layer, whatever the number of prompts
and groups (cascade attention, as in Hydragen):
- every row's scores against its prompt's prefix: one batched product, the rows of a prompt
  together (padded to the most rows any prompt has in this step), the prefix read once per
  prompt, not once per row;
- every row's scores against its own tokens (padded to the longest row of the step);
- one softmax per row over both, and the two weighted sums: the prefix's again per prompt, the
  own tokens' read from the pool in place (an embedding bag per row and head: its slots
  weighted by its probabilities), with no gathered copy of V.
A padded column reads a slot of its own row or prompt (finite) and is masked out of the
softmax. One softmax over [prefix | own] rather than two merged by their log-sum-exp keeps a
row's bits independent of its batch: the softmax reduces each row on its own, in vector lanes
that the 16-column padding keeps in place (an elementwise exp over the whole batch would not).

The pool's tensors grow one tensor of one layer at a time, through the sizes the block
manager's slots grew to (`expect`, then `fit` before the forward that writes them): the copy's
transient is the scheduler's headroom.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specrej_ray.engine.hf.block_manager import StepSlots

# A matrix product gives every row the same bits whatever the number of rows only from this
# many rows up (measured with MKL: 1, 2-3 and 4+ rows round differently). Candidate identity
# across batch compositions needs a row's numbers not to depend on who shares its batch, so a
# prompt's rows are never multiplied with its prefix as fewer.
MIN_ROWS = 4


@dataclass(frozen=True)
class DecodePlan:
    """What one decode forward attends to: the longest context of a row, its new token
    included (the pool holds the step's tables, `begin`)."""

    longest: int


@dataclass(frozen=True)
class PrefillPlan:
    """A prompt's prefill: the slots its K/V go to."""

    slots: torch.Tensor


@dataclass(frozen=True)
class RowLayout:
    """A decode step's rows as its prefix products take them: prompts x rows of a prompt.

    The step's rows come in group order. Each prompt's rows multiply its prefix together, as
    `padded_rows` rows (the most any prompt has in the step, at least MIN_ROWS): `to_prompts`
    reorders and pads them so, `to_rows` takes the product's rows back to step order.
    For example, groups a1 (prompt A, 2 rows), b1 (prompt B, 3 rows), a2 (prompt A, 1 row):
    rows 0-1 are a1's, 2-4 b1's, 5 a2's, and

        prompts = 2 (A then B, in order of first appearance), padded_rows = 4 (MIN_ROWS)
        row_at = [[0, 1, 5, 0],        the step row at each place of prompt A (padding: 0)
                  [2, 3, 4, 0]]        ... and of prompt B
        place_of = [0, 1, 4, 5, 6, 2]  each step row's place in prompts x padded_rows, flat:
                                       row 5 (a2's) is prompt A's third, place 0 * 4 + 2

    When the rows already stand so, `rows_each` rows of each prompt in prompt order (one
    prompt, most often; or groups a1 (2 rows) then b1 (2 rows)), row_at and place_of are None:
    a reshape, padded with zero rows from rows_each up to padded_rows, instead of a copy by
    index each way.
    """

    prompts: int
    padded_rows: int
    rows_each: int  # rows of every prompt, when row_at is None
    row_at: torch.Tensor | None  # [prompts, padded_rows]: the step row at each place
    place_of: torch.Tensor | None  # [rows]: each step row's place, flat

    @classmethod
    def of(cls, prompt_of_row: np.ndarray, prompts: int, put) -> RowLayout:
        """The layout of rows belonging to these prompts (numbered by first appearance);
        `put` takes an index array to the device."""
        rows = len(prompt_of_row)
        per_prompt = np.bincount(prompt_of_row, minlength=prompts)
        padded = max(int(per_prompt.max()), MIN_ROWS)
        each = rows // prompts
        if (per_prompt == each).all() and (np.diff(prompt_of_row) >= 0).all():
            return cls(prompts, padded, each, None, None)
        order = np.argsort(prompt_of_row, kind="stable")  # step rows by prompt
        first = np.concatenate([[0], np.cumsum(per_prompt)[:-1]])
        col = np.arange(rows) - np.repeat(first, per_prompt)  # in order: place in its prompt
        row_at = np.zeros((prompts, padded), np.int64)
        row_at[prompt_of_row[order], col] = order
        place_of = np.empty(rows, np.int64)
        place_of[order] = prompt_of_row[order] * padded + col
        return cls(prompts, padded, each, put(row_at), put(place_of))

    def to_prompts(self, t: torch.Tensor) -> torch.Tensor:
        """[kv heads, rows, group, x] -> [kv heads, prompts, padded_rows x group, x]."""
        kv_heads, _, group, x = t.shape
        if self.row_at is not None:
            return t.index_select(1, self.row_at.flatten()).view(kv_heads, self.prompts, -1, x)
        t = t.reshape(kv_heads, self.prompts, self.rows_each * group, x)
        if self.rows_each == self.padded_rows:
            return t
        # Zero rows as padding: a product row's bits depend on the rows' count, not on the
        # other rows' values.
        return F.pad(t, (0, 0, 0, (self.padded_rows - self.rows_each) * group))

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of to_prompts: [kv heads, prompts, padded_rows x group, x] -> rows."""
        kv_heads, _, padded, x = t.shape
        if self.place_of is not None:
            return t.reshape(kv_heads, self.prompts * self.padded_rows, -1, x).index_select(
                1, self.place_of)
        real = padded // self.padded_rows * self.rows_each
        return t[:, :, :real].reshape(kv_heads, self.prompts * self.rows_each, -1, x)


@dataclass
class _Step:
    """A decode step's addressing, on the device, shared by every layer."""

    write: torch.Tensor  # [rows]: the slot of each row's new token
    own: torch.Tensor  # [rows, cols]: each row's slots, its new token's included
    prefix: torch.Tensor  # [prompts, prefix cols]
    bias: torch.Tensor  # [rows, 1, prefix cols + cols]: -inf where a column is padding, else 0
    layout: RowLayout
    # Own slots per (kv head, row, query head), flat, and where each bag starts, by (kv heads,
    # group, pool capacity): one entry a step in a model whose layers share a shape.
    bags: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)


class KVPool:
    def __init__(self, layers: int) -> None:
        self.n_layers = layers
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self._slots = 0  # slots the tensors hold
        self._growth: deque[int] = deque()  # sizes still to grow through, in order
        self._step: _Step | None = None
        self.peak_bytes = 0  # high-water mark of the pool's bytes, growth transients included

    # -- size ------------------------------------------------------------------------------

    def slot_bytes(self) -> int:
        """Bytes one token slot takes over every layer's K and V (0 before any write)."""
        return sum(t.shape[0] * t.shape[2] * t.element_size() for t in self.k + self.v
                   if t is not None)

    def capacity_bytes(self) -> int:
        """The bytes of the pool's tensors: what the device really holds."""
        return sum(t.nbytes for t in self.k + self.v if t is not None)

    def expect(self, sizes: Iterable[int]) -> None:
        """The sizes the block manager's slots grew through (BlockManager.take_growth)."""
        self._growth.extend(sizes)

    def fit(self, slots: int) -> None:
        """Grow the tensors through the expected sizes up to `slots`: the growths and their
        transients are those of growing as each slot was taken."""
        while self._growth and self._growth[0] <= slots:
            want = self._growth.popleft()
            for pool in (self.k, self.v):
                for i, t in enumerate(pool):
                    if t is None:
                        continue
                    grown = t.new_empty(t.shape[0], want, t.shape[2])
                    self.peak_bytes = max(self.peak_bytes, self.capacity_bytes() + grown.nbytes)
                    grown[:, : t.shape[1]] = t
                    pool[i] = grown
            self._slots = want
            self._mark()

    def clear(self) -> None:
        """Drop every tensor (also after a forward that failed half way)."""
        self.k, self.v = [None] * self.n_layers, [None] * self.n_layers
        self._slots, self._growth, self._step = 0, deque(), None

    def _pool(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pools [kv heads, slots, dim], made on first use in the shape
        of `like` [.., kv heads, tokens, dim]."""
        if self.k[layer] is None:
            shape = (like.shape[-3], self._slots, like.shape[-1])
            self.k[layer] = like.new_empty(shape)
            self.v[layer] = like.new_empty(shape)
            self._mark()
        return self.k[layer], self.v[layer]

    def _mark(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.capacity_bytes())

    # -- steps -----------------------------------------------------------------------------

    def begin(self, slots: StepSlots, device: torch.device) -> None:
        """Lay out a decode step on the device from its slot tables, after copying the pages
        the step copies on write (every layer)."""

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        if len(slots.copy_to):
            src, dst = put(slots.copy_from), put(slots.copy_to)
            for pool in (self.k, self.v):
                for t in pool:
                    if t is not None:  # sources are read whole before any is written
                        t.index_copy_(1, dst, t.index_select(1, src))
        own, prefix, which = slots.own, slots.prefix, slots.prompt_of_row
        # A padded column reads a slot of its own row or prompt, and is masked out.
        pad = np.concatenate([(prefix < 0)[which], own < 0], axis=1)
        self._step = _Step(put(slots.write), put(np.where(own < 0, own[:, :1], own)),
                           put(np.where(prefix < 0, prefix[:, :1], prefix)),
                           put(np.where(pad, -np.inf, 0.0).astype(np.float32)[:, None]),
                           RowLayout.of(which, len(prefix), put))

    def end(self) -> None:
        self._step = None

    # -- attention (called by the model's attention layers, see engine.hf.attention) -------

    def prefill(self, layer: int, plan: PrefillPlan, query, key, value, scaling):
        """Causal attention over the prompt; its K/V fill the prefix's slots."""
        k_pool, v_pool = self._pool(layer, key)
        k_pool.index_copy_(1, plan.slots, key[0])
        v_pool.index_copy_(1, plan.slots, value[0])
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)

    def write(self, layer: int, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's new K/V ([rows, kv heads, 1, dim]) into its slot of the begun step;
        the layer's K and V pools."""
        write = self._step.write
        k_pool, v_pool = self._pool(layer, key)
        # A contiguous source copies faster (measured on CPU, issue 30).
        k_pool.index_copy_(1, write, key[:, :, 0].transpose(0, 1).contiguous())
        v_pool.index_copy_(1, write, value[:, :, 0].transpose(0, 1).contiguous())
        return k_pool, v_pool

    def decode(self, layer: int, plan: DecodePlan, query, key, value, scaling):
        """Write every row's new K/V and attend over its prefix and its own tokens: one
        softmax per row over [its prefix | its tokens], as one batch.

        query [rows, q heads, 1, dim], key/value [rows, kv heads, 1, dim], rows in plan order.
        Returns [rows, 1, q heads, dim].
        """
        s = self._step
        k_pool, v_pool = self.write(layer, key, value)
        rows, q_heads, _, dim = query.shape
        kv_heads = key.shape[1]
        # Everything below is [kv heads, rows or prompts, ..]: products batch over the first
        # two dims of contiguous gathers, with no copy.
        q = query.reshape(rows, kv_heads, q_heads // kv_heads, dim).transpose(0, 1)
        n_prefix = s.prefix.shape[1]
        # The prefix: each prompt's rows as one product with it (read once per prompt).
        prefix_k = _gather(k_pool, s.prefix)
        layout = s.layout
        shared = layout.to_rows(torch.matmul(layout.to_prompts(q), prefix_k.transpose(-1, -2)))
        own = torch.matmul(q, _gather(k_pool, s.own).transpose(-1, -2))
        if s.bias.dtype != query.dtype:  # once a step: the first layer's
            s.bias = s.bias.to(query.dtype)
        # Masked by adding 0 or -inf (exact): a masked fill that broadcasts a mask over the
        # heads is slower on CPU (bench/attention_ops.py, its `mask` line). Scaled first, as
        # its own rounding, in every dtype.
        # (One torch.add with alpha is not the same: it rounds the scaling to a bfloat16 or
        # float16 first.)
        scores = torch.cat([shared, own], dim=-1).mul_(scaling).add_(s.bias)
        # In bfloat16 and float16 the softmax reduces in float32 and rounds once, so asking
        # for float32 and casting back gives the same bits (checked on CPU) in two more
        # kernels.
        probs = torch.softmax(scores, dim=-1)
        out = layout.to_rows(torch.matmul(layout.to_prompts(probs[..., :n_prefix]),
                                          _gather(v_pool, s.prefix)))
        shape = (kv_heads, q_heads // kv_heads, v_pool.shape[1])
        if shape not in s.bags:
            s.bags[shape] = _bags(s.own, *shape)
        bags, starts = s.bags[shape]
        # A weighted sum of pool rows in place: faster on CPU than gathering V for a product
        # (measured by bench/attention_ops.py). Each bag adds its terms in order on its own,
        # so a row's bits do not depend on its batch; a padded column adds 0 x a finite
        # value, exactly. Flat, with the bags' starts made once a step (given 2-D bags,
        # embedding_bag makes them every call).
        own_v = F.embedding_bag(bags, v_pool.view(-1, value.shape[-1]), starts, mode="sum",
                                per_sample_weights=probs[..., n_prefix:].reshape(-1))
        out.add_(own_v.view(kv_heads, rows, -1, value.shape[-1]))  # out: the product's own
        return out.transpose(0, 1).reshape(rows, 1, q_heads, dim)


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool [kv heads, slots, dim] at slots [a, b] -> [kv heads, a, b, dim]."""
    return pool.index_select(1, slots.flatten()).view(pool.shape[0], *slots.shape, -1)


def _bags(own: torch.Tensor, kv_heads: int, group: int,
          capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """own [rows, cols] slots -> each query head's row of slots, as rows of the pool viewed
    [kv heads x capacity, dim]: [kv heads x rows x group x cols] flat, and each bag's start."""
    heads = torch.arange(kv_heads, device=own.device).mul_(capacity).view(-1, 1, 1, 1)
    bags = (own[None, :, None, :] + heads).expand(-1, -1, group, -1).reshape(-1)
    return bags, torch.arange(0, bags.numel(), own.shape[1], device=own.device)

