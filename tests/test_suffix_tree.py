"""Suffix decoding with suffix trees (``--draft suffix``): the trees' counts, the draft it picks, greedy
equivalence at batch 1 and 3, a global cache that only greedy rows read, rows that move slots, the spec string,
and (slow) samples that follow the target."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import PROMPTS
from test_engine import NEW, hf_greedy  # noqa: F401 - the reference fixture
from test_sampling_engine import PASS_P, _p_values, _sample, exact, near  # noqa: F401 - fixtures

from speclab.drafters import DraftContext, make_drafter
from speclab.drafters.suffix_tree import SuffixTree, SuffixTreeDrafter, _walk
from speclab.engine import Request, Scheduler, SpeculativeDecoder, make_policy
from speclab.engine.sampling import RowParams, SamplingParams
from speclab.errors import SpeclabError


def _counts(node, prefix=()):
    """{substring: count} of every node below ``node``."""
    out = {}
    for tok, child in (node.children or {}).items():
        out[prefix + (tok,)] = child.count
        out.update(_counts(child, prefix + (tok,)))
    return out


def _propose(drafter, seqs, k, greedy=True, rids=None):
    n = len(seqs)
    width = max(map(len, seqs))
    buf = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    ctx = DraftContext(buf, torch.tensor([len(s) for s in seqs]), [len(s) for s in seqs], [list(s) for s in seqs],
                       request_ids=rids or [f"r{b}" for b in range(n)])
    params = RowParams([SamplingParams(0.0 if greedy else 0.8)] * n, "cpu")
    prop = drafter.propose(ctx, [k] * n, params, None, False)
    return [prop.tokens[b, :int(prop.lengths[b])].tolist() for b in range(n)]


# ----------------------------------------------------------------------------- the trees
def test_tree_counts_every_substring_up_to_its_depth_and_forgets_exactly():
    t = SuffixTree(3)
    t.add([5, 6, 5, 6])
    assert _counts(t.root) == {(5,): 2, (5, 6): 2, (5, 6, 5): 1, (6,): 2, (6, 5): 1, (6, 5, 6): 1}
    assert t.root.out == 4 and t.root.children[6].out == 1  # the last 6 has no follower yet
    t.add([6, 7])
    assert _counts(t.root)[(6,)] == 3 and t.root.children[6].best in (5, 7)
    t.remove([5, 6, 5, 6])
    assert _counts(t.root) == {(6,): 1, (6, 7): 1, (7,): 1}
    t.remove([6, 7])
    assert not t.root.children and t.root.out == 0 and t.root.best is None


def test_row_tree_grown_token_by_token_equals_one_built_at_once():
    d = SuffixTreeDrafter(depth=4)
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 3, 1]
    _propose(d, [seq[:3]], 2)
    for i in range(4, len(seq) + 1):
        _propose(d, [seq[:i]], 2)
    whole = SuffixTree(4)
    whole.add(seq)
    assert _counts(d.rows[0].root) == _counts(whole.root)
    assert [m for m, _ in d.rows[0].matches()] == [1, 2, 3]  # active nodes: the last 1..depth-1 tokens


def test_walk_follows_the_most_frequent_branch_until_the_probability_falls():
    t = SuffixTree(8)
    t.add([1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 8])
    node = t.root.children[1]
    assert _walk(node, 5, 0.1) == ([2, 3, 9, 1, 2], pytest.approx(1 + 2 / 3 + 2 / 3 + 2 / 3 + 2 / 3))
    assert _walk(node, 5, 0.7)[0] == [2]  # 2/3 < 0.7 after the first token
    assert _walk(node, 2, 0.0)[0] == [2, 3]


def test_drafts_the_most_frequent_continuation_not_the_most_recent():
    """After 'a b' the context saw 'c' twice and 'd' once (most recently): prompt lookup says d, suffix says c."""
    a, b, c, d = 1, 2, 3, 4
    seq = [a, b, c, 10, 11, a, b, c, 12, 13, a, b, d, 14, 15, a, b]
    assert _propose(SuffixTreeDrafter(), [seq], 1) == [[c]]
    assert make_drafter("ngram", None).lookup(seq, 1) == [d]


def test_a_longer_match_earns_a_longer_draft():
    """factor 1: a match of m tokens drafts at most m; the best score over match lengths wins."""
    body = list(range(10, 30))
    seq = body + [50] + body[:3]  # the last 3 tokens match: at most 3 drafted at factor 1
    assert _propose(SuffixTreeDrafter(factor=1.0), [seq], 8) == [body[3:6]]
    assert _propose(SuffixTreeDrafter(factor=2.0), [seq], 8) == [body[3:9]]
    assert _propose(SuffixTreeDrafter(factor=1.0, offset=2), [seq], 8) == [body[3:8]]
    assert _propose(SuffixTreeDrafter(min_match=3), [seq], 8) == [body[3:6]]
    assert _propose(SuffixTreeDrafter(min_match=4), [seq], 8) == [[]]  # the 3-token match is too short
    assert _propose(SuffixTreeDrafter(), [list(range(40))], 4) == [[]]  # nothing repeats: no draft


def test_options_and_bad_options():
    d = make_drafter("suffix:depth=16:factor=2:offset=1:min_prob=0.2:cache=5:min_match=2", None)
    assert (d.depth, d.factor, d.offset, d.min_prob, d.cache, d.min_match) == (16, 2.0, 1.0, 0.2, 5, 2)
    assert make_drafter("suffix:max_depth=8", None).depth == 8
    for bad in ("suffix:depth=1", "suffix:min_prob=2", "suffix:cache=-1", "suffix:nodes=4", "suffix:depth=x",
                "suffix:min_match=0"):
        with pytest.raises(SpeclabError):
            make_drafter(bad, None)


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equivalence_batch1(target_lm, hf_greedy, k):  # noqa: F811
    dec = SpeculativeDecoder(target_lm, make_drafter("suffix", target_lm))
    drafted = accepted = 0
    for p in PROMPTS:
        res = dec.generate([p], k=k, max_new_tokens=NEW)
        assert res.output_tokens[0] == hf_greedy[p], (p, k)
        drafted += res.metrics["drafted_tokens"]
        accepted += res.metrics["accepted_tokens"]
    assert drafted > 0 and accepted > 0  # it really proposed, and some of it was right


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_equivalence_batch3_ragged(target_lm, hf_greedy, k):  # noqa: F811
    dec = SpeculativeDecoder(target_lm, make_drafter("suffix", target_lm))
    for i in range(0, len(PROMPTS) - 2, 3):
        batch = PROMPTS[i:i + 3]
        res = dec.generate(batch, k=k, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == hf_greedy[p], (p, k)


def test_rows_that_move_slots_keep_their_own_trees(target_lm, hf_greedy):  # noqa: F811
    """Continuous batching: 7 requests through 3 slots with different budgets, so rows finish, the last row
    moves into the hole and new ones are admitted into reused slots; every output equals its own greedy run."""
    drafter = make_drafter("suffix:cache=0", target_lm)
    sched = Scheduler(target_lm, drafter, make_policy(None, 4), max_running=3)
    reqs = [Request(target_lm.encode(p), NEW - 3 * (i % 3), SamplingParams(0.0), None)
            for i, p in enumerate(PROMPTS[:7])]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    for p, r in zip(PROMPTS, reqs):
        assert r.generated == hf_greedy[p][:r.max_new_tokens], p
    assert sum(r.drafted for r in reqs) > 0
    assert all(t is None for t in drafter.rows)  # every finished row left its slot


def test_the_global_cache_drafts_what_earlier_requests_wrote(target_lm, hf_greedy):  # noqa: F811
    """The second time a greedy prompt runs, the first run's output is in the global tree: more tokens accepted,
    the same output. Without the cache the second run is the first one again."""
    p = PROMPTS[6]
    for cache, better in ((1000, True), (0, False)):
        dec = SpeculativeDecoder(target_lm, make_drafter(f"suffix:cache={cache}", target_lm))
        first = dec.generate([p], k=4, max_new_tokens=NEW)
        second = dec.generate([p], k=4, max_new_tokens=NEW)
        assert first.output_tokens[0] == second.output_tokens[0] == hf_greedy[p]
        gain = second.metrics["accepted_tokens"] - first.metrics["accepted_tokens"]
        assert (gain > 0) if better else (gain == 0), (cache, first.metrics, second.metrics)
    assert len(dec.drafter.cached) == 0


def test_the_global_cache_evicts_its_oldest_output():
    d = SuffixTreeDrafter(cache=2)
    for i, rid in enumerate(["a", "b", "c"]):
        _propose(d, [[1, 2, 3, 100 + i, 100 + i]], 2, rids=[rid])
        d.rows[0].prompt_len = 3  # tokens 100+i are its output
        d.release(0)
    assert [list(o) for o in d.cached] == [[101, 101], [102, 102]]
    assert set(d.global_tree.root.children) == {101, 102}


def test_a_sampled_row_does_not_read_the_global_cache(target_lm):
    """A seeded sampled request gives the same tokens on a fresh drafter and on one whose cache holds other
    requests' outputs (its realised tokens depend on its drafts; its drafts only on its own tokens)."""
    p, kw = PROMPTS[2], dict(k=4, max_new_tokens=NEW, temperature=0.8, seed=5, record=False)
    fresh = SpeculativeDecoder(target_lm, make_drafter("suffix", target_lm)).generate([p], **kw)
    dec = SpeculativeDecoder(target_lm, make_drafter("suffix", target_lm))
    for q in PROMPTS[:6]:
        dec.generate([q, p], k=4, max_new_tokens=NEW)
    assert len(dec.drafter.cached) > 0
    assert dec.generate([p], **kw).output_tokens == fresh.output_tokens


@pytest.mark.slow
def test_engine_samples_follow_the_target(target_lm, exact):  # noqa: F811
    """Deterministic drafts scored one-hot: thousands of sampled rows match the target's distribution."""
    res = _sample(target_lm, make_drafter("suffix", target_lm))
    assert sum(r.drafted for r in res.requests) > 100
    pv = _p_values(target_lm, res, exact)
    assert min(pv.values()) > PASS_P, pv


# ----------------------------------------------------------------------------- where users name it
def test_generate_and_the_server_config_name_it(tiny):
    from speclab.serve.config import build_drafter, parse_speculative_config

    spec = parse_speculative_config(json.dumps({"method": "suffix", "num_speculative_tokens": 3}))
    assert spec.enabled and spec.k == 3 and parse_speculative_config(json.dumps(spec.to_json())) == spec
    assert isinstance(build_drafter(spec, None), SuffixTreeDrafter)
    out = subprocess.run([sys.executable, "-m", "speclab", "generate", "--target", tiny["target"], "--draft", "suffix",
                          "--prompt", "abc abc abc abc", "-k", "3", "--max-new-tokens", "12", "--no-baseline",
                          "--json", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["metrics"]["drafted_tokens"] > 0
