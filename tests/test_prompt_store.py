"""The driver's prompts on disk: the same prompts, tasks, keys and problems as preparing them in
memory, in chunks; compact content keys that find positions like a dict; ids checked for
duplicates in bounded memory."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from specrej_ray.data import content_keys
from specrej_ray.data.content_keys import ContentKeys, content_key
from specrej_ray.data.output import Supplied
from specrej_ray.data.prompt_store import PromptStore
from specrej_ray.data.prompts import Prompt, SeenIds
from specrej_ray.job.prepare import Prepared, prepare_prompts
from specrej_ray.job.shards import ListSource, plan_shards
from specrej_ray.spec import validate_spec
from tests.conftest import tiny_job, write_jsonl


def _rows() -> list[dict]:
    rows = [{"id": f"q{i}", "prompt": f"Question {i}?" + (" long" * 300 if i % 7 == 3 else "")}
            for i in range(40)]
    rows[5] = {"id": "q5"}  # no prompt: a row problem
    rows[9] = {"id": "q1", "prompt": "again"}  # a duplicate id
    return rows


def test_the_store_holds_what_preparing_in_memory_gives(tmp_path, tiny_lm_dir, monkeypatch):
    monkeypatch.setattr(Prepared, "CHUNK", 6)  # several chunks, a problem in more than one
    spec = validate_spec(tiny_job(tmp_path, tiny_lm_dir, write_jsonl(tmp_path / "p.jsonl",
                                                                     _rows())))
    prompts, tasks, problems, _ = prepare_prompts(spec, str(tiny_lm_dir))
    prepared = Prepared(spec, str(tiny_lm_dir))
    store = PromptStore.build(prepared.chunks(), tmp_path)
    everything = range(len(store))
    assert store.prompts(everything) == prompts and store.tasks(everything) == tasks
    assert store.keys(everything) == {p.id: content_key(p.text, p.system, t.input_ids)
                                      for p, t in zip(prompts, tasks, strict=True)}
    assert prepared.problems == problems
    reasons = [p.reason for p in problems]
    assert [r.split(" ")[0] for r in reasons[:2]] == ["prompt", "duplicate"]
    assert len(reasons) > 3 and all("exceeds the generator's context" in r for r in reasons[2:])
    # A shard reads its own rows, wherever they are.
    assert [p.id for p in store.prompts([7, 2])] == [prompts[7].id, prompts[2].id]


def test_content_keys_find_positions_and_compare_content():
    keys = {f"p{i}": content_key(f"text {i}", None, [i]) for i in range(1000)}
    table = ContentKeys.of(keys)
    asked = pa.array(["p7", "nope", "p999", "p0"], pa.string())
    assert table.positions(asked).tolist() == [7, -1, 999, 0]
    assert list(table) == list(keys) and table.position("p3") == 3
    assert table.position("p3x") == -1
    edited = ContentKeys.of({**keys, "p7": content_key("edited", None, [7])})
    assert (table.digests != edited.digests).tolist() == [i == 7 for i in range(1000)]


def test_ids_sharing_a_hash_are_still_told_apart(monkeypatch):
    # 64-bit hash collisions, forced: strings hash by their length's parity only.
    monkeypatch.setattr(content_keys, "hash64", lambda value: len(value) % 2)
    table = ContentKeys.of({f"p{i}": {"text": str(i)} for i in range(30)})
    asked = pa.array(["p21", "p1", "p11", "q1", "p7"], pa.string())
    assert table.positions(asked).tolist() == [21, 1, 11, -1, 7]


def test_supplied_positions_plan_the_same_shards_as_a_set_of_ids():
    keys = {f"p{i}": {"text": str(i)} for i in range(10)}
    table = ContentKeys.of(keys)
    owner = np.array([0, -1, -1, 0, 1, -1, -1, -1, 1, -1], np.int32)
    done = Supplied(table, owner, ["shard-a", "shard-b"])
    assert dict(done) == {"p0": "shard-a", "p3": "shard-a", "p4": "shard-b", "p8": "shard-b"}
    source = ListSource([Prompt(pid, "text", None, i + 1) for i, pid in enumerate(keys)], [],
                        keys)
    from_mask = plan_shards(source, 3, done)
    from_set = plan_shards(source, 3, set(done))
    assert [s.positions.tolist() for s in from_mask] == [s.positions.tolist() for s in from_set]
    assert [s.positions.tolist() for s in from_mask] == [[1, 2, 5], [6, 7, 9]]
    assert [s.id for s in from_mask] == [s.id for s in from_set]


def test_seen_ids_answer_first_rows_across_merges(monkeypatch):
    monkeypatch.setattr(SeenIds, "_FRESH", 4)  # merges every 4 new ids
    seen = SeenIds()
    firsts = {}
    for row in range(1, 200):
        pid = f"id{row % 70}"  # ids repeat after 70 rows
        got = seen.add(pid, row)
        assert got == firsts.get(pid)
        firsts.setdefault(pid, row)
    assert len(seen.hashes) <= 8  # merged by size: logarithmically many arrays
