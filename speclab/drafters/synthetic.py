"""A synthetic drafter: a draft of known quality and known cost, to separate "how good is the draft"
from "what does the system cost".

``synthetic:ALPHA[:C]`` proposes, at each draft position, the target's own next token with
probability ALPHA (``synthetic:0.9,0.8,0.6:C``: per position, the last value for the positions after)
and a token that is certainly wrong otherwise, and burns C x the target's decode-step time at the
current number of rows per draft step (a spin-wait: it occupies the CPU like a real draft step).

*The target's own next token* is its greedy continuation, from an oracle: a plain greedy run of the
same prompt (EOS ignored), cached per prompt. :meth:`SyntheticDrafter.prepare` computes the oracles
and measures the target's decode-step times outside any timed region; benchmarks call it first. A
prompt that was not prepared gets its oracle when its row is admitted, and a row count whose step
time is unknown is measured when first seen: both happen inside the run and distort its timing
(counted in ``unprepared``).

The drafts are deterministic (``probs=None``: scored one-hot), so the target verifies every token and
output stays exact at any temperature. Greedy, a draft position is accepted with probability exactly
ALPHA (given the positions before it were); a greedy row that leaves its oracle (a near-tie decided
differently in a batched forward) gets a fresh oracle from its current context (``recomputed``).
Under sampling ALPHA is only the rate at which it proposes the greedy oracle's token for that position
(the row follows its own sampled path; acceptance is then the target's probability of that token).

Its randomness comes from one generator per request, seeded from the request's seed: a row's drafts
depend on its prompt, seed and own rounds only, never on its batch-mates.
"""

from __future__ import annotations

import random
import time
import zlib
from typing import Sequence

import torch

from ..engine.costs import OnlineCosts
from ..errors import SpeclabError
from ..limits import check_float
from .base import DraftContext, Proposal, StatelessDrafter


def parse_spec(spec: str) -> tuple[tuple[float, ...], float | None]:
    """'synthetic:0.7' -> ((0.7,), None); 'synthetic:0.9,0.8,0.6:0.1' -> ((0.9, 0.8, 0.6), 0.1)."""
    parts = str(spec).strip().split(":")
    if parts[0].strip().lower() != "synthetic" or len(parts) not in (2, 3) or not parts[1].strip():
        raise SpeclabError(f"a synthetic draft is 'synthetic:ALPHA[:COST]' (ALPHA one value or one per position, "
                           f"e.g. 'synthetic:0.7', 'synthetic:0.9,0.8,0.6:0.1'), got '{spec}'")
    alpha = tuple(check_float("synthetic acceptance", a.strip(), 0.0, 1.0) for a in parts[1].split(",") if a.strip())
    cost = check_float("synthetic draft cost", parts[2].strip(), 0.0, 100.0) if len(parts) == 3 else None
    return alpha, cost


def spin(seconds: float, since: float | None = None, clock=time.perf_counter) -> None:
    """Busy-wait until ``seconds`` after ``since`` (default: now) by ``clock``: it occupies the CPU, like a
    real draft step."""
    end = (since if since is not None else clock()) + seconds
    while clock() < end:
        pass


class SyntheticDrafter(StatelessDrafter):
    lm = None  # no draft model (the scheduler checks draft context limits only for model drafts)

    def __init__(self, target, alpha: float | Sequence[float], cost: float = 0.1, seed: int = 0):
        alpha = (alpha,) if isinstance(alpha, (int, float)) else tuple(alpha)
        if not alpha:
            raise SpeclabError("a synthetic draft needs at least one acceptance value")
        self.alpha = tuple(check_float("synthetic acceptance", a, 0.0, 1.0) for a in alpha)
        self.cost = check_float("synthetic draft cost", cost, 0.0, 100.0)
        self.seed = int(seed)
        self.target = target
        self.name = f"synthetic:{','.join(f'{a:g}' for a in self.alpha)}:{self.cost:g}"
        tok = getattr(target, "tokenizer", None)
        n_tok = len(tok) if tok is not None else target.vocab_size
        self.vocab = max(2, min(target.vocab_size, n_tok))  # wrong tokens are real tokens (they are displayed)
        self.oracle: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> greedy continuation (EOS ignored)
        self.step_costs = OnlineCosts()  # the target's decode step (T = 1) per row count: the cost unit
        self.context = 96  # cache length the step times are measured against (prepare sets it)
        self.clock = time.perf_counter  # what the burn and the step times are measured by (benchmarks may set
        # time.process_time: then a draft step costs C x a step in CPU time, whatever else runs on the machine)
        self.unprepared = 0  # oracles or step times computed inside a run (timing distorted)
        self.recomputed = 0  # greedy rows that left their oracle and got a fresh one
        self._rows: dict[str, list] = {}  # request id -> [prompt length, oracle, rng, generated tokens checked]

    @classmethod
    def from_spec(cls, spec: str, target) -> "SyntheticDrafter":
        alpha, cost = parse_spec(spec)
        return cls(target, alpha, 0.1 if cost is None else cost)

    def alpha_at(self, i: int) -> float:
        return self.alpha[min(i, len(self.alpha) - 1)]

    # ------------------------------------------------------------------ outside the timed region
    def prepare(self, prompts, max_new_tokens: int, rows: Sequence[int] = (1,), batch: int = 32) -> float:
        """Compute the oracle of every prompt (text or token ids) for ``max_new_tokens`` tokens and
        measure the target's decode step at every row count in ``rows``. Returns the seconds spent."""
        t0 = time.perf_counter()
        ids = [self.target.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        todo = list({tuple(p): None for p in ids if len(self.oracle.get(tuple(p), ())) < max_new_tokens})
        for i in range(0, len(todo), batch):
            self._greedy(todo[i:i + batch], max_new_tokens)
        if ids:
            lens = sorted(len(p) for p in ids)
            self.context = max(8, lens[len(lens) // 2] + max_new_tokens // 2)
        self.step_costs.calibrate(self.target, None, rows=tuple(sorted(set(rows))), tokens=(1,), context=self.context,
                                  clock=self.clock)
        return time.perf_counter() - t0

    def _greedy(self, prompts: list[tuple[int, ...]], n: int) -> None:
        from ..engine.decoder import SpeculativeDecoder

        res = SpeculativeDecoder(self.target, None).generate([list(p) for p in prompts], k=0, max_new_tokens=n,
                                                             record=False, stop_on_eos=False)
        for p, out in zip(prompts, res.output_tokens):
            self.oracle[p] = list(out)

    def step_time(self, n: int) -> float:
        """The target's decode-step time at n rows (measured now if no row count was measured)."""
        t = self.step_costs.target_time(n, 1)
        if t is None:
            self.unprepared += 1
            self.step_costs.calibrate(self.target, None, rows=(n,), tokens=(1,), context=self.context,
                                      clock=self.clock)
            t = self.step_costs.target_time(n, 1)
        return t

    # ------------------------------------------------------------------ the drafter protocol
    def _row(self, ctx: DraftContext, b: int) -> list:
        rid = ctx.request_ids[b] if ctx.request_ids else str(b)
        st = self._rows.get(rid)
        if st is None:  # admitted: the context is the prompt plus the first generated token
            prompt = tuple(ctx.host[b][:ctx.host_lengths[b] - 1])
            if prompt not in self.oracle:
                self.unprepared += 1
                self._greedy([prompt], 64)
            seed = ctx.seeds[b] if ctx.seeds else zlib.crc32(repr(prompt).encode())
            rng = random.Random((int(seed) * 1_000_003 + self.seed) & ((1 << 63) - 1))
            st = self._rows[rid] = [len(prompt), self.oracle[prompt], rng, 0]
        return st

    def admit(self, ctx: DraftContext, rows: range, features=None) -> None:
        for b in rows:
            self._row(ctx, b)

    def _oracle_for(self, st: list, host: list[int], greedy: bool, upto: int) -> list[int]:
        """The row's oracle, checked against what the row generated (greedy rows) and long enough
        for position ``upto`` (extended from its own path)."""
        plen, orc = st[0], st[1]
        gen = len(host) - plen
        if greedy and st[3] < gen:
            if host[plen + st[3]:] != orc[st[3]:gen]:  # left the oracle: a fresh one from here
                self.recomputed += 1
                orc = st[1] = host[plen:] + self._continue(host, max(16, upto - gen + 1))
            st[3] = gen
        if len(orc) <= upto:
            orc = st[1] = orc + self._continue(list(host[:plen]) + orc, upto - len(orc) + 16)
        return orc

    def _continue(self, ids: list[int], n: int) -> list[int]:
        from ..engine.decoder import SpeculativeDecoder

        self.unprepared += 1
        res = SpeculativeDecoder(self.target, None).generate([ids], k=0, max_new_tokens=n, record=False,
                                                             stop_on_eos=False)
        return list(res.output_tokens[0])

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        t0 = self.clock()
        n, k = ctx.n, max(ks)
        out = [[-1] * k for _ in range(n)]
        lens = []
        V = self.vocab
        for b in range(n):
            kb = ks[b]
            lens.append(kb)
            if kb == 0:
                continue
            st = self._row(ctx, b)
            host = ctx.host[b]
            gen = len(host) - st[0]
            orc = self._oracle_for(st, host, params.greedy_rows[b], gen + kb - 1)
            rng, row = st[2], out[b]
            for i in range(kb):
                right = orc[gen + i]
                row[i] = right if rng.random() < self.alpha_at(i) else (right + 1 + rng.randrange(V - 1)) % V
        if len(self._rows) > 2 * n + 64 and ctx.request_ids:
            live = set(ctx.request_ids)
            self._rows = {r: s for r, s in self._rows.items() if r in live}
        if self.cost > 0 and k > 0:
            spin(self.cost * k * self.step_time(n), since=t0, clock=self.clock)  # k draft steps of n rows
        dev = ctx.tokens.device
        return Proposal(torch.tensor(out, dtype=torch.long, device=dev).view(n, k),
                        torch.tensor(lens, dtype=torch.long, device=dev), None, None)
