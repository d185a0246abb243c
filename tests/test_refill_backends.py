"""bench/refill_backends.py: both backends do the same, complete work on the tiny model."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.refill_backends import Workload, load_workload, run_cb, run_engine
from specrej_ray.engine.hf.transformers_internals import attention_of
from tests.conftest import write_jsonl

K, N, T, R = 2, 4, 6, 8

PROMPTS = [{"prompt": "Tell me about the sea."}, {"prompt": "Why is the sky blue at noon?"},
           {"prompt": "Not used: beyond K."}]


@pytest.fixture(scope="module")
def lm(tiny_lm_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval(), \
        AutoTokenizer.from_pretrained(tiny_lm_dir)


@pytest.fixture(scope="module")
def work(lm, tmp_path_factory) -> Workload:
    path = write_jsonl(tmp_path_factory.mktemp("prompts") / "p.jsonl", PROMPTS)
    return load_workload(lm[1], str(path), K, N, T, R)


def test_workload_takes_the_first_k_prompts_chat_rendered(lm, work):
    tok = lm[1]
    assert len(work.prompts) == K
    assert tok.decode(work.prompts[1]) == "<|user|>Why is the sky blue at noon?<|assistant|>"
    assert work.kv_tokens == R * (max(map(len, work.prompts)) + T)


def test_engine_generates_every_token_with_eos_suppressed(lm, work):
    res = run_engine(*lm, work)
    assert res.tokens == K * N * T
    assert res.cut == 0
    assert 0 < res.rows_mean <= R


def test_continuous_batching_generates_every_token_with_eos_suppressed(lm, work):
    before = attention_of(lm[0])
    res = run_cb(lm[0], work)
    assert res.tokens == K * N * T
    assert res.cut == 0
    assert 0 < res.rows_mean <= R
    # The model goes back to the attention implementation it had.
    assert attention_of(lm[0]) == before


def test_rejecting_half_at_a_quarter_cuts_the_same_forks_in_both(lm, work):
    # Long enough that a cancel sent at T/4 lands well before the fork would finish.
    long = Workload(work.prompts, N, 24, R)
    half = K * (N // 2)
    ours = run_engine(*lm, long, reject=True)
    assert ours.cut == half
    assert ours.tokens == (K * N - half) * 24 + half * long.cut_at
    cb = run_cb(lm[0], long, cancel=True)
    assert 0 < cb.cut <= half
    # A cancelled fork stops some steps after the cancel: between the two extremes.
    assert (K * N - cb.cut) * 24 + cb.cut * long.cut_at <= cb.tokens < K * N * 24
