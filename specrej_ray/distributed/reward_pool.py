"""Pools of reward actors (one pool per reward) and the client that spreads scoring over them."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import time
import uuid
from dataclasses import asdict, dataclass

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from specrej_ray.distributed.metrics import Metrics
from specrej_ray.distributed.ray_internals import started_here
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.job.threads import reward_threads
from specrej_ray.reward.base import RewardError
from specrej_ray.spec import RewardSpec

log = logging.getLogger(__name__)


# Restarts are unbounded here: a batch that keeps killing its actor is bounded by the pool's
# attempts, and a long job should not lose its pool to a few sporadic deaths.
@ray.remote(max_restarts=-1, max_task_retries=0)
class RewardActor:
    def __init__(self, spec: RewardSpec, model_path: str | None) -> None:
        from specrej_ray.reward import build_reward
        from specrej_ray.reward.tracked import TrackedReward

        self.threads = set_torch_threads(reward_threads(spec))
        self.reward = TrackedReward(build_reward(spec, model_path), spec.incremental,
                                    int(spec.cache_gb * 2**30))

    def ready(self) -> str:
        return self.reward.name

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        with _reward_errors(self.reward.name):
            return [float(s) for s in self.reward.score(prompts, responses)]

    def score_request(self, request: Request, prompt: str, responses: list[str]) -> list[float]:
        """One prompt's responses, named (reward.tracked: incremental where it can)."""
        with _reward_errors(self.reward.name):
            return [float(s) for s in self.reward.score_request(
                request.prompt_id, prompt, responses, request.keys, request.ids,
                request.vocab, request.last)]

    def stats(self) -> dict:
        """Reward-model tokens processed, and what full re-scoring would have processed."""
        return {"name": self.reward.name, "incremental": self.reward.incremental,
                **asdict(self.reward.stats)}


@contextlib.contextmanager
def _reward_errors(name: str):
    try:
        yield
    except RewardError:
        raise
    except Exception as e:  # a bug in the reward: the driver tells the user, exit 2
        why = (str(e).strip().splitlines() or [""])[0]
        raise RewardError(f"reward {name} raised {type(e).__name__}: {why}; "
                          "fix the reward") from None


@dataclass(frozen=True)
class Request:
    """Whose responses a scoring request holds (engine.scoring.Tracking, with the prompt id
    and the generator's tokenizer), so one actor can keep their caches between requests."""

    prompt_id: str
    keys: list[int]
    ids: list[list[int] | None] | None
    vocab: str | None
    last: bool = False

    @staticmethod
    def of(prompt_id: str, tracking, vocab: str | None) -> Request | None:
        if tracking is None:
            return None
        return Request(prompt_id, list(tracking.keys), list(tracking.ids), vocab,
                       tracking.last)


# Reward actor handle -> its name. Generators are given names, not handles: handles in a
# restartable actor's constructor arguments live in the object store, and Ray warns that a
# restart fails if they are lost (ray-project/ray#53727).
_NAMES: dict = {}


def start_reward_actors(spec: RewardSpec, model_path: str | None,
                        strategies: list | None = None) -> list:
    """`pool_size` actors, or one per scheduling strategy (placement group bundles); each
    named, so a generator finds it with `reward_actors(names)`. None for a reward the
    generator scores in its own process (RewardSpec.local)."""
    if spec.local:
        return []
    opts = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus,
            "runtime_env": actor_runtime_env(spec.num_gpus)}
    actors = []
    for strategy in strategies or ["DEFAULT"] * spec.pool_size:
        name = f"specrej-reward-{uuid.uuid4().hex[:16]}"
        actor = RewardActor.options(**opts, name=name, scheduling_strategy=strategy).remote(
            spec, model_path)
        _NAMES[actor] = name
        actors.append(actor)
    return actors


def actor_runtime_env(num_gpus: float) -> dict:
    """Per-actor setup Ray does not do for us: actors with num_gpus=0 see every GPU of their
    node (and `device: auto` would take one), so CPU actors get none, wherever a node may
    have one. A Ray this process started with no GPU has none to hide, and can gain none:
    there the env stays empty, which spares each actor Ray's runtime-env set-up (a
    setup_worker.py interpreter and an agent call per worker: BENCHMARKS.md, a run's start)."""
    if num_gpus > 0 or not gpus_may_be_seen():
        return {}
    return {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


def gpus_may_be_seen() -> bool:
    """Whether a node of the connected Ray may have a GPU: it has one now, or it is a cluster
    this process joined (an autoscaler may add GPU nodes to it)."""
    return not started_here() or ray.cluster_resources().get("GPU", 0) > 0


def reward_names(actors: list) -> list[str]:
    """The names of actors made by start_reward_actors."""
    return [_NAMES[a] for a in actors]


def reward_actors(names: list[str]) -> list:
    """The reward actors with these names (in the job that started them)."""
    return [ray.get_actor(name) for name in names]


class RewardPool:
    """Splits a scoring request into batches over one reward's actors; a batch whose actor
    dies or times out is sent again to the next actor (ray's ActorPool would drop it)."""

    def __init__(self, actors: list, batch_size: int, timeout_s: float, attempts: int = 3,
                 metrics: Metrics | None = None):
        self.actors = actors
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.metrics = metrics
        self._next = itertools.cycle(range(len(actors)))

    def submit(self, prompts: list[str], responses: list[str],
               request: Request | None = None) -> dict:
        """Send every batch now; collect() waits for them. Returns ref -> (chunk, attempt,
        when sent, request). A named `request` goes whole to its prompt's own actor, which
        keeps the prompt's caches (and batches it itself)."""
        if request is not None:
            chunks = [(0, len(responses))]
        else:
            chunks = [(i, min(i + self.batch_size, len(responses)))
                      for i in range(0, len(responses), self.batch_size)]
        sent = time.monotonic()
        return {self._send(prompts, responses, c, request): (c, 1, sent, request)
                for c in chunks}

    def done(self, pending: dict) -> bool:
        """Whether every batch of a submit() has its answer, without waiting (a generator
        decodes other prompts meanwhile). A failed batch counts as answered: collect() sends
        it again, so it may still wait."""
        if not pending:
            return True
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        return len(ready) == len(pending)

    def collect(self, pending: dict, prompts: list[str], responses: list[str]) -> list[float]:
        scores: list[float] = [0.0] * len(responses)
        deadline = time.monotonic() + self.timeout_s
        # Latency: from the request's first send until every score is in (retries included).
        first_sent = min((sent for _, _, sent, _ in pending.values()), default=None)
        while pending:
            ref = next(iter(pending))
            chunk, attempt, _, request = pending.pop(ref)
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
                again = self._send(prompts, responses, chunk, request, attempt)
                pending[again] = (chunk, attempt, time.monotonic(), request)
            except (RayActorError, GetTimeoutError) as e:
                if attempt >= self.attempts:
                    raise RuntimeError(f"reward scoring failed {attempt} times: {e}") from e
                log.warning("reward batch failed (%s); resubmitting", type(e).__name__)
                again = self._send(prompts, responses, chunk, request, attempt + 1)
                pending[again] = (chunk, attempt + 1, time.monotonic(), request)
        if first_sent is not None and self.metrics is not None:
            self.metrics.scoring_latency(time.monotonic() - first_sent)
        return scores

    def _send(self, prompts: list[str], responses: list[str], chunk: tuple[int, int],
              request: Request | None = None, attempt: int = 1):
        if request is not None:
            # Its prompt's own actor first (it holds the caches), then the next ones.
            home = int(hashlib.sha256(request.prompt_id.encode()).hexdigest()[:8], 16)
            actor = self.actors[(home + attempt - 1) % len(self.actors)]
            return actor.score_request.remote(request, prompts[0], responses)
        actor = self.actors[next(self._next)]
        return actor.score.remote(prompts[chunk[0] : chunk[1]], responses[chunk[0] : chunk[1]])


class PoolsAnswer:
    """Every reward's scores for one request, in flight: `done()` looks without waiting,
    `result()` waits (resending failed batches); one row per response."""

    def __init__(self, pools: list[RewardPool], prompts: list[str], responses: list[str],
                 request: Request | None = None):
        self.pools, self.prompts, self.responses = pools, prompts, responses
        self.pending = [pool.submit(prompts, responses, request) for pool in pools]

    def done(self) -> bool:
        return all(pool.done(p) for pool, p in zip(self.pools, self.pending, strict=True))

    def result(self) -> list[list[float]]:
        columns = [pool.collect(p, self.prompts, self.responses)
                   for pool, p in zip(self.pools, self.pending, strict=True)]
        return [list(row) for row in zip(*columns, strict=True)]


def score_all(
    pools: list[RewardPool], prompts: list[str], responses: list[str],
    request: Request | None = None,
) -> list[list[float]]:
    """Every reward's scores, computed concurrently; one row per response."""
    return PoolsAnswer(pools, prompts, responses, request).result()
