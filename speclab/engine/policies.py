"""Draft-length policies: each round, how many tokens each running row drafts (0 = no speculation).

A policy is small and pure: :meth:`Policy.choose` maps a :class:`PolicyView` (every running row's
acceptance history, the number of running and waiting requests, the step costs measured online) to
one :class:`Choice` per row. The scheduler caps each choice by the row's budget (a round emits up to
k+1 tokens) and reports both in the events. A policy may also end a row's draft early inside the
round (:meth:`Policy.draft_stop`).

Policies that adapt keep per-request state (keyed by request id) only as a cache of what they would
compute from the whole history again; given the same views in the same order they decide the same.

The policies (``POLICIES``; ``make_policy("name[:args]", k)``, k = the largest k):

==============  ==================================================================================
``fixed``       k every round (vLLM ``num_speculative_tokens``, HF ``num_assistant_tokens_schedule=
                "constant"``).
``off``         no speculation.
``batch-table`` k from a table of running-batch ranges (vLLM's ``num_speculative_tokens_per_batch_size``
                form; k = 0 switches speculation off for a range).
``heuristic``   per row, +2 after a round whose drafts were all accepted, -1 otherwise, within [1, K]
                (Hugging Face ``num_assistant_tokens_schedule="heuristic"``).
``ema``         per row, an EMA of the accepted length picks one of a few step tiers, with
                hysteresis (SGLang-style adaptive steps).
``goodput``     per round, the k in 0..K that maximises expected committed tokens per expected round
                time, from per-row, per-position acceptance estimates and the measured cost model
                (SmartSpec / TurboSpec).
``confidence``  every row drafts up to K, stopping when the draft's top probability is below a
                threshold (HF ``assistant_confidence_threshold``) or AdaEDL's entropy bound on
                acceptance is below a floor.
==============  ==================================================================================

``heuristic``, ``ema`` and ``confidence`` run behind a *cost gate* (speclab's addition, ``gate=False``
for the published rule alone): a round whose chosen drafts the cost model says lose to plain
decoding (k = 0) runs k = 0 instead, so each switches itself off under load or at low acceptance.
``goodput`` needs no gate: k = 0 is one of its candidates.

Exactness does not depend on the policy: greedy output is the target's argmax whatever k each round
used, and sampled output is an exact sample of the target's distribution. Which sample a seed gives
depends on the k of each round (a row's draws are laid out by its own k), so under a policy that
reacts to load or to batch-mates a sampled row's output, while exact, depends on them too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from ..errors import SpeclabError
from ..limits import check_float, check_k


@dataclass(slots=True)
class RowView:
    """What a policy may know about one running row (the sequences may be the request's live lists:
    read them, never change them; a policy never changes a view, it reads it). A plain slotted class, not a
    frozen one: the scheduler builds one per row every round, and a frozen dataclass costs several times more
    to build."""

    request_id: str
    history: tuple[tuple[int, int], ...]  # (drafted, accepted) per round, oldest first
    pos_drafted: tuple[int, ...] = ()  # per draft position: rounds that drafted it
    pos_accepted: tuple[int, ...] = ()  # ... and in which it was accepted
    remaining: int = 1 << 30  # tokens this row may still emit
    greedy: bool = True
    prompt_len: int = 0  # the row's prompt tokens (what a draft model prefills to take the row in)
    generated: int = 0  # tokens the row has emitted so far
    taken_in: bool = True  # the drafter holds the row already (False: a draft model would prefill it first)

    @property
    def drafted(self) -> int:
        return sum(d for d, _ in self.history)

    @property
    def accepted(self) -> int:
        return sum(a for _, a in self.history)


@dataclass(frozen=True)
class PolicyView:
    rows: tuple[RowView, ...]
    running: int
    waiting: int
    costs: object | None = None  # speclab.engine.costs.OnlineCosts
    draft_cost_hint: float | None = None  # draft step / target step when nothing is measured yet


@dataclass(frozen=True)
class Choice:
    k: int
    reason: str


@runtime_checkable
class Policy(Protocol):
    name: str
    k_max: int  # the largest k it may choose (sizes the scheduler's headroom)

    def choose(self, view: PolicyView) -> list[Choice]:
        """One choice per row of ``view.rows``."""

    def draft_stop(self):
        """A StopRule (see speclab.drafters.base) or None."""


@dataclass
class Fixed:
    """The same k for every row and round: the classic setting (vLLM ``num_speculative_tokens``)."""

    k: int = 4
    name: str = field(default="fixed", init=False)

    def __post_init__(self):
        check_k(self.k)

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, view: PolicyView) -> list[Choice]:
        return [Choice(self.k, f"fixed k={self.k}")] * len(view.rows)

    def draft_stop(self):
        return None


@dataclass
class Off:
    """No speculation: plain target decoding through the same loop (the baseline)."""

    name: str = field(default="off", init=False)
    k_max: int = field(default=0, init=False)

    def choose(self, view: PolicyView) -> list[Choice]:
        return [Choice(0, "off")] * len(view.rows)

    def draft_stop(self):
        return None


# ============================================================================ acceptance estimates


def expected_tokens(survival: list[float], k: int) -> float:
    """Expected tokens a round of k drafts emits, from ``survival[i]`` = P(drafts 0..i all accepted):
    1 (the recovered or bonus token) + sum_{i<k} survival[i]. e.g. i.i.d. acceptance 0.5, k = 2:
    1 + 0.5 + 0.25 = 1.75."""
    return 1.0 + sum(survival[:k])


class AcceptanceTracker:
    """Per-row, per-position conditional acceptance, learned from each row's history and shrunk toward
    a population estimate (every row this tracker has seen), so new rows start from what similar
    requests did.

    c[i] = P(draft i accepted | drafts 0..i-1 accepted): a round (drafted d, accepted a) *reaches*
    position i when i <= a and i < d, and accepts it when i < a. A row's counts decay by ``decay``
    every round, drafted or not, so an estimate follows a row whose text changes character (a code
    row falling into a loop becomes predictable), and evidence ages while the row does not draft: a
    row switched off for low acceptance drifts back to its prior and is tried again. The population's
    counts decay by ``population_decay`` per update that brings evidence (a round in which some row drafted),
    not while nobody drafts: a population switched off keeps what it last measured, and only a probe, whose
    cost the policy weighs, tries it again. A row's estimate at i is
    (accepted + w * prior) / (reached + w), with w = ``prior_weight`` and prior = the row's own
    estimate at i-1 (acceptance is close to i.i.d. along a draft), or at i = 0 the population's; the
    population's own prior at position 0 is ``default``. ``survival(row)`` = cumulative products:
    P(at least i+1 drafts accepted).

    The defaults (decay 0.95, prior weight 4) come from ``speclab bench --tracker-fit``: replaying fixed-k
    histories of JSON, code and prose through the tracker, they predict acceptance with 1.6% less log-loss
    than the earlier 0.9 / 2, which followed a row so closely that one miss halved its estimate (a
    setting that forgets more slowly still, 0.98 / 8, is 0.4% better again, within the grid's flat bottom).
    """

    def __init__(self, k_max: int, decay: float = 0.95, prior_weight: float = 4.0, default: float = 0.8,
                 population_decay: float = 0.95):
        self.k_max = k_max
        self.decay, self.w, self.default, self.pop_decay = decay, prior_weight, default, population_decay
        self.rows: dict[str, list] = {}  # request id -> [history seen, reached[K], accepted[K]]
        self.pop_n = [0.0] * k_max
        self.pop_a = [0.0] * k_max

    def update(self, view: PolicyView) -> None:
        """Absorb every row's rounds since the last call; forget rows that left."""
        K, dec = self.k_max, self.decay
        new_n, new_a = [0.0] * K, [0.0] * K  # this call's evidence, for the population
        live = set()
        for r in view.rows:
            live.add(r.request_id)
            st = self.rows.get(r.request_id)
            h = r.history
            if st is None or st[0] > len(h):  # new (or an id reused by a new request)
                st = self.rows[r.request_id] = [0, [0.0] * K, [0.0] * K, 0]
            seen, N, A, idle = st
            z = 0  # rounds since the last one that drafted: their decay is applied at once
            for d, a in h[seen:]:
                z += 1
                if d == 0:
                    idle += 1
                    continue
                idle = 0
                f = dec ** z
                z = 0
                for i in range(K):
                    N[i] *= f
                    A[i] *= f
                for i in range(min(d, a + 1, K)):
                    ok = 1.0 if i < a else 0.0
                    N[i] += 1.0
                    A[i] += ok
                    new_n[i] += 1.0
                    new_a[i] += ok
            if z and N[0]:  # (N[i] <= N[0]: nothing reached position 0, nothing to decay)
                f = dec ** z
                for i in range(K):
                    N[i] *= f
                    A[i] *= f
            st[0], st[3] = len(h), idle
        if new_n[0]:  # the population's evidence ages as new evidence comes in, not while nobody drafts
            for i in range(K):
                self.pop_n[i] = self.pop_n[i] * self.pop_decay + new_n[i]
                self.pop_a[i] = self.pop_a[i] * self.pop_decay + new_a[i]
        if len(self.rows) > len(live):
            for rid in [x for x in self.rows if x not in live]:
                del self.rows[rid]

    def idle_rounds(self, request_id: str) -> int:
        """Rounds since the row last drafted (all its rounds if it never did): how many tokens a draft model that
        holds the row has to catch up on (one a plain round) before it drafts again."""
        st = self.rows.get(request_id)
        return st[3] if st is not None else 0

    def population(self) -> list[float]:
        """Conditional acceptance per position over every row seen (each position's prior: the one before)."""
        out, prior = [], self.default
        for i in range(self.k_max):
            c = (self.pop_a[i] + prior) / (self.pop_n[i] + 1.0)
            out.append(c)
            prior = c
        return out

    def conditional(self, request_id: str, pop: list[float] | None = None) -> list[float]:
        pop = pop if pop is not None else self.population()
        st = self.rows.get(request_id)
        if st is None:
            return list(pop)
        N, A = st[1], st[2]
        out, w = [], self.w
        for i in range(self.k_max):
            prior = pop[0] if i == 0 else out[-1]
            out.append((A[i] + w * prior) / (N[i] + w))
        return out

    def survival(self, request_id: str, pop: list[float] | None = None) -> list[float]:
        """P(drafts 0..i all accepted) for i < K: the cumulative products of :meth:`conditional` (one loop: policies
        ask for every row every round)."""
        pop = pop if pop is not None else self.population()
        st = self.rows.get(request_id)
        s, out = 1.0, []
        if st is None:
            for c in pop:
                s *= c
                out.append(s)
            return out
        N, A = st[1], st[2]
        w, prior = self.w, pop[0]
        if not N[0]:  # no evidence at all (N[i] <= N[0]): every position at the population's first
            for _ in range(self.k_max):
                s *= prior
                out.append(s)
            return out
        for i in range(self.k_max):
            prior = (A[i] + w * prior) / (N[i] + w)
            s *= prior
            out.append(s)
        return out


# ============================================================================ the cost side

NEVER = 1 << 30  # ProbeBudget.quiet when no probe can come


def _costs_ready(costs, n: int, covered: set | None = None) -> str | None:
    """None when ``costs`` can predict rounds of n rows; else what to measure first: 'plain' or 'spec'.
    ``covered``: row counts already found ready (tables only grow, so they stay ready)."""
    if costs is None:
        return "none"
    if covered is not None and (id(costs), n) in covered:
        return None
    plain, verify, draft = costs.coverage(n)
    if not plain:
        return "plain"
    if not verify or not draft:
        return "spec"
    if covered is not None:
        covered.add((id(costs), n))
    return None


def monotone(ys: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a longer round never
    costs less, and noisy estimates must not make k = 3 look cheaper than k = 2.
    e.g. [1, 3, 2, 4] -> [1, 2.5, 2.5, 4]."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


class RoundTimes:
    """Predicted round time for k = 0..K at n rows, cached: recomputed when n changes or every
    ``refresh`` rounds (the cost tables move slowly; a prediction costs tens of microseconds, a
    batch-1 round a few milliseconds)."""

    def __init__(self, k_max: int, refresh: int = 8):
        self.k_max, self.refresh = k_max, refresh
        self.n = -1
        self.age = 0
        self.costs = None
        self.times: list[float | None] = []

    def get(self, costs, n: int) -> list[float | None]:
        self.age += 1
        if n != self.n or costs is not self.costs or self.age >= self.refresh or None in self.times:
            times = [costs.round_time(n, k) for k in range(self.k_max + 1)]
            self.times = monotone(times) if None not in times else times
            self.n, self.costs, self.age = n, costs, 0
        return self.times


def row_tokens(survival: list[float], remaining: int, k_max: int) -> list[float]:
    """Expected tokens one row emits in a round of k = 0..k_max drafts: 1 + sum of its survival up to k, with k
    capped by its budget (a round emits at most ``remaining`` tokens, so it drafts at most remaining-1).
    e.g. survival [0.5, 0.25], remaining 2, k_max 2 -> [1.0, 1.5, 1.5]."""
    cap = remaining - 1 if remaining > 1 else 0
    out, acc = [1.0], 0.0
    for k in range(1, k_max + 1):
        if k <= cap:
            acc += survival[k - 1]
            out.append(1.0 + acc)
        else:  # budget-capped: a round drafting k runs as one drafting cap
            out.append(out[-1])
    return out


def batch_tokens(survivals: list[list[float]], remaining: list[int], k_max: int) -> list[float]:
    """Expected tokens the whole batch emits in a round of k = 0..k_max drafts per row (:func:`row_tokens`
    summed over the rows)."""
    return round_tokens([row_tokens(s, rem, k_max) for s, rem in zip(survivals, remaining)], k_max)


def round_tokens(per_row: list[list[float]], k_max: int) -> list[float]:
    """The rows' :func:`row_tokens` summed: the batch's expected tokens for k = 0..k_max."""
    return [sum(col) for col in zip(*per_row)] if per_row else [0.0] * (k_max + 1)


def draft_prefill_share(rows, survivals: list[list[float]], k_max: int, per_token: float,
                        per_row: list[list[float]] | None = None) -> list[float]:
    """Seconds of draft-model prefill a round of k = 0..k_max drafts carries, amortized: speculating means taking
    every row into the draft model (its prompt, ``per_token`` seconds a token), a cost paid once per row and spread
    over the row's output, so a round emitting e tokens (:func:`row_tokens`) of a row with budget
    B = generated + remaining carries e / B of it. (Steady state under load: rows keep arriving, each one
    prefilled if speculation stays on; a row already taken in stands for the next one.) k = 0 carries nothing:
    a row that never drafts is never taken in. ``per_row``: the rows' :func:`row_tokens`, when already computed.
    e.g. one row, prompt 100, 1e-4 s a token, budget 40, survival [0.5, 0.25]: k = 1 emits 1.5 tokens,
    1.5 / 40 x 100 x 1e-4 = 0.375 ms; k = 2 emits 1.75: 0.4375 ms."""
    out = [0.0] * (k_max + 1)
    if per_token <= 0:
        return out
    for j, r in enumerate(rows):
        cost = prefill_per_token(r, per_token)
        if not cost:
            continue
        e = per_row[j] if per_row is not None else row_tokens(survivals[j], r.remaining, k_max)
        for k in range(1, k_max + 1):
            out[k] += cost * e[k]
    return out


def prefill_per_token(r, per_token: float) -> float:
    """Seconds of the draft model's prefill of row ``r`` (its prompt, ``per_token`` seconds a token) carried by each
    token the row emits while speculating: the prefill spread over the row's budget (generated + remaining); 0 for a
    row without a prompt length or a bounded budget. e.g. prompt 100, 1e-4 s a token, budget 40: 0.25 ms a token."""
    budget = r.generated + r.remaining
    if per_token <= 0 or r.prompt_len <= 0 or budget <= 0 or budget >= 1 << 29:
        return 0.0
    return per_token * r.prompt_len / budget


def catch_up_time(rows, tracker: AcceptanceTracker, per_token: float) -> float:
    """Seconds a draft model spends catching up before it drafts again, over a steady drafting round: each row it
    holds missed one token per round at k = 0, and its catch-up forward is one block as wide as the most lagging
    row (``per_token`` seconds a token, as its prefill). A switching cost, paid by the round that drafts after
    rounds at k = 0 and charged to it in full: a policy that flips on for a round or two pays it every time.
    e.g. 16 rows held, the longest 10 rounds at k = 0, 2e-5 s a token: 16 x 10 x 2e-5 = 3.2 ms."""
    if per_token <= 0:
        return 0.0
    held = lag = 0
    for r in rows:
        if r.taken_in:
            held += 1
            lag = max(lag, tracker.idle_rounds(r.request_id))
    return per_token * held * lag


def probe_cost(rows, t0: float, t1: float, per_token: float, catch_up: float = 0.0) -> float:
    """Seconds a probe round at k = 1 costs over a plain round: the longer round, plus the draft model's prefill
    of every row it has not taken in yet (each row's prompt and what it generated; ``per_token`` seconds a token),
    plus its catch-up on the rows it holds (``catch_up``: :func:`catch_up_time`).
    e.g. rounds of 10 and 14 ms, one row of 100 + 20 tokens not taken in, 1e-4 s a token: 4 + 12 = 16 ms."""
    pending = sum(r.prompt_len + r.generated for r in rows if not r.taken_in)
    return max(0.0, t1 - t0) + per_token * pending + catch_up


def worth_probing(t0: float, t1: float | None, pop_first: float, default: float, margin: float = 0.25) -> bool:
    """Is a probe round at k = 1 worth its cost? Only if the acceptance at which one draft breaks even
    (t1 / t0 - 1) is within reach: at most ``default`` and at most ``margin`` above what the population
    accepts now. e.g. a 1.3x round at k = 1 breaks even at 0.3: worth probing with the population at
    0.1; at 64 rows a 1.64x round needs 0.64, not worth it with the population at 0.33."""
    if not t1 or not t0:
        return False
    return t1 / t0 - 1.0 <= min(default, pop_first + margin)


class ProbeBudget:
    """When a policy that switched drafting off (k = 0) tries one round at k = 1 again, so that it notices
    acceptance coming back (rows at k = 0 teach the tracker nothing): after at least ``every`` rounds at k = 0,
    when the probe is :func:`worth_probing`, and when its :func:`probe_cost` is at most ``budget`` of the time spent
    at k = 0 since the last probe, so exploring costs at most that share of the run. Under load the cost is mostly
    the draft's prefill of the rows that arrived since (a probe takes every row into the draft), so probes there
    come seconds apart, not every few rounds. One home for goodput and the cost gate of the published rules."""

    def __init__(self, every: int, budget: float):
        self.every, self.budget = every, budget
        self.idle = 0  # rounds at k = 0 since the last probe
        self.idle_s = 0.0  # their predicted seconds
        self.quiet = 0  # after off_round: how many of the next rounds at k = 0 certainly cannot be a probe

    def reset(self) -> None:
        self.idle, self.idle_s = 0, 0.0

    def count(self, t0: float) -> None:
        """Count one round at k = 0 of ``t0`` predicted seconds that was not weighed (an :class:`OffHold`'s)."""
        self.idle += 1
        self.idle_s += t0

    def off_round(self, rows, t0: float, t1: float | None, per_token: float, pop_first: float, default: float,
                  t1_weighed: float | None = None, catch_up: float = 0.0) -> int:
        """Count one round at k = 0 (``t0`` its predicted seconds, ``t1`` a k = 1 round's, both without any prefill
        share; ``t1_weighed``: the k = 1 round as the policy weighs it, default ``t1``; ``catch_up``: the draft's
        catch-up a probe would pay, :func:`catch_up_time`). A probe is due now: the rounds waited for it (the count
        restarts); not due: 0."""
        self.count(t0)
        if not self.every or t1 is None:
            self.quiet = NEVER
            return 0
        if self.idle < self.every:
            self.quiet = self.every - self.idle - 1
            return 0
        short = probe_cost(rows, t0, t1, per_token, catch_up) - self.budget * self.idle_s
        if short > 0:  # the rounds until the budget covers it (a lower bound: the catch-up grows meanwhile)
            self.quiet = math.ceil(short / (self.budget * t0)) - 1 if self.budget > 0 and t0 > 0 else NEVER
            return 0
        if not worth_probing(t0, t1 if t1_weighed is None else t1_weighed, pop_first, default):
            self.quiet = NEVER
            return 0
        waited = self.idle
        self.reset()
        self.quiet = 0
        return waited


SWITCH_MARGIN = 0.05  # the predicted gain over plain decoding that switches speculation back on (see switch_on)


def switch_on(gain: float, on: bool, margin: float = SWITCH_MARGIN) -> bool:
    """Does a round draft, given its predicted ``gain`` over plain decoding (tokens per second, drafting / not) and
    whether the last weighed round drafted (``on``)? Hysteresis: drafting stays on while it is predicted to pay at
    all (gain > 1) but comes back on only at a gain of 1 + ``margin``. Switching on has costs the round's model
    does not carry in full (the draft's weights and cache run cold after plain rounds, rows admitted meanwhile are
    prefilled into the draft), and its prediction errs by a few percent either way; at a predicted 1.01x a policy
    flipping on and off pays those costs for nothing (measured: 16 rows on code, predicted 1.01-1.07x, realized
    0.92-0.96x plain). e.g. gain 1.03: on stays on, off stays off; gain 1.06 switches on; 0.99 switches off."""
    return gain > 1.0 if on else gain >= 1.0 + margin


class OffHold:
    """Keeps a k = 0 decision for the next few rounds instead of weighing every row again each round: while the
    same rows run (same request ids, in the same order), for at most ``rounds`` rounds and never past a round in
    which its :class:`ProbeBudget` could probe (each held round is counted there, at the weighed round's predicted
    time). Weighing a round costs tens of microseconds of Python per round and per row, paid between two forwards
    with cold caches, a few percent of a one-row step at the very time speculation is off because it does not pay.
    Held, what the weighing reads moves only slowly: a row at k = 0 brings no acceptance evidence, the population
    keeps its estimate while nobody drafts, and the cost tables change over many rounds; a row arriving or
    leaving ends the hold at once. The tracker takes in the held rounds at the next weighing (it reads each row's
    history since the last call). A decision near break-even held a few rounds too long costs little: there,
    drafting and not drafting yield nearly the same."""

    def __init__(self, rounds: int = 8):
        self.rounds = rounds
        self.left = 0
        self.ids: tuple = ()
        self.choices: list[Choice] = []
        self.t0 = 0.0

    def held(self, view: PolicyView, probes: ProbeBudget) -> list[Choice] | None:
        """The held choices for this round (counted as a round at k = 0), or None: weigh it."""
        if self.left <= 0:
            return None
        rows, ids = view.rows, self.ids
        if len(rows) != len(ids) or any(r.request_id != i for r, i in zip(rows, ids)):
            self.left = 0
            return None
        self.left -= 1
        probes.count(self.t0)
        return self.choices

    def start(self, view: PolicyView, choices: list[Choice], t0: float, quiet: int) -> list[Choice]:
        """After a weighed round at k = 0 (``t0``: its predicted seconds; ``quiet``: :attr:`ProbeBudget.quiet`): hold
        its choices (marked held in their reasons) for the next rounds. Returns ``choices``."""
        self.left = min(self.rounds, quiet)
        if self.left > 0:
            self.ids = tuple(r.request_id for r in view.rows)
            reason = choices[0].reason + " (held)" if choices else ""
            self.choices = [Choice(0, reason)] * len(choices)
            self.t0 = t0
        return choices

    def stop(self) -> None:
        self.left = 0


class CostGate:
    """Switches a rule's drafts off for a round when the cost model says they lose to plain decoding:
    expected batch tokens / predicted round time at the rule's widest k < the same at k = 0. A drafting round
    carries its share of the draft model's prefill (:func:`prefill_per_token`: speculating takes every row into the
    draft model, a cost that decides the matter under load), as goodput weighs it.

    Rows that stop drafting stop teaching the tracker, so after ``probe_every`` gated rounds one round drafts
    k = 1 (at most) when the :class:`ProbeBudget` allows (``probe_budget`` of the time spent gated) and the probe is
    :func:`worth_probing`: when acceptance, not load, closed the gate and a plausible rise in acceptance would
    reopen it (a probe at a load where even a good draft loses would be pure waste). Without a plain step timed at
    a row count near this one it runs one plain round (rules such as Hugging Face's never draft fewer than one
    token, so nothing else would time it, and the gate would stay open for good); without a draft or verify timed
    there it lets the rule through (so those get measured)."""

    def __init__(self, tracker: AcceptanceTracker, probe_every: int = 16, probe_budget: float = 0.05,
                 margin: float = SWITCH_MARGIN):
        self.tracker = tracker
        self.probes = ProbeBudget(probe_every, probe_budget)
        self.margin = margin
        self.on = False  # did the last weighed round let the rule draft (switch_on's hysteresis)
        self.hold = OffHold()
        self.times = RoundTimes(tracker.k_max)
        self.covered: set = set()

    def held(self, view: PolicyView) -> list[Choice] | None:
        """The choices of a k = 0 decision held from an earlier round (:class:`OffHold`), or None: ask the rule and
        weigh its choices (:meth:`apply`). Asked first, so a held round costs neither the rule nor the gate."""
        return self.hold.held(view, self.probes)

    def apply(self, view: PolicyView, choices: list[Choice], rule: str, width: float | None = None) -> list[Choice]:
        """``width``: the draft length the rule's rounds really reach, when it stops drafts early (default: its
        widest k); the round is timed at it (between the two draft lengths around it; below one draft token,
        plus the draft step that decided to stop)."""
        ks = [c.k for c in choices]
        kmax = max(ks, default=0)
        n = len(view.rows)
        if kmax == 0:
            return choices
        need = _costs_ready(view.costs, n, self.covered)
        if need == "plain":  # a rule that always drafts would never time the plain step the gate weighs it against
            return [Choice(0, f"gate: measuring plain steps at {n} rows ({rule})")] * n
        if need is not None:
            return choices
        times = self.times.get(view.costs, n)
        top = min(kmax, self.tracker.k_max)
        w = top if width is None else max(0.0, min(float(width), top))
        lo, hi = int(w), min(int(w) + 1, top)
        t0, tlo, thi = times[0], times[lo], times[hi]
        if t0 is None or tlo is None or thi is None:
            return choices
        tk = tlo + (thi - tlo) * (w - lo)
        if w < 1.0:  # a draft stopped before its first token still ran the draft forward that decided to stop
            tk += (1.0 - w) * (view.costs.draft_total(n, 1) or 0.0)
        per_token = view.costs.draft_prefill_time(1)
        catch = catch_up_time(view.rows, self.tracker, per_token)
        tk += catch
        pop = self.tracker.population()
        e_spec = share = 0.0
        for r, k in zip(view.rows, ks):
            e = expected_tokens(self.tracker.survival(r.request_id, pop), min(k, max(0, r.remaining - 1)))
            e_spec += e
            if k:
                share += prefill_per_token(r, per_token) * e
        gain = (e_spec / (tk + share)) / (n / t0)
        self.on = switch_on(gain, self.on, self.margin)
        if self.on:
            self.probes.reset()
            return choices
        if self.probes.off_round(view.rows, t0, times[1], per_token, pop[0], self.tracker.default, catch_up=catch):
            return [Choice(min(c.k, 1), f"probe k=1 after {self.probes.every}+ rounds off ({rule})")
                    for c in choices]
        why = f"off: {rule} k={kmax} predicted {gain:.2f}x plain ({n} rows)"
        return self.hold.start(view, [Choice(0, why)] * n, t0, self.probes.quiet)


# ============================================================================ the policies


def parse_table(spec: str) -> list[tuple[int, int | None, int]]:
    """'1-8=4,9-32=2,33-=0' -> [(1, 8, 4), (9, 32, 2), (33, None, 0)] (batch ranges, inclusive)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rng, k = part.split("=")
            lo, _, hi = rng.partition("-")
            out.append((int(lo), int(hi) if hi.strip() else (None if "-" in rng else int(lo)), int(k)))
        except ValueError:
            raise SpeclabError(f"batch-table entries look like '1-8=4' or '33-=0', got '{part}'") from None
    if not out:
        raise SpeclabError("batch-table needs at least one entry, e.g. '1-8=4,9-=0'")
    for lo, hi, k in out:
        check_k(k)
        if lo < 1 or (hi is not None and hi < lo):
            raise SpeclabError(f"batch-table range {lo}-{hi if hi is not None else ''} is empty")
    return out


@dataclass
class BatchTable:
    """k from the number of running rows, looked up in a table of ranges: vLLM's dynamic speculative
    decoding (``--speculative-config`` ``num_speculative_tokens_per_batch_size``, entries
    ``[start_bs, end_bs, K]`` over the concurrency, K = 0 switching speculation off for a range; vLLM
    docs, features/speculative_decoding/dynamic_speculative_decoding). Written here '1-64=3,65-128=1,
    129-=0'. vLLM's older ``speculative_disable_by_batch_size`` (one threshold) was ignored for several
    releases, then removed. Static: the table is the user's (default: K up to 8 rows, K/2 up to 32,
    off above); it does not look at acceptance or measured costs."""

    k_max: int = 4
    table: list[tuple[int, int | None, int]] | None = None
    name: str = field(default="batch-table", init=False)

    def __post_init__(self):
        K = check_k(self.k_max)
        if self.table is None:
            self.table = [(1, 8, K), (9, 32, max(1, K // 2) if K else 0), (33, None, 0)]
        elif isinstance(self.table, str):
            self.table = parse_table(self.table)
        self.k_max = max([K] + [k for _, _, k in self.table]) if self.table else K

    def lookup(self, n: int) -> tuple[int, str]:
        for lo, hi, k in self.table:
            if lo <= n and (hi is None or n <= hi):
                return k, f"batch-table: {n} rows in {lo}-{hi if hi is not None else ''} -> k={k}"
        return 0, f"batch-table: {n} rows in no range -> k=0"

    def choose(self, view: PolicyView) -> list[Choice]:
        k, why = self.lookup(view.running)
        return [Choice(k, why)] * len(view.rows)

    def draft_stop(self):
        return None


@dataclass
class GatedRule:
    """What the published rules behind the cost gate share: the largest k, the gate switch, and the
    acceptance tracker the gate reads."""

    k_max: int = 4
    gate: bool = True

    def _init_gate(self) -> None:
        check_k(self.k_max)
        self._tracker = AcceptanceTracker(self.k_max)
        self._gate = CostGate(self._tracker)

    def _gated(self, view: PolicyView, out: list[Choice], label: str, state: dict,
               width: float | None = None) -> list[Choice]:
        """The rule's choices through the gate (when on; ``width``: see :meth:`CostGate.apply`), after forgetting
        the per-request ``state`` of rows that left (kept while it is small: a request id seen again is checked
        against its history)."""
        if len(state) > 2 * len(view.rows) + 64:
            live = {r.request_id for r in view.rows}
            for rid in [i for i in state if i not in live]:
                del state[rid]
        return self._gate.apply(view, out, label, width) if self.gate else out

    def draft_stop(self):
        return None


@dataclass
class Heuristic(GatedRule):
    """Hugging Face's schedule (transformers ``AssistedCandidateGenerator.update_candidate_strategy``,
    ``num_assistant_tokens_schedule="heuristic"``): per row, k += 2 after a round in which every draft
    was accepted, k -= 1 (at least 1) otherwise; starts at K, here kept within [1, K]. Rounds that
    drafted nothing leave k alone. Behind the cost gate (``gate=False``: HF's rule alone)."""

    name: str = field(default="heuristic", init=False)

    def __post_init__(self):
        self._init_gate()
        self._k: dict[str, list[int]] = {}  # request id -> [history seen, k]

    def row_k(self, r: RowView) -> int:
        st = self._k.get(r.request_id)
        if st is None or st[0] > len(r.history):
            st = self._k[r.request_id] = [0, self.k_max]
        k = st[1]
        for d, a in r.history[st[0]:]:
            if d > 0:
                k = min(self.k_max, k + 2) if a == d else max(1, k - 1)
        st[0], st[1] = len(r.history), k
        return k

    def choose(self, view: PolicyView) -> list[Choice]:
        if self.k_max == 0:
            return [Choice(0, "heuristic: K = 0")] * len(view.rows)
        if self.gate:
            if (held := self._gate.held(view)) is not None:
                return held
            self._tracker.update(view)
        out = [Choice(k, f"heuristic k={k}") for k in (self.row_k(r) for r in view.rows)]
        return self._gated(view, out, "heuristic", self._k)


def ema_tiers(k_max: int) -> list[int]:
    """The step tiers: powers of two below K, and K. e.g. K = 6 -> [1, 2, 4, 6]."""
    tiers, t = [], 1
    while t < k_max:
        tiers.append(t)
        t *= 2
    return tiers + [k_max] if k_max > 0 else [0]


@dataclass
class Ema(GatedRule):
    """SGLang-style adaptive steps (SGLang ``srt/speculative``: an EMA of the accepted length choosing
    between a few precompiled step tiers): per row, ema <- ema + beta (accepted - ema) after each
    round that drafted; the row moves up one tier when ema >= ``up`` x its tier (nearly every draft
    accepted) and down one when ema < ``down`` x its tier, and stays in between (hysteresis: a row at
    the edge does not flip every round). Tiers: powers of two below K, and K; rows start at the
    middle tier. Behind the cost gate (``gate=False``: the tier rule alone)."""

    name: str = field(default="ema", init=False)
    beta: float = 0.3
    up: float = 0.8
    down: float = 0.3

    def __post_init__(self):
        if not 0 <= self.down < self.up <= 1:
            raise SpeclabError(f"ema needs 0 <= down < up <= 1, got down={self.down}, up={self.up}")
        self._init_gate()
        self.tiers = ema_tiers(self.k_max)
        self._st: dict[str, list] = {}  # request id -> [history seen, ema or None, tier index]

    def step(self, ema: float | None, tier: int, accepted: int) -> tuple[float, int]:
        """One round's update: the new EMA and tier index (pure; unit-tested)."""
        ema = float(accepted) if ema is None else ema + self.beta * (accepted - ema)
        k = self.tiers[tier]
        if ema >= self.up * k and tier + 1 < len(self.tiers):
            tier += 1
        elif ema < self.down * k and tier > 0:
            tier -= 1
        return ema, tier

    def row_k(self, r: RowView) -> tuple[int, float | None]:
        st = self._st.get(r.request_id)
        if st is None or st[0] > len(r.history):
            st = self._st[r.request_id] = [0, None, (len(self.tiers) - 1) // 2]
        ema, tier = st[1], st[2]
        for d, a in r.history[st[0]:]:
            if d > 0:
                ema, tier = self.step(ema, tier, a)
        st[0], st[1], st[2] = len(r.history), ema, tier
        return self.tiers[tier], ema

    def choose(self, view: PolicyView) -> list[Choice]:
        if self.k_max == 0:
            return [Choice(0, "ema: K = 0")] * len(view.rows)
        if self.gate:
            if (held := self._gate.held(view)) is not None:
                return held
            self._tracker.update(view)
        out = []
        for r in view.rows:
            k, ema = self.row_k(r)
            out.append(Choice(k, f"ema tier k={k}" + (f" (ema {ema:.2f})" if ema is not None else "")))
        return self._gated(view, out, "ema", self._st)


@dataclass
class Goodput:
    """Maximise goodput each round (SmartSpec, Liu et al. 2024, "Optimizing Speculative Decoding for
    Serving Large Language Models Using Goodput", arXiv:2406.14066, the basis of TurboSpec): choose
    the k in 0..K that maximises

        expected committed tokens of the batch / expected round time
        = sum_b (1 + sum_{i < min(k, remaining_b - 1)} survival_b[i]) / round_time(n, k)

    with survival_b from :class:`AcceptanceTracker` (per row and per position, with a population prior
    for new rows) and round_time(n, k) = draft phase of k steps + target forward of n x (k+1) + the
    per-round overhead, from the measured :class:`~speclab.engine.costs.OnlineCosts` (k = 0: a plain
    decode step, no drafting). One k for the whole round: the verify block is padded to the widest
    row and a draft step runs every row, so a row drafting less saves nothing. k = 0 wins by itself
    when acceptance is low (few tokens per extra cost) or the load is high (verifying k+1 tokens per
    row costs nearly k+1 plain steps once the forward is compute-bound).

    Cold start: at a row count with no cost numbers it runs one k = 0 round and one k = K round to
    measure them (calibrating with :meth:`OnlineCosts.calibrate` beforehand avoids even that).
    Exploration: after ``probe_every`` rounds at k = 0 it drafts k = 1 once when its :class:`ProbeBudget`
    (``probe_budget`` of the time spent at k = 0) allows and the probe is :func:`worth_probing` (so it notices
    acceptance coming back; never at a load where only an implausible acceptance would pay)."""

    k_max: int = 4
    probe_every: int = 8
    probe_budget: float = 0.05
    switch_margin: float = SWITCH_MARGIN
    name: str = field(default="goodput", init=False)

    def __post_init__(self):
        check_k(self.k_max)
        self.tracker = AcceptanceTracker(self.k_max)
        self.times = RoundTimes(self.k_max)
        self.probes = ProbeBudget(self.probe_every, self.probe_budget)
        self.hold = OffHold()
        self.on = False  # did the last weighed round draft (switch_on's hysteresis)
        self._raw: list[float | None] = []  # the last scores' round times without the draft-prefill share
        self._per_token = 0.0
        self._catch = 0.0  # the last scores' catch-up charge (catch_up_time)
        self.covered: set = set()

    def scores(self, view: PolicyView) -> tuple[list[float], list[float | None]]:
        """Expected batch tokens and predicted round time for every k (pure given the tracker); a round that
        drafts also carries its share of the draft model's prefill (:func:`draft_prefill_share`)."""
        pop = self.tracker.population()
        surv = [self.tracker.survival(r.request_id, pop) for r in view.rows]
        per_row = [row_tokens(sv, r.remaining, self.k_max) for sv, r in zip(surv, view.rows)]
        tokens = round_tokens(per_row, self.k_max)
        self._raw = times = self.times.get(view.costs, len(view.rows))
        self._per_token = per_token = view.costs.draft_prefill_time(1) if view.costs is not None else 0.0
        self._catch = catch = catch_up_time(view.rows, self.tracker, per_token)
        if per_token:
            extra = draft_prefill_share(view.rows, surv, self.k_max, per_token, per_row)
            times = [t + e + (catch if k else 0.0) if t is not None else None
                     for k, (t, e) in enumerate(zip(times, extra))]
        return tokens, times

    def choose(self, view: PolicyView) -> list[Choice]:
        n, K = len(view.rows), self.k_max
        if n == 0:
            return []
        if K == 0:
            return [Choice(0, "goodput: K = 0")] * n
        held = self.hold.held(view, self.probes)
        if held is not None:
            return held
        self.tracker.update(view)
        need = _costs_ready(view.costs, n, self.covered)
        if need == "none":
            return [Choice(K, "goodput: no cost model, k=K")] * n
        if need == "plain":
            return [Choice(0, f"goodput: measuring plain steps at {n} rows")] * n
        if need == "spec":
            return [Choice(K, f"goodput: measuring k={K} rounds at {n} rows")] * n
        tokens, times = self.scores(view)
        if times[0] is None:
            return [Choice(0, "goodput: no plain-step estimate")] * n
        rate = [tok / t if t else 0.0 for tok, t in zip(tokens, times)]
        best = 0
        for k in range(1, K + 1):
            if rate[k] > rate[best] * (1 + 1e-9):
                best = k
        gain = rate[best] / rate[0] if rate[0] else float("inf")
        self.on = best > 0 and switch_on(gain, self.on, self.switch_margin)
        why = (f"goodput: k={best} {tokens[best] / n:.2f} tok/row in {times[best] * 1e3:.2f} ms, "
               f"{gain:.2f}x k=0 ({n} rows)")
        if best and not self.on:
            why = (f"goodput: k=0, k={best} predicted {gain:.2f}x < {1 + self.switch_margin:.2f}x to switch on "
                   f"({n} rows)")
            best = 0
        if best == 0:
            # round times without the prefill share: a probe pays the real one (weighed with the share)
            # (a probe pays the catch-up; whether one is worth it is the steady round's question)
            waited = self.probes.off_round(view.rows, self._raw[0], self._raw[1], self._per_token,
                                           self.tracker.population()[0], self.tracker.default,
                                           times[1] - self._catch if times[1] is not None else None,
                                           catch_up=self._catch)
            if waited:
                return [Choice(1, f"goodput: probe k=1 after {waited} rounds at k=0")] * n
        else:
            self.probes.reset()
        out = [Choice(best, why)] * n
        return self.hold.start(view, out, self._raw[0], self.probes.quiet) if best == 0 else out

    def draft_stop(self):
        return None


@dataclass
class Confidence(GatedRule):
    """Draft up to K and stop a row's draft at the first position where the draft is unsure:

    * its top probability is below ``threshold`` (Hugging Face ``assistant_confidence_threshold``,
      default 0.4, checked by ``ConfidenceCriteria`` on each draft token), or
    * AdaEDL's entropy-based lower bound on the token's acceptance probability,
      1 - sqrt(``gamma`` x H(draft distribution)), is below ``floor`` (Agrawal et al. 2024, "AdaEDL:
      Early Draft Stopping for Speculative Decoding of Large Language Models via an Entropy-based
      Lower Bound on Token Acceptance Probability", arXiv:2410.18351; ``floor=0`` turns it off).

    The stop is checked on the draft's distribution before each token (the token it would draft next
    is not proposed). Works with drafters that compute distributions (model drafts); prompt lookup
    and the synthetic drafter have none and ignore it. Behind the cost gate (``gate=False``: the
    stopping rule alone), which weighs what the rule's rounds really yield and cost: a draft the rule
    stopped before the k asked counts as rejected at the stop (:meth:`realized`), and a round is timed at
    the draft length the rule's rounds reach (a decayed mean), plus the draft step that decided to stop."""

    name: str = field(default="confidence", init=False)
    threshold: float = 0.4
    floor: float = 0.3
    gamma: float = 0.5

    def __post_init__(self):
        check_float("confidence threshold", self.threshold, 0.0, 1.0)
        check_float("confidence entropy floor", self.floor, 0.0, 1.0)
        self._init_gate()
        self._asked: dict[str, list] = {}  # request id -> [k asked per round (by history index), realized history]
        self._width: float | None = None  # decayed mean of the draft steps its rounds really ran

    def realized(self, r: RowView) -> RowView:
        """The row as the gate must weigh it: a round in which the stop rule ended the draft before the k asked
        counts as that draft rejected at the stop (it yields what a rejection there yields), not as a shorter
        draft. Otherwise the tracker sees only the drafts the rule was sure of, and rounds that paid for a draft
        step and verified nothing, which do not count, keep the gate open where drafting loses."""
        st = self._asked.get(r.request_id)
        if st is None or len(st[1]) > len(r.history):
            st = self._asked[r.request_id] = [{}, []]
        asked, real = st
        for i in range(len(real), len(r.history)):
            d, a = r.history[i]
            k = asked.pop(i, 0)
            real.append((k, a) if a == d < k else (d, a))
        return RowView(r.request_id, real, r.pos_drafted, r.pos_accepted, r.remaining, r.greedy, r.prompt_len,
                       r.generated, r.taken_in)  # the live list, as the scheduler passes its own (no copy per round)

    def choose(self, view: PolicyView) -> list[Choice]:
        K = self.k_max
        out = [Choice(K, f"confidence: up to k={K}")] * len(view.rows)
        if not (self.gate and K):
            return out
        if (held := self._gate.held(view)) is not None:
            return held
        last = [r.history[-1][0] for r in view.rows
                if r.history and (st := self._asked.get(r.request_id)) and len(r.history) - 1 in st[0]]
        if last:  # the previous round asked for drafts: how far its draft phase ran (the widest row's draft)
            w = float(max(last))
            self._width = w if self._width is None else 0.8 * self._width + 0.2 * w
        seen = replace(view, rows=tuple(self.realized(r) for r in view.rows))
        self._tracker.update(seen)
        out = self._gated(seen, out, "confidence", self._asked, self._width)
        for r, c in zip(view.rows, out):
            if c.k:
                self._asked[r.request_id][0][len(r.history)] = min(c.k, max(0, r.remaining - 1))
        return out

    def draft_stop(self):
        thr, floor, gamma = self.threshold, self.floor, self.gamma

        def stop(i, probs):  # probs (n, V): the draft's distribution for token i
            halt = probs.max(-1).values < thr  # (n,)
            if floor > 0:
                p = probs.float()
                ent = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (n,) nats
                halt = halt | ((1.0 - (gamma * ent).clamp_min(0).sqrt()) < floor)
            return halt

        return stop


POLICIES: dict[str, type] = {"fixed": Fixed, "off": Off, "batch-table": BatchTable, "heuristic": Heuristic,
                             "ema": Ema, "goodput": Goodput, "confidence": Confidence}
ADAPTIVE = ("heuristic", "ema", "goodput", "confidence")  # decide from acceptance (and costs) as they run


def seed_costs(policy, costs, target, drafter, rows: int, context: int = 96) -> float | None:
    """Calibrate ``costs`` (:class:`~speclab.engine.costs.OnlineCosts`) for every shape ``policy`` chooses
    between at up to ``rows`` rows (k = 0..K), before any timed work, when it weighs step costs (the adaptive
    policies): the seconds spent, or None for a policy that does not read them. A model drafter's draft phases
    are timed as they run (:func:`~speclab.engine.costs.time_draft_phases`); other drafters' are learnt online."""
    if policy.name not in ADAPTIVE or policy.k_max == 0:
        return None
    from .costs import calibration_rows

    return costs.calibrate(target, drafter, rows=calibration_rows(rows), tokens=tuple(range(1, policy.k_max + 2)),
                           context=context)


def make_policy(spec, k: int = 4) -> Policy:
    """A policy from a name ('fixed', 'off', ... see ``POLICIES``), a Policy (returned as is), or None
    (fixed k). ``k`` is the draft length of 'fixed' and the largest k of adaptive policies. Arguments
    follow a colon: 'batch-table:1-8=4,9-=0' (its table), 'confidence:0.3' (its threshold)."""
    if spec is None:
        return Fixed(check_k(k)) if k > 0 else Off()
    if not isinstance(spec, str):
        return spec
    name, _, arg = spec.strip().partition(":")
    name = name.strip().lower().replace("_", "-")
    if name not in POLICIES:
        raise SpeclabError(f"unknown policy '{spec}' (known: {', '.join(POLICIES)})")
    cls = POLICIES[name]
    arg = arg.strip()
    if arg and cls not in (BatchTable, Confidence):
        raise SpeclabError(f"policy '{name}' takes no arguments, got '{spec}'")
    if cls is Off:
        return Off()
    if cls is Fixed:
        return Fixed(check_k(k))
    if cls is BatchTable:
        return BatchTable(check_k(k), parse_table(arg) if arg else None)
    if cls is Confidence and arg:
        return Confidence(check_k(k), threshold=check_float("confidence threshold", arg, 0.0, 1.0))
    return cls(k_max=check_k(k))
