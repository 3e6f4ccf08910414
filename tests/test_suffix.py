"""Suffix decoding and the EAGLE + suffix hybrid: the match rule on hand-built sequences, and output identical to
plain decoding (tiny random target and head; the shipped family on held-out prompts, ragged batches)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import make_drafter
from speclab.drafters.heads import MODULES, HeadConfig, save_head, target_fingerprint
from speclab.drafters.suffix import SuffixDrafter, longest_suffix_match
from speclab.engine import SpeculativeDecoder
from speclab.errors import SpeclabError

NEW = 20


def test_longest_suffix_match_worked_example():
    assert longest_suffix_match(np.array([1, 2, 3, 9, 2, 3]), 24) == (3, 2)
    assert longest_suffix_match(np.array([5, 6, 7]), 24) == (-1, 0)  # the newest token never occurred
    assert longest_suffix_match(np.array([4, 1, 2, 8, 1, 2, 9, 1, 2]), 24) == (6, 2)  # the most recent of the longest
    assert longest_suffix_match(np.array([1, 2, 3, 7, 2, 3, 1, 2, 3]), 2) == (6, 2)  # depth caps the match


def test_draft_length_follows_the_match():
    d = SuffixDrafter(min_match=2)
    assert d.draft([1, 2, 3, 9, 5, 1, 2, 3], 8) == [9, 5, 1]  # a 3-token match earns 3 tokens
    assert d.draft([1, 2, 3, 9, 5, 1, 2, 3], 2) == [9, 5]  # capped by k
    assert d.draft([1, 2, 3, 4, 5, 6, 1, 2], 8) == [3, 4]
    assert d.draft([7, 1, 8, 1], 8) == []  # a 1-token match is under min_match
    assert SuffixDrafter(factor=2.0, min_match=1).draft([7, 1, 8, 1], 8) == [8, 1]


def test_refusals(target_lm):
    with pytest.raises(SpeclabError):
        make_drafter("suffix:min_match=0", target_lm)
    with pytest.raises(SpeclabError):
        make_drafter("suffix:width=3", target_lm)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, target_lm):
    c = target_lm.config
    cfg = HeadConfig(kind="eagle", hidden=target_lm.hidden_size, vocab=target_lm.vocab_size, eps=c.rms_norm_eps,
                     n_heads=3, feature_layers=(0, -1), attn_heads=c.num_attention_heads,
                     kv_heads=c.num_key_value_heads, head_dim=target_lm.hidden_size // c.num_attention_heads,
                     ffn=2 * target_lm.hidden_size, exit_layer=1, target="tiny",
                     target_fingerprint=target_fingerprint(target_lm))
    torch.manual_seed(1)
    module = MODULES["eagle"](cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("heads") / "eagle"
    save_head(module, cfg, path)
    return str(path)


@pytest.mark.parametrize("spec", ["suffix", "suffix:min_match=1:factor=2", "eagle+suffix", "eagle+suffix:min_match=1"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identity_tiny(target_lm, eagle_head, spec, k):
    extra = f":head={eagle_head}" if spec.startswith("eagle") else ""
    plain = SpeculativeDecoder(target_lm, None)
    dec = SpeculativeDecoder(target_lm, make_drafter(spec + extra, target_lm))
    for i in range(0, 9, 3):
        batch = PROMPTS[i:i + 3]
        ref = plain.generate(batch, k=0, max_new_tokens=NEW).output_tokens
        assert dec.generate(batch, k=k, max_new_tokens=NEW).output_tokens == ref, (spec, k)


def test_hybrid_sampled_rows_run(target_lm, eagle_head):
    dec = SpeculativeDecoder(target_lm, make_drafter(f"eagle+suffix:head={eagle_head}", target_lm))
    res = dec.generate(PROMPTS[:3], k=3, max_new_tokens=NEW, temperature=0.8, seed=3)
    again = SpeculativeDecoder(target_lm, make_drafter(f"eagle+suffix:head={eagle_head}", target_lm)).generate(
        PROMPTS[:3], k=3, max_new_tokens=NEW, temperature=0.8, seed=3)
    assert res.output_tokens == again.output_tokens and all(len(o) > 0 for o in res.output_tokens)


def test_shipped_family_identity_on_heldout():
    from speclab.analysis.sweep import cached_model
    from speclab.family import resolve
    from speclab.workloads import load_workload

    if resolve("target") is None:
        pytest.skip("family not trained")
    target = cached_model("target", device="cpu", role="target")
    prompts = [load_workload(w)[i].prompt for w in ("heldout_json", "heldout_code", "heldout_prose") for i in (0, 1)]
    ref = SpeculativeDecoder(target, None).generate(prompts, k=0, max_new_tokens=24).output_tokens
    for spec in ("suffix", "eagle+suffix"):
        res = SpeculativeDecoder(target, make_drafter(spec, target)).generate(prompts, k=4, max_new_tokens=24)
        assert res.output_tokens == ref, spec
        assert res.metrics["drafted_tokens"] > 0, spec
