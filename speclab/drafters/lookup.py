"""Prompt lookup decoding: no model, the context itself is the draft."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SpeclabError
from .base import DraftContext, Proposal, StatelessDrafter


class PromptLookupDrafter(StatelessDrafter):
    """Find the context's last n-gram earlier in the context and propose what followed it. Wins when
    the output copies the input (edits, code refactors, repeated structure)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpeclabError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = "ngram"
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def matches(self, seq: list[int], k: int, limit: int = 1) -> list[list[int]]:
        """Up to ``limit`` continuations (k tokens at most) after the most recent earlier occurrences of the
        longest matching suffix n-gram, most recent first, distinct ones only.

        e.g. seq = [5, 6, 7, 9, 5, 6], k = 2: suffix [5, 6] occurs at 0, followed by [7, 9].
        """
        arr = np.asarray(seq)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = arr[L - n:]
            # windows starting at 0..L-n-1 (exclude the suffix itself)
            win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # (L-n, n)
            hits = np.flatnonzero((win == suffix).all(1))
            out: list[list[int]] = []
            for h in hits[::-1]:
                cand = seq[int(h) + n:int(h) + n + k]
                if cand and cand not in out:
                    out.append(cand)
                if len(out) == limit:
                    break
            if out:
                return out
        return []

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """The continuation after the most recent match (the chain prompt lookup proposes)."""
        found = self.matches(seq, k, 1)
        return found[0] if found else []

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n, k = ctx.n, max(ks)
        out = torch.full((n, k), -1, dtype=torch.long)
        lens = []
        for b, seq in enumerate(ctx.host):
            cand = self.lookup(seq, ks[b]) if ks[b] else []
            if cand:
                out[b, :len(cand)] = torch.tensor(cand)
            lens.append(len(cand))
        dev = ctx.tokens.device
        return Proposal(out.to(dev), torch.tensor(lens, device=dev), None, None)
