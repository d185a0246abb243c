"""Tiny random models saved to disk, so tests run the real loading code without a hub."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (every byte one token): any text round-trips exactly."""
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
        additional_special_tokens=SPECIALS[2:],
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(tokenizer: PreTrainedTokenizerFast, **overrides) -> LlamaConfig:
    kw = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def save_tiny_lm(path: Path, seed: int = 0, chat_template: bool = True, **config) -> Path:
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(chat_template)
    model = LlamaForCausalLM(_config(tokenizer, **config))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_classifier(path: Path, seed: int = 0, chat_template: bool = True) -> Path:
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(chat_template)
    model = LlamaForSequenceClassification(_config(tokenizer, num_labels=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_gemma2(path: Path, seed: int = 0) -> Path:
    """A Gemma 2 (attention logit softcapping, a sliding window of 8 tokens, a final logit
    softcap): a family the hf engine refuses and vLLM serves; head_dim 64, which vLLM's CPU
    attention takes."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=8, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None)
    model = Gemma2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
