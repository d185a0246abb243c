"""What a reward is, and the text and batching helpers every model-backed reward shares."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol, runtime_checkable

from specrej_ray.errors import RewardError


@runtime_checkable
class Reward(Protocol):
    """Scores (prompt, response so far) pairs; responses may be partial."""

    name: str

    def score(self, prompts: list[str], responses: list[str]) -> list[float]: ...


def batches_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Index batches of similar length, longest first, so padding is small and an
    out-of-memory error shows on the first batch rather than the last."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_for_scoring(
    tokenizer: Any, prompt: str, response: str, use_chat_template: bool
) -> tuple[str, str]:
    """(context_text, full_text) for one pair.

    With a chat template, context is the user turn plus the generation prompt and full is the
    closed conversation [user, assistant] (what reward models are trained on). Without one,
    context is prompt + newline and full is context + response. Likelihood rewards must not
    use full: templates may append end-of-turn tokens after the response.
    """
    if use_chat_template and has_chat_template(tokenizer):
        user = [{"role": "user", "content": prompt}]
        context = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            [*user, {"role": "assistant", "content": response}], tokenize=False
        )
        return context, full
    context = prompt + "\n"
    return context, context + response


def uses_template(tokenizer: Any, use_chat_template: bool) -> bool:
    return use_chat_template and has_chat_template(tokenizer)


def encode(tokenizer: Any, text: str, templated: bool) -> list[int]:
    """Token ids of text; templated text already carries its special tokens (e.g. BOS)."""
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def check_pairs(name: str, prompts: list[str], responses: list[str]) -> None:
    """One prompt per response: a scorer must not silently zip lists of different lengths."""
    if len(prompts) != len(responses):
        raise RewardError(
            f"reward {name}: got {len(prompts)} prompts and {len(responses)} responses; "
            "pass one prompt per response"
        )


def vocab_fingerprint(tokenizer: Any) -> str:
    """A hash of a tokenizer's vocabulary: equal fingerprints map ids to the same tokens, so
    a reward may take the generator's token ids instead of re-encoding its text."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
