"""A job spec's engine, rewards and prompts in this process, without Ray.

`bench`, `tune` and the Ray-overhead measurement run the same engine the generator actor
runs, built from the same spec, so their figures describe what `run` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specrej_ray.data.prompts import Prompt, RowProblem
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.scoring import later
from specrej_ray.engine.task import EngineTask, ScoreFn
from specrej_ray.job.engines import make_engine, overlaps_scoring
from specrej_ray.job.local_rewards import local_scores
from specrej_ray.job.prepare import (
    PromptTask,
    prepare_prompts,
    resolve_generator,
    resolve_rewards,
)
from specrej_ray.reward import build_reward
from specrej_ray.reward.base import vocab_fingerprint
from specrej_ray.reward.tracked import TrackedReward
from specrej_ray.spec import JobSpec


@dataclass
class LocalJob:
    spec: JobSpec
    engine: Engine
    rewards: list[TrackedReward | None]  # None: scored by the engine (RewardSpec.local)
    prompts: list[Prompt]
    tasks: list[PromptTask]
    problems: list[RowProblem] = field(default_factory=list)  # the rows skipped, and why

    def scorer(self, prompt_id: str, prompt_text: str) -> ScoreFn:
        """The rewards' scores for responses to one prompt: a row per response, a score per
        reward (only the `rewards` asked for, when the engine scores the others itself);
        with `tracking`, each reward keeps the candidates' caches between requests."""
        vocab = vocab_fingerprint(self.engine.tokenizer)

        def score(responses: list[str], rewards=None, tracking=None) -> list[list[float]]:
            picked = self.rewards if rewards is None else [self.rewards[j] for j in rewards]
            if tracking is None:
                columns = [r.score([prompt_text] * len(responses), responses) for r in picked]
            else:
                columns = [r.score_request(prompt_id, prompt_text, responses, tracking.keys,
                                           tracking.ids, vocab, tracking.last) for r in picked]
            return [[float(s) for s in row] for row in zip(*columns, strict=True)]

        return score

    def engine_tasks(self, limit: int | None = None) -> list[EngineTask]:
        """The prompts as the generator actor makes them, decoding past a decision as
        cluster.overlap_scoring says. The rewards run in this process: on a GPU their scores
        are polled from the scoring thread while the batch decodes; on the CPU they are
        asked for where they are needed (they would share the engine's cores, job.threads)."""
        tasks = self.tasks if limit is None else self.tasks[:limit]
        device = str(self.engine.device)
        overlap = overlaps_scoring(self.spec.cluster.overlap_scoring, device)
        tasks = [(t, self.scorer(t.prompt_id, t.text)) for t in tasks]
        return [EngineTask(t.prompt_id, t.input_ids, score,
                           None if device.startswith("cpu") else later(score), t.self_scored,
                           local=local_scores(self.spec, t), overlap=overlap)
                for t, score in tasks]

    def reset_rewards(self) -> None:
        """Forget every kept cache and zero the counters (a new arm starts cold)."""
        for r in self.rewards:
            if r is not None:
                r.reset()

    def reward_stats(self) -> list[dict]:
        return [{"name": r.name, "incremental": r.incremental, **asdict(r.stats)}
                for r in self.rewards if r is not None]


def load_local(spec: JobSpec) -> LocalJob:
    """Resolve and load the spec's models here; prompts that `run` would skip are skipped."""
    gen_path = resolve_generator(spec)
    prompts, tasks, problems, _source = prepare_prompts(spec, gen_path)
    rewards = [None if r.local else
               TrackedReward(build_reward(r, path), r.incremental, int(r.cache_gb * 2**30))
               for r, path in zip(spec.reward, resolve_rewards(spec), strict=True)]
    return LocalJob(spec, make_engine(spec, gen_path), rewards, prompts, tasks, problems)
