"""Incremental reward scoring: a reward model's KV cache kept per candidate between decisions.

Full re-scoring runs the reward model over prompt + partial response at every decision, so a
prompt of P tokens decided every D tokens costs about 2P/D + 2 reward tokens per generated one.
Here each prompt's candidates keep their cache between requests: the prompt is prefilled once
and shared (computed once, copied to each candidate's row), and a request feeds each candidate
only the tokens it gained since it was last scored (plus, for a classifier, the chat
template's closing tokens, which are cropped away again). Candidates a request does not name
any more (rejected, or finished and scored) lose their rows; a prompt marked `last` is dropped.

A token stream (Stream) says what scoring one response feeds: `held`, the tokens whose cache
is kept; `prefix`, how many of them every response to the prompt shares; `targets`, the tokens
whose log-probability a likelihood reward averages; `suffix`, tokens fed after `held` and
dropped again (a classifier's closing tokens). The rewards build their streams (`stream()`)
from the same pieces their full scoring uses, so the scores are the same within float
tolerance (tests/test_incremental.py); a response whose text would tokenize differently as a
whole than in pieces, or that max_length would crop, has no stream and is scored in full.

When a response's tokens no longer extend what its row holds (re-encoded text whose last
token merged with new text), the row keeps the common prefix and masks the rest out. Rows of
one prompt share one rectangular cache: a request appends as many columns as the longest
feed, shorter feeds are left-padded and masked. Memory is bounded: past `cache_bytes` the
least recently used prompts are forgotten (their next request is a full pass again), and a
prompt that alone would exceed it is scored in full without keeping anything.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from specrej_ray.models.cache_arg import cache_kwargs
from specrej_ray.reward.streams import Item, Stats, Stream


class _Rows:
    """One prompt's cache: a row per candidate, columns shared, masked where not valid."""

    def __init__(self, prefix: list[int], layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.prefix = prefix
        self.base = layers  # the prefix's K/V, batch 1: new rows start from it
        self.layers = [(k[:0], v[:0]) for k, v in layers]  # [rows, heads, cols, dim]
        self.mask = torch.zeros((0, len(prefix)), dtype=torch.long)
        self.keys: list[int] = []  # candidate key per row
        self.held: list[list[int]] = []  # per row: the tokens whose K/V is valid, in order
        self.cols: list[list[int]] = []  # per row: the column of each held token
        self.logps: list[list[float]] = []  # per row: log-prob of each target scored
        self.last: list[float | None] = []  # per row: the score of `held` as it stands
        self.tail: list[int | None] = []  # per row: the last target scored (likelihood)
        self.used = 0

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers + self.base)

    def keep(self, keys: list[int]) -> None:
        """Rows of these candidates only, in this order; new candidates start at the prefix
        (its K/V copied, the later columns masked)."""
        at = {k: i for i, k in enumerate(self.keys)}
        old = [at.get(k) for k in keys]
        fresh = torch.tensor([r is None for r in old])
        pick = torch.tensor([0 if r is None else r for r in old], dtype=torch.long)
        n, width = len(self.prefix), self.width
        layers = []
        for (k, v), (bk, bv) in zip(self.layers, self.base, strict=True):
            pad = (0, 0, 0, width - n)  # the prefix's K/V widened to the current columns
            start_k, start_v = torch.nn.functional.pad(bk, pad), torch.nn.functional.pad(bv, pad)
            if self.keys:
                k2, v2 = k[pick], v[pick]
                k2[fresh], v2[fresh] = start_k, start_v
            else:
                k2 = start_k.expand(len(keys), -1, -1, -1).clone()
                v2 = start_v.expand(len(keys), -1, -1, -1).clone()
            layers.append((k2, v2))
        start = torch.zeros(width, dtype=torch.long)
        start[:n] = 1
        mask = self.mask[pick] if self.keys else start.expand(len(keys), -1).clone()
        mask[fresh] = start
        self.layers, self.mask = layers, mask

        def moved(values: list, first):
            return [first() if r is None else values[r] for r in old]

        self.held = moved(self.held, lambda: list(self.prefix))
        self.cols = moved(self.cols, lambda: list(range(n)))
        self.logps = moved(self.logps, list)
        self.last = moved(self.last, lambda: None)
        self.tail = moved(self.tail, lambda: None)
        self.keys = list(keys)


class IncrementalScorer:
    """Scores requests of (prompt id, candidate key, stream) with a causal LM (`kind`
    "likelihood": mean log-prob of the targets) or a causal classifier with last-token
    pooling (`kind` "classifier"), keeping each prompt's rows between requests."""

    def __init__(self, model: Any, kind: str, pad: int, cache_bytes: int, batch_size: int = 16,
                 label_index: int = 0) -> None:
        if kind not in ("likelihood", "classifier"):
            raise ValueError(f"kind must be likelihood or classifier, not {kind!r}")
        self.model, self.kind, self.pad = model, kind, pad
        self.cache_bytes, self.batch_size, self.label_index = cache_bytes, batch_size, label_index
        self.prompts: dict[str, _Rows] = {}
        self.stats = Stats()
        self._clock = 0

    @staticmethod
    def supports(model: Any, kind: str) -> bool:
        """Causal LMs, and classifiers that pool a causal model's last token through a linear
        `score` head (transformers' generic sequence classifiers)."""
        if kind == "likelihood":
            return hasattr(model, "get_output_embeddings")
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        return base is not None and isinstance(getattr(model, "score", None), torch.nn.Linear)

    # -- requests -------------------------------------------------------------------------

    def score(self, prompt_id: str, items: list[Item], full, last: bool = False) -> list[float]:
        """A score per item. `full(indices)` scores those items without a cache (the reward's
        own full pass); it serves items without a stream and prompts that do not fit."""
        self.stats.requests += 1
        self._clock += 1
        out: list[float | None] = [None] * len(items)
        streamed = [i for i, it in enumerate(items) if it.stream is not None]
        prefixes = {tuple(items[i].stream.held[: items[i].stream.prefix]) for i in streamed}
        if len(prefixes) > 1:  # responses to one prompt share their prefix, or nothing is kept
            streamed = []
        self.stats.full_tokens += sum(self._full_cost(it) for it in items)
        if streamed:
            rows = self._rows(prompt_id, items[streamed[0]].stream)
            if rows is not None:
                got = self._feed(rows, [items[i] for i in streamed])
                for i, s in zip(streamed, got, strict=True):
                    out[i] = s
        rest = [i for i, s in enumerate(out) if s is None]
        if rest:
            self.stats.fallbacks += len(rest)
            for i, s in zip(rest, full(rest), strict=True):
                out[i] = s
        if last:
            self.prompts.pop(prompt_id, None)
        else:
            self._bound()
        return out  # type: ignore[return-value]

    def forget(self, prompt_id: str) -> None:
        self.prompts.pop(prompt_id, None)

    def _full_cost(self, it: Item) -> int:
        s = it.stream
        return 0 if s is None else len(s.held) + len(s.suffix)

    def _rows(self, prompt_id: str, stream: Stream) -> _Rows | None:
        rows = self.prompts.get(prompt_id)
        prefix = stream.held[: stream.prefix]
        if rows is not None and rows.prefix == prefix:
            return rows
        if not prefix:
            return None  # pad columns must attend to something: no prefix, no cache
        ids = torch.tensor([prefix], dtype=torch.long, device=self.model.device)
        cache = DynamicCache()
        with torch.inference_mode():
            base = self._base()
            base(input_ids=ids, **cache_kwargs(base, cache), use_cache=True)
        self.stats.tokens += len(prefix)
        rows = _Rows(prefix, _layers(cache))
        self.prompts[prompt_id] = rows
        return rows

    def _bound(self) -> None:
        """Forget the least recently used prompts until the caches fit (the one just scored
        too, if it alone does not)."""
        total = sum(r.nbytes() for r in self.prompts.values())
        for pid in sorted(self.prompts, key=lambda p: self.prompts[p].used):
            if total <= self.cache_bytes:
                break
            total -= self.prompts.pop(pid).nbytes()
            self.stats.evicted += 1

    # -- feeding --------------------------------------------------------------------------

    def _feed(self, rows: _Rows, items: list[Item]) -> list[float]:
        rows.used = self._clock
        rows.keep([it.key for it in items])
        feeds = []
        for r, it in enumerate(items):
            start = self._start(rows, r, it.stream)
            if start < len(rows.held[r]):  # the row went past the new stream: mask the rest
                rows.mask[r, rows.cols[r][start:]] = 0
                del rows.held[r][start:], rows.cols[r][start:]
                rows.last[r] = None
            feeds.append(it.stream.held[start:])
        suffix = items[0].stream.suffix
        if any(it.stream.suffix != suffix for it in items):
            raise ValueError("responses to one prompt must share their closing tokens")
        new = max(len(f) for f in feeds)
        if self.kind == "classifier" and not new and not suffix and \
                all(v is not None for v in rows.last):
            return list(rows.last)  # type: ignore[arg-type]
        if not new and not suffix:
            # Every response's stream is as it was last scored (new text that the reward's
            # tokens do not show, such as whitespace a chat template trims): a zero-width
            # forward pass would fail, and every row scores from what it holds.
            outputs = torch.empty((len(items), 0, 0))
        else:
            outputs = self._forward(rows, feeds, suffix, new)
        return self._scores(rows, items, feeds, outputs, new)

    def _start(self, rows: _Rows, r: int, s: Stream) -> int:
        """Where the row's feed starts: after what its cache holds of the new stream. A
        likelihood row also needs the logits predicting the first target that changed, so
        when the token after the common part differs (a target, not only a held token), the
        position before it is fed again."""
        q = _common(rows.held[r], s.held)
        if self.kind != "likelihood":
            return q
        old = rows.held[r] + ([rows.tail[r]] if rows.tail[r] is not None else [])
        same = _common(old, s.held + s.targets[-1:])  # full streams agree this far
        first = len(s.held) + 1 - len(s.targets)  # stream index of the first target
        return max(len(rows.prefix), min(q, max(same, first) - 1))

    def _forward(self, rows: _Rows, feeds: list[list[int]], suffix: list[int],
                 new: int) -> torch.Tensor:
        """Feed every row its tokens (left-padded to `new`) and the suffix; keep the cache
        of the fed tokens, drop the suffix's. Returns the last layer's output per fed column:
        logits (likelihood) or hidden states (classifier), [rows, new + suffix, ...]."""
        width, chunk = rows.width, new + len(suffix)
        ids = torch.full((len(feeds), chunk), self.pad, dtype=torch.long)
        mask = torch.zeros((len(feeds), chunk), dtype=torch.long)
        pos = torch.zeros((len(feeds), chunk), dtype=torch.long)
        for r, f in enumerate(feeds):
            row = f + suffix
            start = chunk - len(row)
            ids[r, start:] = torch.tensor(row, dtype=torch.long)
            mask[r, start:] = 1
            base = len(rows.held[r])
            pos[r, start:] = torch.arange(base, base + len(row))
        outs, kept = [], []
        for lo in range(0, len(feeds), self.batch_size):
            sl = slice(lo, lo + self.batch_size)
            cache = DynamicCache([(k[sl], v[sl]) for k, v in rows.layers])
            device = self.model.device
            with torch.inference_mode():
                out = self._call(ids[sl].to(device),
                                 torch.cat([rows.mask[sl], mask[sl]], 1).to(device),
                                 pos[sl].to(device), cache)
            outs.append(out)
            kept.append([(k[:, :, : width + new], v[:, :, : width + new])
                         for k, v in _layers(cache)])
        rows.layers = [(torch.cat([b[i][0] for b in kept]), torch.cat([b[i][1] for b in kept]))
                       for i in range(len(rows.layers))]
        rows.mask = torch.cat([rows.mask, mask[:, :new]], 1)
        for r, f in enumerate(feeds):
            rows.cols[r] += list(range(width + new - len(f), width + new))
            rows.held[r] += f
        self.stats.tokens += sum(len(f) + len(suffix) for f in feeds)
        return torch.cat(outs)

    def _call(self, ids, mask, pos, cache) -> torch.Tensor:
        if self.kind == "likelihood":
            return self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              **cache_kwargs(self.model, cache), use_cache=True).logits.float()
        base = self._base()
        return base(input_ids=ids, attention_mask=mask, position_ids=pos,
                    **cache_kwargs(base, cache), use_cache=True).last_hidden_state

    def _base(self):
        """The model under its head: enough for the K/V of a prefix, and what a classifier
        pools."""
        return getattr(self.model, self.model.base_model_prefix)

    def _scores(self, rows: _Rows, items: list[Item], feeds: list[list[int]],
                outputs: torch.Tensor, new: int) -> list[float]:
        scores = []
        for r, (it, f) in enumerate(zip(items, feeds, strict=True)):
            s = it.stream
            if self.kind == "likelihood":
                scores.append(self._likelihood(rows, r, s, f, outputs[r, : new], new))
            else:
                scores.append(self._classify(rows, r, s, f, outputs[r], new))
        return scores

    def _likelihood(self, rows: _Rows, r: int, s: Stream, fed: list[int],
                    logits: torch.Tensor, new: int) -> float:
        """Stream position j predicts token j + 1 of prompt + targets; the targets start
        after the prompt's last token, at position len(held) - len(targets) + 1."""
        first = len(s.held) + 1 - len(s.targets)  # stream index of the first target
        start = len(s.held) - len(fed)  # stream index of the first fed token
        keep = max(0, start + 1 - first)
        logps = rows.logps[r][:keep]
        if fed:
            logp = torch.log_softmax(logits[new - len(fed) :], dim=-1)
            nxt = [*(s.held[start + 1 :]), s.targets[-1]]
            got = logp.gather(-1, torch.tensor(nxt, device=logp.device).unsqueeze(-1))
            got = got.squeeze(-1).tolist()
            logps += got[max(0, first - start - 1) :]
        rows.logps[r], rows.tail[r] = logps, s.targets[-1]
        if len(logps) != len(s.targets):
            raise RuntimeError(f"scored {len(logps)} of {len(s.targets)} targets")
        return sum(logps) / len(logps)

    def _classify(self, rows: _Rows, r: int, s: Stream, fed: list[int], hidden: torch.Tensor,
                  new: int) -> float:
        """The score at the rightmost fed token that is not the pad id (the model's own
        pooling rule); a row with nothing new and no suffix keeps its last score."""
        row = fed + s.suffix
        chunk = hidden.shape[0]
        at = next((chunk - len(row) + j for j in range(len(row) - 1, -1, -1)
                   if row[j] != self.pad), None)
        if at is None:
            if rows.last[r] is None:
                raise RuntimeError("nothing to pool: the fed tokens are all the pad id")
            return rows.last[r]  # type: ignore[return-value]
        value = self.model.score(hidden[at]).float()[self.label_index].item()
        rows.last[r] = value if not s.suffix else None
        return value


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
