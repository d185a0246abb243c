"""What each prompt's results are tied to (content_key), and a compact table of them.

A job of millions of prompts cannot keep a dict per prompt in the driver: `ContentKeys` keeps
prompt ids in one Arrow string array and each key as a 64-bit digest of its content key (keys
are only ever compared for the same prompt id, so a digest collision is a 2^-64 event), with
an optional index (sorted 64-bit hashes of the ids) for finding a prompt's position: about
32 bytes a prompt indexed, 20 without.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def content_key(text: str, system: str | None, input_ids: Sequence[int],
                extra: str | None = None) -> dict[str, str]:
    """What a prompt's results are tied to: its text and the row's columns its rewards read
    (an instruction list), and the tokens the generator saw (the chat template and tokenizer
    included)."""
    row = f"{system or ''}\x00{text}" + ("" if extra is None else f"\x00{extra}")
    text_hash = hashlib.sha256(row.encode()).hexdigest()[:16]
    ids = ",".join(map(str, input_ids)).encode()
    return {"text": text_hash, "input": hashlib.sha256(ids).hexdigest()[:16]}


def hash64(value: str) -> int:
    """A string's 64-bit hash (ids are found and deduplicated by it, then compared)."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")


def key_digest(key: object) -> int:
    """A content key (any JSON value) as 64 bits: equal keys, equal digests."""
    return hash64(json.dumps(key, sort_keys=True))


class ContentKeys:
    """Prompt ids in order with their content keys' digests; `indexed` finds positions."""

    def __init__(self, ids: pa.Array, digests: np.ndarray, indexed: bool = True) -> None:
        self.ids, self.digests = ids, digests
        self._order: np.ndarray | None = None  # positions sorted by id hash
        self._sorted: np.ndarray | None = None  # the id hashes in that order
        if indexed:
            hashes = self.id_hashes()
            self._order = np.argsort(hashes, kind="stable").astype(np.int32)
            self._sorted = hashes[self._order]

    @classmethod
    def of(cls, keys: Mapping[str, object] | ContentKeys, indexed: bool = True) -> ContentKeys:
        """A mapping of prompt id -> content key as a table (a table is returned as it is,
        indexed if asked)."""
        if isinstance(keys, ContentKeys):
            return keys if keys.indexed or not indexed else cls(keys.ids, keys.digests)
        digests = np.fromiter((key_digest(k) for k in keys.values()), np.uint64, len(keys))
        return cls(pa.array(list(keys), pa.string()), digests, indexed)

    @classmethod
    def concat(cls, parts: Iterable[ContentKeys], indexed: bool = True) -> ContentKeys:
        parts = list(parts)
        ids = pa.concat_arrays([p.ids for p in parts]) if parts else pa.array([], pa.string())
        digests = (np.concatenate([p.digests for p in parts]) if parts
                   else np.zeros(0, np.uint64))
        return cls(ids, digests, indexed)

    @property
    def indexed(self) -> bool:
        return self._order is not None

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        """The prompt ids, in order."""
        for chunk in range(0, len(self.ids), 8192):
            yield from self.ids.slice(chunk, 8192).to_pylist()

    def id_hashes(self) -> np.ndarray:
        return np.fromiter((hash64(pid) for pid in self), np.uint64, len(self))

    def positions(self, ids: pa.Array) -> np.ndarray:
        """Each id's position here, -1 where it is not a prompt here."""
        assert self._order is not None and self._sorted is not None, "not indexed"
        pos = np.full(len(ids), -1, np.int64)
        if not len(self._sorted):
            return pos
        hashes = np.fromiter((hash64(pid) for pid in ids.to_pylist()), np.uint64, len(ids))
        lo = np.searchsorted(self._sorted, hashes, "left")
        hi = np.searchsorted(self._sorted, hashes, "right")
        one = hi - lo == 1
        pos[one] = self._order[lo[one]]
        for i in np.flatnonzero(hi - lo > 1):  # a hash several ids here share: rare
            want = ids[int(i)].as_py()
            pos[i] = next((int(p) for p in self._order[lo[i]:hi[i]]
                           if self.ids[int(p)].as_py() == want), -1)
        # An id that is not here may share its hash with one that is: compare the ids.
        found = np.flatnonzero(pos >= 0)
        if len(found):
            same = pc.equal(self.ids.take(pa.array(pos[found])), ids.take(pa.array(found)))
            pos[found[~same.to_numpy(zero_copy_only=False)]] = -1
        return pos

    def position(self, pid: str) -> int:
        return int(self.positions(pa.array([pid], pa.string()))[0])
