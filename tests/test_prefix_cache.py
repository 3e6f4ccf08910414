"""Prefix caching: the store's matching and bounds on hand-built entries, and the scheduler's outputs with
prefixes reused (a repeated prompt, a shared block-aligned prefix) equal to each prompt's solo run, greedy and
sampled, with and without a draft."""

from __future__ import annotations

import pytest
import torch

from speclab.engine import Request, Scheduler, SpeculativeDecoder, make_policy
from speclab.engine.prefix_cache import PrefixCache
from speclab.engine.sampling import SamplingParams


def _kv(P, layers=2, val=0.0):
    return [torch.full((2, P + 3, 4), val + i) for i in range(layers)], [torch.full((2, P + 3, 4), -val - i)
                                                                       for i in range(layers)]


def test_store_matches_whole_prompt_then_block_prefixes():
    pc = PrefixCache(block=4)
    a = list(range(10))  # stores positions 0..8
    pc.store(a, *_kv(9, val=1.0))
    assert len(pc) == 1 and pc.entries[tuple(a[:9])].k[0].shape == (2, 9, 4)
    assert pc.lookup(a) == (9, pc.entries[tuple(a[:9])])  # the same prompt: all but its last token
    p, e = pc.lookup(a[:6] + [99, 98, 97])  # shares 6 tokens: the block boundary below them, 4
    assert p == 4 and e is pc.entries[tuple(a[:9])]
    assert pc.lookup(a[:3] + [99] * 8) == (0, None)  # less than a block shared
    assert pc.lookup(a[:9] + [5, 6, 7]) == (8, e)  # a longer prompt starting with the stored one: by block
    assert pc.lookup([7]) == (0, None)
    assert pc.queries == 10 + 9 + 11 + 12 + 1 and pc.hits == 9 + 4 + 8


def test_longer_prompt_extends_to_its_stored_prefix_and_store_is_bounded():
    one = 2 * 2 * 4 * 4 * 2  # bytes per stored position: k and v, 2 layers, (2 heads x 4) floats
    pc = PrefixCache(max_bytes=20 * one, block=4)
    pc.store(list(range(9)), *_kv(8))  # 8 positions
    pc.store(list(range(100, 109)), *_kv(8))  # 8 more: 16 of 20
    assert pc.nbytes == 16 * one and len(pc) == 2
    pc.lookup(list(range(9)))  # the first is used again: the second is now the oldest
    pc.store(list(range(200, 209)), *_kv(8))  # 24 > 20: the least recently used goes
    assert set(pc.entries) == {tuple(range(8)), tuple(range(200, 208))} and pc.nbytes == 16 * one
    assert pc.lookup(list(range(100, 109))) == (0, None)  # its keys went with it
    assert pc.lookup(list(range(5)) + [1])[0] == 4  # the block key of the survivor still answers
    pc.store(list(range(300, 400)), *_kv(99))  # bigger than the whole store: not kept, nothing evicted
    assert len(pc) == 2


def _run(target, drafter, policy, prompts, params, seeds, prefix):
    sched = Scheduler(target, drafter, policy, max_running=3, max_waiting=len(prompts), max_len=128, capacity=3,
                      prefix_cache=prefix)
    reqs = [Request(list(p), 12, sp, seed=s, request_id=f"r{i}") for i, (p, sp, s) in
            enumerate(zip(prompts, params, seeds))]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    return [r.generated for r in reqs]


@pytest.mark.parametrize("speculative", [False, True])
def test_outputs_with_reused_prefixes_equal_solo_runs(tiny, target_lm, speculative):
    from speclab.drafters import make_drafter

    drafter = make_drafter(tiny["draft_close"], target_lm) if speculative else None
    policy = make_policy("fixed", 3) if speculative else make_policy("off", 0)
    base = target_lm.encode("the cat sat on the mat and the dog sat on the log, " * 2)
    assert len(base) > 20
    other = target_lm.encode("quick brown fox jumps over the lazy dog " * 2)
    prompts = [base, other, base, base[:17] + other[:5], base, other]  # repeats and a shared 16-token prefix
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.9)
    params = [greedy, hot, greedy, greedy, hot, hot]
    seeds = [1, 2, 3, 4, 5, 2]
    pc = PrefixCache()
    got = _run(target_lm, drafter, policy, prompts, params, seeds, pc)
    # the first three are admitted together (nothing stored yet); then the shared block and both repeats are reused
    assert pc.hits == 16 + (len(base) - 1) + (len(other) - 1)
    solo = [_run(target_lm, drafter, policy, [p], [sp], [s], None)[0] for p, sp, s in zip(prompts, params, seeds)]
    assert got == solo
    assert got[1] == got[5]  # the same prompt, settings and seed: the same sample, whether its prefix was stored
    plain = SpeculativeDecoder(target_lm, None)
    assert got[0] == plain.generate([base], k=0, max_new_tokens=12).output_tokens[0]


def test_an_entry_serves_a_drafter_that_reads_features_only_with_them():
    pc = PrefixCache(block=4)
    a, b = list(range(10)), list(range(50, 60))
    pc.store(a, *_kv(9))  # no features
    pc.store(b, *_kv(9), {-1: torch.arange(30.0).reshape(10, 3), 1: torch.ones(10, 3)})
    assert pc.lookup(a, features=(-1,)) == (0, None) and pc.lookup(a)[0] == 9
    p, e = pc.lookup(b, features=(1, -1))
    assert p == 9 and e.features[-1].shape == (9, 3) and torch.equal(e.features[-1], torch.arange(27.0).reshape(9, 3))
    assert pc.lookup(b, features=(2,)) == (0, None)  # a layer it does not hold
    before = pc.hits
    pc.unused(9)
    assert pc.hits == before - 9


def test_eagle_reuses_prefixes_with_their_features(target_lm):
    """A drafter that reads the target's features (the EAGLE head) reuses stored prefixes: the outputs are each
    prompt's solo run, and the drafts too (the stored features are the prompt's own)."""
    from speclab.drafters import make_drafter
    from speclab.drafters.heads import head_dir
    from speclab.models import load_model

    if head_dir("eagle") is None:
        pytest.skip("the family's EAGLE head is not shipped")
    target = load_model("target", device="cpu")
    base = target.encode('{"name": "Ada", "email": "ada@example.com", "tags": ["a", "b"], "city": "')
    other = target.encode("def parse(text):\n    return [line.strip() for line in text.splitlines()]\n")
    prompts = [base, other, base, base[:17] + other[:5], base]
    params = [SamplingParams()] * len(prompts)
    seeds = [1] * len(prompts)

    def run(prompts, prefix):
        drafter = make_drafter("eagle", target)
        sched = Scheduler(target, drafter, make_policy("fixed", 4), max_running=3, max_waiting=len(prompts),
                          max_len=128, capacity=3, prefix_cache=prefix)
        reqs = [Request(list(p), 16, sp, seed=s, request_id=f"r{i}") for i, (p, sp, s) in
                enumerate(zip(prompts, params, seeds))]
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return [(r.generated, r.drafted, r.accepted) for r in reqs]

    pc = PrefixCache()
    got = run(prompts, pc)
    assert pc.hits >= 16 + len(base) - 1  # the shared block and a repeat were reused
    solo = [run([p], None)[0] for p in prompts]
    assert [g[0] for g in got] == [s[0] for s in solo]
    assert [g[1:] for g in got] == [s[1:] for s in solo]  # the same drafts accepted: the features lined up
