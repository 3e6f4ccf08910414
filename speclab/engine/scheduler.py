"""The step scheduler: continuous batching over the one decode loop.

Requests wait in a bounded queue, join the running rows between rounds (:mod:`.prefill`: their prompts are
prefilled together and each gets its first token), take part in every following verification round
(:mod:`.round`) with their own sampling settings, seed and draft length, and leave the moment they finish or
are cancelled. Which request holds which slot of the caches is :mod:`.batch`'s bookkeeping.

A step::

    cancel    requests cancelled since the last step leave (waiting or running)
    admit     waiting requests take the free rows; their prompts are prefilled
    round     one verification round over every running row: propose, verify, accept

The draft length is the policy's alone: it is built once, before the scheduler, and asked every round.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

import torch

from ..errors import SpeclabError
from ..events import HookRegistry
from ..limits import check_context
from ..models import check_draft_context
from ..models.cuda_graphs import graphed, use_cuda_graphs
from .acceptance import rejection_impl, tree_rejection_sample
from .batch import Batch
from .cost_sampler import COST_STRIDE, COST_WARM, CostSampler
from .costs import OnlineCosts
from .policies import Off
from .prefill import Prefill
from .request import WAITING, Request
from .round import Round
from .stopping import finish

# named here too: the acceptance rules a scheduler takes at construction (tests put a wrong rule in their place) and
# the cost sampler's stride
__all__ = ["COST_STRIDE", "COST_WARM", "QueueFull", "Scheduler", "rejection_impl", "tree_rejection_sample"]

_run_ids = itertools.count(1)


class QueueFull(SpeclabError):
    """The waiting queue is at its bound: the request was refused (servers answer 429)."""


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
        self.context = min(max_len or target.max_context, target.max_context)  # prompt + generated per row
        self.slots = self.context + self.k_max + 2  # + one round's block of headroom
        self.device = target.device
        self.waiting: deque[Request] = deque()
        self.lock = threading.Lock()
        self._cancel: set[str] = set()
        self.round = 0
        self.run_id = run_id if run_id is not None else next(_run_ids)
        self.costs = costs if costs is not None else OnlineCosts()
        self.draft_features = tuple(getattr(drafter, "features", ()) or ()) if drafter is not None else ()
        self.batch = self._batch(capacity, cuda_graphs)
        # prefix caching (speclab.engine.prefix_cache): the native cache only; for a drafter that reads the target's
        # features at every prompt position, the entries keep those features too
        self.prefix = prefix_cache if (prefix_cache is not None and hasattr(self.cache, "load_prefix")) else None
        drafting = drafter if self.k_max > 0 else None
        self.prefill = Prefill(self.batch, target, drafting, self.hooks, self.run_id, self.prefix, self.draft_features)
        self.round_runner = Round(self.batch, target, drafter, self.policy, self.hooks, self.costs,
                            rejection_impl(self.device), tree_rejection_sample, self.run_id, self.draft_features)
        if record_costs:
            self.round_runner.listeners.append(CostSampler(self.costs))

    def _batch(self, capacity: int | None, cuda_graphs: bool | None) -> Batch:
        """The rows' slots: the target's cache (CUDA graphs for its decode and verify forwards, None: on for CUDA,
        and a model drafter's own cache too) and the drafter's per-row state, room for ``capacity`` rows."""
        cap = max(1, min(capacity or self.max_running, self.max_running))
        cache = self.target.new_cache(cap, self.slots)
        if self.drafter is not None:
            self.drafter.reset(cap, self.slots)
        self.cuda_graphs = use_cuda_graphs(cuda_graphs, self.device)
        if self.cuda_graphs:  # pooled per model: the next run finds the graphs captured (see cuda_graphs)
            cache = graphed(cache, self.k_max + 1, owner=self)
            if self.drafter is not None and hasattr(self.drafter, "cache"):
                self.drafter.cache = graphed(self.drafter.cache, self.k_max + 1, owner=self)
        return Batch(cache, cap, self.slots, self.device, self.drafter, self.costs)

    @property
    def k_max(self) -> int:
        """The longest draft a round may verify: the policy's (0 without a drafter)."""
        return self.policy.k_max if self.drafter is not None else 0

    @property
    def cache(self):
        return self.batch.cache

    @property
    def rows(self) -> list[Request]:
        """The running requests, in slot order."""
        return self.batch.rows

    @property
    def capacity(self) -> int:
        return self.batch.capacity

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
                done += self._drop_waiting(cancels)
            free = self.max_running - len(self.rows)
            admit = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if cancels:
            gone = [i for i, r in enumerate(self.rows) if r.request_id in cancels]
            for i in gone:
                finish(self.rows[i], "cancelled")
                done.append(self.rows[i])
            self.batch.leave(gone)
        if admit:
            done += self.prefill.run(admit, self.round, len(self.waiting))
        if self.rows:
            self.round += 1
            done += self.round_runner.run(self.round, len(self.waiting), after_prefill=bool(admit))
        return done

    def _drop_waiting(self, cancels: set[str]) -> list[Request]:
        """The cancelled requests leave the queue (the caller holds the lock)."""
        kept, gone = deque(), []
        for r in self.waiting:
            if r.request_id in cancels:
                finish(r, "cancelled")
                gone.append(r)
            else:
                kept.append(r)
        self.waiting = kept
        return gone

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
