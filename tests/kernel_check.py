"""Run under TRITON_INTERPRET=1 (set before Triton is imported): the Triton acceptance kernel
against the pure PyTorch reference on random and hand-built inputs, and the kernel's offset arithmetic
at logical sizes past 2^31 elements. Exits non-zero on mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from speclab.engine.acceptance import fused_rejection_sample, rejection_sample  # noqa: E402
from speclab.engine.sampling import sample_from_probs  # noqa: E402
from speclab.kernels.rejection import HAVE_TRITON, row_offset, triton_available  # noqa: E402

assert HAVE_TRITON and triton_available("cpu")
g = torch.Generator().manual_seed(0)
mismatch_tok = 0
total = 0
for B, K, V, deterministic, block in [(16, 4, 50, False, 16), (16, 3, 64, True, 64), (8, 1, 33, False, 8),
                                      (8, 0, 20, False, 32), (12, 5, 130, False, 32)]:
    tp = torch.rand(B, K + 1, V, generator=g) ** 4
    tp /= tp.sum(-1, keepdim=True)
    dp = None if deterministic else torch.rand(B, K, V, generator=g) ** 4
    if dp is not None:
        dp /= dp.sum(-1, keepdim=True)
        drafts = sample_from_probs(dp, torch.rand(B, K, generator=g))
        # make some drafts very likely under the target too, so runs of acceptances happen
        tp[:, :K] = 0.5 * tp[:, :K] + 0.5 * dp
    else:
        drafts = tp[:, :K].argmax(-1)
        drafts[::3] = torch.randint(0, V, drafts[::3].shape, generator=g)
    nd = torch.randint(0, K + 1, (B,), generator=g)
    drafts = torch.where(torch.arange(K)[None] < nd[:, None], drafts, torch.full_like(drafts, -1))
    ua, un = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    ref = rejection_sample(drafts, dp, tp, nd, ua, un)
    got = fused_rejection_sample(drafts, dp, tp, nd, ua, un, block_v=block)
    assert torch.equal(ref.num_accepted, got.num_accepted), (B, K, V, ref.num_accepted, got.num_accepted)
    assert torch.equal(ref.is_bonus, got.is_bonus)
    mismatch_tok += int((ref.next_token != got.next_token).sum())
    total += B
# the CDF is taken on exact integers in both (blocked in the kernel, sequential in torch): no tie can differ
assert mismatch_tok == 0, (mismatch_tok, total)
# the residual that sums to ~0: target == draft, forced rejection
tp = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
dp = torch.tensor([[[0.5 + 1e-12, 0.5 - 1e-12, 0.0]]])
got = fused_rejection_sample(torch.tensor([[0]]), dp, tp, torch.tensor([1]), torch.tensor([[0.9999999]]),
                             torch.tensor([0.7]))
ref = rejection_sample(torch.tensor([[0]]), dp, tp, torch.tensor([1]), torch.tensor([[0.9999999]]),
                       torch.tensor([0.7]))
assert got.next_token.item() == ref.next_token.item() and got.num_accepted.item() == ref.num_accepted.item()
print(f"kernel ok: {total} rows, next tokens identical")

# ---- offsets past 2^31 elements. A (B, K+1, V) tensor that large cannot be allocated here, so a probe
# kernel runs the kernel's own offset function (row_offset) for program ids and sizes where the offsets
# pass 2^31, and the old int32 arithmetic beside it: the interpreter wraps int32 like the GPU does, so the
# old formula must come out wrong (the check can fail) and row_offset must come out exact.


@triton.jit
def _offset_probe(out_ptr, b0, i, K, V, WIDE: tl.constexpr):
    pid = tl.program_id(0)
    b = b0 + pid  # an int32, as tl.program_id(0) is in the kernel
    if WIDE:
        off = row_offset(b, i, K, V)
    else:
        off = (b * K + i) * V  # before the fix
    tl.store(out_ptr + pid, off)


# (first b, i, K (= k + 1 for target rows), V): Qwen-sized vocabulary at B = 1800 and k = 7; offsets at
# 2^31 - V .. 2^31 + V; a 256k vocabulary at B = 2048, k = 31
OFFSET_CASES = [(1796, 7, 8, 152064), (1023, 7, 8, 262144), (2044, 31, 32, 262144)]
for b0, i, K, V in OFFSET_CASES:
    n = 4
    wide = torch.zeros(n, dtype=torch.int64)
    narrow = torch.zeros(n, dtype=torch.int64)
    _offset_probe[(n,)](wide, b0, i, K, V, WIDE=True)
    _offset_probe[(n,)](narrow, b0, i, K, V, WIDE=False)
    exact = [((b0 + p) * K + i) * V for p in range(n)]
    assert wide.tolist() == exact, (b0, i, K, V, wide.tolist(), exact)
    past = [e >= 2**31 for e in exact]
    assert any(past), "the case does not pass 2^31"
    assert all((narrow[p].item() != exact[p]) == past[p] for p in range(n)), (narrow.tolist(), exact)
print(f"offsets ok: {len(OFFSET_CASES)} cases past 2^31 exact in int64, wrapped in int32 as before the fix")
