"""The job's prepared prompts on the driver's local disk, so its memory does not grow with
the job: each chunk is written as it is prepared to an Arrow file, and a shard reads its own
rows (the record batches that hold them) when it is sent and when it is written. What stays
in memory per prompt is its id and content-key digest (content_keys.ContentKeys, about 32
bytes).

The file is read, not memory-mapped: every page of a mapped file a run touches (and a run
touches them all) counts in the driver's resident memory, and in a pod's memory limit, until
the file is closed: over 100 MB at a million prompts (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from specrej_ray.data.content_keys import ContentKeys, content_key, key_digest
from specrej_ray.data.prompts import Prompt, PromptTask

SCHEMA = pa.schema([
    ("id", pa.string()), ("text", pa.string()), ("system", pa.string()), ("row", pa.int64()),
    ("input_ids", pa.list_(pa.int32())), ("self_scored", pa.bool_()),
    ("key_text", pa.string()), ("key_input", pa.string()), ("extra", pa.string()),
])
FILE = "prompts.arrow"


class PromptStore:
    """Prepared prompts by position, in job order (a shards.ShardSource)."""

    def __init__(self, path: Path, keys: ContentKeys, sizes: Sequence[int]) -> None:
        # Record batches, not one table: taking rows from a table of many chunks concatenates
        # whole columns first, which would copy every prompt into memory at each shard.
        self.reader = pa.ipc.open_file(pa.OSFile(str(path)))
        self.starts = np.cumsum([0, *sizes])  # the first position of each batch
        self.content_keys = keys  # indexed: positions of prompt ids
        self._last: tuple[int, pa.RecordBatch] | None = None  # shards read batches in order

    def _batch(self, b: int) -> pa.RecordBatch:
        if self._last is None or self._last[0] != b:
            self._last = (b, self.reader.get_batch(b))
        return self._last[1]

    @classmethod
    def build(cls, chunks: Iterable[tuple[list[Prompt], list[PromptTask]]],
              directory: Path) -> PromptStore:
        """Every prepared prompt (job.prepare.Prepared.chunks), a chunk at a time, into
        directory/prompts.arrow."""
        path = directory / FILE
        parts, sizes = [], []
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            for prompts, tasks in chunks:
                keys = [content_key(p.text, p.system, t.input_ids, p.extra)
                        for p, t in zip(prompts, tasks, strict=True)]
                batch = pa.record_batch([
                    [p.id for p in prompts], [p.text for p in prompts],
                    [p.system for p in prompts], [p.row for p in prompts],
                    [t.input_ids for t in tasks], [t.self_scored for t in tasks],
                    [k["text"] for k in keys], [k["input"] for k in keys],
                    [p.extra for p in prompts],
                ], schema=SCHEMA)
                writer.write_batch(batch)
                sizes.append(batch.num_rows)
                digests = np.fromiter((key_digest(k) for k in keys), np.uint64, len(keys))
                parts.append(ContentKeys(batch.column(0), digests, indexed=False))
        return cls(path, ContentKeys.concat(parts), sizes)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def ids(self, start: int, stop: int) -> list[str]:
        return self._rows(np.arange(start, max(start, stop)), ["id"])["id"]

    def _rows(self, positions: Sequence[int], columns: list[str] | None = None
              ) -> dict[str, list]:
        """These rows, in this order, read from the batches that hold them."""
        at = np.asarray(positions, np.int64)
        which = np.searchsorted(self.starts, at, side="right") - 1
        parts = [self._batch(b).select(columns or SCHEMA.names)
                 .take(pa.array(at[which == b] - self.starts[b])) for b in np.unique(which)]
        if not parts:
            return {name: [] for name in columns or SCHEMA.names}
        table = pa.Table.from_batches(parts)  # grouped by batch, each in the asked order
        back = np.empty(len(at), np.int64)
        back[np.argsort(which, kind="stable")] = np.arange(len(at))
        return table.take(pa.array(back)).to_pydict()

    def prompts(self, positions: Sequence[int]) -> list[Prompt]:
        r = self._rows(positions)
        return [Prompt(*row) for row in zip(r["id"], r["text"], r["system"], r["row"],
                                            r["extra"], strict=True)]

    def tasks(self, positions: Sequence[int]) -> list[PromptTask]:
        r = self._rows(positions)
        return [PromptTask(*row) for row in zip(r["id"], r["text"], r["input_ids"],
                                                r["self_scored"], r["extra"], strict=True)]

    def keys(self, positions: Sequence[int]) -> dict[str, dict[str, str]]:
        r = self._rows(positions, ["id", "key_text", "key_input"])
        return {pid: {"text": t, "input": i}
                for pid, t, i in zip(r["id"], r["key_text"], r["key_input"], strict=True)}
