"""Engines on the tiny model for tests, and KV budgets stated as the room rows get."""

from __future__ import annotations

from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.sampling import SamplingParams
from specrej_ray.engine.task import SearchParams
from specrej_ray.search.bounds import Keep
from specrej_ray.search.reservation import ceil_div


def budget_for(model, slots: int) -> int:
    """The smallest KV budget that leaves `slots` token slots beside the scheduler's
    headroom (one tensor of one layer: budget / (2 x layers), see engine.hf.scheduler)."""
    layers = model.config.num_hidden_layers
    budget = slots
    while budget - ceil_div(budget, 2 * layers) < slots:
        budget += 1
    return budget


def engine(lm, *, n=8, alpha=0.5, decisions=(6, 12), min_decision=4, budget=10**6,
           max_new=20, stop=(), temperature=1.0, top_p=1.0, top_k=0, seed=0, rewards=None,
           overlap=4, model=None, ignore_eos=False, bounds_every=0, keep=None, draws=None,
           branch=False) -> Engine:
    m, tok = lm
    sampling = SamplingParams(temperature, top_p, top_k, max_new, tuple(stop), ignore_eos)
    search = SearchParams(n, alpha, decisions, min_decision, budget, seed, overlap,
                          bounds_every, keep or Keep(), draws, branch)
    return Engine(model or m, tok, sampling, search, rewards)


# Every generator backend the property suite runs (tests/test_backend_properties.py): a name
# and how to build it on the tiny model with the settings of `engine` above. A new backend
# joins by adding its builder here.
BUILDERS = {"hf": engine}


def _with_vllm(builders: dict) -> dict:
    """The vLLM backend joins where vLLM is installed (make setup installs it)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return builders
    from tests.helpers.vllm_engines import vllm_engine

    return {**builders, "vllm": vllm_engine}


BUILDERS = _with_vllm(BUILDERS)
