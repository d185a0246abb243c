"""Default torch threads of a run's actors (job.threads): a generator and the reward actors that
score with a model on the CPU beside it split the cores, since they run at once."""

from __future__ import annotations

from specrej_ray.job.threads import generator_threads, reward_threads
from specrej_ray.spec import JobSpec


def spec(reward, **generator) -> JobSpec:
    return JobSpec.model_validate({
        "prompts": {"path": "p.jsonl"}, "output": {"path": "out"},
        "generator": {"model": "gen", **generator}, "reward": reward})


def test_model_rewards_on_the_cpu_take_their_cores_from_the_generator():
    s = spec([{"type": "classifier", "model": "rm", "num_cpus": 2, "pool_size": 2},
              {"type": "lm_likelihood", "model": "other", "weight": 1.0}])
    assert [reward_threads(r) for r in s.reward] == [2, 1]
    assert generator_threads(s, cores=16) == 16 - 2 * 2 - 1
    assert generator_threads(s, cores=3) == 1  # never none


def test_what_takes_no_cpu_beside_the_generator_leaves_it_every_core():
    free = spec({"type": "lm_likelihood", "model": "gen"})  # its own likelihood
    on_gpu = spec({"type": "classifier", "model": "rm", "num_gpus": 1})
    python = spec({"type": "callable", "function": "m:f"})
    assert {generator_threads(s, cores=8) for s in (free, on_gpu, python)} == {8}
    chosen = spec({"type": "classifier", "model": "rm", "threads": 3}, threads=5)
    assert generator_threads(chosen, cores=8) == 5 and reward_threads(chosen.reward[0]) == 3
