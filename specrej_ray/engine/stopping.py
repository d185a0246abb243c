"""End-of-sequence and stop-string detection on a growing token list."""

from __future__ import annotations

# transformers' clean_up_tokenization deletes the space that starts a pattern of at most 4
# characters (" n't"): one still unfinished at the end of a text is at most 3 characters.
CLEAN_UP_TAIL = 3


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

    def settled(self, tokens: list[int]) -> str:
        """A prefix of the response text that every continuation of these tokens keeps (what
        bounds are computed on): the text less an unfinished multi-byte character at its end
        (decoded as U+FFFD), less the tail that a stop string completed later would cut, or
        that the decoder's space clean-up (" ," -> ",", " n't" -> "n't") may still change."""
        text = self._cut(self.tokenizer.decode(tokens, skip_special_tokens=True)
                         .rstrip("\ufffd"))
        tail = max((len(s) - 1 for s in self.stop), default=0)
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            tail = max(tail, CLEAN_UP_TAIL)
        return text[: max(0, len(text) - tail)]

    def text(self, tokens: list[int]) -> str:
        """The response text: special tokens dropped, cut before the first stop string."""
        return self._cut(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _cut(self, text: str) -> str:
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
