"""A separate small causal LM as the draft, with its own rollback-by-length cache; it drafts a chain or
a token tree (:mod:`.trees`)."""

from __future__ import annotations

import torch

from ..engine.sampling import logits_to_probs
from ..errors import SpeclabError
from ..limits import MAX_K
from .base import DraftContext, Proposal, Verified
from .chain import ChainDraft
from .trees import RowTree, TreeShape, grow_trees, pack_trees, tree_layout


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer. Its cache holds positions < dlen[b] of row b;
    each round it first catches up on the tokens it has not seen (1, or 2 after a bonus round, or more
    after rounds in which its row did not draft), then drafts step by step.

    With a tree shape, each level of the tree is one draft forward over every candidate expanded so far
    (positions by depth, the ancestor mask; slots from the row's length up, stale after the round): the
    draft's own cache never holds more than the committed tokens between rounds."""

    features: tuple[int, ...] = ()

    def __init__(self, lm, target_vocab: int, tree: TreeShape | None = None):
        self.lm = lm
        self.tree = tree if tree is not None else TreeShape()
        if self.tree.is_tree and lm.native is None:
            raise SpeclabError(f"tree drafts need the native backend; draft '{lm.name}' runs on '{lm.backend}'")
        self.name = lm.name + (":" + self.tree.label() if self.tree.is_tree else "")
        # admit prefills every token but the newest from ctx, so the scheduler may put it off until the row first
        # drafts; the generic backend's cache takes rows only in order of arrival (all rows, or new ones at the end)
        self.admits_late = lm.native is not None
        self.target_vocab = target_vocab
        self.cache = None
        self.dlen: torch.Tensor | None = None  # (R,) positions < dlen[b] are in this drafter's cache
        self.host_dlen: list[int] = []

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: padded heads differ in size, not in meaning."""
        V = self.target_vocab
        if logits.shape[-1] > V:
            return logits[..., :V]
        if logits.shape[-1] < V:
            pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], -1)
        return logits

    def reset(self, capacity: int, max_len: int) -> None:
        # a tree's expanded candidates sit above the row's length: room for the widest tree
        grow = (self.tree.nodes or MAX_K) * (self.tree.width if self.tree.kind == "dynamic" else 1)
        self.cache = self.lm.new_cache(capacity, max_len + (grow if self.tree.is_tree else 0))
        self.dlen = torch.zeros(capacity, dtype=torch.long, device=self.lm.device)
        self.host_dlen = [0] * capacity

    def admit(self, ctx: DraftContext, rows: range, features=None) -> None:
        """Prefill everything but each row's newest token (right after the target's prefill, or later: the scheduler
        puts it off until the row first drafts); the next propose feeds the newest one."""
        if len(self.host_dlen) < rows.stop:
            grow = rows.stop - len(self.host_dlen)
            self.host_dlen += [0] * grow
            self.dlen = torch.cat([self.dlen, self.dlen.new_zeros(grow)])
        self.cache.ensure_capacity(rows.stop)
        lens = [ctx.host_lengths[b] - 1 for b in rows]
        T = max(lens)
        m = len(lens)
        dev = ctx.tokens.device
        pos = torch.arange(T, device=dev)[None].expand(m, T)  # (m, T)
        lens_t = torch.tensor(lens, device=dev)
        self.cache.forward(ctx.tokens[rows.start:rows.stop, :T], torch.zeros(m, dtype=torch.long, device=dev),
                           kv_len=T, rows=slice(rows.start, rows.stop), valid=pos < lens_t[:, None],
                           last_only=torch.zeros(m, dtype=torch.long, device=dev))
        for i, b in enumerate(rows):
            self.host_dlen[b] = lens[i]
        self.dlen[rows.start:rows.stop] = lens_t

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n = ctx.n
        L, dlen = ctx.lengths, self.dlen[:n]
        dev = L.device
        k = max(ks)
        # catch up on tokens the draft has not seen: one block as wide as the most lagging row, ending at each
        # row's newest token (a row behind by less re-feeds committed tokens it already holds, marked not valid:
        # the same tokens at the same positions, so the native cache rewrites the same K/V and the generic
        # backend skips them). Ending at the newest token keeps every row's block inside its slots: a row taken
        # in late, near its end, beside rows that ran many plain rounds, would otherwise write past them.
        w = max(hl - dl for hl, dl in zip(ctx.host_lengths, self.host_dlen[:n]))
        start = (L - w).clamp(min=0)  # (n,) <= dlen; 0 for a row shorter than the block (padded after its tokens)
        pos = start[:, None] + torch.arange(w, device=dev)[None]  # (n, w)
        valid = (pos >= dlen[:, None]) & (pos < L[:, None])
        inp = ctx.tokens[:n].gather(1, pos.clamp(max=ctx.tokens.shape[1] - 1))  # (n, w)
        kv_len = max(max(hl - w, 0) + w for hl in ctx.host_lengths)
        logits = self.cache.forward(inp, start, kv_len=kv_len, rows=slice(0, n), valid=valid,
                                    last_only=L - start - 1).logits[:, -1]  # (n, V)
        if self.tree.is_tree:
            return self._propose_tree(ctx, ks, params, logits)
        chain = ChainDraft(ks, params, uniform, want_probs, stop, dev)
        for i in range(k):
            tok, go_on = chain.step(self._align(logits))
            if i < k - 1:  # the last draft token is never fed: the target verifies it
                if not go_on:
                    break  # every row has stopped: no more draft steps this round
                start = L + i  # (n,) the position token i sits at
                logits = self.cache.forward(tok[:, None], start, kv_len=max(ctx.host_lengths) + i + 1,
                                            rows=slice(0, n)).logits[:, -1]
        steps = len(chain)
        self.dlen[:n] = L + steps - 1
        self.host_dlen[:n] = [hl + steps - 1 for hl in ctx.host_lengths]
        return chain.proposal()

    def _propose_tree(self, ctx: DraftContext, ks, params, logits: torch.Tensor) -> Proposal:
        """Grow a tree per row from the draft's distribution after the newest token (``logits`` (n, V))."""
        n, L = ctx.n, ctx.lengths
        dev = L.device
        expanded: list[list[int]] = [[] for _ in range(n)]  # per row: pool indices in block order

        def expand(pools: list[RowTree], frontier: list[list[int]]) -> torch.Tensor:
            # one forward over every expanded candidate of each row (earlier levels again: their K/V must
            # sit in this block to be visible only to their own descendants)
            for b in range(n):
                expanded[b] += frontier[b]
            M = max(len(e) for e in expanded)
            toks, par, valid = [], [], []
            for b in range(n):
                where = {p: j for j, p in enumerate(expanded[b])}
                pad = M - len(expanded[b])
                toks.append([pools[b].tokens[p] for p in expanded[b]] + [0] * pad)
                par.append([where.get(pools[b].parents[p], -1) for p in expanded[b]] + [-1] * pad)
                valid.append([True] * len(expanded[b]) + [False] * pad)
            toks = torch.tensor(toks, dtype=torch.long).view(n, M)
            # over [root, block]: drop the root (already cached at L-1)
            depth, mask = tree_layout(torch.tensor(par, dtype=torch.long).view(n, M), torch.tensor(valid).view(n, M))
            out = self.cache.forward(toks.to(dev), L, kv_len=max(ctx.host_lengths) + M, rows=slice(0, n),
                                     depth=(depth[:, 1:] - 1).to(dev), tree_mask=mask[:, 1:, 1:].to(dev))
            Fm = max(len(f) for f in frontier)
            at = torch.tensor([[len(expanded[b]) - len(frontier[b]) + min(j, max(len(frontier[b]) - 1, 0))
                                for j in range(Fm)] for b in range(n)], dtype=torch.long)  # (n, F) block indices
            lg = self._align(out.logits).gather(1, at.to(dev)[..., None].expand(-1, -1, self.target_vocab))
            return logits_to_probs(lg, params)  # (n, F, V)

        budgets = [self.tree.budget(k) for k in ks]
        pools, chosen = grow_trees(self.tree, budgets, logits_to_probs(self._align(logits), params), expand)
        self.dlen[:n] = L
        self.host_dlen[:n] = list(ctx.host_lengths)
        tokens, parents, lengths, probs = pack_trees(pools, chosen, dev)
        return Proposal(tokens, lengths, None, probs, parents)

    def commit(self, ctx: DraftContext, verified: Verified | None = None) -> None:
        # cached draft tokens stay valid up to the row's last accepted token
        n = ctx.n
        self.dlen[:n] = torch.minimum(self.dlen[:n], ctx.lengths - 1)
        self.host_dlen[:n] = [min(d, hl - 1) for d, hl in zip(self.host_dlen[:n], ctx.host_lengths)]
        self.cache.commit(self.dlen[:n], rows=slice(0, n))

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst, self.host_dlen[src])
        self.dlen[dst] = self.dlen[src]
        self.host_dlen[dst] = self.host_dlen[src]

    def release(self, n: int) -> None:
        release = getattr(self.cache, "release", None)
        if release is not None:
            release(n)
