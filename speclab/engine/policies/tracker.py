"""Per-row, per-position acceptance estimates (:class:`AcceptanceTracker`) and the expected tokens of a round."""

from __future__ import annotations

import math
from collections import deque

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
    (``"population"``, the default), the row's own estimate at i-1 (``"chain"``: acceptance i.i.d. along a draft,
    the default until 2026-12-02), or the row's offset from the population carried in log-odds (``"logit"``).
    Drafts are not i.i.d.: on JSON the first draft token is taken 0.69 of the time and every later one about 0.9
    once the ones before it were, so 'chain' started a new row at [0.69, 0.48, 0.33, 0.23] where the population
    read [0.69, 0.61, 0.55, 0.50] (``speclab bench --tracker-fit``: 'population' has the lower log-loss on JSON and
    code at k >= 2, and over all). The population's own prior at position 0 is ``default``, deeper in its estimate
    before. ``survival(row)`` = cumulative products: P(at least i+1 drafts accepted).

    The defaults (decay 0.95, prior weight 4) come from ``speclab bench --tracker-fit``: replaying fixed-k
    histories of JSON, code and prose through the tracker, they predict acceptance with 1.6% less log-loss
    than the earlier 0.9 / 2, which followed a row so closely that one miss halved its estimate (a
    setting that forgets more slowly still, 0.98 / 8, is 0.4% better again, within the grid's flat bottom).
    """

    def __init__(self, k_max: int, decay: float = 0.95, prior_weight: float = 4.0, default: float = 0.8,
                 population_decay: float = 0.95, position_prior: str = "population", profiles: int = 32):
        if position_prior not in POSITION_PRIORS:
            raise ValueError(f"position_prior must be one of {', '.join(POSITION_PRIORS)}, got {position_prior!r}")
        self.position_prior = position_prior
        self.k_max = k_max
        self.decay, self.w, self.default, self.pop_decay = decay, prior_weight, default, population_decay
        # request id -> [history seen, reached[K], accepted[K], idle rounds, lifetime reached[K], lifetime accepted[K]]
        self.rows: dict[str, list] = {}
        self.pop_n = [0.0] * k_max
        self.pop_a = [0.0] * k_max
        self.departed: deque = deque(maxlen=profiles)  # (reached, accepted) over the whole life of rows that left
        self.departures = 0  # rows that left having drafted (mixture's cache key)
        self._mix: tuple[int, Mixture | None] = (-1, None)

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
                st = self.rows[r.request_id] = [0, [0.0] * K, [0.0] * K, 0, [0] * K, [0] * K]
            seen, N, A, idle, LN, LA = st
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
                    LN[i] += 1
                    LA[i] += ok
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
                st = self.rows.pop(rid)
                if st[4][0]:
                    self.departed.append((st[4], st[5]))
                    self.departures += 1

    def fresh(self, request_id: str) -> bool:
        """Has the row never drafted (no acceptance evidence of its own)?"""
        st = self.rows.get(request_id)
        return st is None or not st[4][0]

    def young(self, request_id: str) -> tuple[list[float], list[float]] | None:
        """The row's (reached, accepted) counts (decayed) while it is young: it reached position 0 in fewer than
        2 x ``prior_weight`` rounds over its life (empty counts for a row never seen); else None."""
        st = self.rows.get(request_id)
        if st is None:
            return [0.0] * self.k_max, [0.0] * self.k_max
        return (st[1], st[2]) if st[4][0] < 2 * self.w else None

    def profiles(self, pop: list[float] | None = None) -> list[list[float]]:
        """The survival curves of the last rows that left having drafted, each from its whole life's counts (no decay:
        what the row accepted while it drafted), each position's conditional (accepted + prior) / (reached + 1), prior
        the population's there: the spread of what rows accept, which a mean hides (on a stream of JSON and code
        requests, half the rows accept 0.7 at the first position and half 0.2; the mean, 0.45, describes neither).
        e.g. a row reached position 0 in 4 rounds and accepted once, population [0.6, 0.9]: c0 = (1 + 0.6) / 5 = 0.32,
        position 1 never reached: c1 = 0.9, survival [0.32, 0.288]."""
        pop = pop if pop is not None else self.population()
        out = []
        for LN, LA in self.departed:
            s, surv = 1.0, []
            for i in range(self.k_max):
                s *= (LA[i] + pop[i]) / (LN[i] + 1.0)
                surv.append(s)
            out.append(surv)
        return out

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

    def mixture(self, pop: list[float] | None = None) -> "Mixture | None":
        """What past rows accepted (:meth:`profiles`, with the population as one more), ready to weigh a young row
        against (:meth:`survival`'s ``mix``); None with fewer than :data:`MIXTURE_PROFILES` past rows. Built when a
        row leaves (with the population then), not every round: a policy weighs rounds of a few milliseconds."""
        if len(self.departed) < MIXTURE_PROFILES:
            return None
        if self._mix[0] != self.departures:
            pop = pop if pop is not None else self.population()
            s, surv = 1.0, []
            for c in pop:
                s *= c
                surv.append(s)
            self._mix = (self.departures, Mixture(self.profiles(pop) + [surv]))
        return self._mix[1]

    def survival(self, request_id: str, pop: list[float] | None = None, mix: "Mixture | None" = None) -> list[float]:
        """P(drafts 0..i all accepted) for i < K: the cumulative products of :meth:`conditional` (one loop: policies
        ask for every row every round). ``mix`` (:meth:`mixture`): a young row that has drafted (:meth:`young`) is
        shrunk toward what past rows like it accepted (:meth:`Mixture.prior`), not toward the population's mean."""
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
        if mix is not None and 0 < st[4][0] < 2 * w:  # young (as young() says)
            for i, m in enumerate(mix.prior(N, A)):
                s *= (A[i] + w * m) / (N[i] + w)
                out.append(s)
            return out
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


MIXTURE_PROFILES = 2  # past rows needed before young rows are weighed against them (AcceptanceTracker.mixture)


class Mixture:
    """Past rows' survival curves as a discrete prior over what a row may be like (empirical Bayes): given a row's
    counts (reached, accepted per position), each past row j is weighed by the likelihood of those counts under its
    conditionals c_j, prod_i c_ji^accepted_i (1 - c_ji)^(reached_i - accepted_i), and :meth:`prior` is the weighted
    mean survival's conditionals. On a stream of JSON and code requests, one accepted draft makes a new row far more
    likely a JSON one (0.7 against 0.2 per draft), where shrinking it toward the mean of both (0.45) with prior weight
    4 moves it a fifth of the way."""

    def __init__(self, survivals: list[list[float]]):
        self.surv = survivals
        self.logs = []
        for sv in survivals:
            prev, lc, l1 = 1.0, [], []
            for x in sv:
                c = min(max(x / prev if prev > 0 else 0.0, 1e-4), 1 - 1e-4)
                lc.append(math.log(c))
                l1.append(math.log(1 - c))
                prev = x
            self.logs.append((lc, l1))

    def weights(self, reached: list[float], accepted: list[float]) -> list[float]:
        """Each past row's posterior weight given these counts (summing to 1)."""
        lls = []
        for lc, l1 in self.logs:
            ll = 0.0
            for i, n in enumerate(reached):
                if n:
                    a = accepted[i]
                    ll += a * lc[i] + (n - a) * l1[i]
            lls.append(ll)
        top = max(lls)
        ws = [math.exp(x - top) for x in lls]
        tot = sum(ws)
        return [w / tot for w in ws]

    def prior(self, reached: list[float], accepted: list[float]) -> list[float]:
        """The conditionals per position of the past rows' survival, each weighed by the likelihood of these counts.
        e.g. past rows with conditionals [0.8, 0.9] and [0.2, 0.5], one round that accepted its one draft
        (reached [1, 0], accepted [1, 0]): weights 0.8 and 0.2, survival 0.8 x [0.8, 0.72] + 0.2 x [0.2, 0.1] =
        [0.68, 0.596], conditionals [0.68, 0.876]."""
        ws = self.weights(reached, accepted)
        K = len(self.surv[0])
        mean = [sum(wj * sv[i] for wj, sv in zip(ws, self.surv)) for i in range(K)]
        out, prev = [], 1.0
        for x in mean:
            out.append(x / prev if prev > 0 else 0.0)
            prev = x
        return out
