"""A head and a lookup in one drafter: the lookup's draft where the context repeats itself, the head's elsewhere.

Where the text copies what came before (a JSON key path, a repeated line of code) a suffix match of several
tokens predicts the next ones better than a small head does, and costs no forward at all; where it does not
(open prose, new code) the head drafts. Per round and row: a suffix match of at least ``min_match`` tokens
gives the suffix draft (``SuffixDrafter``'s length rule); otherwise the head's chain. When every row takes the
lookup's draft the head runs nothing that round: its :meth:`commit` keeps the target's features of the
committed tokens pending, and the next round it drafts in, it catches up on all of them in one step.
"""

from __future__ import annotations

import torch

from .base import DraftContext, Proposal, Verified
from .suffix import SuffixDrafter


class HybridDrafter:
    def __init__(self, head, lookup: SuffixDrafter | None = None, min_match: int = 3, name: str = "eagle+suffix"):
        self.head = head
        self.lookup = lookup if lookup is not None else SuffixDrafter(min_match=min_match)
        self.min_match = int(min_match)
        self.name = name
        self.features = getattr(head, "features", ())
        self.admits_late = getattr(head, "admits_late", False)
        self.tree = getattr(head, "tree", None)

    # the head's state follows the rows; the lookup keeps none
    def reset(self, capacity: int, max_len: int) -> None:
        self.head.reset(capacity, max_len)

    def admit(self, ctx: DraftContext, rows: range, features) -> None:
        self.head.admit(ctx, rows, features)

    def commit(self, ctx: DraftContext, verified: Verified) -> None:
        self.head.commit(ctx, verified)

    def move_row(self, src: int, dst: int) -> None:
        self.head.move_row(src, dst)

    def release(self, n: int) -> None:
        self.head.release(n)

    def _lookups(self, ctx: DraftContext, ks, params) -> list[list[int]]:
        """Per row, the suffix draft it takes this round, or []: greedy rows only, so a sampled row always drafts
        with the head and its draws never depend on which rows share its batch."""
        greedy = getattr(params, "greedy_rows", None) or [True] * ctx.n
        out = []
        for b, seq in enumerate(ctx.host):
            found = []
            if ks[b] and greedy[b]:
                _, n = self.lookup.match(seq)
                found = self.lookup.draft(seq, ks[b]) if n >= self.min_match else []
            out.append(found)
        return out

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        found = self._lookups(ctx, ks, params)
        k, dev = max(ks), ctx.tokens.device
        if all(found):  # every row repeats itself: no head forward this round
            return Proposal.from_host(found, k, dev)
        prop = self.head.propose(ctx, ks, params, uniform, want_probs, stop)
        if not any(found) or prop.parents is not None:
            return prop  # a tree: the head's draft
        tokens, lengths = prop.tokens.clone(), prop.lengths.clone()
        probs = prop.probs.clone() if prop.probs is not None else None
        tprobs = prop.token_probs.clone() if prop.token_probs is not None else None
        for b, cand in enumerate(found):
            if not cand:
                continue
            # a greedy row that repeats itself: the suffix draft, scored as one-hot (a deterministic draft)
            c = torch.tensor(cand, device=dev)
            tokens[b] = -1
            tokens[b, :len(cand)] = c
            lengths[b] = len(cand)
            if probs is not None:
                probs[b, :len(cand)] = 0
                probs[b, torch.arange(len(cand), device=dev), c] = 1
            if tprobs is not None:
                tprobs[b, :len(cand)] = 1
        return Proposal(tokens, lengths, probs, tprobs)
