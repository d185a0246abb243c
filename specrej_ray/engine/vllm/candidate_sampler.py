"""Candidate identity inside vLLM: a logits processor that draws each candidate's token from
its counter stream (engine.sampling), the very draw the hf engine makes.

vLLM's own seeded sampling restarts its generator with every request, and a candidate is
several requests (one per stretch between decisions), so its samples would depend on where
the decisions fell. Here a candidate's step-t token is a pure function of (seed, prompt,
candidate, t): its text is the same whatever shares the batch, a survivor is its Best-of-N
self, and a resumed job regenerates the same responses. The requests run greedy; this
processor leaves one finite logit, the drawn token. vLLM computes the reported logprobs from
the raw logits before any processor runs (logprobs_mode raw_logprobs), so they stay the
model's untempered log-probabilities, which self-likelihood scores from.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from specrej_ray.engine.sampling import SamplingParams, candidate_uniforms, sample_next

# SamplingParams.extra_args[KEY] of a candidate's request: see draw_args.
KEY = "specrej"
NAME = f"{__name__}:CandidateSampler"  # how vLLM's workers load it


def draw_args(seed: int, pkey: int, index: int, offset: int,
              sampling: SamplingParams) -> dict:
    """What the processor needs of a request: its stream (seed, prompt key, candidate index),
    where its response starts in the request's prompt (`offset`: a request that continues a
    candidate carries its earlier tokens in the prompt), and the sampling settings."""
    return {KEY: {"seed": seed, "pkey": pkey, "index": index, "offset": offset,
                  "temperature": sampling.temperature, "top_p": sampling.top_p,
                  "top_k": sampling.top_k}}


class CandidateSampler(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (draw args, the request's prompt length, its live output tokens)
        self.rows: dict[int, tuple[dict, int, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, prompt, output in batch_update.added:
            args = (params.extra_args or {}).get(KEY) if params is not None else None
            if args is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = (args, len(prompt or ()), output)
        for a, b, how in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if how is MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, (args, _, _) in self.rows.items():
            groups[(args["seed"], args["temperature"], args["top_p"], args["top_k"])].append(i)
        for (seed, temperature, top_p, top_k), rows in groups.items():
            pkeys, index, step = [], [], []
            for i in rows:
                args, prompt_len, output = self.rows[i]
                pkeys.append(args["pkey"])
                index.append(args["index"])
                step.append(prompt_len - args["offset"] + len(output))
            at = torch.tensor(rows, device=logits.device)
            u = candidate_uniforms(seed, torch.tensor(pkeys), torch.tensor(index),
                                   torch.tensor(step))
            drawn = sample_next(logits[at], SamplingParams(temperature, top_p, top_k), u)
            logits[at] = float("-inf")
            logits[at, drawn.to(logits.device)] = 0.0
        return logits
