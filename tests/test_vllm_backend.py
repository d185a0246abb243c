"""The vLLM backend (engine/vllm/) on a tiny random model, beyond the property suite every
backend passes (test_backend_properties.py): it draws the hf engine's very candidates, its
aborts free vLLM's blocks at once, decoding goes on while scores are out, n: auto comes from
vLLM's KV capacity, and the memory schedule decides on vLLM's KV pressure."""

from __future__ import annotations

import importlib.util

import pytest

from specrej_ray.engine.scoring import Answered, RewardSet
from specrej_ray.engine.task import EngineTask
from tests.conftest import text_score
from tests.helpers.answers import Late
from tests.helpers.engines import engine as hf_engine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (make setup installs it)")

PROMPT = "<|user|>Tell me something.<|assistant|>"
OTHER = "<|user|>Tell me about something else entirely.<|assistant|>"


@pytest.fixture(scope="module")
def vllm_lm():
    """(the vLLM tiny model loaded in transformers, its tokenizer): the hf engine's copy."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.vllm_engines import shared_llm

    _, tokenizer, _, path = shared_llm()
    return AutoModelForCausalLM.from_pretrained(path).eval(), tokenizer


def ids(lm, text: str) -> list[int]:
    return lm[1](text, add_special_tokens=False).input_ids


def run(engine, tasks):
    try:
        return engine.run(tasks)
    finally:
        engine.close()


def vllm(**settings):
    from tests.helpers.vllm_engines import vllm_engine

    return vllm_engine(**settings)


def test_draws_the_hf_engines_candidates(vllm_lm):
    """The same model, prompts and seed give the same candidates, decisions and scores on
    both backends (candidate_sampler draws the hf engine's counter streams)."""
    settings = dict(n=8, alpha=0.5, decisions=(6, 12), max_new=24, top_p=0.9,
                    rewards=RewardSet(("likelihood",), (1.0,), "zscore", (True,)))
    tasks = [EngineTask(pid, ids(vllm_lm, text), text_score_2, self_scored=True)
             for pid, text in (("p", PROMPT), ("q", OTHER))]
    ours = run(vllm(**settings), tasks)
    ref = run(hf_engine(vllm_lm, **settings), tasks)
    for a, b in zip(ours, ref, strict=True):
        assert a.rejected > 0
        assert [c.tokens for c in a.candidates] == [c.tokens for c in b.candidates]
        assert [c.status for c in a.candidates] == [c.status for c in b.candidates]
        assert a.best == b.best
        for x, y in zip(a.candidates, b.candidates, strict=True):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
            assert [s for _, s in x.partial_scores] == pytest.approx(
                [s for _, s in y.partial_scores], abs=1e-4)


def text_score_2(responses, rewards=None, tracking=None):
    """Never asked: the one reward is scored from the decode's log-probabilities."""
    raise AssertionError("self-likelihood is free: no reward pass expected")


def test_aborted_requests_free_their_blocks_at_once(vllm_lm):
    """The losers are still decoding when their scores come in (overlap): one abort stops
    all four, and vLLM's free-block count rises by at least a block each (a row holds its
    own tail block) before the next step."""
    def submit(responses, rewards=None, tracking=None):
        return Late(text_score(responses), polls=5)

    engine = vllm(n=8, alpha=0.5, decisions=(8,), max_new=60, overlap=40)
    calls = []
    abort = engine.llm.abort_request

    def watched(request_ids, internal=False):
        before = engine.probe.free_blocks()
        abort(request_ids, internal)
        calls.append((len(request_ids), engine.probe.free_blocks() - before))

    engine.llm.abort_request = watched
    idle = engine.probe.free_blocks()
    assert idle == engine.probe.num_blocks  # nothing else holds a block
    try:
        task = EngineTask("p", ids(vllm_lm, PROMPT), text_score, submit=submit)
        result = run(engine, [task])[0]
    finally:
        del engine.llm.abort_request
    assert result.rejected == 4 and result.discarded_tokens > 0
    rejection = [(n, gain) for n, gain in calls if n == 4]
    assert len(rejection) == 1 and rejection[0][1] >= 4
    assert engine.probe.free_blocks() == idle  # every request's blocks came back


@pytest.mark.parametrize("cap", [0, 3, 50])
def test_decoding_goes_on_while_scores_are_out_up_to_the_cap(vllm_lm, cap):
    def submit(responses, rewards=None, tracking=None):
        return Late(text_score(responses), polls=10)

    task = EngineTask("p", ids(vllm_lm, PROMPT), text_score, submit=submit)
    engine = vllm(n=8, alpha=0.5, decisions=(6,), max_new=40, overlap=cap)
    sync = run(vllm(n=8, alpha=0.5, decisions=(6,), max_new=40),
               [EngineTask("p", ids(vllm_lm, PROMPT), text_score)])[0]
    result = run(engine, [task])[0]
    rejected = [c for c in result.candidates if c.rejected]
    assert len(rejected) == 4 and all(len(c.tokens) == 6 for c in rejected)
    # the same candidates and texts as with scores in at once; only the work differs
    assert [c.tokens for c in result.candidates] == [c.tokens for c in sync.candidates]
    assert result.discarded_tokens == engine.stats.discarded_tokens
    if cap == 0:
        assert result.discarded_tokens == 0
    else:
        assert 0 < result.discarded_tokens <= 4 * min(cap, 10)


def test_n_auto_is_what_vllms_cache_holds(vllm_lm):
    engine = vllm(n=None, alpha=0.5, decisions=(6,), max_new=10)
    result = run(engine, [EngineTask("p", ids(vllm_lm, PROMPT), text_score)])[0]
    from specrej_ray.search.schedule import Layout, TokensSchedule

    layout = Layout(len(ids(vllm_lm, PROMPT)), engine.probe.block_size)
    expect = TokensSchedule((6,)).auto_n(engine.kv_capacity_tokens(), layout, 0, 10)
    assert result.n == expect if hasattr(result, "n") else len(result.candidates) == expect
    assert len(result.candidates) == expect > 8


def test_an_answer_already_in_is_used_without_waiting(vllm_lm):
    task = EngineTask("p", ids(vllm_lm, PROMPT), text_score,
                      submit=lambda r, rewards=None, tracking=None: Answered(text_score(r)))
    result = run(vllm(n=4, alpha=0.5, decisions=(6,), max_new=12), [task])[0]
    assert result.rejected == 2 and result.finished == 2


@pytest.fixture(scope="module")
def small_llm():
    """A second vLLM engine on the same model with a cache of 96 blocks of 32 tokens (3,072
    tokens): too small for 3 prompts x 32 candidates x 300 tokens. Its blocks are GPU-sized
    (vLLM's CPU default, 128 tokens, holds the tests' prompts in one partial block, which
    prefix caching never shares)."""
    from specrej_ray.engine.vllm.build import start_llm
    from specrej_ray.engine.vllm.candidate_sampler import NAME
    from specrej_ray.engine.vllm.vllm_internals import shutdown
    from tests.helpers.vllm_engines import shared_llm

    _, _, _, path = shared_llm()
    llm = start_llm(dict(model=path, dtype="float32", enable_prefix_caching=True,
                         logits_processors=[NAME], logprobs_mode="raw_logprobs",
                         kv_cache_memory_bytes=3 << 20, max_model_len=512, enforce_eager=True,
                         seed=0, disable_log_stats=True, block_size=32))
    yield llm
    shutdown(llm)


def on(llm, **settings):
    from specrej_ray.engine.vllm.engine import VllmEngine
    from tests.helpers.vllm_engines import shared_llm

    _, tokenizer, eos, _ = shared_llm()
    shared = vllm(**settings)
    return VllmEngine(llm, tokenizer, shared.sampling, shared.search, shared.rewards, eos,
                      owner=False)


def test_memory_schedule_decides_when_vllms_cache_runs_short(vllm_lm, small_llm):
    """Best-of-N overflows the small cache and vLLM preempts (counted); the memory
    schedule cuts at min_decision_tokens and again whenever vLLM's cache is about to run out,
    and decodes far less; preempted candidates come back as the same samples."""
    tasks = [EngineTask(f"p{i}", ids(vllm_lm, PROMPT), text_score) for i in range(3)]
    settings = dict(n=32, decisions=None, min_decision=8, max_new=300, ignore_eos=True)
    bon = on(small_llm, alpha=0.0, **settings)
    bon_results = bon.run(tasks)
    assert bon.vllm.preemptions > 0 and bon.stats.evictions == bon.vllm.preemptions
    assert bon.probe.capacity_tokens < 3 * 32 * 300
    roomy = run(vllm(alpha=0.0, **settings), tasks)
    assert [[c.tokens for c in r.candidates] for r in bon_results] == \
        [[c.tokens for c in r.candidates] for r in roomy]

    sbon = on(small_llm, alpha=0.5, **settings)
    results = sbon.run(tasks)
    assert all(r.rounds >= 1 and r.finished >= 1 for r in results)
    assert max(r.rounds for r in results) >= 2  # a cut past the first, on vLLM's pressure
    assert sbon.stats.decode_steps < bon.stats.decode_steps
    assert sbon.vllm.preemptions < bon.vllm.preemptions
    for r, b in zip(results, bon_results, strict=True):  # survivors are Best-of-N's
        for c, full in zip(r.candidates, b.candidates, strict=True):
            assert full.tokens[: len(c.tokens)] == c.tokens


def test_survivors_re_prefill_at_most_a_block_per_decision(vllm_lm, small_llm):
    """A candidate goes on past a decision as a new request whose prompt carries its tokens:
    prefix caching holds every full block of it, so it re-prefills less than a block. The
    prompt's blocks are shared by its candidates too."""
    prompt = ids(vllm_lm, PROMPT * 3)  # over a block, so its first block can be shared
    assert len(prompt) > 32
    engine = on(small_llm, n=8, alpha=0.5, decisions=(40, 80), max_new=120, ignore_eos=True)
    result = engine.run([EngineTask("p", prompt, text_score)])[0]
    v = engine.vllm
    assert result.rounds == 2 and result.finished == 2
    # 8 first requests, 4 survivors of the first decision, 2 of the second
    assert v.requests == 8 + 4 + 2 and v.continuations == 4 + 2
    assert 0 < v.max_reprefill <= engine.probe.block_size
    assert v.reprefill_tokens <= v.continuations * engine.probe.block_size
    # the first request prefills the prompt; the other 7 find its full block(s)
    full = (len(prompt) // 32) * 32
    assert v.cached_tokens >= 7 * full
    assert v.prefix_hit_rate > 0.5


def test_a_stuck_engine_is_one_clear_error_and_leaves_nothing_running(vllm_lm):
    from specrej_ray.engine.vllm.engine import EngineStuck

    engine = vllm(n=4, alpha=0.5, decisions=(6,), max_new=12)
    engine.stuck_steps = 5
    engine.llm.step = lambda: []  # requests in, no token out
    try:
        with pytest.raises(EngineStuck, match="vLLM made 5 steps without a token for 4 "
                                              "requests"):
            engine.run([EngineTask("p", ids(vllm_lm, PROMPT), text_score)])
    finally:
        del engine.llm.step
    assert not engine.llm.has_unfinished_requests()


def test_an_error_in_a_step_aborts_the_prompts_requests(vllm_lm):
    engine = vllm(n=4, alpha=0.5, decisions=(6,), max_new=12)
    step, calls = engine.llm.step, []

    def failing():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step()

    engine.llm.step = failing
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            engine.run([EngineTask("p", ids(vllm_lm, PROMPT), text_score)])
    finally:
        del engine.llm.step
    assert not engine.llm.has_unfinished_requests()
    # the engine is usable again: the next run is the same as on a fresh one
    again = run(vllm(n=4, alpha=0.5, decisions=(6,), max_new=12),
                [EngineTask("p", ids(vllm_lm, PROMPT), text_score)])[0]
    assert again.finished + again.rejected == 4


def test_an_engine_thread_of_its_own_runs_with_torchs_thread_count(vllm_lm):
    """The generator actor runs the engine in a thread of its own (TaskFeed), whose OpenMP
    thread count is the machine's, not torch's: vLLM's CPU attention must not see both."""
    import threading

    import torch

    got: list = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the actor's generator.threads: 1

    def go():
        try:
            got.append(run(vllm(n=4, alpha=0.5, decisions=(6,), max_new=12),
                           [EngineTask("p", ids(vllm_lm, PROMPT), text_score)])[0])
        except Exception as e:  # reported below
            got.append(e)

    try:
        worker = threading.Thread(target=go)
        worker.start()
        worker.join(120)
    finally:
        torch.set_num_threads(threads)
    assert len(got) == 1 and not isinstance(got[0], Exception), got
    assert got[0].finished + got[0].rejected == 4


def test_branching_and_draws_give_the_hf_engines_candidates(vllm_lm):
    """Children of survivors and per-prompt draws (issue 56) on vLLM: the same candidates,
    parents, fork lengths, statuses and stop as the hf engine; a child's request finds its
    parent's blocks in vLLM's prefix cache and re-prefills at most a block's worth."""
    from specrej_ray.engine.task import DrawPlan

    plan = DrawPlan(max_n=16, wave=8, met=lambda finished: False)  # every draw, to the cap
    settings = dict(n=8, alpha=0.5, decisions=(6, 12), max_new=24, top_p=0.9, branch=True,
                    draws=plan, rewards=RewardSet(("likelihood",), (1.0,), "zscore", (True,)))
    tasks = [EngineTask(pid, ids(vllm_lm, text), text_score_2, self_scored=True)
             for pid, text in (("p", PROMPT), ("q", OTHER))]
    engine = vllm(**settings)
    ours = run(engine, tasks)
    ref = run(hf_engine(vllm_lm, **settings), tasks)
    for a, b in zip(ours, ref, strict=True):
        assert any(c.parent is not None for c in a.candidates) and a.draws == 2
        assert [(c.tokens, c.status, c.parent, c.forked_at) for c in a.candidates] == \
            [(c.tokens, c.status, c.parent, c.forked_at) for c in b.candidates]
        assert (a.best, a.stop_reason) == (b.best, b.stop_reason)
    v = engine.vllm
    assert v.continuations > 0 and v.max_reprefill <= engine.probe.block_size
