"""The generator actor: one model on one device, running speculative rejection per prompt."""

from __future__ import annotations

import ray

from specrej_ray.calibrate import score_prefixes, table_json
from specrej_ray.distributed.metrics import Metrics
from specrej_ray.distributed.resources import actor_runtime_env
from specrej_ray.distributed.reward_pool import PoolsAnswer, RewardPool, score_all
from specrej_ray.engine.engine import Choice, EngineTask
from specrej_ray.engine.sequence import PromptResult
from specrej_ray.engine.task_feed import TaskFeed
from specrej_ray.job import PromptTask, build_engine
from specrej_ray.runtime import set_torch_threads
from specrej_ray.spec import JobSpec


def engine_stats(stats) -> dict:
    """What run.json records of a generator's engine (EngineStats) at the end of a run."""
    return {"decode_steps": stats.decode_steps, "prompts": stats.prompts,
            "mean_rows": round(stats.mean_rows, 2), "occupancy": round(stats.occupancy, 4),
            "allocated": round(stats.allocated, 4), "slack": round(stats.slack, 4),
            "peak_kv_bytes": stats.peak_kv_bytes, "oom_backoffs": stats.oom_backoffs,
            "discarded_tokens": stats.discarded_tokens, "replayed_tokens": stats.replayed_tokens,
            "stalls": stats.stalls, "evictions": stats.evictions}


def overlaps_scoring(setting: str, device) -> bool:
    """Whether decoding goes on while rewards score (cluster.overlap_scoring)."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


# Restarts are unlimited: every death costs the shard it was running one of its
# cluster.max_shard_retries, which bounds them; a fixed cap would let one bad shard
# leave no generator for the rest of the job. Methods run in threads: the driver sends a
# generator its next shard while the current one decodes (SHARDS_IN_FLIGHT), and info()
# pings answer meanwhile; one engine thread (TaskFeed) runs them all in one batch.
@ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=4)
class GeneratorActor:
    def __init__(self, spec: JobSpec, model_path: str, reward_actors: list[list]) -> None:
        from specrej_ray.models import load_causal_lm

        self.threads = set_torch_threads(spec.generator.threads)
        g = spec.generator
        model, tokenizer = load_causal_lm(model_path, dtype=g.dtype, device=g.device,
                                          trust_remote_code=g.trust_remote_code,
                                          revision=g.revision)
        self.pools = [RewardPool(actors, r.batch_size, spec.cluster.call_timeout_s,
                                 metrics=Metrics(spec.name))
                      for actors, r in zip(reward_actors, spec.reward, strict=True)]
        self.engine = build_engine(spec, model, tokenizer)
        self.refill = spec.search.refill
        self.overlap = overlaps_scoring(spec.cluster.overlap_scoring, self.engine.model.device)
        self.feed = TaskFeed(self._run)

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {"threads": self.threads, "device": str(self.engine.model.device),
                "budget_tokens": self.engine.budget,
                "memory_plan": self.engine.memory_plan.as_dict(),
                "node_id": ctx.get_node_id(), "placement_group": ctx.get_placement_group_id(),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "engine": engine_stats(self.engine.stats)}

    def run_shard(self, tasks: list[PromptTask],
                  choice: Choice | None = None) -> list[PromptResult]:
        """The shard's results once its prompts are done; they share the running batch with
        the prompts of any other shard this generator is running (refill across shards).
        `choice`: the alpha and schedule calibration chose (schedule: auto)."""
        return self.feed.submit([self._task(t, choice) for t in tasks])

    def calibrate_shard(self, tasks: list[PromptTask],
                        grid: list[int]) -> tuple[list[PromptResult], dict[str, dict]]:
        """schedule: auto's calibration prompts: Best-of-N (their answers are exact), then
        every candidate's rewards at the grid's lengths (calibrate.score_prefixes)."""
        engine_tasks = [self._task(t, Choice(0.0, None)) for t in tasks]
        results = self.feed.submit(engine_tasks)
        tables = {t.prompt_id: table_json(score_prefixes(self.engine, t, r, grid))
                  for t, r in zip(engine_tasks, results, strict=True)}
        return results, tables

    def _task(self, t: PromptTask, choice: Choice | None) -> EngineTask:
        return EngineTask(t.prompt_id, t.input_ids, self._scorer(t.text),
                          self._submitter(t.text) if self.overlap else None, t.self_scored,
                          choice)

    def _run(self, tasks, on_result, more) -> None:
        self.engine.run(tasks, refill=self.refill, on_result=on_result, more=more)

    def _scorer(self, prompt: str):
        return lambda responses, rewards=None: score_all(
            self._pools(rewards), [prompt] * len(responses), responses)

    def _submitter(self, prompt: str):
        # Decisions go out to the reward actors while the batch keeps decoding.
        return lambda responses, rewards=None: PoolsAnswer(
            self._pools(rewards), [prompt] * len(responses), responses)

    def _pools(self, rewards) -> list:
        """The reward pools asked for (all, unless the engine scores some itself)."""
        return self.pools if rewards is None else [self.pools[j] for j in rewards]


def start_generator(spec: JobSpec, model_path: str, reward_actors: list[list],
                    strategy: object = "DEFAULT"):
    """One generator actor; `strategy` may put it in a placement group bundle."""
    c = spec.cluster
    opts = {"num_cpus": c.cpus_per_generator, "num_gpus": c.gpus_per_generator,
            "runtime_env": actor_runtime_env(c.gpus_per_generator),
            "scheduling_strategy": strategy}
    return GeneratorActor.options(**opts).remote(spec, model_path, reward_actors)
