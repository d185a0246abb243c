"""A reward answering one prompt's requests at a time: incrementally where it can.

The engine names whose responses a request holds (engine.scoring.Tracking): the prompt, each
candidate's index and, where the reward shares the generator's tokenizer, the generated token
ids. A model reward (likelihood or causal classifier) then keeps each candidate's cache
between requests (reward.incremental); any other reward, or `reward.incremental: false`,
scores each request in full. Either way it counts the reward-model tokens it processed and
those full re-scoring would have, so a run can report both.
"""

from __future__ import annotations

from typing import Any

from specrej_ray.reward.base import vocab_fingerprint
from specrej_ray.reward.streams import Item, Stats, Stream


class TrackedReward:
    def __init__(self, reward: Any, incremental: bool = True, cache_bytes: int = 1 << 30) -> None:
        self.reward, self.name = reward, reward.name
        self.kind = getattr(reward, "kind", None)  # "likelihood" / "classifier" / None
        model = getattr(reward, "model", None)
        self.vocab = vocab_fingerprint(reward.tokenizer) if self.kind else None
        self.scorer = _scorer(reward, model, cache_bytes) if incremental and self.kind else None
        self.stats = self.scorer.stats if self.scorer is not None else Stats()

    @property
    def incremental(self) -> bool:
        return self.scorer is not None

    def reset(self) -> None:
        """Forget every kept cache and zero the counters."""
        if self.scorer is not None:
            self.scorer.prompts.clear()
            self.scorer.stats = Stats()
        self.stats = self.scorer.stats if self.scorer is not None else Stats()

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Stateless scoring, as the wrapped reward does it."""
        return self.reward.score(prompts, responses)

    def score_request(self, prompt_id: str, prompt: str, responses: list[str],
                      keys: list[int], ids: list[list[int] | None] | None = None,
                      vocab: str | None = None, last: bool = False) -> list[float]:
        """One prompt's responses; `ids` (the generator's tokens, tokenizer `vocab`) are used
        only when this reward's tokenizer is the same."""
        if self.kind is None:
            return self.reward.score([prompt] * len(responses), responses)
        same = ids is not None and vocab is not None and vocab == self.vocab
        streams = [self.reward.stream(prompt, r, i if same else None)
                   for r, i in zip(responses, ids if same else [None] * len(responses),
                                   strict=True)]

        def full(picked: list[int]) -> list[float]:
            return self._full(prompt, [responses[i] for i in picked],
                              [streams[i] for i in picked])

        if self.scorer is None:
            self.stats.requests += 1
            cost = sum(len(s.held) + len(s.suffix) for s in streams if s is not None)
            self.stats.tokens += cost
            self.stats.full_tokens += cost
            return full(list(range(len(responses))))
        items = [Item(k, s) for k, s in zip(keys, streams, strict=True)]
        return self.scorer.score(prompt_id, items, full, last)

    def _full(self, prompt: str, responses: list[str], streams: list[Stream | None]):
        """A full pass: over the streams where there are, over the text elsewhere."""
        out = [0.0] * len(responses)
        have = [i for i, s in enumerate(streams) if s is not None]
        text = [i for i, s in enumerate(streams) if s is None]
        if have:
            for i, v in zip(have, self.reward.score_streams([streams[i] for i in have]),
                            strict=True):
                out[i] = v
        if text:
            for i, v in zip(text, self.reward.score([prompt] * len(text),
                                                    [responses[i] for i in text]), strict=True):
                out[i] = v
        return out


def _scorer(reward: Any, model: Any, cache_bytes: int):
    """The incremental scorer of a model reward, or None where its model cannot keep a cache.
    Imported here: torch and transformers are a model reward's, never a callable's."""
    from specrej_ray.reward.incremental import IncrementalScorer

    if not IncrementalScorer.supports(model, reward.kind):
        return None
    return IncrementalScorer(model, reward.kind, _pad(reward), cache_bytes, reward.batch_size,
                             getattr(reward, "label_index", 0))


def _pad(reward: Any) -> int:
    """The id a classifier pools past (its config's, which its own forward uses), or the
    tokenizer's pad for a likelihood reward (only ever masked)."""
    if reward.kind == "classifier":
        return int(reward.model.config.get_text_config().pad_token_id)
    return int(reward.pad)
