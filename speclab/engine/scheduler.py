"""The step scheduler: continuous batching over the one decode loop.

Requests wait in a bounded queue, join the running rows between rounds (their prompts are prefilled
together and each gets its first token), take part in every following verification round with their
own sampling settings, seed and draft length, and leave the moment they finish or are cancelled.

Rows live in slots 0..n-1 of the caches. Bookkeeping per running row b (host and device kept equal)::

    L = lengths[b]   tokens of row b so far (prompt + generated); the newest one, at L-1, has no K/V
                     in the target cache yet: it is the first input of the next verification.

A round for a row with drafts d1..dk (k from the policy, capped so the round cannot overrun the
row's budget):

    verify block  [tok[L-1], d1, ..., dk] written at slots L-1 .. L+k-1 -> target logits for
                  positions L .. L+k (k draft checks + 1 bonus)
    accept n      -> emit d1..dn and one recovered/bonus token; L' = L + n + 1
    rollback      the target cache keeps positions < L' - 1: moving the integer is the whole rollback

Rows of one round may draft different k (ragged); the block is padded to the widest row and padding is
never accepted. When a row leaves, the last row moves into its slot, so the running rows stay
contiguous and every forward runs on a view of the caches.

Exactness: a row's output depends on its prompt, settings and seed only. Greedy rows keep the
target's argmax; sampled rows draw every uniform from their own generator, in a layout fixed by their
own k (draft draws, acceptance draws, one draw for the next token), never by their batch-mates.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import replace

import torch

from ..errors import SpeclabError
from ..events import HookRegistry, RoundEvent
from ..limits import check_context
from ..models.cuda_graphs import graphed, use_cuda_graphs
from .acceptance import accept_rows, rejection_sample, tree_rejection_sample
from .costs import PLAIN_SAMPLES, OnlineCosts
from .policies import Off, PolicyView, RowView
from .request import FINISHED, RUNNING, WAITING, Request, find_stop
from .rounds import prefill_round, row_round, tree_row_round
from .sampling import RowParams, logits_to_probs, sample_from_probs

_run_ids = itertools.count(1)


# Prompts prefilled in one forward are padded to the longest; a forward's fixed cost (the weights streamed once,
# ~150 kernel launches) is about that of 30 more prompt tokens for the embedded family on a CPU (one row: 16 tokens
# 7.7 ms, 64 tokens 11.2 ms), so a group takes the next longer prompt while its padding stays within this many tokens
PREFILL_PAD_BUDGET = 32
# step costs: every steady round until this many samples are recorded (OnlineCosts.version), then one steady round in
# COST_STRIDE of each kind (drafting, plain). Recording is cheap alone (about 13 us a round) but not between two
# forwards, where its Python runs on cold caches: at one row it took 2.4% of a run that recorded every round
COST_WARM = 128
COST_STRIDE = 4


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


class QueueFull(SpeclabError):
    """The waiting queue is at its bound: the request was refused (servers answer 429)."""


def rejection_impl(device: torch.device):
    """The fused Triton kernel on CUDA when Triton is installed, else the pure PyTorch reference."""
    if device.type == "cuda":
        try:
            from ..kernels import fused_rejection_sample, triton_available

            if triton_available(device):
                return fused_rejection_sample
        except ImportError:
            pass
    return rejection_sample


def sync(device: torch.device) -> None:
    """Wait for the device (timings on a GPU are meaningless without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Scheduler:
    """Continuous batching for ``target`` with ``drafter`` (None: plain decoding) under ``policy``.

    Thread-safe entry points: :meth:`submit`, :meth:`cancel`, :meth:`counts`. :meth:`step` runs on one
    thread (the caller's, or the server's engine thread).
    """

    def __init__(self, target, drafter=None, policy=None, hooks: HookRegistry | None = None, *,
                 max_running: int = 64, max_waiting: int = 256, max_len: int | None = None,
                 capacity: int | None = None, costs: OnlineCosts | None = None, record_costs: bool = True,
                 run_id: int | None = None, cuda_graphs: bool | None = None, prefix_cache=None):
        self.target = target
        self.drafter = drafter
        self.policy = policy if (policy is not None and drafter is not None) else Off()
        self.hooks = hooks if hooks is not None else HookRegistry()
        self.max_running = max(1, int(max_running))
        self.max_waiting = max(0, int(max_waiting))
        self.k_max = self.policy.k_max if drafter is not None else 0
        self.context = min(max_len or target.max_context, target.max_context)  # prompt + generated per row
        self.slots = self.context + self.k_max + 2  # + one round's block of headroom
        self.device = target.device
        cap = max(1, min(capacity or self.max_running, self.max_running))
        self.cache = target.new_cache(cap, self.slots)
        self.capacity = cap
        self.buf = torch.zeros(cap, self.slots, dtype=torch.long, device=self.device)  # (R, S) tokens per row
        self.lengths = torch.zeros(cap, dtype=torch.long, device=self.device)  # (R,)
        self.rows: list[Request] = []  # slot order
        self.waiting: deque[Request] = deque()
        self.lock = threading.Lock()
        self._cancel: set[str] = set()
        self.round = 0
        self.run_id = run_id if run_id is not None else next(_run_ids)
        self.costs = costs if costs is not None else OnlineCosts()
        self.record_costs = record_costs
        self.reject = rejection_impl(self.device)
        self.reject_tree = tree_rejection_sample  # the multi-candidate rule (tests patch the module name)
        self.t_last = time.perf_counter()
        self._drafted_last = False  # did the last round draft (its draft phase is then a steady one's cost sample)
        self._drafted_ever = False  # has a round drafted yet (the first one is a fresh engine's warm-up: not a sample)
        self._admitted = False  # did this step prefill new rows before its round (a plain step then runs cold)
        self._unsampled = [0, 0]  # steady plain / drafting rounds since the last one whose costs were recorded
        self.draft_features = tuple(getattr(drafter, "features", ()) or ()) if drafter is not None else ()
        # prefix caching (speclab.engine.prefix_cache): the native cache only, and not for drafters that read the
        # target's features at every prompt position (a reused prefix has none)
        self.prefix = prefix_cache if (prefix_cache is not None and not self.draft_features
                                       and hasattr(self.cache, "load_prefix")) else None
        if drafter is not None:
            drafter.reset(cap, self.slots)
        # CUDA graphs for the decode and verify forwards (None: on for CUDA); a model drafter's own cache too
        self.cuda_graphs = use_cuda_graphs(cuda_graphs, self.device)
        if self.cuda_graphs:  # pooled per model: the next run finds the graphs captured (see cuda_graphs)
            self.cache = graphed(self.cache, self.k_max + 1, owner=self)
            if drafter is not None and hasattr(drafter, "cache"):
                drafter.cache = graphed(drafter.cache, self.k_max + 1, owner=self)

    # ------------------------------------------------------------------ requests in and out
    def validate(self, req: Request) -> None:
        """Refuse, up front and in one line, what this scheduler cannot run."""
        if not req.prompt_ids:
            raise SpeclabError("the prompt encodes to no tokens")
        if req.max_new_tokens < 1:
            raise SpeclabError(f"max_new_tokens must be at least 1, got {req.max_new_tokens}")
        check_context(len(req.prompt_ids), req.max_new_tokens, self.context, self.target.name)
        dlm = getattr(self.drafter, "lm", None)
        if dlm is not None and self.k_max > 0:
            from ..models import check_draft_context

            check_draft_context(self.target, dlm, len(req.prompt_ids) + req.max_new_tokens)

    def submit(self, req: Request) -> Request:
        """Queue a request; :class:`QueueFull` when the queue is at its bound."""
        self.validate(req)
        with self.lock:
            room = self.max_waiting + max(0, self.max_running - len(self.rows))  # free slots admit at the next step
            if len(self.waiting) >= room:
                raise QueueFull(f"the queue is full ({len(self.rows)} running, {len(self.waiting)} waiting; "
                                f"at most {self.max_running} running and {self.max_waiting} waiting)")
            req.status = WAITING
            self.waiting.append(req)
        return req

    def cancel(self, request_id: str) -> None:
        """Cancel a waiting or running request; it leaves before the next round."""
        with self.lock:
            self._cancel.add(request_id)

    def counts(self) -> tuple[int, int]:
        with self.lock:
            return len(self.rows), len(self.waiting)

    @property
    def idle(self) -> bool:
        with self.lock:
            return not self.rows and not self.waiting

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit what fits, prefill it, run one verification round; returns the requests that finished."""
        done: list[Request] = []
        with self.lock:
            cancels, self._cancel = self._cancel, set()
            if cancels:
                kept = deque()
                for r in self.waiting:
                    if r.request_id in cancels:
                        self._finish(r, "cancelled")
                        done.append(r)
                    else:
                        kept.append(r)
                self.waiting = kept
            free = self.max_running - len(self.rows)
            admit = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if cancels:
            gone = [i for i, r in enumerate(self.rows) if r.request_id in cancels]
            for i in gone:
                self._finish(self.rows[i], "cancelled")
                done.append(self.rows[i])
            self._leave(gone)
        if admit:
            done += self._prefill(admit)
        self._admitted = bool(admit)
        if self.rows:
            done += self._round()
        return done

    def _finish(self, req: Request, reason: str) -> None:
        req.status = FINISHED
        req.finish_reason = req.finish_reason or reason
        req.finish_time = time.perf_counter()

    # ------------------------------------------------------------------ slots
    def _grow(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        new = max(rows, 2 * self.capacity)
        self.cache.ensure_capacity(new)
        buf = torch.zeros(new, self.slots, dtype=torch.long, device=self.device)
        buf[: self.capacity] = self.buf
        lengths = torch.zeros(new, dtype=torch.long, device=self.device)
        lengths[: self.capacity] = self.lengths
        self.buf, self.lengths, self.capacity = buf, lengths, new

    def _leave(self, idxs: list[int]) -> None:
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

    def _ctx(self):
        from ..drafters.base import DraftContext

        n = len(self.rows)
        return DraftContext(self.buf, self.lengths[:n], [len(r.context) for r in self.rows],
                            [r.context for r in self.rows], self.costs, [r.request_id for r in self.rows],
                            self.cache, seeds=[r.seed_used for r in self.rows])

    # ------------------------------------------------------------------ stopping
    def _cut(self, req: Request, new: list[int]) -> tuple[list[int], str | None]:
        """The part of ``new`` the request keeps, and why it ends (None: it goes on).

        Every EOS id ends it (the EOS token is kept), so does its budget, so does a stop string (the
        output text ends before it; the tokens up to the one that completed it are kept)."""
        reason = None
        if not req.ignore_eos:
            eos = self.target.eos_token_ids
            for i, t in enumerate(new):
                if t in eos:
                    new, reason = new[: i + 1], "eos"
                    break
        if len(new) >= req.remaining:
            new = new[: req.remaining]
            reason = reason or "length"
        if req.stop and new:
            dec = self.target.decode
            before = len(dec(req.generated))
            longest = max(len(s) for s in req.stop)
            for m in range(1, len(new) + 1):
                text = dec(req.generated + new[:m])
                at = find_stop(text, req.stop, search_from=max(0, before - longest + 1))
                if at is not None:
                    req.stop_at = at
                    return new[:m], "stop"
        return new, reason

    # ------------------------------------------------------------------ prefill
    def _prefill(self, reqs: list[Request]) -> list[Request]:
        dev = self.device
        t0 = time.perf_counter()
        r0, m = len(self.rows), len(reqs)
        self._grow(r0 + m)
        # with prefix caching, a prompt's stored prefix is copied into its row and only the rest is run
        found = [self.prefix.lookup(r.prompt_ids) for r in reqs] if self.prefix is not None else [(0, None)] * m
        # prompts of similar lengths (left to run) are prefilled together, each group padded to its longest only
        # (hidden features for a drafter: one group, so that they stack)
        groups = [(0, m)]
        if m > 1 and not self.draft_features:
            order = sorted(range(m), key=lambda i: len(reqs[i].prompt_ids) - found[i][0])
            reqs, found = [reqs[i] for i in order], [found[i] for i in order]
            groups = prefill_groups([len(r.prompt_ids) - f[0] for r, f in zip(reqs, found)])
            if self.prefix is not None:  # a block padded to a batch-mate's width must fit in the row's slots
                groups = [g for a, b in groups for g in self._fit_slots(reqs, found, a, b)]
        plen = [len(r.prompt_ids) for r in reqs]
        skip = [f[0] for f in found]
        for i, r in enumerate(reqs):
            r.start_rng(dev)
            r.context = list(r.prompt_ids)
            self.buf[r0 + i, : plen[i]] = torch.tensor(r.prompt_ids, device=dev)
            if skip[i]:
                self.cache.load_prefix(r0 + i, found[i][1].k, found[i][1].v, skip[i])
        lens = torch.tensor(plen, device=dev)
        parts = []
        for a, b in groups:
            if not any(skip[a:b]):
                Lp = max(plen[a:b])
                pos = torch.arange(Lp, device=dev)[None].expand(b - a, Lp)
                out = self.cache.forward(self.buf[r0 + a:r0 + b, :Lp], torch.zeros(b - a, dtype=torch.long, device=dev),
                                         kv_len=Lp, rows=slice(r0 + a, r0 + b), valid=pos < lens[a:b, None],
                                         last_only=lens[a:b] - 1, hidden=self.draft_features)
            else:  # rows start at their stored prefix: each row's block is the rest of its prompt
                left = [plen[i] - skip[i] for i in range(a, b)]
                T = max(left)
                block = torch.zeros(b - a, T, dtype=torch.long, device=dev)
                for j, i in enumerate(range(a, b)):
                    block[j, :left[j]] = self.buf[r0 + i, skip[i]:plen[i]]
                start = torch.tensor(skip[a:b], device=dev)
                out = self.cache.forward(block, start, kv_len=max(skip[a:b]) + T, rows=slice(r0 + a, r0 + b),
                                         last_only=torch.tensor(left, device=dev) - 1, hidden=self.draft_features)
            parts.append(out.logits[:, 0])  # (b - a, V)
        if self.prefix is not None:
            for i, r in enumerate(reqs):
                self.prefix.store(r.prompt_ids, *self.cache.row_kv(r0 + i))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # (m, V)
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
        self.buf[torch.arange(r0, r0 + m, device=dev), lens] = first
        self.lengths[r0:r0 + m] = lens + 1
        first_h = first.tolist()
        fp_h = probs.gather(1, first[:, None]).squeeze(1).tolist() if probs is not None and want_probs else [None] * m
        now = time.perf_counter()
        events, finished = [], []
        for i, r in enumerate(reqs):
            new, reason = self._cut(r, [first_h[i]])
            r.generated.extend(new)
            r.context.extend(new)
            r.status = RUNNING
            r.first_token_time = now
            self.rows.append(r)
            if reason is not None:
                self._finish(r, reason)
                finished.append(r0 + i)
            if active:
                events.append(prefill_round(r.row, first_h[i], fp_h[i], reason, r.request_id))
        if active:  # the first tokens are known now: the draft's own prefill (below) does not delay them
            sync(dev)
            t1 = time.perf_counter()
            run, wait = len(self.rows) - len(finished), len(self.waiting)
            q, h = (sum(plen), sum(skip)) if self.prefix is not None else (0, 0)
            self.hooks.emit(RoundEvent(self.run_id, self.round, t1, {"prefill": t1 - t0}, events, "prefill", run, wait,
                                       q, h))
        if self.drafter is not None and self.k_max > 0:
            if getattr(self.drafter, "admits_late", False) and not self.draft_features:
                for r in reqs:  # taken in before the row's first draft (_admit_late): never, if it never drafts
                    r.draft_pending = True
            else:
                feats = dict(out.hidden) if self.draft_features else None
                ctx = self._ctx()
                for a, b in groups:
                    self.drafter.admit(ctx, range(r0 + a, r0 + b), feats)
        done = [self.rows[i] for i in finished]
        self._leave(finished)
        return done

    def _fit_slots(self, reqs, found, a: int, b: int) -> list[tuple[int, int]]:
        """Group [a, b) as it is, or one group per row when a row's stored prefix plus the group's widest block
        would run past the row's slots."""
        T = max(len(reqs[i].prompt_ids) - found[i][0] for i in range(a, b))
        if max(found[i][0] for i in range(a, b)) + T <= self.slots:
            return [(a, b)]
        return [(i, i + 1) for i in range(a, b)]

    def _admit_late(self) -> tuple[float, float]:
        """Hand the drafter the rows it has not taken in yet (every row, drafting or not, runs through a draft
        forward), grouped as :func:`admit_runs` says; returns the seconds it took by the wall clock and by the cost
        table's clock (:attr:`OnlineCosts.clock`)."""
        pending = [b for b, r in enumerate(self.rows) if r.draft_pending]
        if not pending:
            return 0.0, 0.0
        t, c = time.perf_counter(), self.costs.clock()
        ctx = self._ctx()
        lengths = [len(self.rows[i].context) for i in pending]
        for a, b in admit_runs(pending, lengths):
            self.drafter.admit(ctx, range(a, b), None)
        for b in pending:
            self.rows[b].draft_pending = False
        if self.hooks.active or self.record_costs:
            sync(self.device)
        spent, cost = time.perf_counter() - t, self.costs.clock() - c
        if self.record_costs:
            self.costs.record_draft_prefill(sum(lengths) - len(lengths), cost)
        return spent, cost

    # ------------------------------------------------------------------ one verification round
    def _draws(self, ks: list[int], params: RowParams, kmax: int):
        """Per sampled row, 2k+1 uniforms from its own generator: k to draft with, k to accept with, one
        for the next token. Padded to (n, kmax) with values that are never used."""
        if params.all_greedy:
            return None, None, None
        dev, n = self.device, len(self.rows)
        u_draft = torch.full((n, kmax), 0.5, device=dev)
        u_acc = torch.zeros(n, kmax, device=dev)
        u_next = torch.zeros(n, device=dev)
        for b, r in enumerate(self.rows):
            if r.rng is None:
                continue
            k = ks[b]
            u = torch.rand(2 * k + 1, generator=r.rng, device=dev)
            u_draft[b, :k] = u[:k]
            u_acc[b, :k] = u[k:2 * k]
            u_next[b] = u[2 * k]
        return u_draft, u_acc, u_next

    def _choose(self) -> tuple[list[int], list[str]]:
        rows = self.rows
        if self.drafter is None or self.k_max == 0:
            return [0] * len(rows), ["off"] * len(rows)
        view = PolicyView(tuple(RowView(r.request_id, r.history, r.pos_drafted, r.pos_accepted, r.remaining,
                                        r.params.greedy, len(r.prompt_ids), len(r.generated), not r.draft_pending)
                                for r in rows),
                          len(rows), len(self.waiting), self.costs)
        choices = self.policy.choose(view)
        ks, why = [], []
        for r, c in zip(rows, choices):
            k = max(0, min(int(c.k), self.k_max, r.remaining - 1))  # a round emits up to k+1 tokens
            ks.append(k)
            why.append(c.reason if k == c.k else f"budget (policy: {c.reason})")
        return ks, why

    def _round(self) -> list[Request]:
        dev, drafter = self.device, self.drafter
        rows = self.rows
        n = len(rows)
        active = self.hooks.active
        want_probs = active and self.hooks.wants_probs  # display probabilities: only when a subscriber reads them
        timed = active or self.record_costs
        # the phases as events report them: the wall clock; cost samples: the cost table's clock (the thread's CPU
        # time on a CPU with one torch thread, see OnlineCosts.clock: at two engine cores sharing 2 CPUs with the
        # HTTP side, wall-clock samples taken while the core was preempted priced one core's verify blocks at 8 rows
        # at 3.7x a plain step against the other core's 1.9x, and that core drafted k = 1 where k = 4 paid)
        clock = self.costs.clock
        c0 = clock()
        self.round += 1
        params = RowParams([r.params for r in rows], dev)
        ks, why = self._choose()
        kmax = max(ks)
        u_draft, u_acc, u_next = self._draws(ks, params, kmax)
        tc, cc = time.perf_counter(), clock()  # the policy's choice: paid every round, drafting or not (overhead)

        # ---- draft
        prop = None
        t_admit = c_admit = 0.0  # the drafter's late prefill of rows drafting for the first time: not the draft phase
        if drafter is not None and kmax > 0:
            t_admit, c_admit = self._admit_late()
            stop = self.policy.draft_stop()
            prop = drafter.propose(self._ctx(), ks, params, u_draft, want_probs=want_probs, stop=stop)
            steps = prop.tokens.shape[1]  # draft steps run (for the cost model)
            num_draft = torch.minimum(prop.lengths, torch.tensor(ks, device=dev))  # (n,)
            if stop is not None and prop.parents is None:  # drafts the stop rule ended: verify only what is left
                w = int(num_draft.max())
                prop = replace(prop, tokens=prop.tokens[:, :w],
                               probs=prop.probs[:, :w] if prop.probs is not None else None,
                               token_probs=prop.token_probs[:, :w] if prop.token_probs is not None else None)
            d_tokens = prop.tokens  # (n, kk)
            if prop.parents is not None:  # a tree: kk nodes per row (at most its k), verified in one forward
                from .tree_verify import tree_inputs

                d_tokens, parents, depth, tmask = tree_inputs(d_tokens, prop.parents, num_draft)
        else:
            d_tokens = torch.zeros(n, 0, dtype=torch.long, device=dev)
            num_draft = torch.zeros(n, dtype=torch.long, device=dev)
        kk = d_tokens.shape[1]
        if timed:
            sync(dev)
        t1, c1 = time.perf_counter(), clock()
        # steady rounds only: right after a round without drafts the draft's weights are cold and its cache catches
        # up on every plain round's token, a switching cost a policy pays once, not per drafting round; likewise a
        # plain step right after a drafting round runs the target's weights cold (the draft's forwards and the
        # verify block displaced them), and so does one right after a prefill in the same step (on code at 4 rows:
        # 3.9 ms against 2.4-2.6 ms steady; a policy timing its first plain steps at a burst's start read them all
        # there). Nor is the first drafting round of a fresh scheduler: it touches the draft's cache and the verify's
        # buffers for the first time (in a forked engine process, a verify of 5 tokens at one row took 6.5 ms there
        # against 2.5-3.1 ms in the rounds after, and as the first sample of its shape it priced drafting off). Of
        # those, every one while the tables are young, then one in COST_STRIDE
        sample = False
        if self.record_costs and (self._drafted_ever if prop is not None
                                  else not (self._drafted_last or self._admitted)):
            kind = prop is not None
            if (self.costs.version < COST_WARM or self._unsampled[kind] >= COST_STRIDE - 1
                    or (not kind and self.costs.plain_samples(n) < PLAIN_SAMPLES)):  # a level's first plain steps
                sample, self._unsampled[kind] = True, 0
            else:
                self._unsampled[kind] += 1
        if sample and prop is not None and self._drafted_last:
            self.costs.record_draft(n, steps, c1 - cc - c_admit)

        # ---- verify: one target forward over [newest token, d1..dk] per row (a tree: [newest, nodes...] with
        # positions start + depth and the ancestor mask)
        tree = prop is not None and prop.parents is not None
        L = self.lengths[:n]
        hlen = [len(r.context) for r in rows]
        r_idx = torch.arange(n, device=dev)
        start = L - 1  # (n,)
        inp = torch.cat([self.buf[r_idx, start][:, None], d_tokens.clamp(min=0)], 1)  # (n, kk+1)
        out = self.cache.forward(inp, start, kv_len=max(hlen) + kk, rows=slice(0, n), hidden=self.draft_features,
                                 depth=depth if tree else None, tree_mask=tmask if tree else None)
        logits = out.logits  # (n, kk+1, V)
        if timed:
            sync(dev)
        t2, c2 = time.perf_counter(), clock()
        if sample:
            self.costs.record_target(n, kk + 1, c2 - c1)

        # ---- accept, write, roll back
        if tree:  # the longest accepted root path; its K/V move down to slot = position
            from .tree_verify import accept_tree_rows, block_path, keep_path

            res, tprobs = accept_tree_rows(d_tokens, parents, prop.probs, logits, params, u_acc, u_next,
                                           want_probs=want_probs, reject=self.reject_tree)
            keep_path(self.cache, n, start, res.path, res.num_accepted)
            seq = d_tokens.gather(1, res.path.clamp(min=0))  # (n, kk) the accepted tokens first
        else:
            res, tprobs = accept_rows(d_tokens, prop.probs if prop is not None else None, logits, num_draft, params,
                                      u_acc[:, :kk] if u_acc is not None else None, u_next, want_probs=want_probs,
                                      reject=self.reject)
            seq = d_tokens
        t_acc = time.perf_counter() if active else 0.0  # acceptance done: the rest is bookkeeping and events
        block = torch.cat([seq.clamp(min=0), torch.zeros(n, 1, dtype=torch.long, device=dev)], 1)  # (n, kk+1)
        block[r_idx, res.num_accepted] = res.next_token
        self.buf[:n].scatter_(1, start[:, None] + 1 + torch.arange(kk + 1, device=dev)[None], block)
        n_h, block_h, nd_h = res.num_accepted.tolist(), block.tolist(), num_draft.tolist()
        if active:
            d_h, bonus_h = d_tokens.tolist(), res.is_bonus.tolist()
            tp_h = tpn_h = dp_h = None  # the probabilities shown with each token: only when a subscriber wants them
            if tree:
                par_h, path_h = parents.tolist(), res.path.tolist()
            if want_probs and tree:
                from .tree_verify import node_target_probs

                tp_h = node_target_probs(tprobs, d_tokens, parents).tolist()  # (n, kk)
                pathx = torch.cat([res.path, res.path.new_full((n, 1), -1)], 1)  # (n, kk+1): kk may be 0
                end = pathx.gather(1, (res.num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)  # (n,) last node
                last = torch.where(res.num_accepted > 0, end + 1, 0)  # (n,) block index the next token was read at
                tpn_h = tprobs[r_idx, last, res.next_token].tolist()
            elif want_probs:
                tp_h = tprobs[:, :kk].gather(2, d_tokens.clamp(min=0)[..., None]).squeeze(-1).tolist()  # (n, kk)
                tpn_h = tprobs[r_idx, res.num_accepted, res.next_token].tolist()  # (n,)
            if want_probs and prop is not None and prop.token_probs is not None:
                dp_h = prop.token_probs.tolist()
        events, finished, kept = [], [], []
        for b, r in enumerate(rows):
            na, nd = n_h[b], nd_h[b]
            g0 = len(r.generated)
            new, reason = self._cut(r, block_h[b][:na + 1])
            r.generated.extend(new)
            r.context.extend(new)
            r.record_round(nd, na)
            kept.append(len(new))
            if reason is not None:
                self._finish(r, reason)
                finished.append(b)
            if active and tree:
                events.append(tree_row_round(r.row, g0, d_h[b][:nd], par_h[b][:nd], path_h[b][:na], new, bonus_h[b],
                                             dp_h[b][:nd] if dp_h else None, tp_h[b][:nd] if tp_h else None,
                                             tpn_h[b] if tpn_h else None, reason, r.request_id, ks[b], why[b]))
            elif active:
                events.append(row_round(r.row, g0, d_h[b][:nd], na, new, bonus_h[b],
                                        dp_h[b][:nd] if dp_h else None, tp_h[b][:nd] if tp_h else None,
                                        tpn_h[b] if tpn_h else None, reason, r.request_id, ks[b], why[b]))
        self.lengths[:n] = torch.tensor([len(r.context) for r in rows], device=dev)  # the rollback
        self.cache.commit(self.lengths[:n] - 1, rows=slice(0, n))
        # after a round without drafts only a drafter fed the target's features has anything to take in (a draft
        # model's cache is behind the committed tokens already, and catches up when it next drafts)
        if drafter is not None and self.k_max > 0 and (prop is not None or self.draft_features):
            from ..drafters.base import Verified

            feats = out.hidden if self.draft_features else {}
            drafter.commit(self._ctx(), Verified(start, torch.tensor(kept, device=dev), feats,
                                                 block_path(res.path, res.num_accepted) if tree else None))
        if active:
            sync(dev)
            t3 = time.perf_counter()
            run, wait = n - len(finished), len(self.waiting)
            self.hooks.emit(RoundEvent(self.run_id, self.round, t3, {"draft": t1 - tc - t_admit, "verify": t2 - t1,
                                                                     "accept": t_acc - t2, "bookkeeping": t3 - t_acc,
                                                                     "other": tc - self.t_last + t_admit},
                                       events, "verify", run, wait))
        done = [rows[b] for b in finished]
        self._leave(finished)
        self._drafted_last = prop is not None
        self._drafted_ever = self._drafted_ever or self._drafted_last
        self.t_last = time.perf_counter()
        if sample:  # the round's work outside the forwards (weighed against the forwards)
            self.costs.record_overhead(n, clock() - c2 + cc - c0, prop is not None)
        return done

    # ------------------------------------------------------------------ running until done
    def run_until_idle(self, on_step=None) -> None:
        """Step until no request is running or waiting (``on_step()`` after each step)."""
        while not self.idle:
            self.step()
            if on_step is not None:
                on_step()

    def slots_held(self) -> int:
        """Cache slots in use per row (the bound: context + one round's block)."""
        held = getattr(self.cache, "slots_held", None)
        return max(held()) if held is not None and held() else self.slots
