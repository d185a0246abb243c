"""One factory for the generator's engine: every caller (the generator actor, bench, tune, the
in-process runs) gets its backend here, as an engine.protocol.GenerationEngine.

Backends: `hf`, the hand-written transformers engine (engine/hf/), exact and seeded: the CPU
default and the reference; `vllm`, the algorithm inside vLLM's batch (engine/vllm/, the
`vllm` extra). A backend joins BACKENDS, make_engine and the property suite
(tests/test_backend_properties.py). torch is imported when an engine is built.
"""

from __future__ import annotations

import importlib.util

from specrej_ray.engine.protocol import GenerationEngine
from specrej_ray.job.prepare import self_likelihood
from specrej_ray.models.loader import ModelError
from specrej_ray.spec import JobSpec

BACKENDS = ("hf", "vllm")


def overlaps_scoring(setting: str, device: str) -> bool:
    """Whether decoding goes on while rewards score (cluster.overlap_scoring)."""
    return setting == "on" or (setting == "auto" and str(device).startswith("cuda"))


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def pick_backend(setting: str, has_gpu: bool, tensor_parallel: int = 1) -> str:
    """generator.engine: auto is vllm where it is installed and the generator has a GPU (or
    several: tensor parallelism is vLLM's)."""
    if setting != "auto":
        return setting
    return "vllm" if (has_gpu or tensor_parallel > 1) and vllm_installed() else "hf"


def make_engine(spec: JobSpec, model_path: str, backend: str | None = None) -> GenerationEngine:
    """The spec's generator, loaded from its resolved path, in the engine its
    generator.engine picks (or `backend`)."""
    import torch

    has_gpu = torch.cuda.is_available() and spec.generator.device != "cpu"
    backend = backend or pick_backend(spec.generator.engine, has_gpu,
                                      spec.generator.tensor_parallel_size)
    if backend not in BACKENDS:
        raise ValueError(f"unknown generator backend {backend!r}; one of {', '.join(BACKENDS)}")
    if backend == "vllm":
        if not vllm_installed():
            raise ModelError("generator.engine: vllm, but vLLM is not installed here; "
                             "pip install 'specrej-ray[vllm]' (or use engine: hf)")
        from specrej_ray.engine.vllm.build import build_vllm_engine

        return build_vllm_engine(spec, model_path, has_gpu, sampling_params(spec),
                                 search_params(spec, budget_tokens=0), reward_set(spec))
    from specrej_ray.models.loader import load_causal_lm

    g = spec.generator
    model, tokenizer = load_causal_lm(model_path, dtype=g.dtype, device=g.device,
                                      trust_remote_code=g.trust_remote_code, revision=g.revision)
    return build_engine(spec, model, tokenizer)


def build_engine(spec: JobSpec, model, tokenizer):
    """The spec's engine on a loaded generator, its KV budget planned on the model's device
    (the generator actor, bench, tune and the in-process paths all build it here)."""
    from specrej_ray.engine.hf.engine import Engine
    from specrej_ray.engine.hf.memory import plan_memory
    from specrej_ray.engine.hf.model_runner import ModelRunner

    s = spec.search
    runner = ModelRunner(model)  # measures what a token of its cache really takes
    plan = plan_memory(model, s.kv_budget_gb, s.gpu_memory_utilization,
                       runner.bytes_per_token)
    engine = Engine(model, tokenizer, sampling_params(spec), search_params(spec,
                    plan.budget_tokens), reward_set(spec), runner=runner)
    engine.memory_plan = plan
    return engine


def sampling_params(spec: JobSpec):
    from specrej_ray.engine.sampling import SamplingParams

    g = spec.generator.sampling
    return SamplingParams(g.temperature, g.top_p, g.top_k, g.max_new_tokens, tuple(g.stop))


def search_params(spec: JobSpec, budget_tokens: int):
    """The spec's search settings; `budget_tokens`: the hf engine's KV budget (vLLM sizes
    its own cache)."""
    from specrej_ray.data.formats import kept_by
    from specrej_ray.engine.task import SearchParams
    from specrej_ray.job.draws import draw_plan

    s = spec.search
    return SearchParams(
        n=s.n_or_none,
        alpha=s.effective_alpha,
        decision_tokens=tuple(s.decision_tokens) if s.decision_tokens else None,
        min_decision_tokens=s.min_decision_tokens,
        budget_tokens=budget_tokens,
        seed=spec.seed,
        overlap_tokens=spec.cluster.overlap_max_tokens,
        branch=s.branch,
        draws=draw_plan(spec),
        bounds_every=s.bounds_every if s.bounds else 0,
        keep=kept_by(spec.output),
    )


def reward_set(spec: JobSpec):
    from specrej_ray.engine.scoring import RewardSet

    return RewardSet(tuple(r.label for r in spec.reward), tuple(r.weight for r in spec.reward),
                     spec.search.reward_combine, self_likelihood(spec),
                     tuple(r.local for r in spec.reward))
