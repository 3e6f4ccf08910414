"""The family's byte-level BPE tokenizers: training one, its identity, and the ``transformers`` wrapper."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

EOT = "<|endoftext|>"


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_id(tok) -> str:
    """Identity of a tokenizer: a hash of its token->id map and special tokens."""
    vocab = tok.get_vocab(with_added_tokens=True)
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=True)
    return "bpe%d-%s" % (len(vocab), hashlib.sha256(blob.encode()).hexdigest()[:10])


def hf_tokenizer(tok, max_length: int = 1024):
    """The ``transformers`` tokenizer around a trained one: EOT is BOS, EOS and PAD."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=None,
                                   pad_token=EOT, model_max_length=max_length)


def save_hf_tokenizer(tok, directory: Path, max_length: int = 1024) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    hf_tokenizer(tok, max_length).save_pretrained(str(directory))


def load_tokenizer_file(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
