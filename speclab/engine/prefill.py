"""Admitted requests join the batch: their prompts are prefilled together and each gets its first token.

Prompts of similar lengths (left to run) are prefilled in one forward, each group padded to its longest
only; with prefix caching a prompt's stored prefix is copied into its row and only the rest is run.
"""

from __future__ import annotations

import time

import torch

from ..events import RoundEvent
from .batch import sync
from .request import RUNNING, Request
from .rounds import prefill_round
from .sampling import RowParams, logits_to_probs, sample_from_probs
from .stopping import cut, finish

# Prompts prefilled in one forward are padded to the longest; a forward's fixed cost (the weights streamed once, some
# hundred kernel launches) is about that of a few dozen more prompt tokens for a small model on a CPU, so a group takes
# the next longer prompt while its padding stays within this many tokens
PREFILL_PAD_BUDGET = 32


def prefill_groups(lengths: list[int], budget: int = PREFILL_PAD_BUDGET) -> list[tuple[int, int]]:
    """Split prompt ``lengths`` (sorted ascending) into consecutive groups [a, b) whose padding to their longest,
    sum(max - length), is at most ``budget`` tokens. e.g. [10, 12, 40, 41], budget 8 -> [(0, 2), (2, 4)]."""
    groups, a = [], 0
    for b in range(1, len(lengths) + 1):
        if b == len(lengths) or (b - a + 1) * lengths[b] - sum(lengths[a:b + 1]) > budget:
            groups.append((a, b))
            a = b
    return groups


def admit_runs(rows: list[int], lengths: list[int], budget: int = PREFILL_PAD_BUDGET) -> list[tuple[int, int]]:
    """Rows to hand a drafter in groups ``range(a, b)``: runs of consecutive row indices (sorted ``rows``), each
    split where padding to the group's longest, sum(max - length), would pass ``budget`` tokens.
    e.g. rows [0, 1, 2, 5], lengths [10, 12, 90, 11] (by position in ``rows``) -> [(0, 2), (2, 3), (5, 6)]."""
    out: list[tuple[int, int]] = []
    a = 0
    for b in range(1, len(rows) + 1):
        if b < len(rows) and rows[b] == rows[b - 1] + 1:
            grp = lengths[a:b + 1]
            if len(grp) * max(grp) - sum(grp) <= budget:
                continue
        out.append((rows[a], rows[b - 1] + 1))
        a = b
    return out


class Prefill:
    """Prefills admitted requests into the rows after ``batch``'s running ones."""

    def __init__(self, batch, target, drafter, hooks, run_id: int, prefix=None, draft_features: tuple = ()):
        self.batch = batch
        self.target = target
        self.drafter = drafter  # None, or a drafter that drafts (k_max > 0)
        self.hooks = hooks
        self.run_id = run_id
        self.prefix = prefix
        self.draft_features = draft_features

    def run(self, reqs: list[Request], number: int, waiting: int) -> list[Request]:
        """Prefill ``reqs``, give each its first token, hand them to the drafter; returns those already done."""
        t0 = time.perf_counter()
        batch = self.batch
        r0 = len(batch)
        batch.grow(r0 + len(reqs))
        reqs, found, groups = self.plan(reqs)
        skip = [f[0] for f in found]
        for i, r in enumerate(reqs):
            r.start_rng(batch.device)
            r.context = list(r.prompt_ids)
            batch.buf[r0 + i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=batch.device)
            if skip[i]:
                batch.cache.load_prefix(r0 + i, found[i][1].k, found[i][1].v, skip[i])
        logits, out = self.forward(reqs, skip, groups, r0)
        feats = self.features(reqs, out, found) if self.draft_features else None
        if self.prefix is not None:
            for i, r in enumerate(reqs):
                self.prefix.store(r.prompt_ids, *batch.cache.row_kv(r0 + i),
                                  {layer: f[i] for layer, f in feats.items()} if feats else None)
        finished = self.first_tokens(reqs, logits, r0, t0, number, waiting, skip)
        if self.drafter is not None:
            self.admit(reqs, feats, groups, r0)
        done = [batch.rows[i] for i in finished]
        batch.leave(finished)
        return done

    def plan(self, reqs: list[Request]):
        """The requests in prefill order, each one's stored prefix (length, K/V) and the groups run together
        (hidden features for a drafter: one group, so that they stack)."""
        m = len(reqs)
        found = [self.prefix.lookup(r.prompt_ids, self.draft_features) for r in reqs] if self.prefix is not None \
            else [(0, None)] * m
        if m == 1 or self.draft_features:
            widest = max(len(r.prompt_ids) - f[0] for r, f in zip(reqs, found))
            # one group: a block padded to a batch-mate's width must still fit in every row's slots
            if self.prefix is not None and max(f[0] for f in found) + widest > self.batch.slots:
                for f in found:
                    self.prefix.unused(f[0])
                found = [(0, None)] * m
            return reqs, found, [(0, m)]
        order = sorted(range(m), key=lambda i: len(reqs[i].prompt_ids) - found[i][0])
        reqs, found = [reqs[i] for i in order], [found[i] for i in order]
        groups = prefill_groups([len(r.prompt_ids) - f[0] for r, f in zip(reqs, found)])
        if self.prefix is not None:  # a block padded to a batch-mate's width must fit in the row's slots
            groups = [g for a, b in groups for g in self._fit_slots(reqs, found, a, b)]
        return reqs, found, groups

    def _fit_slots(self, reqs, found, a: int, b: int) -> list[tuple[int, int]]:
        """Group [a, b) as it is, or one group per row when a row's stored prefix plus the group's widest block
        would run past the row's slots."""
        T = max(len(reqs[i].prompt_ids) - found[i][0] for i in range(a, b))
        if max(found[i][0] for i in range(a, b)) + T <= self.batch.slots:
            return [(a, b)]
        return [(i, i + 1) for i in range(a, b)]

    def forward(self, reqs, skip: list[int], groups, r0: int):
        """One target forward per group; returns the logits at each prompt's last position (m, V) and the last
        forward's output (its hidden features, for a drafter that reads them: one group then)."""
        batch, dev = self.batch, self.batch.device
        plen = [len(r.prompt_ids) for r in reqs]
        lens = torch.tensor(plen, device=dev)
        parts = []
        for a, b in groups:
            rows = slice(r0 + a, r0 + b)
            if not any(skip[a:b]):
                Lp = max(plen[a:b])
                pos = torch.arange(Lp, device=dev)[None].expand(b - a, Lp)
                out = batch.cache.forward(batch.buf[rows, :Lp], torch.zeros(b - a, dtype=torch.long, device=dev),
                                          kv_len=Lp, rows=rows, valid=pos < lens[a:b, None], last_only=lens[a:b] - 1,
                                          hidden=self.draft_features)
            else:  # rows start at their stored prefix: each row's block is the rest of its prompt
                left = [plen[i] - skip[i] for i in range(a, b)]
                T = max(left)
                block = torch.zeros(b - a, T, dtype=torch.long, device=dev)
                for j, i in enumerate(range(a, b)):
                    block[j, :left[j]] = batch.buf[r0 + i, skip[i]:plen[i]]
                start = torch.tensor(skip[a:b], device=dev)
                out = batch.cache.forward(block, start, kv_len=max(skip[a:b]) + T, rows=rows,
                                          last_only=torch.tensor(left, device=dev) - 1, hidden=self.draft_features)
            parts.append(out.logits[:, 0])  # (b - a, V)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), out

    def first_tokens(self, reqs, logits, r0: int, t0: float, number: int, waiting: int, skip: list[int]) -> list[int]:
        """Sample each request's first token, start its row, emit the prefill's event; returns the rows that are
        already done (an EOS, a one-token budget, a stop string)."""
        batch, dev, m = self.batch, self.batch.device, len(reqs)
        params = RowParams([r.params for r in reqs], dev)
        active = self.hooks.active
        want_probs = active and self.hooks.wants_probs  # display probabilities: only when a subscriber reads them
        first = logits.argmax(-1)  # (m,)
        probs = None
        if not params.all_greedy:
            probs = logits_to_probs(logits, params)
            u = torch.stack([torch.rand(1, generator=r.rng, device=dev)[0] if r.rng is not None
                             else torch.zeros((), device=dev) for r in reqs])
            first = torch.where(params.greedy, first, sample_from_probs(probs, u))
        elif want_probs:
            probs = logits.float().softmax(-1)
        lens = torch.tensor([len(r.prompt_ids) for r in reqs], device=dev)
        batch.buf[torch.arange(r0, r0 + m, device=dev), lens] = first
        batch.lengths[r0:r0 + m] = lens + 1
        first_h = first.tolist()
        fp_h = probs.gather(1, first[:, None]).squeeze(1).tolist() if probs is not None and want_probs else [None] * m
        now = time.perf_counter()
        events, finished = [], []
        for i, r in enumerate(reqs):
            new, reason = cut(self.target, r, [first_h[i]])
            r.generated.extend(new)
            r.context.extend(new)
            r.status = RUNNING
            r.first_token_time = now
            batch.rows.append(r)
            if reason is not None:
                finish(r, reason)
                finished.append(r0 + i)
            if active:
                events.append(prefill_round(r.row, first_h[i], fp_h[i], reason, r.request_id))
        if active:  # the first tokens are known now: the draft's own prefill (after this) does not delay them
            sync(dev)
            t1 = time.perf_counter()
            q, h = (sum(len(r.prompt_ids) for r in reqs), sum(skip)) if self.prefix is not None else (0, 0)
            self.hooks.emit(RoundEvent(self.run_id, number, t1, {"prefill": t1 - t0}, events, "prefill",
                                       len(batch) - len(finished), waiting, q, h))
        return finished

    def features(self, reqs, out, found) -> dict:
        """{layer: (m, L, C)}: the target's hidden features at every prompt position (L the longest prompt), a
        reused prefix's from its stored entry and the rest from this prefill's forward."""
        hidden = dict(out.hidden)
        if not any(f[0] for f in found):
            return hidden
        plen = [len(r.prompt_ids) for r in reqs]
        full = {}
        for layer, h in hidden.items():  # h (m, T, C): row i's block starts at its stored prefix's end
            f = h.new_zeros(len(reqs), max(plen), h.shape[-1])
            for i, (skip, entry) in enumerate(found):
                if skip:
                    f[i, :skip] = entry.features[layer][:skip]
                f[i, skip:plen[i]] = h[i, :plen[i] - skip]
            full[layer] = f
        return full

    def admit(self, reqs, feats, groups, r0: int) -> None:
        """Hand the drafter the new rows now (with ``feats``, the prompts' features, for a drafter that reads them),
        or mark them to be taken in before their first draft (a drafter that ``admits_late`` and reads no
        features): never, if a row never drafts."""
        if getattr(self.drafter, "admits_late", False) and not self.draft_features:
            for r in reqs:
                r.draft_pending = True
            return
        ctx = self.batch.draft_context()
        for a, b in groups:
            self.drafter.admit(ctx, range(r0 + a, r0 + b), feats)
