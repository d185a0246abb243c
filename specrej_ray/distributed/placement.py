"""Generator groups: a generator actor and the reward actors placed with it (reward.placement:
with_generator), packed into one placement group so they share a node and, by fractions, a GPU.

With generator.tensor_parallel_size k > 1 the generator itself is k bundles of one GPU each,
all on one node (STRICT_PACK), as OpenRLHF places its vLLM engines: the actor sits on the
first bundle with no GPU of its own and captures its child tasks, so vLLM's Ray executor
starts its k workers in the group, one per bundle (VLLM_RAY_BUNDLE_INDICES)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specrej_ray.distributed.generator import start_generator
from specrej_ray.distributed.reward_pool import start_reward_actors
from specrej_ray.spec import JobSpec


@dataclass(eq=False)  # hashed by identity: the fleet keys its bookkeeping on groups
class GeneratorGroup:
    label: str  # names the generator in logs and run.json
    actor: object
    rewards: list = field(default_factory=list)  # reward actors of this generator only
    pg: PlacementGroup | None = None

    def release(self) -> None:
        """Kill the actors and free their reservation, so the node can scale down."""
        for a in [self.actor, *self.rewards]:
            ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)


def generator_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """The generator's bundles: one, or with tensor parallelism k of {GPU: 1, CPU}, the
    actor's CPUs in the first."""
    c, k = spec.cluster, spec.generator.tensor_parallel_size
    if k == 1:
        return [_bundle(c.cpus_per_generator, c.gpus_per_generator)]
    return [{"CPU": c.cpus_per_generator, "GPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * (k - 1)


def group_bundles(spec: JobSpec) -> list[dict[str, float]]:
    """The generator's bundles first; then one per reward actor placed with it, in reward
    order."""
    bundles = generator_bundles(spec)
    for r in spec.reward:
        if r.placement == "with_generator":
            bundles += [_bundle(r.num_cpus, r.num_gpus)] * r.pool_size
    return bundles


def group_shape(spec: JobSpec) -> dict[str, float]:
    """What one generator group takes from one node, all bundles together."""
    total: Counter = Counter()
    for b in group_bundles(spec):
        total.update(b)
    return dict(total)


def start_group(spec: JobSpec, gen_path: str, rm_paths: list, shared: list[list],
                label: str) -> GeneratorGroup:
    """One generator with its reward pools: `shared[i]` for rewards placed `own`, new actors
    in the generator's placement group for rewards placed `with_generator`."""
    tp = spec.generator.tensor_parallel_size
    if tp == 1 and all(r.placement == "own" for r in spec.reward):
        return GeneratorGroup(label, start_generator(spec, gen_path, shared))
    bundles = group_bundles(spec)
    # a tensor-parallel group must share one node (its workers talk over NVLink/PCIe)
    pg = placement_group(bundles, strategy="STRICT_PACK" if tp > 1 else "PACK",
                         name=f"specrej-{label}")
    slot = iter(range(len(generator_bundles(spec)), len(bundles)))
    pools, own = [], []
    for r, path, pool in zip(spec.reward, rm_paths, shared, strict=True):
        if r.placement == "own":
            pools.append(pool)
            continue
        actors = start_reward_actors(r, path, [_in(pg, next(slot)) for _ in range(r.pool_size)])
        pools.append(actors)
        own += actors
    # vLLM's workers are the generator's child tasks: they must land in its group
    strategy = _in(pg, 0, capture=tp > 1)
    return GeneratorGroup(label, start_generator(spec, gen_path, pools, strategy), own, pg)


def _in(pg: PlacementGroup, index: int, capture: bool = False) -> PlacementGroupSchedulingStrategy:
    # An explicit bundle: with "any bundle" a reward actor could take the generator's slot.
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=capture)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}
