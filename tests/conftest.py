"""Tiny models built from a config, saved, and loaded back through the same path a user's model takes."""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest
import torch

from speclab.testing import char_tokenizer as make_tokenizer  # noqa: F401 - used by test modules
from speclab.testing import tiny_llama

torch.set_num_threads(1)  # tiny models; and several test processes must not fight over 2 cores


STUCK_S = int(os.environ.get("SPECLAB_STUCK_S", "900"))  # no test takes a fifth of this; one that does is stuck
_STDERR: list[int] = []  # a copy of the terminal's stderr, taken before pytest captures a test's output


def pytest_configure(config):
    _STDERR.append(os.dup(sys.stderr.fileno()))


# the files whose slow tests take longest (a fresh venv, the GPU check's dry run, the notebooks, real vLLM servers),
# longest first: pytest-xdist hands whole files to its workers in collection order, so starting these first keeps
# both workers busy to the end instead of one running a long file alone
LONGEST_FIRST = ("test_app.py", "test_gpu_check.py", "test_notebooks.py", "test_load.py", "test_serve_experiment.py",
                 "test_outside_clients.py", "test_heldout.py", "test_browser.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test stuck for STUCK_S seconds (its fixtures' set-up and tear-down included) dumps every thread's stack
    and ends the run with exit status 1: CI then fails in minutes, saying where it hung, instead of running out
    its time limit with nothing said."""
    faulthandler.dump_traceback_later(STUCK_S, exit=True, file=_STDERR[0] if _STDERR else sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def make_model(path, seed: int, tokenizer=None, vocab_size: int | None = None, layers: int = 2, hidden: int = 64,
               eos: int | None = None, init: float = 0.2, base_state=None, noise: float = 0.0, dtype=torch.float32):
    """The tests' default tiny Llama: 2 KV heads (GQA), 256 positions, a wide init (sharp logits)."""
    tokenizer = tokenizer or make_tokenizer()
    return tiny_llama(path, tokenizer, seed=seed, vocab_size=vocab_size, layers=layers, hidden=hidden, kv_heads=2,
                      max_pos=256, init=init, eos=eos if eos is not None else len(tokenizer) - 1,
                      base_state=base_state, noise=noise, dtype=dtype)


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
