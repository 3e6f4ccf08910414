"""The drafting contracts: what the engine hands a drafter and what it takes back.

A drafter returns data (vLLM's contract): :meth:`Drafter.propose` gives a :class:`Proposal` of token
ids, per-row lengths, and the distributions the tokens were drawn from (``None`` for a deterministic
drafter such as prompt lookup, scored as one-hot). A proposal is a chain, or a tree when it carries
``parents``. The engine never looks inside a drafter, and never imports one: drafters implement this
protocol from above (:mod:`speclab.drafters`).

Rows live in slots 0..n-1 of the scheduler (continuous batching): a request's row is *admitted*
(prefilled) into the next free slot, rows that finish leave, and the last row *moves* into the hole
so the running rows stay contiguous. A drafter that keeps per-row state (a KV cache) follows those
moves; a stateless one ignores them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch


@dataclass
class DraftContext:
    """What a drafter may read about the running rows 0..n-1. Row b's tokens are
    ``tokens[b, :lengths[b]]``; the last one is the newest, whose successor is to be drafted."""

    tokens: torch.Tensor  # (R, S) int64 buffer on the decoder's device (R >= n: capacity)
    lengths: torch.Tensor  # (n,) int64 on device
    host_lengths: list[int]
    host: list[list[int]]  # per running row, prompt + generated tokens
    costs: object | None = None  # speclab.engine.costs.OnlineCosts: measured step times (synthetic drafts)
    request_ids: list[str] = field(default_factory=list)  # per running row
    # the scheduler's target KV cache: self-drafters that run the target's own layers (early exit) write
    # draft K/V into it above each row's length; the verify forward rewrites those slots before reading them
    target_cache: object | None = None
    seeds: list[int] = field(default_factory=list)  # per running row: its request's seed (reproducible drafts)

    @property
    def n(self) -> int:
        return len(self.host_lengths)


@dataclass
class Verified:
    """What the target's verification committed this round, handed to :meth:`Drafter.commit`.

    Row b's block started at position ``start[b]`` (its newest token before the round) and the first
    ``kept[b]`` block tokens are now committed (the newest token plus the accepted drafts). ``features``
    are the target's hidden states over the block (layer -> (n, T, C)), when the drafter asked for them;
    ``path`` the node index of each kept token for a tree block (None: a chain, node i = token i)."""

    start: torch.Tensor  # (n,)
    kept: torch.Tensor  # (n,)
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    path: torch.Tensor | None = None  # (n, T) block indices of the kept tokens, -1 padded


@dataclass
class Proposal:
    tokens: torch.Tensor  # (n, N) int64, -1 = padding; a chain's N = k, a tree's N = its node count
    lengths: torch.Tensor  # (n,) int64, proposed tokens (or tree nodes) per row (<= N)
    probs: torch.Tensor | None = None  # (n, N, V) float32: the distributions tokens were drawn from
    token_probs: torch.Tensor | None = None  # (n, N) the draft's probability of each token (display)
    parents: torch.Tensor | None = None  # (n, N) tree: parent node index, -1 = the newest committed token

    @classmethod
    def from_host(cls, drafts: list[list[int]], width: int, device) -> "Proposal":
        """A deterministic chain (scored as one-hot) from each row's draft token ids on the host, padded with -1 to
        ``width`` columns (``len(drafts[b]) <= width``)."""
        out = torch.full((len(drafts), width), -1, dtype=torch.long)
        for b, cand in enumerate(drafts):
            if cand:
                out[b, :len(cand)] = torch.tensor(cand, dtype=torch.long)
        return cls(out.to(device), torch.tensor([len(c) for c in drafts], device=device))


# stop(i, probs) -> (n,) bool: do not draft token i of the row (draft distribution probs (n, V) at step i)
StopRule = Callable[[int, torch.Tensor], torch.Tensor]


@runtime_checkable
class Drafter(Protocol):
    """``admits_late`` (optional attribute, default False): :meth:`admit` reads all it needs from ``ctx`` and may
    run at any round after the prefill (on everything but the newest token), so a scheduler may put it off
    until the row first drafts; a row that never drafts (speculation off under load) never pays for it."""

    name: str
    features: tuple[int, ...]  # target hidden states it reads (layer indices, -1 = final); () = none

    def reset(self, capacity: int, max_len: int) -> None:
        """A fresh scheduler: room for ``capacity`` rows of ``max_len`` positions."""

    def admit(self, ctx: DraftContext, rows: range, features: dict[int, torch.Tensor] | None) -> None:
        """Rows ``rows`` were just prefilled (prompt + first token are in ``ctx``); ``features`` are the
        target's hidden states over their prompts, (len(rows), T, C) per layer. A drafter that ``admits_late``
        may instead be admitted later, with ``ctx`` holding the row's tokens so far and no features."""

    def propose(self, ctx: DraftContext, ks: list[int], params, uniform: torch.Tensor | None, want_probs: bool,
                stop: StopRule | None = None) -> Proposal:
        """Up to ``ks[b]`` tokens for row b. ``params`` is a RowParams; ``uniform`` (n, max(ks)) are the
        draws sampled rows draw with (None when every row is greedy); ``stop`` may end a row's draft early."""

    def commit(self, ctx: DraftContext, verified: Verified) -> None:
        """Verification is done: ``ctx.lengths`` are the rows' new lengths. Roll back what was rejected. Called
        after every round that proposed, and after every round for a drafter with ``features`` (it takes the
        target's hidden states of the committed tokens); a round in which nothing was proposed skips the others."""

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src`` now lives in slot ``dst`` (a finished row's slot is reused). Called only for rows this drafter
        has taken in (:meth:`admit`): a row a drafter that ``admits_late`` has not taken in yet is taken in at
        ``dst`` before it first drafts."""

    def release(self, n: int) -> None:
        """Only rows 0..n-1 are running now."""
