"""The acceptance step fused into one Triton kernel: one program per row computes the
target/draft ratios at the drafted tokens, compares them with the uniform draws, finds the first
rejection, builds the residual max(target - draft, 0) (or takes the target's bonus distribution)
and samples from it by inverse CDF with the row's last uniform draw. The CDF is taken on fixed-point
integers (``speclab.engine.sampling.fixed_point_weights``), whose sums are exact in any order, so the
kernel's blocked scan and the reference's sequential one draw the same token.

Reference: :func:`speclab.engine.acceptance.rejection_sample` (same inputs, same outputs). The kernel
reads each row's probabilities once per vocabulary block and writes two integers; the reference
materialises a (B, V) residual. The engine calls it through
:func:`speclab.engine.acceptance.fused_rejection_sample` on CUDA when Triton is installed.

This folder imports nothing of speclab (the engine imports it, never the other way), and it is no
top-level package: ``kernels`` is the name of Hugging Face's kernel library, which transformers imports.
An install maps the folder to ``speclab.kernels`` (setup.py); a checkout finds it the same way
(speclab/__init__.py).

Offsets are int64 (:func:`row_offset`): a (B, K+1, V) tensor passes 2^31 elements at realistic sizes
(e.g. B = 1800, K = 7, V = 152064), where int32 element offsets wrap and read another row's memory.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: CUDA machines have it, CPU machines may not
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # noqa: BLE001
    HAVE_TRITON = False


def triton_available(device: torch.device | str) -> bool:
    """Can the kernel run for tensors on this device? (CUDA, or the interpreter on the CPU.)"""
    if not HAVE_TRITON:
        return False
    dev = torch.device(device)
    return dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if HAVE_TRITON:

    @triton.jit
    def row_offset(b, i, K, V):
        """Element offset of row (b, i) of a contiguous (B, K, V) tensor, in int64: b comes from
        ``tl.program_id`` and K, V from int arguments, all int32, and (b * K + i) * V passes 2^31 once
        B * K * V does. Widening b first makes every product after it int64."""
        return (b.to(tl.int64) * K + i) * V

    @triton.jit
    def _weights(t_row, d_row, v0, V, d_rej, use_res, HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr):
        """One vocabulary block of the distribution a token is drawn from, as fixed-point integer weights
        (``speclab.engine.sampling.fixed_point_weights``: float32 x 2^40, truncated): the residual
        max(target - draft, 0) when ``use_res``, else the target. A deterministic draft is one-hot at d_rej."""
        offs = v0 + tl.arange(0, BLOCK_V)
        m = offs < V
        t = tl.load(t_row + offs, mask=m, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(d_row + offs, mask=m, other=0.0)
        else:
            q = tl.where(offs == d_rej, 1.0, 0.0)
        p = tl.where(use_res != 0, tl.maximum(t - q, 0.0), t)
        return (p * 1099511627776.0).to(tl.int64)  # 2^40: exact in float32, as in the reference

    @triton.jit
    def _rejection_kernel(
        draft_tokens_ptr, draft_probs_ptr, target_probs_ptr, num_draft_ptr, u_accept_ptr, u_next_ptr,
        out_n_ptr, out_tok_ptr,
        K, V, min_mass,
        HAS_DRAFT_PROBS: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)  # every offset below is int64 (see row_offset)
        nd = tl.load(num_draft_ptr + b)
        # ---- first rejection: n = number of leading accepted drafts
        n = 0
        accepting = 1
        for i in range(0, K):
            d = tl.load(draft_tokens_ptr + b * K + i)
            d = tl.maximum(d, 0)
            pt = tl.load(target_probs_ptr + row_offset(b, i, K + 1, V) + d)
            if HAS_DRAFT_PROBS:
                pd = tl.load(draft_probs_ptr + row_offset(b, i, K, V) + d)
            else:
                pd = 1.0
            u = tl.load(u_accept_ptr + b * K + i)
            keep = (u * pd < pt) & (i < nd)
            accepting = accepting * keep.to(tl.int32)
            n += accepting
        rejected = (n < nd).to(tl.int32)  # 1 when the row rejected a draft
        slot = tl.minimum(n, K - 1)
        slot = tl.maximum(slot, 0)
        d_rej = tl.maximum(tl.load(draft_tokens_ptr + b * K + slot), 0)
        t_row = target_probs_ptr + row_offset(b, n, K + 1, V)
        d_row = draft_probs_ptr + row_offset(b, slot, K, V)
        # Integer sums are exact in any order: the blocked sums and scans below give the reference's
        # sequential values bit for bit, so the kernel draws the reference's token.
        # ---- pass 1: the residual's mass (when nothing was rejected, it is not used)
        mass = b * 0  # int64 zero
        for v0 in range(0, V, BLOCK_V):
            mass += tl.sum(_weights(t_row, d_row, v0, V, d_rej, rejected, HAS_DRAFT_PROBS, BLOCK_V), axis=0)
        use_res = rejected * (mass > min_mass).to(tl.int32)  # residual when rejected and it has mass
        # ---- pass 2: total of the chosen distribution; pass 3: inverse CDF
        total = b * 0
        for v0 in range(0, V, BLOCK_V):
            total += tl.sum(_weights(t_row, d_row, v0, V, d_rej, use_res, HAS_DRAFT_PROBS, BLOCK_V), axis=0)
        goal = (tl.load(u_next_ptr + b).to(tl.float64) * total.to(tl.float64)).to(tl.int64)
        prefix = b * 0
        found = V - 1
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            w = _weights(t_row, d_row, v0, V, d_rej, use_res, HAS_DRAFT_PROBS, BLOCK_V)
            c = prefix + tl.cumsum(w, axis=0)
            hit = (c > goal) & (offs < V)
            first = tl.min(tl.where(hit, offs, V), axis=0)
            found = tl.minimum(found, first)
            prefix += tl.sum(w, axis=0)
        tl.store(out_n_ptr + b, n)
        tl.store(out_tok_ptr + b, found)


def rejection_counts(draft_tokens, draft_probs, target_probs, num_draft, uniform_accept, uniform_next,
                     min_mass: int, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on the reference's inputs: (num_accepted, next_token), both (B,) int64. ``min_mass`` is the
    fixed-point mass below which a residual counts as empty and the target's distribution is sampled instead."""
    B, K = draft_tokens.shape
    V = target_probs.shape[-1]
    if block_v is None:
        block_v = min(triton.next_power_of_2(V), 4096)
    out_n = torch.empty(B, dtype=torch.int64, device=target_probs.device)
    out_tok = torch.empty(B, dtype=torch.int64, device=target_probs.device)
    tp = target_probs.float().contiguous()
    dp = draft_probs.float().contiguous() if draft_probs is not None and K > 0 else tp  # unused when absent
    dt = draft_tokens.contiguous() if K > 0 else torch.zeros(B, 1, dtype=torch.long, device=tp.device)
    ua = uniform_accept.float().contiguous() if K > 0 else torch.zeros(B, 1, device=tp.device)
    _rejection_kernel[(B,)](dt, dp, tp, num_draft.contiguous(), ua, uniform_next.float().contiguous(),
                            out_n, out_tok, K, V, min_mass,
                            HAS_DRAFT_PROBS=draft_probs is not None and K > 0, BLOCK_V=block_v)
    return out_n, out_tok
