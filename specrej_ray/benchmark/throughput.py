"""Engine throughput against `model.generate` at the same batch size, on equal work.

Both sample B rows from one prompt with the job's temperature / top_p / top_k, and neither
may stop a row early (EOS and stop strings off), so both produce exactly B x max_new_tokens
tokens. Each is run once untimed first (warm-up), then timed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrej_ray.benchmark.timing import say, timed
from specrej_ray.engine.engine import Engine, EngineTask
from specrej_ray.engine.stopping import eos_token_ids


@dataclass(frozen=True)
class Side:
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Throughput:
    batch: int
    prompt_tokens: int
    new_tokens: int  # per row
    engine: Side
    generate: Side
    engine_waves: int  # 1 when the KV budget held all B rows at once
    engine_mean_rows: float

    @property
    def ratio(self) -> float:
        """Engine tokens/s over model.generate tokens/s."""
        return self.engine.tokens_per_s / self.generate.tokens_per_s


def measure_throughput(engine: Engine, input_ids: list[int], batch: int) -> Throughput:
    max_new = engine.sampling.max_new_tokens
    say(f"throughput: engine vs model.generate, batch {batch}, {max_new} new tokens per row")
    e = no_stop_engine(engine, batch)
    task = EngineTask("throughput", input_ids, _zero_scores(len(engine.rewards.names)))
    e.run([task])  # warm-up
    e.reset_stats()
    results, engine_s = timed(lambda: e.run([task]), e.model.device)
    result = results[0]
    gen_tokens, gen_s = _time_generate(engine, input_ids, batch)
    out = Throughput(batch, len(input_ids), max_new, Side(engine_s, result.tokens_generated),
                     Side(gen_s, gen_tokens), result.waves, e.stats.mean_rows)
    say(f"throughput: engine {out.engine.tokens_per_s:.1f} tokens/s, model.generate "
        f"{out.generate.tokens_per_s:.1f} tokens/s (x{out.ratio:.2f})")
    return out


def no_stop_engine(engine: Engine, batch: int) -> Engine:
    """Best-of-`batch` (alpha 0) whose rows all run to max_new_tokens (EOS and stop
    strings off)."""
    return engine.with_search(n=batch, alpha=0.0).with_sampling(ignore_eos=True)


def _zero_scores(rewards: int):
    # Scoring is not generation: a constant scorer keeps the reward model out of the timing.
    return lambda responses: [[0.0] * rewards for _ in responses]


def _time_generate(engine: Engine, input_ids: list[int], batch: int) -> tuple[int, float]:
    model, s = engine.model, engine.sampling
    tokenizer = engine.tokenizer
    eos = sorted(eos_token_ids(model, tokenizer))
    # A repeated batch rather than num_return_sequences, which greedy decoding refuses.
    ids = torch.tensor([input_ids] * batch, device=model.device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=s.max_new_tokens,
        min_new_tokens=s.max_new_tokens,  # EOS suppressed until the length limit
        eos_token_id=eos or None,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
        else (eos[0] if eos else 0),
        do_sample=s.temperature > 0,
    )
    if s.temperature > 0:
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)

    def generate() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, **kwargs)

    generate()  # warm-up
    out, seconds = timed(generate, model.device)
    return out.shape[0] * (out.shape[1] - ids.shape[1]), seconds
