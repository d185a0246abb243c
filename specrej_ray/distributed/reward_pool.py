"""Pools of reward actors (one pool per reward) and the client that spreads scoring over them."""

from __future__ import annotations

import itertools
import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from specrej_ray.distributed.resources import actor_runtime_env, set_torch_threads
from specrej_ray.spec import RewardSpec

log = logging.getLogger(__name__)


# Restarts are unbounded here: a batch that keeps killing its actor is bounded by the pool's
# attempts, and a long job should not lose its pool to a few sporadic deaths.
@ray.remote(max_restarts=-1, max_task_retries=0)
class RewardActor:
    def __init__(self, spec: RewardSpec, model_path: str | None) -> None:
        from specrej_ray.reward import build_reward

        self.threads = set_torch_threads(spec.threads)
        self.reward = build_reward(spec, model_path)

    def ready(self) -> str:
        return self.reward.name

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [float(s) for s in self.reward.score(prompts, responses)]


def start_reward_actors(spec: RewardSpec, model_path: str | None) -> list:
    opts = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus,
            "runtime_env": actor_runtime_env(spec.num_gpus)}
    return [RewardActor.options(**opts).remote(spec, model_path) for _ in range(spec.pool_size)]


class RewardPool:
    """Splits a scoring request into batches over one reward's actors; a batch whose actor
    dies or times out is sent again to the next actor (ray's ActorPool would drop it)."""

    def __init__(self, actors: list, batch_size: int, timeout_s: float, attempts: int = 3):
        self.actors = actors
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._next = itertools.cycle(range(len(actors)))

    def submit(self, prompts: list[str], responses: list[str]) -> dict:
        """Send every batch now; collect() waits for them."""
        chunks = [(i, min(i + self.batch_size, len(responses)))
                  for i in range(0, len(responses), self.batch_size)]
        return {self._send(prompts, responses, c): (c, 1) for c in chunks}

    def collect(self, pending: dict, prompts: list[str], responses: list[str]) -> list[float]:
        scores: list[float] = [0.0] * len(responses)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ref = next(iter(pending))
            chunk, attempt = pending.pop(ref)
            try:
                scores[chunk[0] : chunk[1]] = ray.get(ref, timeout=self.timeout_s)
            except ActorUnavailableError:
                # The actor is restarting (reloading its model): not this batch's fault, so it
                # costs no attempt; wait and send it again, up to the call timeout.
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"reward actors stayed unavailable for {self.timeout_s:.0f}s"
                    ) from None
                time.sleep(1.0)
                pending[self._send(prompts, responses, chunk)] = (chunk, attempt)
            except (RayActorError, GetTimeoutError) as e:
                if attempt >= self.attempts:
                    raise RuntimeError(f"reward scoring failed {attempt} times: {e}") from e
                log.warning("reward batch failed (%s); resubmitting", type(e).__name__)
                pending[self._send(prompts, responses, chunk)] = (chunk, attempt + 1)
        return scores

    def _send(self, prompts: list[str], responses: list[str], chunk: tuple[int, int]):
        actor = self.actors[next(self._next)]
        return actor.score.remote(prompts[chunk[0] : chunk[1]], responses[chunk[0] : chunk[1]])


def score_all(
    pools: list[RewardPool], prompts: list[str], responses: list[str]
) -> list[list[float]]:
    """Every reward's scores, computed concurrently; one row per response."""
    pending = [pool.submit(prompts, responses) for pool in pools]
    columns = [pool.collect(p, prompts, responses) for pool, p in zip(pools, pending, strict=True)]
    return [list(row) for row in zip(*columns, strict=True)]
