"""Reward models: classifier RM, LM likelihood, python callable; all score partial text."""

from __future__ import annotations

from specrej_ray.reward.base import Reward, RewardError, batches_by_length, format_for_scoring
from specrej_ray.reward.callable import CallableReward
from specrej_ray.spec import RewardSpec

# The model rewards (torch, transformers: 6 s to import here) come from their own modules, and
# build_reward imports them: a reward actor with a Python callable never loads them.
__all__ = [
    "CallableReward",
    "Reward",
    "RewardError",
    "batches_by_length",
    "build_reward",
    "format_for_scoring",
]


def build_reward(spec: RewardSpec, model_path: str | None) -> Reward:
    """The reward of a spec; model_path is spec.model already resolved to a loadable source."""
    if spec.type == "callable":
        return CallableReward(spec.function or "")
    if model_path is None:
        raise RewardError(f"reward.model is required when reward.type is {spec.type}")
    from specrej_ray.models import loader as models
    from specrej_ray.reward.classifier import ClassifierReward
    from specrej_ray.reward.likelihood import LMLikelihoodReward

    load = models.load_classifier if spec.type == "classifier" else models.load_causal_lm
    model, tokenizer = load(
        model_path,
        dtype=spec.dtype,
        device=spec.device,
        trust_remote_code=spec.trust_remote_code,
        revision=spec.revision,
        field="reward.model",
        source=spec.model,
    )
    name = f"{spec.type}({spec.model})"
    common = dict(
        name=name,
        batch_size=spec.batch_size,
        use_chat_template=spec.chat_template,
        max_length=spec.max_length,
    )
    if spec.type == "classifier":
        return ClassifierReward(model, tokenizer, label_index=spec.label_index, **common)
    return LMLikelihoodReward(model, tokenizer, **common)

