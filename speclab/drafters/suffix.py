"""Suffix decoding (Arctic Inference's, as vLLM ships it), without a model: the longest suffix of the context
that occurred before, and a draft whose length follows how long that match is.

Prompt lookup matches the last 1-3 tokens and always proposes k; suffix decoding matches as far back as the
text agrees (up to ``max_depth`` tokens) and proposes ``ceil(factor * match)`` tokens, capped by k: a long
match (a repeated JSON key path, a copied line of code) earns a long draft, a short match a short one, and a
match under ``min_match`` none (a round that drafts nothing is a plain step, with no verify of k + 1 rows to
pay). Matches are searched in the row's own prompt and output (Arctic Inference also keeps a tree of earlier
requests' outputs; speclab's drafters are fresh per run, so that cache would start empty every time).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SpeclabError
from .base import DraftContext, Proposal, StatelessDrafter


def longest_suffix_match(arr: np.ndarray, max_depth: int) -> tuple[int, int]:
    """(start of the continuation, match length) of the most recent earlier occurrence of the longest suffix
    of ``arr`` (at most ``max_depth`` tokens), or (-1, 0) when the last token never occurred before.

    e.g. arr = [1, 2, 3, 9, 2, 3]: the suffix [2, 3] occurred at 1..2, so the continuation starts at 3 (token 9)
    and the match is 2 tokens long."""
    L = len(arr)
    if L < 2:
        return -1, 0
    ends = np.flatnonzero(arr[:L - 1] == arr[L - 1])  # earlier positions holding the newest token
    if ends.size == 0:
        return -1, 0
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, min(max_depth, L - 1)):
        idx = ends - d
        ok = alive & (idx >= 0)
        ok[ok] = arr[idx[ok]] == arr[L - 1 - d]
        if not ok.any():
            break
        length += ok
        alive = ok
    best = int(length.max())
    h = int(ends[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
    return h + 1, best


class SuffixDrafter(StatelessDrafter):
    """Longest-suffix-match drafting with a draft length of ``ceil(factor * match)`` (at most k); no draft
    when the match is shorter than ``min_match``."""

    def __init__(self, max_depth: int = 24, factor: float = 1.0, min_match: int = 2):
        if not (1 <= int(max_depth) <= 256 and 0 < float(factor) <= 16 and 1 <= int(min_match) <= int(max_depth)):
            raise SpeclabError("suffix decoding needs 1 <= min_match <= max_depth <= 256 and 0 < factor <= 16")
        self.name = "suffix"
        self.max_depth, self.factor, self.min_match = int(max_depth), float(factor), int(min_match)

    def match(self, seq: list[int]) -> tuple[int, int]:
        """(continuation start, match length) in ``seq`` (see :func:`longest_suffix_match`)."""
        return longest_suffix_match(np.asarray(seq, dtype=np.int64), self.max_depth)

    def draft(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens after the longest earlier match of ``seq``'s suffix; [] under ``min_match``."""
        start, n = self.match(seq)
        if n < self.min_match:
            return []
        return [int(t) for t in seq[start:start + min(k, math.ceil(self.factor * n))]]

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        drafts = [self.draft(seq, ks[b]) if ks[b] else [] for b, seq in enumerate(ctx.host)]
        return Proposal.from_host(drafts, max(ks), ctx.tokens.device)
