"""Prompt lookup decoding: no model, the context itself is the draft."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import SpeclabError
from .base import DraftContext, Proposal, StatelessDrafter
from .trees import TreeShape, trie


class PromptLookupDrafter(StatelessDrafter):
    """Find the context's last n-gram earlier in the context and propose what followed it. Wins when
    the output copies the input (edits, code refactors, repeated structure).

    With a tree shape (``tree``: any of static/dynamic), the continuations after up to ``matches``
    earlier occurrences are merged into one token tree (:func:`~speclab.drafters.trees.trie`: shared
    prefixes once, the node budget spent where the most recent matches agree)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: TreeShape | None = None, matches: int = 4,
                 recency: float = 0.3, decay: float = 0.95):
        if not 1 <= min_ngram <= max_ngram:
            raise SpeclabError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 1 <= int(matches) <= 32:
            raise SpeclabError(f"prompt lookup matches must be in 1..32, got {matches}")
        self.tree = tree if tree is not None else TreeShape()
        self.name = "ngram" + (":" + self.tree.label() if self.tree.is_tree else "")
        if not (0 < recency <= 1 and 0 < decay <= 1):
            raise SpeclabError(f"prompt lookup recency and decay must be in (0, 1], got {recency}, {decay}")
        self.max_ngram, self.min_ngram, self.n_matches = max_ngram, min_ngram, int(matches)
        self.recency, self.decay = float(recency), float(decay)  # tree scores: weight of the j-th match, per level

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

    def weighted_matches(self, seq: list[int], k: int) -> tuple[list[list[int]], list[float]]:
        """Continuations for a tree: up to ``matches`` of them, those of the longest matching n-gram first
        (the ones :meth:`matches` gives), then those of shorter n-grams (backing off: an alternative where
        the longest match has no second occurrence). Weights: ``recency`` ** rank within an n-gram length,
        times ``recency`` per length backed off."""
        arr = np.asarray(seq)
        L = len(arr)
        out: list[list[int]] = []
        weights: list[float] = []
        level = 0
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # (L-n, n)
            hits = np.flatnonzero((win == arr[L - n:]).all(1))
            j = 0
            for h in hits[::-1]:
                cand = seq[int(h) + n:int(h) + n + k]
                if cand and cand not in out:
                    out.append(cand)
                    weights.append(self.recency ** (j + level))
                    j += 1
                if len(out) == self.n_matches:
                    return out, weights
            level += 1 if j else 0
        return out, weights

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """The continuation after the most recent match (the chain prompt lookup proposes)."""
        found = self.matches(seq, k, 1)
        return found[0] if found else []

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        if self.tree.is_tree:
            return self._propose_tree(ctx, ks)
        drafts = [self.lookup(seq, ks[b]) if ks[b] else [] for b, seq in enumerate(ctx.host)]
        return Proposal.from_host(drafts, max(ks), ctx.tokens.device)

    def _propose_tree(self, ctx: DraftContext, ks) -> Proposal:
        """Every row's matches merged into a tree of at most its budget of nodes; the most recent match
        weighs most (weights 1, r, r^2, ... with r = ``recency``)."""
        rows = []
        for b, seq in enumerate(ctx.host):
            budget = self.tree.budget(ks[b])
            found, weights = self.weighted_matches(seq, budget) if budget else ([], [])
            rows.append(trie(found, weights, budget, self.decay) if found else ([], [], []))
        N = max(len(t) for t, _, _ in rows)
        tokens = torch.full((ctx.n, N), -1, dtype=torch.long)
        parents = torch.full((ctx.n, N), -1, dtype=torch.long)
        for b, (t, p, _) in enumerate(rows):
            tokens[b, :len(t)] = torch.tensor(t, dtype=torch.long)
            parents[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        dev = ctx.tokens.device
        lengths = torch.tensor([len(t) for t, _, _ in rows], device=dev)
        return Proposal(tokens.to(dev), lengths, None, None, parents.to(dev))
