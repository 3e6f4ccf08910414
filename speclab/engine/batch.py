"""The running rows: which request lives in which slot of the caches, and each row's tokens and length.

Rows live in slots 0..n-1. Bookkeeping per running row b (host and device kept equal)::

    L = lengths[b]   tokens of row b so far (prompt + generated); the newest one, at L-1, has no K/V
                     in the target cache yet: it is the first input of the next verification.

When a row leaves, the last row moves into its slot, so the running rows stay contiguous and every
forward runs on a view of the caches. Rollback after a round is writing the new lengths: the target
cache keeps positions < L - 1 and the slots above are overwritten by the next block.
"""

from __future__ import annotations

import torch

from .drafting import DraftContext
from .request import Request


def sync(device: torch.device) -> None:
    """Wait for the device (timings on a GPU are meaningless without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batch:
    """Slots 0..capacity-1 of ``cache`` (the target's KV cache), a token buffer and a length per row, the
    requests that hold them (slot order), and ``drafter``'s per-row state kept in step with them."""

    def __init__(self, cache, capacity: int, slots: int, device, drafter=None, costs=None):
        self.cache = cache
        self.capacity = capacity
        self.slots = slots  # positions per row: context + one round's block of headroom
        self.device = device
        self.drafter = drafter
        self.costs = costs  # handed to drafters in their context (synthetic drafts read measured step times)
        self.buf = torch.zeros(capacity, slots, dtype=torch.long, device=device)  # (R, S) tokens per row
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=device)  # (R,)
        self.rows: list[Request] = []

    def __len__(self) -> int:
        return len(self.rows)

    def grow(self, rows: int) -> None:
        """Room for ``rows`` rows (at least doubling, so that joining requests one by one stays cheap)."""
        if rows <= self.capacity:
            return
        new = max(rows, 2 * self.capacity)
        self.cache.ensure_capacity(new)
        buf = torch.zeros(new, self.slots, dtype=torch.long, device=self.device)
        buf[: self.capacity] = self.buf
        lengths = torch.zeros(new, dtype=torch.long, device=self.device)
        lengths[: self.capacity] = self.lengths
        self.buf, self.lengths, self.capacity = buf, lengths, new

    def leave(self, idxs: list[int]) -> None:
        """Rows ``idxs`` leave; the last rows move into their slots (caches, tokens, lengths)."""
        if not idxs:
            return
        n = len(self.rows)
        gone = set(idxs)
        n2 = n - len(gone)
        holes = sorted(i for i in gone if i < n2)
        movers = [r for r in range(n2, n) if r not in gone]
        for src, dst in zip(movers, holes):
            L = len(self.rows[src].context)
            self.cache.move_row(src, dst, L)
            if self.drafter is not None and not self.rows[src].draft_pending:  # a row never taken in: nothing to move
                self.drafter.move_row(src, dst)  # (it is taken in where it now lives before it first drafts)
            self.buf[dst, :L] = self.buf[src, :L]
            self.lengths[dst] = self.lengths[src]
            self.rows[dst] = self.rows[src]
        self.rows = self.rows[:n2]
        release = getattr(self.cache, "release", None)
        if release is not None:
            release(n2)
        if self.drafter is not None:
            self.drafter.release(n2)

    def commit(self) -> None:
        """The rows' contexts are final for this round: their lengths follow (the rollback), and the target cache
        keeps every position before each row's newest token."""
        n = len(self.rows)
        self.lengths[:n] = torch.tensor([len(r.context) for r in self.rows], device=self.device)
        self.cache.commit(self.lengths[:n] - 1, rows=slice(0, n))

    def draft_context(self) -> DraftContext:
        """What a drafter may read about the running rows."""
        n = len(self.rows)
        return DraftContext(self.buf, self.lengths[:n], [len(r.context) for r in self.rows],
                            [r.context for r in self.rows], self.costs, [r.request_id for r in self.rows],
                            self.cache, seeds=[r.seed_used for r in self.rows])
