"""One factory for the generator's engine: every caller (the generator actor, bench, tune, the
in-process runs) gets its backend here, as an engine.protocol.GenerationEngine.

Backends: `hf`, the hand-written transformers engine (engine/hf/), exact and seeded: the CPU
default and the reference. A second backend joins BACKENDS, make_engine and the property
suite (tests/test_backend_properties.py). torch is imported when an engine is built.
"""

from __future__ import annotations

from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.job.prepare import self_likelihood
from specrej_ray.spec import JobSpec

BACKENDS = ("hf",)


def overlaps_scoring(setting: str, device: str) -> bool:
    """Whether decoding goes on while rewards score (cluster.overlap_scoring)."""
    return setting == "on" or (setting == "auto" and str(device).startswith("cuda"))


def make_engine(spec: JobSpec, model_path: str, backend: str = "hf") -> GenerationEngine:
    """The spec's generator, loaded from its resolved path, in an engine of `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown generator backend {backend!r}; one of {', '.join(BACKENDS)}")
    from specrej_ray.models.loader import load_causal_lm

    g = spec.generator
    model, tokenizer = load_causal_lm(model_path, dtype=g.dtype, device=g.device,
                                      trust_remote_code=g.trust_remote_code, revision=g.revision)
    return build_engine(spec, model, tokenizer)


def build_engine(spec: JobSpec, model, tokenizer):
    """The spec's engine on a loaded generator, its KV budget planned on the model's device
    (the generator actor, bench, tune and the in-process paths all build it here)."""
    from specrej_ray.engine.hf.engine import Engine, RewardSet
    from specrej_ray.engine.hf.memory import plan_memory
    from specrej_ray.engine.hf.model_runner import ModelRunner
    from specrej_ray.engine.hf.sampling import SamplingParams
    from specrej_ray.engine.task import SearchParams

    s, g = spec.search, spec.generator.sampling
    runner = ModelRunner(model)  # measures what a token of its cache really takes
    plan = plan_memory(model, s.kv_budget_gb, s.gpu_memory_utilization,
                       runner.bytes_per_token)
    sampling = SamplingParams(g.temperature, g.top_p, g.top_k, g.max_new_tokens, tuple(g.stop))
    search = SearchParams(
        n=s.n_or_none,
        alpha=s.effective_alpha,
        decision_tokens=tuple(s.decision_tokens) if s.decision_tokens else None,
        min_decision_tokens=s.min_decision_tokens,
        budget_tokens=plan.budget_tokens,
        seed=spec.seed,
        overlap_tokens=spec.cluster.overlap_max_tokens,
    )
    rewards = RewardSet(tuple(r.label for r in spec.reward),
                        tuple(r.weight for r in spec.reward), s.reward_combine,
                        self_likelihood(spec))
    engine = Engine(model, tokenizer, sampling, search, rewards, runner=runner)
    engine.memory_plan = plan
    return engine
