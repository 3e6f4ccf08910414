"""One verification round over the running rows: propose, verify, accept.

A round for a row with drafts d1..dk (k from the policy, capped so the round cannot overrun the
row's budget)::

    verify block  [tok[L-1], d1, ..., dk] written at slots L-1 .. L+k-1 -> target logits for
                  positions L .. L+k (k draft checks + 1 bonus)
    accept n      -> emit d1..dn and one recovered/bonus token; L' = L + n + 1
    rollback      the target cache keeps positions < L' - 1: moving the integer is the whole rollback

Rows of one round may draft different k (ragged); the block is padded to the widest row and padding is
never accepted. A tree proposal is verified in one forward too: [newest, nodes...] at positions
start + depth under the ancestor mask, and the accepted path's K/V move down to slot = position.

Exactness: a row's output depends on its prompt, settings and seed only. Greedy rows keep the
target's argmax; sampled rows draw every uniform from their own generator, in a layout fixed by their
own k (draft draws, acceptance draws, one draw for the next token), never by their batch-mates.

What is not the round's job stays out of it: admission and slots (:mod:`.scheduler`, :mod:`.batch`), the
events' token records (:mod:`.round_events`), and cost sampling, a subscriber of the clock readings each round
hands its listeners (:mod:`.cost_sampler`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..events import RoundEvent
from .acceptance import accept_rows
from .batch import sync
from .cost_sampler import RoundClock
from .drafting import Proposal, Verified
from .policies import PolicyView, RowView
from .prefill import admit_runs
from .rounds import row_events
from .sampling import RowParams
from .stopping import cut, finish
from .tree_verify import accept_tree_rows, block_path, keep_path, tree_inputs


@dataclass
class Drafts:
    """A round's drafts as the verify forward takes them."""

    tokens: torch.Tensor  # (n, kk) int64, -1 = padding (a tree: its nodes)
    num_draft: torch.Tensor  # (n,) drafts (or tree nodes) per row
    proposal: Proposal | None = None  # None: nobody drafted this round
    steps: int = 0  # draft steps run (for the cost model)
    tree: tuple | None = None  # (parents (n, kk), depth (n, kk+1), mask (n, kk+1, kk+1)) for a tree proposal


@dataclass
class Verdict:
    """What the target decided for every row: the acceptance result and the block written back."""

    result: object  # AcceptResult or TreeAcceptResult
    target_probs: torch.Tensor | None  # (n, kk+1, V) when sampled rows or a subscriber needed them
    block: torch.Tensor  # (n, kk+1) accepted tokens then the next token (padding past it)
    features: dict  # the target's hidden states over the block, for a drafter that reads them


def draw_uniforms(rows, ks: list[int], params: RowParams, kmax: int, device):
    """Per sampled row, 2k+1 uniforms from its own generator: k to draft with, k to accept with, one
    for the next token. Padded to (n, kmax) with values that are never used."""
    if params.all_greedy:
        return None, None, None
    n = len(rows)
    u_draft = torch.full((n, kmax), 0.5, device=device)
    u_acc = torch.zeros(n, kmax, device=device)
    u_next = torch.zeros(n, device=device)
    for b, r in enumerate(rows):
        if r.rng is None:
            continue
        k = ks[b]
        u = torch.rand(2 * k + 1, generator=r.rng, device=device)
        u_draft[b, :k] = u[:k]
        u_acc[b, :k] = u[k:2 * k]
        u_next[b] = u[2 * k]
    return u_draft, u_acc, u_next


class Round:
    """Runs the rounds of one scheduler over its :class:`~speclab.engine.batch.Batch`.

    ``listeners`` get each round's :class:`~speclab.engine.cost_sampler.RoundClock`; with none and no event
    subscriber the round never waits for the device to time itself."""

    def __init__(self, batch, target, drafter, policy, hooks, costs, reject, reject_tree, run_id: int,
                 draft_features: tuple = ()):
        self.batch = batch
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.hooks = hooks
        self.costs = costs
        self.reject = reject
        self.reject_tree = reject_tree
        self.run_id = run_id
        self.draft_features = draft_features
        self.listeners: list = []
        self.active = self.want_probs = False  # this round: an event subscriber, and one that reads probabilities
        self.t_last = time.perf_counter()  # when the last round ended (the "other" phase runs from there)

    @property
    def k_max(self) -> int:
        return self.policy.k_max if self.drafter is not None else 0

    def run(self, number: int, waiting: int, after_prefill: bool) -> list:
        """Round ``number`` over every running row (``waiting`` requests queued behind them); returns the requests
        that finished, which have left the batch."""
        rows, dev, clock = self.batch.rows, self.batch.device, self.costs.clock
        self.active = self.hooks.active
        self.want_probs = self.active and self.hooks.wants_probs  # display probabilities: only when read
        timed = self.active or bool(self.listeners)
        c0 = clock()
        params = RowParams([r.params for r in rows], dev)
        ks, why = self.choose(waiting)
        u_draft, u_acc, u_next = draw_uniforms(rows, ks, params, max(ks), dev)
        tc, cc = time.perf_counter(), clock()  # the policy's choice: paid every round, drafting or not (overhead)
        t_admit, c_admit, late = self.admit_late(timed) if max(ks) > 0 else (0.0, 0.0, 0)
        drafts = self.propose(ks, params, u_draft)
        if timed:
            sync(dev)
        t1, c1 = time.perf_counter(), clock()
        out = self.verify(drafts)
        if timed:
            sync(dev)
        t2, c2 = time.perf_counter(), clock()
        verdict = self.judge(drafts, out, params, u_acc, u_next)
        t_acc = time.perf_counter() if self.active else 0.0  # acceptance done: the rest is bookkeeping and events
        finished, events = self.accept(drafts, verdict, ks, why)
        if self.active:
            sync(dev)
            t3 = time.perf_counter()
            timings = {"draft": t1 - tc - t_admit, "verify": t2 - t1, "accept": t_acc - t2,
                       "bookkeeping": t3 - t_acc, "other": tc - self.t_last + t_admit}
            self.hooks.emit(RoundEvent(self.run_id, number, t3, timings, events, "verify",
                                       len(rows) - len(finished), waiting))
        done = [rows[b] for b in finished]
        n = len(rows)
        self.batch.leave(finished)
        self.t_last = time.perf_counter()
        rc = RoundClock(n, drafts.proposal is not None, drafts.steps, drafts.tokens.shape[1] + 1, after_prefill,
                        c0, cc, c1, c2, c_admit, late)
        for fn in self.listeners:
            fn(rc)
        return done

    # ------------------------------------------------------------------ choose
    def choose(self, waiting: int) -> tuple[list[int], list[str]]:
        """Each row's draft length this round and why (the policy's reason, or the budget that capped it)."""
        rows = self.batch.rows
        if self.drafter is None or self.k_max == 0:
            return [0] * len(rows), ["off"] * len(rows)
        view = PolicyView(tuple(RowView(r.request_id, r.history, r.pos_drafted, r.pos_accepted, r.remaining,
                                        r.params.greedy, len(r.prompt_ids), len(r.generated), not r.draft_pending)
                                for r in rows),
                          len(rows), waiting, self.costs)
        ks, why = [], []
        for r, c in zip(rows, self.policy.choose(view)):
            k = max(0, min(int(c.k), self.k_max, r.remaining - 1))  # a round emits up to k+1 tokens
            ks.append(k)
            why.append(c.reason if k == c.k else f"budget (policy: {c.reason})")
        return ks, why

    # ------------------------------------------------------------------ propose
    def admit_late(self, timed: bool) -> tuple[float, float, int]:
        """Hand the drafter the rows it has not taken in yet, before any of them drafts (every row, drafting or
        not, runs through a draft forward), grouped as :func:`~speclab.engine.prefill.admit_runs` says. Returns
        the seconds it took by the wall clock and by the cost table's clock, and the tokens it took in."""
        rows = self.batch.rows
        pending = [b for b, r in enumerate(rows) if r.draft_pending]
        if not pending or self.drafter is None or self.k_max == 0:
            return 0.0, 0.0, 0
        t, c = time.perf_counter(), self.costs.clock()
        ctx = self.batch.draft_context()
        lengths = [len(rows[i].context) for i in pending]
        for a, b in admit_runs(pending, lengths):
            self.drafter.admit(ctx, range(a, b), None)
        for b in pending:
            rows[b].draft_pending = False
        if timed:
            sync(self.batch.device)
        return time.perf_counter() - t, self.costs.clock() - c, sum(lengths) - len(lengths)

    def propose(self, ks: list[int], params: RowParams, u_draft) -> Drafts:
        """The drafter's proposal, cut to what the rows verify (a tree: laid out as its verify block)."""
        n, dev = len(self.batch.rows), self.batch.device
        if self.drafter is None or max(ks) == 0:
            return Drafts(torch.zeros(n, 0, dtype=torch.long, device=dev), torch.zeros(n, dtype=torch.long, device=dev))
        stop = self.policy.draft_stop()
        prop = self.drafter.propose(self.batch.draft_context(), ks, params, u_draft, want_probs=self.want_probs,
                                    stop=stop)
        steps = prop.tokens.shape[1]
        num_draft = torch.minimum(prop.lengths, torch.tensor(ks, device=dev))  # (n,)
        if prop.parents is not None:  # a tree: kk nodes per row (at most its k), verified in one forward
            tokens, parents, depth, mask = tree_inputs(prop.tokens, prop.parents, num_draft)
            return Drafts(tokens, num_draft, prop, steps, (parents, depth, mask))
        if stop is not None:  # drafts the stop rule ended: verify only what is left
            w = int(num_draft.max())
            prop = replace(prop, tokens=prop.tokens[:, :w],
                           probs=prop.probs[:, :w] if prop.probs is not None else None,
                           token_probs=prop.token_probs[:, :w] if prop.token_probs is not None else None)
        return Drafts(prop.tokens, num_draft, prop, steps)

    # ------------------------------------------------------------------ verify
    def verify(self, drafts: Drafts):
        """One target forward over [newest token, d1..dk] per row (a tree: [newest, nodes...] at positions
        start + depth under the ancestor mask)."""
        batch, dev = self.batch, self.batch.device
        n, kk = len(batch.rows), drafts.tokens.shape[1]
        start = batch.lengths[:n] - 1  # (n,) the newest token's slot
        newest = batch.buf[torch.arange(n, device=dev), start][:, None]  # (n, 1)
        inp = torch.cat([newest, drafts.tokens.clamp(min=0)], 1)  # (n, kk+1)
        kv_len = max(len(r.context) for r in batch.rows) + kk
        depth, mask = drafts.tree[1:] if drafts.tree else (None, None)
        return batch.cache.forward(inp, start, kv_len=kv_len, rows=slice(0, n), hidden=self.draft_features,
                                   depth=depth, tree_mask=mask)

    def judge(self, drafts: Drafts, out, params: RowParams, u_acc, u_next) -> Verdict:
        """The acceptance rule over the target's logits; the accepted tokens and the next one are written into the
        token buffer (a tree's accepted path also moves down to slot = position in the cache)."""
        batch, dev = self.batch, self.batch.device
        n, kk = len(batch.rows), drafts.tokens.shape[1]
        start = batch.lengths[:n] - 1
        dprobs = drafts.proposal.probs if drafts.proposal is not None else None
        if drafts.tree:  # the longest accepted root path
            res, tprobs = accept_tree_rows(drafts.tokens, drafts.tree[0], dprobs, out.logits, params, u_acc, u_next,
                                           want_probs=self.want_probs, reject=self.reject_tree)
            keep_path(batch.cache, n, start, res.path, res.num_accepted)
            seq = drafts.tokens.gather(1, res.path.clamp(min=0))  # (n, kk) the accepted tokens first
        else:
            res, tprobs = accept_rows(drafts.tokens, dprobs, out.logits, drafts.num_draft, params,
                                      u_acc[:, :kk] if u_acc is not None else None, u_next,
                                      want_probs=self.want_probs, reject=self.reject)
            seq = drafts.tokens
        block = torch.cat([seq.clamp(min=0), torch.zeros(n, 1, dtype=torch.long, device=dev)], 1)  # (n, kk+1)
        block[torch.arange(n, device=dev), res.num_accepted] = res.next_token
        batch.buf[:n].scatter_(1, start[:, None] + 1 + torch.arange(kk + 1, device=dev)[None], block)
        return Verdict(res, tprobs, block, out.hidden if self.draft_features else {})

    # ------------------------------------------------------------------ accept
    def accept(self, drafts: Drafts, verdict: Verdict, ks: list[int], why: list[str]) -> tuple[list[int], list]:
        """Each row keeps its accepted tokens and the next one (up to its stop), the lengths roll back, and the
        drafter learns what was kept. Returns the rows that finished and the rows' event records."""
        batch, res = self.batch, verdict.result
        rows = batch.rows
        start = batch.lengths[:len(rows)] - 1
        n_h, block_h, nd_h = res.num_accepted.tolist(), verdict.block.tolist(), drafts.num_draft.tolist()
        finished, kept, news = [], [], []
        for b, r in enumerate(rows):
            new, reason = cut(self.target, r, block_h[b][:n_h[b] + 1])
            news.append((len(r.generated), new, reason))
            r.generated.extend(new)
            r.context.extend(new)
            r.record_round(nd_h[b], n_h[b])
            kept.append(len(new))
            if reason is not None:
                finish(r, reason)
                finished.append(b)
        events = row_events(rows, drafts, verdict, news, ks, why, self.want_probs) if self.active else []
        batch.commit()
        # after a round without drafts only a drafter fed the target's features has anything to take in (a draft
        # model's cache is behind the committed tokens already, and catches up when it next drafts)
        if self.drafter is not None and self.k_max > 0 and (drafts.proposal is not None or self.draft_features):
            path = block_path(res.path, res.num_accepted) if drafts.tree else None
            self.drafter.commit(batch.draft_context(), Verified(start, torch.tensor(kept, device=batch.device),
                                                                verdict.features, path))
        return finished, events
