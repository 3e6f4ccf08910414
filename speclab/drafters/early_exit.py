"""Early-exit self-drafting (LayerSkip-style): the target's first m layers, its final norm and its LM
head draft; no second model, no second cache.

The draft runs on the scheduler's own target KV cache (``DraftContext.target_cache``). Row b holds
target K/V for positions < L - 1 (L = its length; the newest token, at L - 1, has none yet). Drafting
k tokens runs k forwards of one token through layers 0..m-1 only::

    step 0   newest token at slot L-1        -> layers < m write slot L-1,     logits for position L (d1)
    step i   d_i at slot L-1+i               -> layers < m write slot L-1+i,   logits for d_{i+1}

Why the target's output is unchanged: the draft writes only slots >= L - 1 (above the row's committed
K/V), and the verification forward that follows writes every layer's K/V at slots L-1 .. L-1+k, the
same slots, *before* any of its queries attend (the cached forward writes a layer's keys and values,
then attends). So every slot a verify query can see (slots < L - 1, untouched, and the block's own
slots, freshly rewritten) holds exactly what plain decoding would hold there; the stale draft K/V of
layers < m above the block is masked and overwritten later. The draft therefore changes which tokens
are proposed, never what the target computes: greedy output is identical to plain decoding (tested).

Prefix reuse is the point: the first m layers' K/V for the whole context are already in the target
cache, so a draft step costs m/n_layers of a target step plus the LM head, with no catch-up prefill.

An optional *tuned exit* (``exit_adapter``: a residual block and its own norm weight before the LM head,
trained by ``speclab train --heads --only exit-m<m>``) corrects the layer-m features; the target's own
layers are never changed.
"""

from __future__ import annotations

import torch

from ..errors import SpeclabError
from .base import DraftContext, Proposal, StatelessDrafter
from .chain import ChainDraft

# m by measurement on the shipped family (`speclab bench heads --exits`, docs/heads.md; k = 4, greedy, code,
# json and tech_prose): mean accepted length rises with m (1.36, 1.59, 1.91, 1.97, 2.62 for m = 1..5) and so
# does the round cost (2.1 to 4.3 plain steps), so no m pays on this CPU (speedups 0.54-0.65); the tuned exit
# at m = 3 is the best of all (2.41 tokens per round, 0.73x), so 3 is the default and the tuned exit's layer
DEFAULT_EXIT = 3


class EarlyExitDrafter(StatelessDrafter):
    """Drafts with the target's first ``m`` layers (+ final norm + LM head, or a trained exit adapter).
    Keeps no state of its own: the target cache is the only cache."""

    def __init__(self, target, m: int | None = None, adapter=None):
        native = getattr(target, "native", None)
        if native is None:
            raise SpeclabError(f"early-exit drafting needs the native backend; target '{target.name}' runs on "
                               f"'{getattr(target, 'backend', '?')}'")
        n_layers = native.cfg.n_layers
        m = DEFAULT_EXIT if m is None else int(m)
        if not 1 <= m < n_layers:
            raise SpeclabError(f"early exit m must be in 1..{n_layers - 1} for '{target.name}' "
                               f"({n_layers} layers), got {m}")
        self.target, self.native, self.m, self.adapter = target, native, m, adapter
        self.name = f"early-exit:{m}" + (":tuned" if adapter is not None else "")

    def _logits(self, ctx: DraftContext, tok: torch.Tensor, start: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One draft step: tok (n, 1) at slots start (n,) -> logits (n, V) for the next position."""
        cache = ctx.target_cache
        if cache is None or not getattr(cache, "supports_early_exit", False):
            raise SpeclabError("early-exit drafting needs the scheduler's native target cache")
        n = tok.shape[0]
        if self.adapter is None:
            return cache.forward(tok, start, kv_len=kv_len, rows=slice(0, n), layers=self.m).logits[:, -1]
        out = cache.forward(tok, start, kv_len=kv_len, rows=slice(0, n), layers=self.m, hidden=(self.m - 1,))
        return self.native.head(self.adapter(out.hidden[self.m - 1][:, -1]))  # (n, V)

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n, k = ctx.n, max(ks)
        L = ctx.lengths
        dev = L.device
        rows = torch.arange(n, device=dev)
        tok = ctx.tokens[rows, L - 1][:, None]  # (n, 1) the newest token: its K/V are not in the cache yet
        longest = max(ctx.host_lengths)
        chain = ChainDraft(ks, params, uniform, want_probs, stop, dev)
        for i in range(k):
            nxt, go_on = chain.step(self._logits(ctx, tok, L - 1 + i, longest + i))
            if not go_on:
                break
            tok = nxt[:, None]
        return chain.proposal()
