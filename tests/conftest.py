"""Tiny models built from a config, saved, and loaded back through the same path a user's model takes."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(1)  # tiny models; and several test processes must not fight over 2 cores

VOCAB = "abcdefghijklmnopqrstuvwxyz .,"


def make_tokenizer(chars: str = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<eos>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


def make_model(path, seed: int, tokenizer=None, vocab_size: int | None = None, layers: int = 2, hidden: int = 64,
               eos: int | None = None, init: float = 0.2, base_state=None, noise: float = 0.0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or make_tokenizer()
    V = vocab_size or len(tokenizer)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=init, eos_token_id=eos if eos is not None else len(tokenizer) - 1,
                      bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).to(dtype)
    if base_state is not None:
        m.load_state_dict(base_state)
        if noise:
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std().clamp(min=1e-3))
    m.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return m


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """target, a close draft (perturbed target), a far draft (unrelated), a mismatched-tokenizer model."""
    root = tmp_path_factory.mktemp("tiny")
    tgt = make_model(root / "target", seed=0)
    make_model(root / "draft_close", seed=1, base_state=tgt.state_dict(), noise=0.3)
    make_model(root / "draft_far", seed=2, layers=1, hidden=32)
    make_model(root / "other_tok", seed=3, tokenizer=make_tokenizer("abcdefghij0123456789 "))
    # the same tokenizer with a padded LM head (vocab_size larger than the tokenizer)
    make_model(root / "draft_padded", seed=4, vocab_size=len(make_tokenizer()) + 7)
    return {p.name: str(p) for p in root.iterdir()}


@pytest.fixture(scope="session")
def target_lm(tiny):
    from speclab.models import load_model

    return load_model(tiny["target"], device="cpu")


PROMPTS = [
    "hello world", "the cat sat on the mat", "abc abc abc abc", "speculative decoding", "a", "zz top",
    "quick brown fox", "lorem ipsum dolor", "one two three four", "x", "more and more and more",
    "the the the", "kv cache", "draft and verify", "rollback is bookkeeping", "abcdefghij",
    "jump over the lazy dog", "hello hello", "q", "end of line, start of line.",
]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
