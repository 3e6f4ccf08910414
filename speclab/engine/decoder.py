"""``SpeculativeDecoder``: decode a batch of prompts, as a thin wrapper over the step scheduler.

``generate`` submits one request per prompt to a fresh :class:`~speclab.engine.scheduler.Scheduler`
(all arrive together) and steps it until every row is done; ``stream`` does the same and yields the
events as they happen. k = 0 (or no drafter) is plain target decoding through the same loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from ..errors import SpeclabError
from ..events import Event, HookRegistry, RunFinished, RunStarted
from ..limits import check_batch, check_k, check_max_new_tokens, check_sampling, check_seed
from ..metrics import Recorder
from .costs import OnlineCosts
from .policies import make_policy
from .request import Request
from .sampling import SamplingParams
from .scheduler import Scheduler


@dataclass
class GenerationResult:
    prompt_tokens: list[list[int]]
    output_tokens: list[list[int]]  # generated tokens per row (EOS included when produced)
    texts: list[str]
    finish_reasons: list[str]
    seeds: list[int] = field(default_factory=list)  # per row: the seed its samples came from
    metrics: dict = field(default_factory=dict)
    tokens: list[list[dict]] = field(default_factory=list)  # per row: {token, text, status, round, ...}
    recorder: object | None = None  # speclab.metrics.Recorder when recorded
    requests: list[Request] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"text": self.texts, "tokens": self.tokens, "metrics": self.metrics, "seeds": self.seeds}


class SpeculativeDecoder:
    """Exact, batched speculative decoding of ``target`` with ``drafter`` (None: plain decoding)."""

    def __init__(self, target, drafter=None, hooks: HookRegistry | None = None, cuda_graphs: bool | None = None):
        self.target = target
        self.drafter = drafter
        self.hooks = hooks if hooks is not None else HookRegistry()
        self.cuda_graphs = cuda_graphs  # None: on for CUDA (speclab.models.cuda_graphs)
        # step costs learnt over this decoder's runs (cost-weighing policies read them; calibrate() seeds them)
        self.costs = OnlineCosts()

    # -------------------------------------------------------------------------------- public API
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str, k: int = 4,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = 0, record: bool = True, stop_on_eos: bool = True, policy=None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """Decode every prompt (a batch). Row b samples with ``seed + b`` (``seed=None``: a fresh seed per
        row, reported in ``seeds``). ``policy`` chooses each round's draft length (default: fixed ``k``;
        a name or a Policy, whose largest k is ``k``). ``record`` subscribes a metrics recorder for this
        run; ``record=False`` runs with no subscriber of its own (the fast path; benchmarks measure both)."""
        rec = Recorder(self.target) if record else None
        unsub = self.hooks.subscribe(rec) if rec else None
        try:
            sched, reqs = self._run(prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos,
                                    policy, stop)
            self._drive(sched, reqs)
        finally:
            if unsub:
                unsub()
        out = self._result(reqs)
        if rec is not None:
            out.recorder = rec
            out.metrics = rec.summary()
            out.tokens = rec.token_dicts()
        return out

    def scheduler(self, prompts, k: int = 4, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                  top_p: float = 1.0, seed: int | None = 0, stop_on_eos: bool = True, policy=None,
                  stop: Sequence[str] = ()) -> tuple[Scheduler, list[Request]]:
        """The scheduler :meth:`generate` would drive, with every prompt submitted, and its requests: for callers that
        step several runs themselves (benchmarks interleave configurations step by step). Nothing runs until its
        ``step()`` is called; done when its ``idle`` is true. Subscribers get RunStarted and the rounds' events, but
        no RunFinished (that belongs to the loop that drives it)."""
        return self._run(prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos, policy, stop)

    def stream(self, prompts, k: int = 4, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = 0, stop_on_eos: bool = True, policy=None,
               stop: Sequence[str] = ()) -> Iterator[Event]:
        """Events as they happen (RunStarted, a prefill RoundEvent, one RoundEvent per round,
        RunFinished). Stop iterating (or close the generator) to cancel the run between rounds."""
        queue: list[Event] = []
        unsub = self.hooks.subscribe(queue.append)
        try:
            sched, reqs = self._run(prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos,
                                    policy, stop)
            for _ in self._steps(sched, reqs):
                while queue:
                    yield queue.pop(0)
            while queue:
                yield queue.pop(0)
        finally:
            unsub()

    # -------------------------------------------------------------------------------- the run
    def requests(self, prompts, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int | None, stop_on_eos: bool = True, stop: Sequence[str] = ()) -> list[Request]:
        """One validated :class:`Request` per prompt (text or token ids); row b gets seed + b."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if len(prompts) < 1:
            raise SpeclabError("batch size must be at least 1 (no prompts given)")
        check_batch(len(prompts))
        check_max_new_tokens(max_new_tokens)
        temperature, top_p, top_k = check_sampling(temperature, top_p, top_k)
        seed = check_seed(seed)
        params = SamplingParams(temperature, top_k, top_p)
        reqs = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p.strip():
                    raise SpeclabError(f"prompt {i} is empty" if len(prompts) > 1 else "the prompt is empty")
                toks = self.target.encode(p)
            else:
                toks = [int(t) for t in p]
            if not toks:
                raise SpeclabError(f"prompt {i} encodes to no tokens")
            reqs.append(Request(toks, max_new_tokens, params, None if seed is None else seed + i, tuple(stop),
                                not stop_on_eos, row=i))
        return reqs

    def _run(self, prompts, k, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos, policy, stop):
        check_k(k)
        reqs = self.requests(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_on_eos, stop)
        pol = make_policy(policy, k)
        drafter = self.drafter if (self.drafter is not None and pol.k_max > 0) else None
        longest = max(len(r.prompt_ids) for r in reqs) + max_new_tokens
        sched = Scheduler(self.target, drafter, pol, self.hooks, max_running=len(reqs), max_waiting=0,
                          max_len=longest, capacity=len(reqs), costs=self.costs,
                          record_costs=pol.name not in ("fixed", "off"), cuda_graphs=self.cuda_graphs)
        for r in reqs:
            sched.validate(r)
        for r in reqs:
            sched.submit(r)
        if self.hooks.active:
            p = reqs[0].params
            self.hooks.emit(RunStarted(sched.run_id, time.perf_counter(), len(reqs), sched.k_max,
                                       drafter.name if drafter else "none", self.target.name,
                                       [len(r.prompt_ids) for r in reqs], p.temperature, p.top_k, p.top_p,
                                       max_new_tokens, sched.policy.name, [r.seed_used for r in reqs]))
        return sched, reqs

    def _steps(self, sched: Scheduler, reqs: list[Request]):
        t0 = time.perf_counter()
        cancelled = True
        try:
            while not sched.idle:
                sched.step()
                yield
            cancelled = False
        finally:
            if self.hooks.active:
                now = time.perf_counter()
                self.hooks.emit(RunFinished(sched.run_id, now, now - t0, [len(r.generated) for r in reqs],
                                            [r.finish_reason or "cancelled" for r in reqs], cancelled))

    def _drive(self, sched, reqs) -> None:
        for _ in self._steps(sched, reqs):
            pass

    def _result(self, reqs: list[Request]) -> GenerationResult:
        T = self.target
        texts = []
        for r in reqs:
            text = T.decode(r.generated)
            texts.append(text[:r.stop_at] if r.stop_at is not None else text)
        return GenerationResult([r.prompt_ids for r in reqs], [list(r.generated) for r in reqs], texts,
                                [r.finish_reason or "cancelled" for r in reqs], [r.seed_used for r in reqs],
                                requests=reqs)
