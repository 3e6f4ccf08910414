"""Per-row, per-position acceptance estimates (:class:`AcceptanceTracker`) and the expected tokens of a round."""

from __future__ import annotations

import math

from .base import PolicyView


def expected_tokens(survival: list[float], k: int) -> float:
    """Expected tokens a round of k drafts emits, from ``survival[i]`` = P(drafts 0..i all accepted):
    1 (the recovered or bonus token) + sum_{i<k} survival[i]. e.g. i.i.d. acceptance 0.5, k = 2:
    1 + 0.5 + 0.25 = 1.75."""
    return 1.0 + sum(survival[:k])


POSITION_PRIORS = ("chain", "population", "logit")


def _logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def position_priors(kind: str, row_prev: float, pop: list[float], i: int) -> float:
    """The prior of a row's conditional acceptance at draft position i >= 1, given its estimate at i-1
    (``row_prev``) and the population's conditionals ``pop``: 'chain' the row's own estimate at i-1 (acceptance
    i.i.d. along a draft); 'population' the population's at i; 'logit' the row's offset from the population at
    i-1 carried to i in log-odds (a row below the population at position 0 stays as far below it deeper in).
    e.g. row 0.6, population [0.7, 0.9]: chain 0.6, population 0.9, logit sigmoid(logit 0.6 + logit 0.9 -
    logit 0.7) = 0.85."""
    if kind == "chain":
        return row_prev
    if kind == "population":
        return pop[i]
    return _sigmoid(_logit(row_prev) + _logit(pop[i]) - _logit(pop[i - 1]))


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
    (accepted + w * prior) / (reached + w), with w = ``prior_weight`` and prior, at i = 0, the population's
    estimate there and, deeper in, by ``position_prior`` (:func:`position_priors`): the population's estimate at i
    (``"population"``, the default), the row's own estimate at i-1 (``"chain"``: acceptance i.i.d. along a
    draft), or the row's offset from the population carried in log-odds (``"logit"``).
    Drafts are not i.i.d.: a later draft token is taken more often once the ones before it were, so 'chain'
    starts a new row far too low at the deeper positions, where the population's estimate there is close (the
    tracker-fit benchmark, ``benchmarks/tracker_fit.py``, compares the priors by log-loss over recorded histories).
    The population's own prior at position 0 is ``default``, deeper in its estimate
    before. ``survival(row)`` = cumulative products: P(at least i+1 drafts accepted).

    The defaults (decay 0.95, prior weight 4) sit in the flat bottom of the tracker-fit benchmark's log-loss over
    fixed-k histories of JSON, code and prose; a setting that forgets faster follows a row so closely that one miss
    halves its estimate.
    """

    def __init__(self, k_max: int, decay: float = 0.95, prior_weight: float = 4.0, default: float = 0.8,
                 population_decay: float = 0.95, position_prior: str = "population"):
        if position_prior not in POSITION_PRIORS:
            raise ValueError(f"position_prior must be one of {', '.join(POSITION_PRIORS)}, got {position_prior!r}")
        self.position_prior = position_prior
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
        out, w, kind = [], self.w, self.position_prior
        for i in range(self.k_max):
            prior = pop[0] if i == 0 else position_priors(kind, out[-1], pop, i)
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
        w, prior, kind = self.w, pop[0], self.position_prior
        if not N[0] and kind == "chain":  # no evidence at all (N[i] <= N[0]): every position at the population's first
            for _ in range(self.k_max):
                s *= prior
                out.append(s)
            return out
        for i in range(self.k_max):
            if i:
                prior = position_priors(kind, prior, pop, i)
            prior = (A[i] + w * prior) / (N[i] + w)
            s *= prior
            out.append(s)
        return out
