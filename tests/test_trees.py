"""Token trees: layout and growth on hand-built cases, one-forward verification in the engine (greedy
identity for every tree-proposing drafter, accepted paths through later siblings so the slot moves
matter, events), the HF backend's refusal, and the sampling distribution with a tree drafter against
a deliberately wrong rule."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, make_model

from speclab.drafters import Proposal, StatelessDrafter, make_drafter
from speclab.drafters.trees import RowTree, TreeShape, grow_trees, pack_trees, tree_layout, trie
from speclab.engine import SpeculativeDecoder
from speclab.engine.acceptance import tree_rejection_sample
from speclab.engine.tree_verify import block_path, kept_slots
from speclab.errors import SpeclabError
from speclab.models import load_model

NEW = 20


def t(x):
    return torch.tensor(x, dtype=torch.long)


# ----------------------------------------------------------------------------------------------- pure parts
def test_tree_layout_hand_built():
    # block [r, a, b, c, pad]: a and b under the root, c under a, node 3 is padding
    depth, mask = tree_layout(t([[-1, -1, 0, -1]]), torch.tensor([[True, True, True, False]]))
    assert depth.tolist() == [[0, 1, 1, 2, 1]]
    m = mask[0].int().tolist()
    assert m[0] == [1, 0, 0, 0, 0]
    assert m[1] == [1, 1, 0, 0, 0]  # a: root and itself
    assert m[2] == [1, 0, 1, 0, 0]  # b: not its sibling a
    assert m[3] == [1, 1, 0, 1, 0]  # c: root, its parent a, itself; not its uncle b
    assert m[4][4] == 1 and sum(m[r][4] for r in range(4)) == 0  # padding: seen by no real token


def test_kept_slots_worked_example():
    # tree.py docstring: start 9, path [1, 3] -> slots 11 and 13 move to 10 and 11
    src, dst = kept_slots(t([9]), t([[1, 3, -1, -1]]), t([2]))
    assert src.tolist() == [[11, 13, 12, 13]] and dst.tolist() == [[10, 11, 12, 13]]
    assert block_path(t([[1, 3, -1, -1]]), t([2])).tolist() == [[0, 2, 4, -1, -1]]


def _probs(rows, V=6):
    out = torch.zeros(len(rows), V)
    for i, r in enumerate(rows):
        for tok, p in r.items():
            out[i, tok] = p
    return out


def test_grow_dynamic_picks_highest_cumulative_probability():
    # root: 1 (.6), 2 (.25), 3 (.15); after 1: 4 (.5), 5 (.3); after 2: 5 (.6), 4 (.2); after 4: 0 (.4), 5 (.1)
    root = _probs([{1: .6, 2: .25, 3: .15}])
    after = {1: {4: .5, 5: .3}, 2: {5: .6, 4: .2}, 4: {0: .4, 5: .1}}

    def expand(pools, frontier):
        return torch.stack([_probs([after[pools[0].tokens[i]] for i in frontier[0]])])

    pools, chosen = grow_trees(TreeShape("dynamic", width=2, trunk=1.0), [4], root, expand)
    tok, par, lengths, _ = pack_trees(pools, chosen, "cpu")
    # cumulative: 1 .6, 1-4 .30, 2 .25, 1-5 .18, 2-5 .15, 1-4-0 .12: the best four, ordered by depth
    assert lengths.tolist() == [4]
    assert tok.tolist() == [[1, 2, 4, 5]] and par.tolist() == [[-1, -1, 0, 0]]
    # growth stopped once no frontier node could enter the top four: 1-4-0 (.12) was never expanded
    assert pools[0].depth.count(3) == 2 and max(pools[0].depth) == 3
    # trunk = 0: the most likely child is free, so the most likely path takes the budget first
    pools, chosen = grow_trees(TreeShape("dynamic", width=2, trunk=0.0), [3], root, expand)
    assert pack_trees(pools, chosen, "cpu")[0].tolist() == [[1, 4, 0]]


def test_grow_static_branching_and_budget():
    root = _probs([{1: .5, 2: .3, 3: .2}])

    def expand(pools, frontier):
        return torch.stack([_probs([{4: .7, 5: .3}] * len(frontier[0]))])

    pools, chosen = grow_trees(TreeShape("static", branch=(2, 2, 1)), [5], root, expand)
    tok, par, lengths, _ = pack_trees(pools, chosen, "cpu")
    assert lengths.tolist() == [5]
    assert tok[0, :2].tolist() == [1, 2]  # the root's two best
    assert tok[0, 2:].tolist() == [4, 5, 4]  # the best parent gets its 2 children first, then the budget ends
    assert par[0].tolist() == [-1, -1, 0, 0, 1]


def test_trie_merges_matches():
    tokens, parents, _ = trie([[5, 6, 7], [5, 6, 9], [8]], [1.0, 0.5, 0.25], budget=4)
    # shared prefix 5-6 once; 7 (weight 1) outranks 9 (weight .5) and 8 (.25)
    assert tokens[:2] == [5, 6] and parents[:2] == [-1, 0]
    assert set(tokens) <= {5, 6, 7, 9, 8} and len(tokens) == 4 and 7 in tokens
    assert all(p < i for i, p in enumerate(parents))


def test_tree_shape_options():
    s = TreeShape.from_options(tree="static", nodes="8", branch="3-2-1")
    assert (s.kind, s.nodes, s.branch, s.budget(6), s.budget(12)) == ("static", 8, (3, 2, 1), 6, 8)
    assert TreeShape.from_options(nodes=4).kind == "dynamic"
    with pytest.raises(SpeclabError):
        TreeShape.from_options(tree="bushy")


# ----------------------------------------------------------------------------------------------- the engine
class SiblingTreeDrafter(StatelessDrafter):
    """Knows the target's greedy continuation (the 'right' tokens) and hides it behind decoys: at every
    depth the right token is the *last* child, after ``decoys`` wrong siblings, so accepted paths run
    through later siblings and the accepted K/V must move in the cache. ``wrong=True`` proposes only decoys."""

    name = "sibling-tree"

    def __init__(self, target, depth=3, decoys=1, wrong=False):
        self.target, self.depth, self.decoys, self.wrong = target, depth, decoys, wrong

    def propose(self, ctx, ks, params, uniform, want_probs, stop=None):
        V = self.target.vocab_size
        rows_t, rows_p = [], []
        for b, seq in enumerate(ctx.host):
            x = torch.tensor([seq])
            right = []
            for _ in range(self.depth):
                right.append(int(self.target.hf_model(x).logits[0, -1].argmax()))
                x = torch.cat([x, torch.tensor([[right[-1]]])], 1)
            toks, pars, parent = [], [], -1
            for d in range(self.depth):
                for j in range(self.decoys):
                    toks.append((right[d] + 1 + j) % V)
                    pars.append(parent)
                if not self.wrong:
                    toks.append(right[d])
                    pars.append(parent)
                parent = len(toks) - 1
            budget = ks[b]
            rows_t.append(toks[:budget])
            rows_p.append(pars[:budget])
        N = max(len(r) for r in rows_t)
        tok = torch.full((len(rows_t), N), -1, dtype=torch.long)
        par = torch.full((len(rows_t), N), -1, dtype=torch.long)
        for b, (tt, pp) in enumerate(zip(rows_t, rows_p)):
            tok[b, :len(tt)], par[b, :len(pp)] = torch.tensor(tt, dtype=torch.long), torch.tensor(pp, dtype=torch.long)
        return Proposal(tok, torch.tensor([len(r) for r in rows_t]), None, None, par)


@pytest.fixture(scope="module")
def plain_out(target_lm):
    dec = SpeculativeDecoder(target_lm, None)
    return {p: dec.generate([p], k=0, max_new_tokens=NEW).output_tokens[0] for p in PROMPTS}


def test_accepted_path_through_later_siblings(target_lm, plain_out):
    dec = SpeculativeDecoder(target_lm, SiblingTreeDrafter(target_lm, depth=3, decoys=1))
    accepted = 0
    for i in range(0, 9, 3):
        batch = PROMPTS[i:i + 3]
        res = dec.generate(batch, k=6, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == plain_out[p], p
        for ev in res.recorder.rounds:
            for rr in ev.rows:
                if rr.tree is not None and rr.num_accepted:
                    accepted += rr.num_accepted
                    assert rr.tree["path"][0] == 1  # the right token is the second child of the root
    assert accepted > 0


def test_all_wrong_tree_is_plain_decoding(target_lm, plain_out):
    dec = SpeculativeDecoder(target_lm, SiblingTreeDrafter(target_lm, depth=2, decoys=2, wrong=True))
    for p in PROMPTS[:4]:
        res = dec.generate([p], k=4, max_new_tokens=NEW)
        assert res.output_tokens[0] == plain_out[p]
        assert res.metrics["accepted_tokens"] == 0 and res.metrics["drafted_tokens"] > 0


@pytest.mark.parametrize("spec", ["ngram:tree=dynamic", "ngram:tree=static:branch=2-1",
                                  "draft_close:tree=dynamic:width=2", "draft_close:tree=static:branch=2-2-1"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_tree_drafters_greedy_identity(tiny, target_lm, plain_out, spec, k):
    name, _, opts = spec.partition(":")
    dec = SpeculativeDecoder(target_lm, make_drafter(f"{tiny.get(name, name)}:{opts}", target_lm))
    drafted = 0
    for i in range(0, 9, 3):  # ragged batches of 3
        batch = PROMPTS[i:i + 3]
        res = dec.generate(batch, k=k, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == plain_out[p], (spec, k, p)
        drafted += res.metrics["drafted_tokens"]
    assert drafted > 0


def test_tree_events_describe_the_round(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(f"{tiny['draft_close']}:tree=dynamic:width=2", target_lm))
    res = dec.generate(PROMPTS[:3], k=5, max_new_tokens=NEW, temperature=0.9, seed=3)
    trees = 0
    for ev in res.recorder.rounds:
        for rr in ev.rows:
            if rr.tree is None:
                continue
            trees += 1
            tr = rr.tree
            assert len(tr["tokens"]) == len(tr["parents"]) == len(tr["fates"]) == rr.num_drafted
            assert [tr["tokens"][i] for i in tr["path"]][:len(rr.emitted)] == \
                [x.token for x in rr.tokens if x.status == "accepted"]
            for i, f in enumerate(tr["fates"]):
                par = tr["parents"][i]
                assert (f == "accepted") == (i in tr["path"])
                if f == "rejected":
                    assert par == -1 or par in tr["path"]
                if f == "discarded":
                    assert par != -1 and tr["fates"][par] != "accepted"
    assert trees > 0
    for row, out in zip(res.tokens, res.output_tokens):
        assert [x["token"] for x in row if x["status"] != "rejected"] == out


def test_hf_backend_refuses_trees(tiny):
    target = load_model(tiny["target"], device="cpu", backend="hf")
    dec = SpeculativeDecoder(target, make_drafter("ngram:tree=dynamic", target))
    with pytest.raises(SpeclabError, match="native backend"):
        dec.generate(["abc abc abc abc"], k=4, max_new_tokens=8)


def test_early_exit_greedy_identity(tmp_path, target_lm):
    path = tmp_path / "t3"
    make_model(path, seed=5, layers=3)
    lm = load_model(str(path), device="cpu")
    plain = SpeculativeDecoder(lm, None)
    for m in (1, 2):
        dec = SpeculativeDecoder(lm, make_drafter(f"early-exit:{m}", lm))
        for i in range(0, 6, 3):
            batch = PROMPTS[i:i + 3]
            ref = plain.generate(batch, k=0, max_new_tokens=NEW).output_tokens
            assert dec.generate(batch, k=4, max_new_tokens=NEW).output_tokens == ref
    with pytest.raises(SpeclabError, match="1..2"):
        make_drafter("early-exit:3", lm)


# ----------------------------------------------------------------------------------------------- sampling
def second_token_dist(lm, prompt, temperature):
    m, ids = lm.hf_model, lm.encode(prompt)
    with torch.no_grad():
        p1 = (m(torch.tensor([ids])).logits[0, -1].double() / temperature).softmax(-1)
        V = p1.shape[0]
        p2 = (m(torch.tensor([ids + [x] for x in range(V)])).logits[:, -1].double() / temperature).softmax(-1)
    return (p1[:, None] * p2).sum(0)


def chi2(emp, exact, n):
    exp, obs = exact * n, emp * n
    big = exp >= 5
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    keep = e > 0
    return (((o - e) ** 2) / e)[keep].sum().item(), int(keep.sum().item()) - 1


def chi2_quantile(dof, z):
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def residual_ignored(tokens, parents, draft_probs, target_probs, ua, un):
    """A wrong rule: after a rejection the next token comes from the target's distribution at the node,
    not from the residual (a rejected candidate can come back: drafted tokens are over-represented)."""
    from speclab.engine.sampling import sample_from_probs

    r = tree_rejection_sample(tokens, parents, draft_probs, target_probs, ua, un)
    n, N = tokens.shape
    last = torch.cat([r.path, r.path.new_full((n, 1), -1)], 1).gather(1, (r.num_accepted - 1).clamp(min=0)[:, None])
    at = torch.where(r.num_accepted > 0, last.squeeze(1) + 1, 0)
    plain = sample_from_probs(target_probs.float()[torch.arange(n), at], un)
    r.next_token = torch.where(r.is_bonus, r.next_token, plain)
    return r


@pytest.mark.slow
def test_tree_samples_follow_target_distribution(tiny, target_lm, monkeypatch):
    """The second generated token (the first decided by the multi-candidate rule over a dynamic tree of the
    close draft: three candidates of high target probability, so a rejection changes a lot) has the
    target's exact marginal; the wrong rule fails the same test."""
    import speclab.engine.scheduler as scheduler

    temperature, n, prompt = 1.0, 6000, "hello wor"
    exact = second_token_dist(target_lm, prompt, temperature)

    def empirical():
        drafter = make_drafter(f"{tiny['draft_close']}:tree=dynamic:width=3", target_lm)
        dec = SpeculativeDecoder(target_lm, drafter)
        res = dec.generate([prompt] * n, k=4, max_new_tokens=3, temperature=temperature, seed=0, record=False,
                           stop_on_eos=False)
        return torch.bincount(torch.tensor([o[1] for o in res.output_tokens]), minlength=target_lm.vocab_size
                              ).double() / n

    emp = empirical()
    stat, dof = chi2(emp, exact, n)
    assert stat < chi2_quantile(dof, 3.09), (stat, dof)  # p > 0.001
    monkeypatch.setattr(scheduler, "tree_rejection_sample", residual_ignored)
    stat_bad, dof = chi2(empirical(), exact, n)
    assert stat_bad > chi2_quantile(dof, 5.0), (stat_bad, dof)


def test_row_tree_scores():
    pool = RowTree()
    a = pool.add(3, -1, -0.5)
    b = pool.add(4, a, -1.0)
    assert pool.depth == [1, 2] and pool.score[b] == pytest.approx(-1.5) and pool.parents == [-1, 0]
