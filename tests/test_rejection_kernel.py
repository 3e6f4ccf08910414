"""The fused acceptance kernel's algorithm, step for step in PyTorch, against the reference
(:func:`speclab.engine.acceptance.rejection_sample`), without Triton.

The kernel (``speclab/kernels/rejection.py``) visits one row per program and the vocabulary in blocks:
pass 1 sums the residual's mass block by block, pass 2 the chosen distribution's total, pass 3 scans the
blocks with a running prefix and takes the first token whose cumulative weight exceeds the goal. The
reference takes one sequential cumsum. ``kernel_algorithm`` below is that blocked order written in PyTorch
(its float32 arithmetic and int64 weights as the kernel has them), so the claim "the blocked order draws the
reference's tokens, ties included" is checked on every machine; tests/kernel_check.py runs the kernel itself
under Triton's interpreter when Triton is installed, and the GPU check runs it past 2^31 elements."""

from __future__ import annotations

import pytest
import torch

from speclab.engine.acceptance import RESIDUAL_EPS_FIXED, rejection_sample
from speclab.engine.sampling import FIXED_POINT_SCALE, fixed_point_weights


def _block_weights(t_row, d_row, v0, block, d_rej, use_res):
    """One block of fixed-point weights, as the kernel's ``_weights``: float32 max(t - q, 0) (or t),
    times 2^40, truncated to int64. A deterministic draft (no d_row) is one-hot at d_rej."""
    t = t_row[v0:v0 + block]
    if d_row is not None:
        q = d_row[v0:v0 + block]
    else:
        q = (torch.arange(v0, v0 + t.shape[0]) == d_rej).float()
    p = torch.clamp(t - q, min=0.0) if use_res else t
    return (p * FIXED_POINT_SCALE).long()


def _row(b, drafts, dp, tp, nd, ua, un, block):
    K, V = drafts.shape[1], tp.shape[-1]
    n, accepting = 0, 1
    for i in range(K):  # the first rejection, one draft at a time
        d = max(int(drafts[b, i]), 0)
        pt = tp[b, i, d]
        pd = dp[b, i, d] if dp is not None else torch.tensor(1.0)
        keep = bool(ua[b, i] * pd < pt) and i < int(nd[b])
        accepting *= int(keep)
        n += accepting
    rejected = n < int(nd[b])
    slot = max(min(n, K - 1), 0)
    d_rej = max(int(drafts[b, slot]), 0) if K else 0
    t_row = tp[b, n]
    d_row = dp[b, slot] if dp is not None and K else None
    blocks = range(0, V, block)
    mass = sum(int(_block_weights(t_row, d_row, v0, block, d_rej, rejected).sum()) for v0 in blocks)  # pass 1
    use_res = rejected and mass > RESIDUAL_EPS_FIXED
    total = sum(int(_block_weights(t_row, d_row, v0, block, d_rej, use_res).sum()) for v0 in blocks)  # pass 2
    goal = int(float(un[b].double()) * float(total))  # float64 product, truncated, as the kernel's
    prefix, found = 0, V - 1
    for v0 in blocks:  # pass 3: each block's cumsum on the running prefix
        w = _block_weights(t_row, d_row, v0, block, d_rej, use_res)
        hit = ((prefix + w.cumsum(0)) > goal).nonzero()
        if len(hit):
            found = min(found, v0 + int(hit[0]))
        prefix += int(w.sum())
    return n, found


def kernel_algorithm(drafts, dp, tp, nd, ua, un, block: int):
    """(num_accepted, next_token) per row, in the kernel's blocked order."""
    tp = tp.float()
    dp = dp.float() if dp is not None else None
    out = [_row(b, drafts, dp, tp, nd, ua, un, block) for b in range(drafts.shape[0])]
    return torch.tensor([o[0] for o in out]), torch.tensor([o[1] for o in out])


def _inputs(B, K, V, deterministic, g):
    tp = torch.rand(B, K + 1, V, generator=g) ** 4
    tp /= tp.sum(-1, keepdim=True)
    dp = None
    if deterministic or K == 0:
        drafts = tp[:, :K].argmax(-1)
        drafts[::3] = torch.randint(0, V, drafts[::3].shape, generator=g)
    else:
        dp = torch.rand(B, K, V, generator=g) ** 4
        dp /= dp.sum(-1, keepdim=True)
        drafts = torch.multinomial(dp.view(-1, V), 1, generator=g).view(B, K)
        tp[:, :K] = 0.5 * tp[:, :K] + 0.5 * dp  # runs of acceptances happen
    nd = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.where(torch.arange(K)[None] < nd[:, None], drafts, torch.full_like(drafts, -1))
    return drafts, dp, tp, nd, torch.rand(B, K, generator=g), torch.rand(B, generator=g)


def _draws_on_steps(drafts, dp, tp, nd, ua, g):
    """Uniform draws that land exactly on a CDF step of the distribution each row draws from (the
    reference's own), where a float CDF summed in another order would pick the neighbouring token."""
    ref = rejection_sample(drafts, dp, tp, nd, ua, torch.zeros(drafts.shape[0]))
    un = torch.empty(drafts.shape[0])
    for b in range(drafts.shape[0]):
        n = int(ref.num_accepted[b])
        t = tp[b, n].float()
        if n < int(nd[b]):
            q = dp[b, n].float() if dp is not None else torch.zeros_like(t).index_fill_(0, drafts[b, n], 1.0)
            res = fixed_point_weights((t - q).clamp(min=0.0))
            w = res if int(res.sum()) > RESIDUAL_EPS_FIXED else fixed_point_weights(t)
        else:
            w = fixed_point_weights(t)
        cdf = w.cumsum(0).double()
        j = int(torch.randint(0, t.shape[0] - 1, (1,), generator=g))
        un[b] = float(cdf[j] / cdf[-1])
    return un


@pytest.mark.parametrize("B,K,V,deterministic", [(12, 4, 50, False), (12, 3, 64, True), (8, 1, 33, False),
                                                 (6, 0, 20, False), (10, 5, 130, False)])
def test_blocked_order_draws_the_reference_tokens(B, K, V, deterministic):
    g = torch.Generator().manual_seed(B * 1000 + V)
    drafts, dp, tp, nd, ua, un = _inputs(B, K, V, deterministic, g)
    ref = rejection_sample(drafts, dp, tp, nd, ua, un)
    for block in (1, 3, 8, 32, 1 << (V - 1).bit_length()):
        n, tok = kernel_algorithm(drafts, dp, tp, nd, ua, un, block)
        assert torch.equal(n, ref.num_accepted), block
        assert torch.equal(tok, ref.next_token), block


def test_draws_on_cdf_steps_are_not_ties():
    """The draws most exposed to summation order: each exactly at a step of the row's CDF. The blocked
    scan and the sequential one still pick the same token (integer prefix sums are exact)."""
    g = torch.Generator().manual_seed(7)
    for deterministic in (False, True):
        drafts, dp, tp, nd, ua, _ = _inputs(16, 4, 96, deterministic, g)
        un = _draws_on_steps(drafts, dp, tp, nd, ua, g)
        ref = rejection_sample(drafts, dp, tp, nd, ua, un)
        for block in (5, 16, 128):
            n, tok = kernel_algorithm(drafts, dp, tp, nd, ua, un, block)
            assert torch.equal(n, ref.num_accepted) and torch.equal(tok, ref.next_token), (deterministic, block)


def test_a_float_cdf_in_blocked_order_would_differ():
    """The control: the same blocked scan on float32 sums (what the kernel did before the fixed-point CDF)
    picks another token than a sequential float32 cumsum for some on-step draws, so the tests above can
    tell a summation-order tie from an exact draw."""
    g = torch.Generator().manual_seed(3)
    differ = 0
    for _ in range(200):
        p = torch.rand(200, generator=g) ** 6
        p /= p.sum()
        cdf = p.cumsum(0)  # sequential float32
        j = int(torch.randint(1, 198, (1,), generator=g))
        goal = cdf[j]
        seq = int(torch.searchsorted(cdf, goal[None], right=True).clamp(max=199))
        prefix, blocked = torch.tensor(0.0), 199
        for v0 in range(0, 200, 16):  # the blocked order: block sums added to a running prefix
            c = prefix + p[v0:v0 + 16].cumsum(0)
            hit = (c > goal).nonzero()
            if len(hit):
                blocked = min(blocked, v0 + int(hit[0]))
            prefix = prefix + p[v0:v0 + 16].sum()
        differ += seq != blocked
    assert differ > 0
