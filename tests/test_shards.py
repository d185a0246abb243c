"""Shard planning: consecutive prompts not yet done, named by their position in the job and a
hash of their content (stable across resumes, new for edited prompts)."""

from __future__ import annotations

from specrej_ray.data.prompts import Prompt, PromptTask
from specrej_ray.job.shards import ListSource, plan_shards


def prompts(n: int, text: str = "q") -> tuple[list[Prompt], list[PromptTask], dict]:
    ps = [Prompt(f"p{i}", f"{text}{i}", None, i + 1) for i in range(n)]
    tasks = [PromptTask(p.id, p.text, [1, 2]) for p in ps]
    keys = {p.id: {"text": p.text} for p in ps}
    return ps, tasks, keys


def test_shards_are_consecutive_and_named_by_their_first_prompts_position():
    ps, tasks, keys = prompts(7)
    shards = plan_shards(ListSource(ps, tasks, keys), 3)
    assert [[p.id for p in s.prompts] for s in shards] == [["p0", "p1", "p2"],
                                                           ["p3", "p4", "p5"], ["p6"]]
    assert [s.id.split("-")[1] for s in shards] == ["00000", "00003", "00006"]
    assert [t.prompt_id for t in shards[1].tasks] == ["p3", "p4", "p5"]


def test_done_prompts_are_left_out_and_positions_kept():
    ps, tasks, keys = prompts(6)
    shards = plan_shards(ListSource(ps, tasks, keys), 2, done={"p0", "p3"})
    assert [[p.id for p in s.prompts] for s in shards] == [["p1", "p2"], ["p4", "p5"]]
    assert [s.id.split("-")[1] for s in shards] == ["00001", "00004"]


def test_a_later_part_of_the_job_counts_positions_from_its_start():
    ps, tasks, keys = prompts(4)
    shards = plan_shards(ListSource(ps, tasks, keys), 2, start=2)
    assert [s.id.split("-")[1] for s in shards] == ["00002"]


def test_names_are_stable_and_change_with_the_content():
    ps, tasks, keys = prompts(4)
    again = plan_shards(ListSource(ps, tasks, keys), 2)
    assert [s.id for s in again] == [s.id for s in plan_shards(ListSource(ps, tasks, keys), 2)]
    edited = dict(keys, p1={"text": "changed"})
    ids = [s.id for s in plan_shards(ListSource(ps, tasks, edited), 2)]
    assert ids[0] != again[0].id and ids[1] == again[1].id
