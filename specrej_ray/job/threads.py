"""How many torch threads each actor of a run takes by default (Ray-free).

A generator decodes while its prompts' scores are out (the engine polls the reward actors'
answers), so on a CPU node its threads and those of reward actors scoring with a model beside
it run at once; more torch threads than cores then slow both (OpenMP's threads wait for each
other by spinning). So unless a spec says otherwise, a reward actor takes the CPUs Ray gives it
(`num_cpus`), and the generator the node's cores less those its model-scoring reward actors on
the CPU take. A reward the generator scores itself (its own likelihood, instructions) or a
Python callable takes none of its cores.
"""

from __future__ import annotations

import math
import os

from specrej_ray.job.prepare import self_likelihood
from specrej_ray.spec import JobSpec, RewardSpec


def reward_threads(reward: RewardSpec) -> int:
    return reward.threads or max(1, math.ceil(reward.num_cpus))


def generator_threads(spec: JobSpec, cores: int | None = None) -> int:
    if spec.generator.threads:
        return spec.generator.threads
    cores = cores or os.cpu_count() or 1
    beside = sum(reward_threads(r) * r.pool_size
                 for r, free in zip(spec.reward, self_likelihood(spec), strict=True)
                 if not (free or r.local or r.type == "callable" or r.num_gpus))
    return max(1, cores - beside)
