"""Rewards: padding invariance, the likelihood definition, callable errors, build_reward."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from specrej_ray.reward import (
    CallableReward,
    RewardError,
    batches_by_length,
    build_reward,
    format_for_scoring,
)
from specrej_ray.reward.classifier import ClassifierReward
from specrej_ray.reward.likelihood import LMLikelihoodReward
from specrej_ray.spec import RewardSpec
from tests.tiny import make_tokenizer, save_tiny_classifier, save_tiny_lm

PROMPTS = ["hi", "tell me a long story about a cat", "2+2?", "x"]
RESPONSES = ["hello there", "once upon a time a cat sat on a mat and", "", "y" * 40]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("lm"), seed=0)


@pytest.fixture(scope="module")
def clf_dir(tmp_path_factory):
    return save_tiny_classifier(tmp_path_factory.mktemp("clf"), seed=0)


@pytest.fixture(scope="module")
def lm(lm_dir):
    return AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def clf(clf_dir):
    return AutoModelForSequenceClassification.from_pretrained(clf_dir, dtype=torch.float32).eval()


def one_at_a_time(reward, prompts, responses):
    return [reward.score([p], [r])[0] for p, r in zip(prompts, responses, strict=True)]


# ---- helpers ----

def test_batches_by_length_groups_similar_lengths_and_covers_every_index():
    lengths = [5, 1, 9, 3, 7]
    batches = batches_by_length(lengths, 2)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [[lengths[i] for i in b] for b in batches] == [[9, 7], [5, 3], [1]]


def test_format_for_scoring_with_and_without_template():
    tok = make_tokenizer(chat_template=True)
    ctx, full = format_for_scoring(tok, "hi", "yo", use_chat_template=True)
    assert (ctx, full) == ("<|user|>hi<|assistant|>", "<|user|>hi<|assistant|>yo<eos>")
    assert format_for_scoring(tok, "hi", "yo", use_chat_template=False) == ("hi\n", "hi\nyo")
    plain = make_tokenizer(chat_template=False)
    assert format_for_scoring(plain, "hi", "yo", use_chat_template=True) == ("hi\n", "hi\nyo")


# ---- classifier ----

def test_classifier_batched_equals_single(clf):
    reward = ClassifierReward(clf, make_tokenizer(), name="c", batch_size=3)
    batched = reward.score(PROMPTS, RESPONSES)
    assert batched == pytest.approx(one_at_a_time(reward, PROMPTS, RESPONSES), abs=1e-4)
    assert len(set(round(s, 6) for s in batched)) == len(batched)  # texts really differ


def test_classifier_left_truncation_keeps_the_end(clf):
    tok = make_tokenizer()
    reward = ClassifierReward(clf, tok, name="c", max_length=16)
    ids = reward.encode_pair("a long prompt " * 5, "the response ends HERE")
    assert len(ids) == 16
    assert tok.decode(ids).endswith("ends HERE<eos>")
    # Text before the window cannot change the score.
    a = reward.score(["one prompt " * 5], ["same long ending of the response"])
    b = reward.score(["another prompt " * 5], ["same long ending of the response"])
    assert a == pytest.approx(b, abs=1e-6)
    full = ClassifierReward(clf, tok, name="c").score(["one prompt " * 5], ["same long ending"])
    assert full != pytest.approx(reward.score(["one prompt " * 5], ["same long ending"]))


def test_classifier_label_index_picks_the_logit(clf_dir):
    model = AutoModelForSequenceClassification.from_pretrained(
        clf_dir, num_labels=3, ignore_mismatched_sizes=True
    ).eval()
    tok = make_tokenizer()
    scores = [
        ClassifierReward(model, tok, name="c", label_index=k).score(["hi"], ["yo"])[0]
        for k in range(3)
    ]
    with torch.inference_mode():
        ids = tok("<|user|>hi<|assistant|>yo<eos>", add_special_tokens=False, return_tensors="pt")
        logits = model(**ids).logits[0]
    assert scores == pytest.approx(logits.tolist(), abs=1e-5)
    with pytest.raises(RewardError, match="label_index 3 is out of range"):
        ClassifierReward(model, tok, name="c", label_index=3)


# ---- LM likelihood ----

def test_likelihood_batched_equals_single(lm):
    reward = LMLikelihoodReward(lm, make_tokenizer(), name="l", batch_size=4)
    batched = reward.score(PROMPTS, RESPONSES)
    assert batched == pytest.approx(one_at_a_time(reward, PROMPTS, RESPONSES), abs=1e-4)


def test_likelihood_matches_hand_computation(lm):
    tok = make_tokenizer()
    reward = LMLikelihoodReward(lm, tok, name="l")
    ctx = tok("<|user|>hi<|assistant|>", add_special_tokens=False).input_ids
    resp = tok("hello", add_special_tokens=False).input_ids
    ids = torch.tensor([ctx + resp])
    with torch.inference_mode():
        logp = torch.log_softmax(lm(input_ids=ids).logits[0].float(), -1)
    want = sum(logp[len(ctx) - 1 + k, t].item() for k, t in enumerate(resp)) / len(resp)
    assert reward.score(["hi"], ["hello"])[0] == pytest.approx(want, abs=1e-4)
    # The template's closing <eos> after the response is not part of the score.
    assert reward.encode_pair("hi", "hello") == (ctx, resp)


def test_likelihood_empty_response_is_the_log_prob_of_ending(lm):
    tok = make_tokenizer()
    reward = LMLikelihoodReward(lm, tok, name="l")
    ctx = tok("<|user|>hi<|assistant|>", add_special_tokens=False).input_ids
    with torch.inference_mode():
        logp = torch.log_softmax(lm(input_ids=torch.tensor([ctx])).logits[0, -1].float(), -1)
    assert reward.score(["hi"], [""])[0] == pytest.approx(logp[tok.eos_token_id].item(), abs=1e-5)


def test_likelihood_without_template_uses_prompt_newline(lm):
    tok = make_tokenizer()
    reward = LMLikelihoodReward(lm, tok, name="l", use_chat_template=False)
    ctx, resp = reward.encode_pair("hi", "yo")
    assert tok.decode(ctx) == "hi\n" and tok.decode(resp) == "yo"


def test_likelihood_max_length_drops_context_first(lm):
    tok = make_tokenizer()
    reward = LMLikelihoodReward(lm, tok, name="l", max_length=12)
    ctx, resp = reward.encode_pair("a long prompt " * 3, "resp")
    assert tok.decode(resp) == "resp" and len(ctx) + len(resp) - 1 == 12
    assert tok.decode(ctx).endswith("<|assistant|>")
    ctx, resp = reward.encode_pair("p", "a very long response indeed")
    assert len(ctx) == 1 and tok.decode(resp) == "a very long response indeed"[-12:]


def test_likelihood_prefers_the_models_own_greedy_text(tmp_path):
    # A wider init makes the random LM opinionated; printable ASCII only, so the greedy
    # tokens survive decode -> re-encode unchanged.
    lm = AutoModelForCausalLM.from_pretrained(save_tiny_lm(tmp_path, initializer_range=0.2))
    tok = make_tokenizer()
    printable = set(tok("".join(map(chr, range(32, 127))), add_special_tokens=False).input_ids)
    ctx = tok("<|user|>hi<|assistant|>", add_special_tokens=False, return_tensors="pt")
    out = lm.eval().generate(
        **ctx, max_new_tokens=24, min_new_tokens=24, do_sample=False,
        pad_token_id=tok.pad_token_id,
        suppress_tokens=[i for i in range(len(tok)) if i not in printable],
    )
    greedy = tok.decode(out[0, ctx.input_ids.shape[1] :])
    assert len(greedy) == 24
    reward = LMLikelihoodReward(lm, tok, name="l")
    own, reversed_ = reward.score(["hi", "hi"], [greedy, greedy[::-1]])
    assert own > reversed_ + 0.5


# ---- callable ----

REWARD_MODULE = """
def length(prompts, responses):
    return [float(len(r)) for r in responses]

def short(prompts, responses):
    return [1.0]

def words(prompts, responses):
    return ["many" for r in responses]

def one(prompts, responses):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = "user_reward_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_callable_scores_with_the_users_function(reward_module):
    reward = CallableReward(f"{reward_module}:length")
    assert reward.name == f"callable({reward_module}:length)"
    assert reward.score(["a", "b"], ["xyz", ""]) == [3.0, 0.0]


def test_callable_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_reward_for_test.py").write_text("def f(p, r):\n    return [0.5] * len(r)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    assert importlib.util.find_spec("cwd_reward_for_test") is None
    assert CallableReward("cwd_reward_for_test:f").score(["p"], ["r"]) == [0.5]


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("missing", "has no attribute 'missing'"),
        ("NOT_A_FUNCTION", "not a function"),
    ],
)
def test_callable_import_errors_name_the_function(reward_module, attr, message):
    with pytest.raises(RewardError, match=message) as err:
        CallableReward(f"{reward_module}:{attr}")
    assert f"{reward_module}:{attr}" in str(err.value) and "\n" not in str(err.value)


def test_callable_missing_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the lookup may add the cwd
    with pytest.raises(RewardError, match="module no_such_reward_mod not found") as err:
        CallableReward("no_such_reward_mod:f")
    assert "no_such_reward_mod:f" in str(err.value)


def test_callable_broken_module_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_for_test.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="importing broken_reward_for_test failed") as err:
        CallableReward("broken_reward_for_test:f")
    assert "SyntaxError" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("attr", "message"),
    [("short", "returned 1 scores for 2"), ("words", "returned str"), ("one", "returned float")],
)
def test_callable_bad_results_name_the_function(reward_module, attr, message):
    reward = CallableReward(f"{reward_module}:{attr}")
    with pytest.raises(RewardError, match=message) as err:
        reward.score(["a", "b"], ["x", "y"])
    assert f"{reward_module}:{attr}" in str(err.value)


# ---- build_reward ----

models = pytest.importorskip("specrej_ray.models.loader")


def test_build_reward_classifier(clf_dir, clf):
    spec = RewardSpec(type="classifier", model="my-rm", dtype="float32", device="cpu",
                      label_index=0, batch_size=2)
    reward = build_reward(spec, str(clf_dir))
    assert isinstance(reward, ClassifierReward) and reward.name == "classifier(my-rm)"
    want = ClassifierReward(clf, make_tokenizer(), name="c").score(PROMPTS, RESPONSES)
    assert reward.score(PROMPTS, RESPONSES) == pytest.approx(want, abs=1e-5)


def test_build_reward_lm_likelihood(lm_dir, lm):
    spec = RewardSpec(type="lm_likelihood", model="my-lm", dtype="float32", device="cpu",
                      chat_template=False, max_length=64)
    reward = build_reward(spec, str(lm_dir))
    assert isinstance(reward, LMLikelihoodReward) and reward.max_length == 64
    want = LMLikelihoodReward(
        lm, make_tokenizer(), name="l", use_chat_template=False, max_length=64
    )
    assert reward.score(PROMPTS, RESPONSES) == pytest.approx(want.score(PROMPTS, RESPONSES), 1e-5)


def test_build_reward_callable(reward_module):
    reward = build_reward(RewardSpec(type="callable", function=f"{reward_module}:length"), None)
    assert isinstance(reward, CallableReward) and reward.score(["p"], ["abcd"]) == [4.0]


@pytest.mark.slow  # a fresh process: what it imported is the subject
def test_a_callable_reward_actor_never_imports_torch_and_torch_later_gets_its_threads():
    """A reward actor with a Python callable paid 6 s here to import torch and transformers
    it never used, in every run; now 1 s. torch imported afterwards (a callable may use it)
    still runs with the threads the spec gave (torch caps them at the cores when it reads them
    at its import: 2 here)."""
    threads = min(2, os.cpu_count() or 1)
    code = textwrap.dedent(f"""
        import sys
        from specrej_ray.distributed.reward_pool import RewardActor
        from specrej_ray.job.runtime import set_torch_threads
        from specrej_ray.reward import build_reward
        from specrej_ray.reward.tracked import TrackedReward
        from specrej_ray.spec import RewardSpec

        spec = RewardSpec(type="callable", function="tests.helpers.rewards:vowels",
                          threads={threads})
        assert set_torch_threads(spec.threads) == {threads}
        reward = TrackedReward(build_reward(spec, None), spec.incremental)
        assert reward.score_request("p", "hi", ["aei"], [0]) == [3.0]
        print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
        import torch
        print(torch.get_num_threads())
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1",  # as Ray sets it
                               "MKL_NUM_THREADS": "1"})  # and as the suite had it, once
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", str(threads)]
