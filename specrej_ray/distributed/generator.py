"""The generator actor: one model on one device, running speculative rejection per prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import ray

from specrej_ray.data.prompts import PromptTask
from specrej_ray.distributed.metrics import Metrics
from specrej_ray.distributed.reward_pool import (
    PoolsAnswer,
    Request,
    RewardPool,
    actor_runtime_env,
    reward_actors,
    reward_names,
    score_all,
)
from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.engine.task import Choice, EngineTask
from specrej_ray.engine.task_feed import TaskFeed
from specrej_ray.job.engines import make_engine, overlaps_scoring
from specrej_ray.job.local_rewards import local_scores
from specrej_ray.job.runtime import set_torch_threads
from specrej_ray.job.shards import ShardOutput
from specrej_ray.job.threads import generator_threads
from specrej_ray.quality.audit import record as audit_record
from specrej_ray.quality.audit import shadow_id
from specrej_ray.quality.calibrate import score_prefixes, table_json
from specrej_ray.reward.base import vocab_fingerprint
from specrej_ray.spec import JobSpec

BEST_OF_N = Choice(0.0, None, bounds=False)  # every candidate to its end


def engine_stats(stats) -> dict:
    """What run.json records of a generator's engine (EngineStats) at the end of a run."""
    return {"decode_steps": stats.decode_steps, "prompts": stats.prompts,
            "mean_rows": round(stats.mean_rows, 2), "occupancy": round(stats.occupancy, 4),
            "allocated": round(stats.allocated, 4), "slack": round(stats.slack, 4),
            "peak_kv_bytes": stats.peak_kv_bytes, "oom_backoffs": stats.oom_backoffs,
            "discarded_tokens": stats.discarded_tokens, "replayed_tokens": stats.replayed_tokens,
            "stalls": stats.stalls, "evictions": stats.evictions, "pruned": stats.pruned,
            "bounds_checks": stats.bounds_checks,
            "bounds_seconds": round(stats.bounds_seconds, 3)}


def _setting(choice: Choice) -> dict:
    """What a shard ran with, as audit records and calibration.json name it."""
    tokens = choice.decision_tokens
    return {"alpha": choice.alpha, "schedule": list(tokens) if tokens else "memory"}


# Restarts are unlimited: every death costs the shard it was running one of its
# cluster.max_shard_retries, which bounds them; a fixed cap would let one bad shard
# leave no generator for the rest of the job. Methods run in threads: the driver sends a
# generator its next shard while the current one decodes (SHARDS_IN_FLIGHT), and info()
# pings answer meanwhile; one engine thread (TaskFeed) runs them all in one batch.
@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class GeneratorActor:
    def __init__(self, spec: JobSpec, model_path: str, reward_names: list[list[str]]) -> None:
        self.spec = spec
        self.threads = set_torch_threads(generator_threads(spec))
        self.pools = [RewardPool(actors, r.batch_size, spec.cluster.call_timeout_s,
                                 metrics=Metrics(spec.name))
                      for actors, r in zip(map(reward_actors, reward_names), spec.reward,
                                           strict=True)]
        try:
            self.engine: GenerationEngine = make_engine(spec, model_path)
        except Exception as e:
            # Said by info(), the driver's first call: an actor whose creation fails dies
            # with Ray's text of the error and traceback, not ours in one line.
            self.failed: Exception | None = e
            return
        self.failed = None
        # rewards with this vocabulary take ids
        self.vocab = vocab_fingerprint(self.engine.tokenizer)
        self.refill = spec.search.refill
        self.overlap = overlaps_scoring(spec.cluster.overlap_scoring, self.engine.device)
        self.feed = TaskFeed(self._run)

    def info(self) -> dict:
        if self.failed is not None:
            raise self.failed
        ctx = ray.get_runtime_context()
        plan = getattr(self.engine, "memory_plan", None)  # how the hf engine sized its cache
        vllm = getattr(self.engine, "vllm", None)  # the vLLM backend's own counters
        return {"threads": self.threads, "device": self.engine.device,
                "backend": self.engine.backend,
                "budget_tokens": self.engine.kv_capacity_tokens(),
                "memory_plan": plan.as_dict() if plan is not None else None,
                "node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "engine": engine_stats(self.engine.stats),
                "vllm": vllm.as_dict() if vllm is not None else None}

    def run_shard(self, tasks: list[PromptTask], choice: Choice | None = None,
                  audit: Sequence[str] = (), grid: Sequence[int] = ()) -> ShardOutput:
        """The shard's results once its prompts are done; they share the running batch with
        the prompts of any other shard this generator is running (refill across shards).
        `choice`: the alpha and schedule calibration chose (schedule: auto). The prompts in
        `audit` also run a shadow Best-of-N (audit.py) whose record comes back; with `grid`
        the shadow's rewards are scored at its lengths as well (calibration data)."""
        run = [self._task(t, choice) for t in tasks]
        shadows = [replace(self._task(t, BEST_OF_N, key=shadow_id(t.prompt_id)),
                           prompt_id=shadow_id(t.prompt_id), samples_of=t.prompt_id)
                   for t in tasks if t.prompt_id in audit]
        results = self.feed.submit(run + shadows)
        out = ShardOutput(results[: len(run)])
        setting = _setting(choice or self.engine_choice)
        by_id = {r.prompt_id: r for r in out.results}
        for task, shadow in zip(shadows, results[len(run):], strict=True):
            pid = task.samples_of
            out.audits.append(audit_record(by_id[pid], shadow, setting))
            if grid:
                out.tables[pid] = table_json(score_prefixes(self.engine, task, shadow, grid))
        return out

    def calibrate_shard(self, tasks: list[PromptTask], grid: list[int]) -> ShardOutput:
        """schedule: auto's calibration prompts: Best-of-N (their answers are exact), then
        every candidate's rewards at the grid's lengths (calibrate.score_prefixes)."""
        engine_tasks = [self._task(t, BEST_OF_N) for t in tasks]
        results = self.feed.submit(engine_tasks)
        return ShardOutput(results, {
            t.prompt_id: table_json(score_prefixes(self.engine, t, r, grid))
            for t, r in zip(engine_tasks, results, strict=True)})

    @property
    def engine_choice(self) -> Choice:
        s = self.engine.search
        return Choice(s.alpha, s.decision_tokens)

    def _task(self, t: PromptTask, choice: Choice | None, key: str | None = None) -> EngineTask:
        """`key`: the id its rewards keep its candidates' caches under (default its own)."""
        key = key or t.prompt_id
        # Answers are always polled (the batch never waits for the reward actors while a row
        # can move); overlap_scoring says whether a prompt's live rows decode past a
        # decision meanwhile.
        return EngineTask(t.prompt_id, t.input_ids, self._scorer(key, t.text),
                          self._submitter(key, t.text), t.self_scored, choice,
                          local=local_scores(self.spec, t), overlap=self.overlap)

    def _run(self, tasks, on_result, more) -> None:
        self.engine.run(tasks, refill=self.refill, on_result=on_result, more=more)

    def _scorer(self, key: str, prompt: str):
        return lambda responses, rewards=None, tracking=None: score_all(
            self._pools(rewards), [prompt] * len(responses), responses,
            Request.of(key, tracking, self.vocab))

    def _submitter(self, key: str, prompt: str):
        # Scores go out to the reward actors while the batch keeps decoding.
        return lambda responses, rewards=None, tracking=None: PoolsAnswer(
            self._pools(rewards), [prompt] * len(responses), responses,
            Request.of(key, tracking, self.vocab))

    def _pools(self, rewards) -> list:
        """The reward pools asked for (all, unless the engine scores some itself)."""
        return self.pools if rewards is None else [self.pools[j] for j in rewards]


def tensor_parallel_env(k: int) -> dict:
    """A tensor-parallel generator's runtime env: vLLM's k workers take one GPU each, from
    bundles 0..k-1 of the generator's placement group (placement.generator_bundles). The
    actor keeps the node's GPUs visible: its workers inherit this env."""
    return {"env_vars": {"VLLM_RAY_PER_WORKER_GPUS": "1",
                         "VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, range(k)))}}


def start_generator(spec: JobSpec, model_path: str, pools: list[list],
                    strategy: object = "DEFAULT"):
    """One generator actor; `strategy` may put it in a placement group bundle."""
    return GeneratorActor.options(**generator_options(spec, strategy)).remote(
        spec, model_path, [reward_names(pool) for pool in pools])


def generator_options(spec: JobSpec, strategy: object = "DEFAULT") -> dict:
    """The generator actor's Ray options: its CPUs and GPU, or with tensor parallelism none
    of its own (its vLLM workers take the GPUs of its bundles)."""
    c, k = spec.cluster, spec.generator.tensor_parallel_size
    if k > 1:
        return {"num_cpus": c.cpus_per_generator, "num_gpus": 0,
                "runtime_env": tensor_parallel_env(k), "scheduling_strategy": strategy}
    return {"num_cpus": c.cpus_per_generator, "num_gpus": c.gpus_per_generator,
            "runtime_env": actor_runtime_env(c.gpus_per_generator),
            "scheduling_strategy": strategy}
