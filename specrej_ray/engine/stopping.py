"""End-of-sequence and stop-string detection on a growing token list."""

from __future__ import annotations


class StopChecker:
    """Decides whether a candidate is finished after each new token.

    Stop strings are checked on the decoded tail only (a window wide enough for the longest
    stop string), so a step costs O(window), not O(response).
    """

    def __init__(self, tokenizer, eos_ids: set[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stop = stop
        self.window = max((len(s) for s in stop), default=0) + 8

    def reason(self, tokens: list[int]) -> str | None:
        if tokens[-1] in self.eos_ids:
            return "eos"
        if self.stop:
            tail = self.tokenizer.decode(tokens[-self.window :], skip_special_tokens=True)
            if any(s in tail for s in self.stop):
                return "stop"
        return None

    def text(self, tokens: list[int]) -> str:
        """The response text: special tokens dropped, cut before the first stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
        return text[:cut]


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids
