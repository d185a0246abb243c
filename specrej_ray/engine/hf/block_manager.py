"""The block manager: which KV token slots hold what. Only the scheduler changes it.

Every K/V the running batch holds lives in one slot pool per layer (engine.hf.kv_pool); this
module decides which slot holds which token, on the host (numpy), as nano-vllm's BlockManager
and vLLM's block tables do. It never touches the device: the slot tables it hands out (a
prompt's prefix slots, a decode step's `StepSlots`) are what the model runner reads.

- A prompt's **prefix** (its K/V, computed once) takes one slot per token and is shared by all
  its rows, so N candidates hold the prompt once, not N times.
- A **group** (an id from `add_group`) is rows of one prompt that hold the same number of
  generated tokens; each row's table takes a **page** of `chunk` slots at a time, so what the
  cache holds is exact: prefix + rows x chunk_up(tokens in the cache) per group, and a row
  pruned frees its pages without moving anything.
- Pages are **reference-counted**: `fork` makes a group whose rows share their parents' pages
  up to the fork's length, charging nothing; the first write into a shared page copies it
  (copy-on-write: the copy's source and destination slots go into the step's `StepSlots` for
  the runner to apply), so a fork charges only the pages it adds.

The slots a step decides are taken when it is scheduled (`step`), so the scheduler's guard
sees the step's exact growth; the pool sizes the slots grew through (`growth`) go with the
batch, and the pool's tensors follow them when the forward that writes them runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specrej_ray.search.reservation import ceil_div

# Slots a row takes at once (a page). Smaller wastes fewer slots per row (a reservation counts
# whole pages); larger allocates less often.
CHUNK = 16

# Columns of a step's tables come in whole blocks of this many: a row's softmax then reads its
# real columns in the same vector lanes whatever the padding (so its bits do not depend on its
# batch; engine.hf.kv_pool).
BLOCK = 16


@dataclass
class _Group:
    prefix: object  # key of its prompt's prefix
    table: np.ndarray  # [rows, allocated columns]: each row's slots, whole pages


@dataclass(frozen=True)
class StepSlots:
    """A decode step's slot tables, as the scheduler decided them (host arrays).

    Rows come in the order of the step's groups. -1 marks a padded column."""

    write: np.ndarray  # [rows]: the slot of each row's new token
    own: np.ndarray  # [rows, cols]: each row's slots, its new token's included
    prefix: np.ndarray  # [prompts, prefix cols]: each prompt's prefix slots
    prompt_of_row: np.ndarray  # [rows]: the prompt (row of `prefix`) of each row
    positions: np.ndarray  # [rows]: each row's position, the tokens it attends to before its own
    # Copy-on-write: before the step writes, the K/V at copy_from goes to copy_to (every layer).
    copy_from: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    copy_to: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class BlockManager:
    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self.limit: int | None = None  # slots the pool may grow to (the budget's room)
        self._capacity = 0  # slots in the pool, taken or free
        self._free = np.zeros(0, np.int64)  # a stack of free slots
        self._refs = np.zeros(0, np.int32)  # per slot: the tables and prefixes holding it
        self._grown: list[int] = []  # pool sizes not yet handed to a batch, in order
        self._prefixes: dict[object, np.ndarray] = {}  # key -> its slots
        self._groups: dict[int, _Group] = {}
        self._ids = itertools.count()

    # -- accounting ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Slots the pool holds now, taken or free (what its tensors must reach)."""
        return self._capacity

    def tokens(self) -> int:
        """Token slots in use: every prefix, and every page of a row (a shared page once)."""
        return self._capacity - len(self._free)

    def growth(self, gid: int, cached: int) -> int:
        """Slots the group's next decode step takes, its rows holding `cached` tokens: a
        fresh page, or a copy of a shared one, for each row that needs one."""
        table = self._groups[gid].table
        if cached == table.shape[1]:
            return len(table) * self.chunk
        return int((self._refs[table[:, cached]] > 1).sum()) * self.chunk

    def held_slots(self) -> np.ndarray:
        """Every slot a prefix or a row's table holds, once (what `tokens` counts, from the
        tables rather than the free list)."""
        held = [*self._prefixes.values(), *(g.table.ravel() for g in self._groups.values())]
        return np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)

    def set_limit(self, slots: int | None) -> None:
        """The most slots the pool may grow to (None: no limit)."""
        self.limit = slots

    def take_growth(self) -> tuple[int, ...]:
        """The pool sizes the slots grew through since the last call, in order (the pool's
        tensors grow through the same sizes, so their transients are those of growing as
        each slot was taken)."""
        sizes, self._grown = tuple(self._grown), []
        return sizes

    # -- prefixes and groups ---------------------------------------------------------------

    def has_prefix(self, key) -> bool:
        return key in self._prefixes

    def prefix_tokens(self, key) -> int:
        slots = self._prefixes.get(key)
        return 0 if slots is None else len(slots)

    def prefix_slots(self, key) -> np.ndarray:
        return self._prefixes[key]

    def add_prefix(self, key, tokens: int) -> np.ndarray:
        """Take the slots of a prompt's prefix now (its prefill forward writes them)."""
        if key in self._prefixes:
            raise RuntimeError(f"prefix {key!r} is already in the cache")
        self._prefixes[key] = slots = self._alloc(tokens)
        return slots

    def drop_prefix(self, key) -> None:
        slots = self._prefixes.pop(key, None)
        if slots is not None:
            self._release(slots)

    def add_group(self, prefix, rows: int) -> int:
        """A new group of rows on this prefix, holding no token yet; its id."""
        if prefix not in self._prefixes:
            raise KeyError(f"no prefix {prefix!r} in the cache")
        gid = next(self._ids)
        self._groups[gid] = _Group(prefix, np.zeros((rows, 0), np.int64))
        return gid

    def fork(self, gid: int, positions: Sequence[int], tokens: int) -> int:
        """A new group whose rows continue these rows of group `gid` from their first `tokens`
        generated tokens (a row may be named more than once): they share its pages up to
        there, charging nothing; its id. A shared page is copied when first written."""
        parent = self._groups[gid]
        pages = ceil_div(tokens, self.chunk) * self.chunk
        if pages > parent.table.shape[1]:
            raise ValueError(f"group {gid} holds {parent.table.shape[1]} columns, not {tokens}")
        table = parent.table[list(positions), :pages].copy()
        np.add.at(self._refs, table.ravel(), 1)
        child = next(self._ids)
        self._groups[child] = _Group(parent.prefix, table)
        return child

    def drop_group(self, gid: int) -> None:
        self._release(self._groups.pop(gid).table)

    def keep_rows(self, gid: int, positions: Sequence[int]) -> None:
        """Keep only these rows of the group, in this order (dropping the group if none)."""
        g = self._groups[gid]
        if not positions:
            self.drop_group(gid)
            return
        keep = np.zeros(len(g.table), bool)
        keep[list(positions)] = True
        self._release(g.table[~keep])
        g.table = g.table[list(positions)]

    def clear(self) -> None:
        """Drop everything (also after a forward that failed half way)."""
        self._groups.clear()
        self._prefixes.clear()
        self._capacity, self._free = 0, np.zeros(0, np.int64)
        self._refs, self._grown = np.zeros(0, np.int32), []

    # -- a step ----------------------------------------------------------------------------

    def step(self, groups: Sequence[tuple[int, int]]) -> StepSlots:
        """Give every (group, tokens its rows hold) about to be fed its new token's slot (a
        fresh page where a row's pages are full, a copy where its page is shared), and lay
        out the step's tables."""
        copies = [self._writable(gid, cached) for gid, cached in groups]
        tables = [self._groups[gid] for gid, _ in groups]
        sizes = np.array([len(g.table) for g in tables])
        cached = np.array([c for _, c in groups], np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        rows = int(starts[-1])
        own = np.full((rows, _blocks(int(cached.max()) + 1)), -1, np.int64)
        for g, c, at in zip(tables, cached.tolist(), starts.tolist(), strict=False):
            own[at : at + len(g.table), : c + 1] = g.table[:, : c + 1]
        row_cached = np.repeat(cached, sizes)
        write = own[np.arange(rows), row_cached]
        # Prompts in order of first appearance; each one's rows (from any of its groups).
        prompt_of: dict[object, int] = {}
        for g in tables:
            prompt_of.setdefault(g.prefix, len(prompt_of))
        which = np.repeat([prompt_of[g.prefix] for g in tables], sizes)
        longest = max(len(self._prefixes[k]) for k in prompt_of)
        prefix = np.full((len(prompt_of), _blocks(longest)), -1, np.int64)
        lengths = np.zeros(len(prompt_of), np.int64)
        for key, i in prompt_of.items():
            prefix[i, : len(self._prefixes[key])] = self._prefixes[key]
            lengths[i] = len(self._prefixes[key])
        src = [s for s, _ in copies if len(s)]
        dst = [d for _, d in copies if len(d)]
        return StepSlots(write, own, prefix, which, lengths[which] + row_cached,
                         *(np.concatenate(a) if a else np.zeros(0, np.int64)
                           for a in (src, dst)))

    def _writable(self, gid: int, cached: int) -> tuple[np.ndarray, np.ndarray]:
        """Make column `cached` of every row of the group its own to write: a fresh page
        where its pages are full, else a copy of its page while another table shares it
        (once the others have copied theirs, the last one writes it in place). Returns the
        slots to copy from and to."""
        g, chunk = self._groups[gid], self.chunk
        if cached == g.table.shape[1]:
            fresh = self._alloc(len(g.table) * chunk).reshape(len(g.table), chunk)
            g.table = np.concatenate([g.table, fresh], axis=1)
            return _none(), _none()
        start = cached - cached % chunk
        shared = np.flatnonzero(self._refs[g.table[:, cached]] > 1)
        if not len(shared):
            return _none(), _none()
        old = g.table[shared, start : start + chunk]
        fresh = self._alloc(len(shared) * chunk).reshape(len(shared), chunk)
        g.table[shared, start : start + chunk] = fresh
        self._release(old)
        written = cached - start
        return old[:, :written].ravel(), fresh[:, :written].ravel()

    # -- slots -----------------------------------------------------------------------------

    def _alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            self._grow(n - len(self._free))
        self._free, taken = self._free[: len(self._free) - n], self._free[len(self._free) - n:]
        self._refs[taken] = 1
        return taken

    def _release(self, slots: np.ndarray) -> None:
        """One holder less for each slot; those no one holds are free again."""
        if not slots.size:
            return
        flat = slots.ravel()
        np.subtract.at(self._refs, flat, 1)
        gone = flat[self._refs[flat] == 0]
        if gone.size:  # once each, in the order given (a fork may name a row twice)
            _, first = np.unique(gone, return_index=True)
            self._free = np.concatenate([self._free, gone[np.sort(first)]])

    def _grow(self, short: int) -> None:
        """More slots (the pool's tensors follow when the next forward runs)."""
        want = max(self._capacity + short, 2 * self._capacity, 4 * self.chunk)
        if self.limit is not None:
            want = min(want, self.limit)
        if want < self._capacity + short:
            raise RuntimeError(f"the KV cache needs {self._capacity + short} slots, more than "
                               f"its budget of {self.limit}")
        self._free = np.concatenate([self._free, np.arange(want - 1, self._capacity - 1, -1)])
        self._refs = np.concatenate([self._refs, np.zeros(want - self._capacity, np.int32)])
        self._capacity = want
        self._grown.append(want)


def single_row(prompt_tokens: int, steps: int) -> tuple[np.ndarray, int, list[StepSlots]]:
    """The slot tables of one prompt and one row decoding `steps` tokens on an empty pool:
    (the prefix's slots, the pool size they need, each step's slots). The model runner's
    start-up self-check feeds them."""
    blocks = BlockManager()
    prefix = blocks.add_prefix("probe", prompt_tokens)
    gid = blocks.add_group("probe", 1)
    slots = [blocks.step([(gid, t)]) for t in range(steps)]
    return prefix, blocks.capacity, slots


def _blocks(n: int) -> int:
    return ceil_div(n, BLOCK) * BLOCK


def _none() -> np.ndarray:
    return np.zeros(0, np.int64)
