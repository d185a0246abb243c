"""The running batch's KV cache: one prefix per prompt, one growing block per row group.

A prompt's prefix (its K/V, a single row) is computed once and shared by all its rows, so N
candidates hold the prompt once, not N times. A group is rows of one prompt that hold the same
number of generated tokens; per layer it keeps a `body` [rows, kv heads, B, dim] and a `tail`
[rows, kv heads, CHUNK, dim] that a decode step fills in place, one column per step. A full tail
is merged into the body (one copy every CHUNK steps, not one per step as a concatenating cache
makes). Rows of different lengths live in different groups, so nothing is padded, and what the
cache holds is exact: prefix + rows x chunk_up(fed) slots per group.

Attention for a decode step runs group by group over prefix, body and tail (see `attend`);
everything else in the model runs on all rows at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Columns a tail holds. Smaller wastes fewer slots per row (a reservation counts whole
# chunks); larger merges less often. At 16 a merge copies a group's body every 16 steps.
CHUNK = 16


@dataclass
class _Group:
    prefix: object  # key of its prompt's prefix
    rows: int
    fed: int = 0  # generated tokens in the cache, the same for every row
    body_cols: int = 0  # columns merged into the body (a multiple of CHUNK)
    has_tail: bool = False
    # Per layer: [body_k, body_v, tail_k, tail_v] (None until first written).
    layers: list[list[torch.Tensor | None]] = field(default_factory=list)
    # Set by begin_step for the forward that follows: where this step's token goes.
    write_at: int = 0
    merge: bool = False
    alloc: bool = False


@dataclass(frozen=True)
class DecodePlan:
    """What one decode forward feeds: its groups, in row order."""

    groups: tuple[object, ...]


@dataclass(frozen=True)
class PrefillPlan:
    prefix: object


class KVCache:
    def __init__(self, layers: int, chunk: int = CHUNK) -> None:
        self.n_layers, self.chunk = layers, chunk
        self._prefixes: dict[object, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._groups: dict[object, _Group] = {}
        self.held_bytes = 0
        self.peak_bytes = 0  # high-water mark, transients of merges and compactions included

    # -- accounting ------------------------------------------------------------------------

    def tokens(self) -> int:
        """Token slots held: every prefix, and every group's rows x allocated columns."""
        return (sum(kv[0][0].shape[2] for kv in self._prefixes.values() if kv)
                + sum(g.rows * self._cols(g) for g in self._groups.values()))

    def real_tokens(self) -> int:
        """Tokens actually written (prefixes and generated tokens, no chunk slack)."""
        return (sum(kv[0][0].shape[2] for kv in self._prefixes.values() if kv)
                + sum(g.rows * g.fed for g in self._groups.values()))

    def growth(self, gid) -> int:
        """Slots the next decode step of this group allocates (a fresh tail, or none)."""
        g = self._groups[gid]
        full = not g.has_tail or g.fed - g.body_cols == self.chunk
        return g.rows * self.chunk if full else 0

    def bytes_held(self) -> int:
        """The bytes of every K/V tensor the cache holds, counted from the tensors."""
        total = sum(k.nbytes + v.nbytes for kv in self._prefixes.values() for k, v in kv)
        for g in self._groups.values():
            total += sum(t.nbytes for layer in g.layers for t in layer if t is not None)
        return total

    def _cols(self, g: _Group) -> int:
        return g.body_cols + (self.chunk if g.has_tail else 0)

    def _track(self, added: int, freed: int = 0) -> None:
        self.held_bytes += added
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.held_bytes -= freed

    # -- prefixes and groups ---------------------------------------------------------------

    def has_prefix(self, key) -> bool:
        return key in self._prefixes

    def prefix_tokens(self, key) -> int:
        kv = self._prefixes.get(key)
        return kv[0][0].shape[2] if kv else 0

    def drop_prefix(self, key) -> None:
        for k, v in self._prefixes.pop(key, []):
            self._track(0, k.nbytes + v.nbytes)

    def add_group(self, gid, prefix, rows: int) -> None:
        if prefix not in self._prefixes:
            raise KeyError(f"no prefix {prefix!r} in the cache")
        self._groups[gid] = _Group(prefix, rows, layers=[[None] * 4 for _ in range(self.n_layers)])

    def fed(self, gid) -> int:
        return self._groups[gid].fed

    def context(self, gid) -> int:
        """Tokens a row of the group attends to: its prefix and its generated tokens."""
        g = self._groups[gid]
        return self.prefix_tokens(g.prefix) + g.fed

    def drop_group(self, gid) -> None:
        g = self._groups.pop(gid)
        self._track(0, sum(t.nbytes for layer in g.layers for t in layer if t is not None))

    def keep_rows(self, gid, positions: list[int]) -> None:
        """Keep only these rows of the group, in this order (dropping the group if none)."""
        g = self._groups[gid]
        if not positions:
            self.drop_group(gid)
            return
        if positions == list(range(g.rows)):
            return
        index = None
        for layer in g.layers:
            for i, t in enumerate(layer):
                if t is None:
                    continue
                if index is None:
                    index = torch.tensor(positions, device=t.device)
                kept = t.index_select(0, index)
                self._track(kept.nbytes, t.nbytes)
                layer[i] = kept
        g.rows = len(positions)

    def clear(self) -> None:
        """Drop everything (also after a forward that failed half way)."""
        self._groups.clear()
        self._prefixes.clear()
        self.held_bytes = 0

    # -- steps -----------------------------------------------------------------------------

    def begin_step(self, gids) -> None:
        """Place this step's token of every group about to be fed."""
        for gid in gids:
            g = self._groups[gid]
            col = g.fed - g.body_cols
            g.merge = g.has_tail and col == self.chunk
            g.alloc = g.merge or not g.has_tail
            g.write_at = 0 if g.alloc else col

    def end_step(self, gids) -> None:
        for gid in gids:
            g = self._groups[gid]
            if g.merge:
                g.body_cols += self.chunk
            g.has_tail = True
            g.fed += 1
            g.merge = g.alloc = False

    # -- attention (called by the model's attention layers, see engine.attention) ----------

    def prefill(self, layer: int, plan: PrefillPlan, query, key, value, scaling):
        """Causal attention over the prompt; its K/V become the prompt's prefix."""
        kv = self._prefixes.setdefault(plan.prefix, [])
        if len(kv) != layer:
            raise RuntimeError(f"prefix {plan.prefix!r}: layer {layer} out of order")
        key, value = key.contiguous(), value.contiguous()
        kv.append((key, value))
        self._track(key.nbytes + value.nbytes)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)

    def decode(self, layer: int, plan: DecodePlan, query, key, value, scaling):
        """Append each row's new K/V to its group and attend over prefix, body and tail.

        query [rows, q heads, 1, dim], key/value [rows, kv heads, 1, dim], rows in plan order.
        Returns [rows, 1, q heads, dim].
        """
        out = query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])
        start = 0
        for gid in plan.groups:
            g = self._groups[gid]
            end = start + g.rows
            self._write(g, layer, key[start:end], value[start:end])
            out[start:end] = self._attend(g, layer, query[start:end], scaling)
            start = end
        return out

    def _write(self, g: _Group, layer: int, key, value) -> None:
        slots = g.layers[layer]
        if g.merge:
            body_k, body_v, tail_k, tail_v = slots
            for i, (body, tail) in enumerate(((body_k, tail_k), (body_v, tail_v))):
                merged = tail if body is None else torch.cat([body, tail], dim=2)
                self._track(0 if body is None else merged.nbytes,
                            0 if body is None else body.nbytes + tail.nbytes)
                slots[i] = merged
        if g.alloc:
            for i, t in ((2, key), (3, value)):
                fresh = t.new_empty(g.rows, t.shape[1], self.chunk, t.shape[3])
                self._track(fresh.nbytes)
                slots[i] = fresh
        slots[2][:, :, g.write_at] = key[:, :, 0]
        slots[3][:, :, g.write_at] = value[:, :, 0]

    def _attend(self, g: _Group, layer: int, query, scaling):
        body_k, body_v, tail_k, tail_v = g.layers[layer]
        prefix_k, prefix_v = self._prefixes[g.prefix][layer]
        rows, q_heads, _, dim = query.shape
        kv_heads = prefix_k.shape[1]
        q = query.reshape(rows, kv_heads, q_heads // kv_heads, dim)  # query heads by kv head
        fill = g.write_at + 1
        tail_k, tail_v = tail_k[:, :, :fill], tail_v[:, :, :fill]
        scores = [_fold(q, prefix_k[0].transpose(1, 2))]
        if body_k is not None:
            scores.append(torch.matmul(q, body_k.transpose(-1, -2)))
        scores.append(torch.matmul(q, tail_k.transpose(-1, -2)))
        probs = torch.softmax(torch.cat(scores, dim=-1) * scaling, dim=-1,
                              dtype=torch.float32).to(query.dtype)
        n_prefix = prefix_k.shape[2]
        out = _fold(probs[..., :n_prefix], prefix_v[0])
        at = n_prefix
        if body_v is not None:
            out = out + torch.matmul(probs[..., at : at + body_v.shape[2]], body_v)
            at += body_v.shape[2]
        out = out + torch.matmul(probs[..., at:], tail_v)
        return out.reshape(rows, 1, q_heads, dim)


# A matrix product gives every row the same bits whatever the number of rows only from this
# many rows up (measured with MKL: 1, 2-3 and 4+ rows round differently). Candidate identity
# across batch compositions needs a row's numbers not to depend on who shares its batch, so
# the prefix product, whose rows are the group's, is never run on fewer.
MIN_ROWS = 4


def _fold(q: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """q [rows, kv heads, group, a] times a per-head matrix [kv heads, a, b] shared by every
    row, as one product per head (no copy of `shared` per row): [rows, kv heads, group, b]."""
    rows, heads, group, a = q.shape
    flat = q.permute(1, 0, 2, 3).reshape(heads, rows * group, a)
    short = MIN_ROWS - flat.shape[1]
    if short > 0:
        flat = torch.cat([flat, flat.new_zeros(heads, short, a)], dim=1)
    out = torch.bmm(flat, shared)[:, : rows * group]
    return out.reshape(heads, rows, group, -1).permute(1, 0, 2, 3)

