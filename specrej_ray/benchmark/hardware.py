"""This machine and the engine's speed on it: what ran the bench, its roofline, and the
engine's decode rate against `model.generate`.

The roofline: peak matmul FLOP/s and memory bandwidth are measured here, in the model's dtype
on the model's device. A decode step at batch B reads every weight once, the prompt's K/V
once and each row's own generated K/V, and does 2 FLOPs per weight per row plus the
attention; it cannot take less than max(FLOPs / peak, bytes / bandwidth), so B tokens per
that time bounds the tokens/s. The arithmetic is kept as text, numbers substituted.

The throughput comparison: both sides sample B rows from one prompt with the job's
temperature / top_p / top_k, and neither may stop a row early (EOS and stop strings off), so
both produce exactly B x max_new_tokens tokens. Each is run once untimed first.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from specrej_ray.benchmark.arms import best_time, say, timed
from specrej_ray.engine.hf.block_manager import CHUNK
from specrej_ray.engine.hf.engine import Engine
from specrej_ray.engine.hf.memory import kv_bytes_per_token
from specrej_ray.engine.stopping import eos_token_ids
from specrej_ray.engine.task import EngineTask
from specrej_ray.job.runtime import package_versions
from specrej_ray.numbers import si

MIB = 2**20

# -- the machine ------------------------------------------------------------------------------


def machine_info(device: torch.device) -> dict:
    return {
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _mem_gib(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": package_versions(),
    }


def _proc_field(path: str, key: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def _mem_gib() -> float | None:
    value = _proc_field("/proc/meminfo", "MemTotal")  # "24576000 kB"
    return int(value.split()[0]) / 2**20 if value else None


# -- the roofline -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    device: str
    dtype: str
    matmul_size: int
    flops_per_s: float  # best of several square matmuls
    bandwidth_bytes: int  # size of the tensor summed
    bytes_per_s: float  # best of several full reads (a sum)


@dataclass(frozen=True)
class DecodeShape:
    """What one decode step touches, from the loaded model."""

    weight_params: int  # parameters read per step
    gathered_params: int  # an untied input embedding: only B of its rows are read
    dtype_bytes: int
    layers: int
    heads: int  # query heads (attention FLOPs)
    head_dim: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class Roofline:
    peak: Peak
    batch: int
    context: int  # mean KV length per row over the generation
    bytes_per_step: float
    flops_per_step: float
    step_seconds: float
    bound: str  # "compute" or "memory"
    tokens_per_s: float  # B / step_seconds
    lines: tuple[str, ...]


def measure_peak(device: torch.device, dtype: torch.dtype, size: int = 2048,
                 mib: int = 512, repeats: int = 5) -> Peak:
    say(f"roofline: matmul {size}x{size} {_name(dtype)} and a {mib} MiB read on {device}")
    flops = _matmul_flops(device, dtype, size, repeats)
    read, bandwidth = _read_bandwidth(device, dtype, mib, repeats)
    return Peak(str(device), _name(dtype), size, flops, read, bandwidth)


def _matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b, c = torch.randn_like(a), torch.empty_like(a)
    _, once = timed(lambda: torch.matmul(a, b, out=c), device)
    inner = max(1, int(0.05 / max(once, 1e-6)))  # long enough to time on a fast device

    def matmuls() -> None:
        for _ in range(inner):
            torch.matmul(a, b, out=c)

    return 2 * size**3 * inner / best_time(matmuls, device, repeats)


def _read_bandwidth(device: torch.device, dtype: torch.dtype, mib: int,
                    repeats: int) -> tuple[int, float]:
    """Bytes read and bytes/s of a full sum: decode reads weights, it rarely writes."""
    x = torch.ones(mib * MIB // dtype.itemsize, device=device, dtype=dtype)
    read = x.numel() * dtype.itemsize
    return read, read / best_time(x.sum, device, repeats)


def decode_shape(model) -> DecodeShape:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
        else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    untied = out is None or inp.weight.data_ptr() != out.weight.data_ptr()
    read = params - (inp.weight.numel() if untied else 0)
    return DecodeShape(read, params - read, model.dtype.itemsize, cfg.num_hidden_layers, heads,
                       head_dim, kv_bytes_per_token(model.config, model.dtype))


def decode_roofline(shape: DecodeShape, peak: Peak, batch: int, prompt_tokens: int,
                    new_tokens: int) -> Roofline:
    """The bound for one decode step at `batch` rows, at the generation's mean length."""
    s, b = shape, batch
    ctx = prompt_tokens + new_tokens // 2
    weights = s.weight_params * s.dtype_bytes
    # The rows share one prompt: its K/V is read once, each row's generated tokens apart.
    kv = (prompt_tokens + b * (new_tokens // 2)) * s.kv_bytes_per_token
    mm_flops = 2 * s.weight_params * b
    att_flops = 4 * s.layers * s.heads * s.head_dim * ctx * b
    nbytes, flops = weights + kv, mm_flops + att_flops
    compute_s, memory_s = flops / peak.flops_per_s, nbytes / peak.bytes_per_s
    step = max(compute_s, memory_s)
    bound = "compute" if compute_s >= memory_s else "memory"
    lines = (
        f"peak: {si(peak.flops_per_s, 'FLOP/s')} ({peak.matmul_size}x{peak.matmul_size} "
        f"{peak.dtype} matmul, best of several); bandwidth: {si(peak.bytes_per_s, 'B/s')} "
        f"(sum of a {peak.bandwidth_bytes // MIB} MiB {peak.dtype} tensor)",
        f"decode step at batch B = {b}, mean context L = {prompt_tokens} prompt + "
        f"{new_tokens} / 2 generated = {ctx} tokens",
        f"weights read: {s.weight_params:,} parameters x {s.dtype_bytes} bytes = "
        f"{si(weights, 'B')}" + (f" (the untied input embedding's {s.gathered_params:,} "
                                 "parameters are gathered, not read: left out)"
                                 if s.gathered_params else ""),
        f"KV cache read (the prompt once, each row's generated tokens): ({prompt_tokens} + "
        f"{b} x {new_tokens // 2}) x {s.kv_bytes_per_token:,} bytes/token = {si(kv, 'B')}",
        f"bytes per step: {si(weights, 'B')} + {si(kv, 'B')} = {si(nbytes, 'B')}",
        f"FLOPs per step: 2 x {s.weight_params:,} x {b} (weights) + 4 x {s.layers} layers x "
        f"{s.heads} heads x {s.head_dim} head dim x {ctx} x {b} (attention) = "
        f"{si(mm_flops, 'FLOP')} + {si(att_flops, 'FLOP')} = {si(flops, 'FLOP')}",
        f"compute time: {si(flops, 'FLOP')} / {si(peak.flops_per_s, 'FLOP/s')} = "
        f"{compute_s * 1e3:.3g} ms",
        f"memory time: {si(nbytes, 'B')} / {si(peak.bytes_per_s, 'B/s')} = "
        f"{memory_s * 1e3:.3g} ms",
        f"bound: max({compute_s * 1e3:.3g} ms, {memory_s * 1e3:.3g} ms) = {step * 1e3:.3g} ms "
        f"per step ({bound}-bound) -> {b} / {step * 1e3:.3g} ms = {b / step:,.1f} tokens/s",
    )
    return Roofline(peak, b, ctx, nbytes, flops, step, bound, b / step, lines)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- engine vs model.generate ------------------------------------------------------------------


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
    engine_mean_rows: float  # B when every row decoded in every step

    @property
    def ratio(self) -> float:
        """Engine tokens/s over model.generate tokens/s."""
        return self.engine.tokens_per_s / self.generate.tokens_per_s


def measure_throughput(engine: Engine, input_ids: list[int], batch: int) -> Throughput:
    max_new = engine.sampling.max_new_tokens
    say(f"throughput: engine vs model.generate, batch {batch}, {max_new} new tokens per row")
    e = no_stop_engine(engine, batch, len(input_ids))
    task = EngineTask("throughput", input_ids, _zero_scores(len(engine.rewards.names)))
    e.run([task])  # warm-up
    e.reset_stats()
    results, engine_s = timed(lambda: e.run([task]), e.model.device)
    result = results[0]
    gen_tokens, gen_s = _time_generate(engine, input_ids, batch)
    out = Throughput(batch, len(input_ids), max_new, Side(engine_s, result.tokens_generated),
                     Side(gen_s, gen_tokens), e.stats.mean_rows)
    say(f"throughput: engine {out.engine.tokens_per_s:.1f} tokens/s, model.generate "
        f"{out.generate.tokens_per_s:.1f} tokens/s (x{out.ratio:.2f})")
    return out


def no_stop_engine(engine: Engine, batch: int, prompt_tokens: int) -> Engine:
    """Best-of-`batch` (alpha 0) whose rows all run to max_new_tokens (EOS and stop
    strings off), with a KV budget that holds them all: this compares decoding speed at
    batch B, not memory policies."""
    rows = prompt_tokens + batch * (engine.sampling.max_new_tokens + CHUNK)
    budget = max(engine.search.budget_tokens, 2 * rows)
    return engine.best_of_n(batch, budget_tokens=budget) \
        .with_sampling(ignore_eos=True)


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
