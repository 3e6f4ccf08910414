"""The cost side of a policy's choice: predicted round times, the draft's prefill and catch-up a round carries,
probes and their budget, the switch-on band, held k = 0 decisions, and the cost gate of the published rules."""

from __future__ import annotations

import math

from ..costs import PLAIN_SAMPLES, row_level
from .base import Choice, PolicyView
from .tracker import AcceptanceTracker, expected_tokens

NEVER = 1 << 30  # ProbeBudget.quiet when no probe can come


def costs_ready(costs, n: int, covered: set | None = None) -> str | None:
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


CALIBRATED_WEIGHT = 0.1  # a draft length whose verify was only calibrated, in the line through the round times


def affine_in_k(times: list[float], weights: list[float] | None = None) -> list[float]:
    """Drafting rounds' times (k >= 1) replaced by their least-squares line in k, never falling; k = 0 (a plain step,
    another kernel and no draft phase) kept. A drafting round is a draft phase of k steps (a catch-up forward and k
    steps: affine in k) and a verify of k + 1 tokens a row (affine in k at a given row count too), so a line is what
    the costs are; each draft length's own estimate is a median of rounds taken at other moments of a machine whose
    speed drifts by tens of percent over seconds, and a length tried rarely keeps a reading from a slow spell. Fitted,
    every length's rounds inform every other's. ``weights``: one per k >= 1 (default: all 1), e.g. less for draft
    lengths only calibrated (:class:`RoundTimes`). e.g. [5, 8, 9, 13, 12] -> [5, 8.1, 9.7, 11.3, 12.9]."""
    ys = times[1:]
    m = len(ys)
    ws = list(weights) if weights is not None else [1.0] * m
    if sum(1 for w in ws if w > 0) < 2:
        return list(times)
    xs = range(1, m + 1)
    W = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / W
    my = sum(w * y for w, y in zip(ws, ys)) / W
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = max(0.0, sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx) if sxx > 0 else 0.0
    return [times[0]] + [my + slope * (x - mx) if w > 0 else y for x, y, w in zip(xs, ys, ws)]


class RoundTimes:
    """Predicted round time for k = 0..K at n rows, cached: recomputed when n changes or every
    ``refresh`` rounds (the cost tables move slowly; a prediction costs tens of microseconds, a
    batch-1 round a few milliseconds). ``fit``: what smooths the drafting rounds' times across k
    (:func:`affine_in_k`); then :func:`monotone`.

    In the line, where some draft lengths' verifies were timed online at n rows and others only calibrated there
    (read from the table's :meth:`~speclab.engine.costs.OnlineCosts.measured`), a timed one weighs 1 and a calibrated
    one ``calibrated`` (default :data:`CALIBRATED_WEIGHT`; 0 keeps it out of the line, as it is): a calibrated width
    is rescaled by the ratio another width drifted by online, which need not hold for it. Weighed equally, rescaled
    calibrations of the widths a policy never ran can tilt the line enough to price the short draft lengths above
    their own parts and keep the policy off where a short fixed k pays."""

    def __init__(self, k_max: int, refresh: int = 8, fit=affine_in_k, calibrated: float = CALIBRATED_WEIGHT):
        self.k_max, self.refresh, self.fit, self.calibrated = k_max, refresh, fit, calibrated
        self.n = -1
        self.age = 0
        self.costs = None
        self.times: list[float | None] = []

    def get(self, costs, n: int) -> list[float | None]:
        self.age += 1
        if n != self.n or costs is not self.costs or self.age >= self.refresh or None in self.times:
            times = [costs.round_time(n, k) for k in range(self.k_max + 1)]
            if None in times:
                self.times = times
            elif self.fit is affine_in_k:
                measured = getattr(costs, "measured", None)
                on = [measured is None or measured(n, k + 1) for k in range(1, self.k_max + 1)]
                w = [1.0 if m else self.calibrated for m in on] if 0 < sum(on) < len(on) else None
                self.times = monotone(affine_in_k(times, w))
            else:
                self.times = monotone(self.fit(times))
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
    come seconds apart, not every few rounds. One home for goodput and the cost gate of the published rules.

    Backoff: each probe in a row that did not switch drafting back on halves the budget (at most ``backoff``
    times; :attr:`share`), and drafting switching on (:meth:`reset`) makes it whole again. Where speculation never
    pays, every probe is lost, so the whole budget would show as a loss against plain decoding; where acceptance
    comes back, the first probes after a switch-off come as often as before."""

    def __init__(self, every: int, budget: float, backoff: int = 2):
        self.every, self.budget, self.backoff = every, budget, backoff
        self.idle = 0  # rounds at k = 0 since the last probe
        self.idle_s = 0.0  # their predicted seconds
        self.quiet = 0  # after off_round: how many of the next rounds at k = 0 certainly cannot be a probe
        self.misses = 0  # probes since drafting was last on

    @property
    def share(self) -> float:
        """The budget now: ``budget`` halved for each probe since drafting was last on, at most ``backoff`` times.
        e.g. budget 0.05, backoff 2: 0.05, then 0.025, then 0.0125 for every later probe."""
        return self.budget * 0.5 ** min(self.misses, self.backoff)

    def reset(self) -> None:
        """Drafting is on: the count of rounds at k = 0 restarts and the budget is whole again."""
        self.idle, self.idle_s = 0, 0.0
        self.misses = 0

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
        share = self.share
        short = probe_cost(rows, t0, t1, per_token, catch_up) - share * self.idle_s
        if short > 0:  # the rounds until the budget covers it (a lower bound: the catch-up grows meanwhile)
            self.quiet = math.ceil(short / (share * t0)) - 1 if share > 0 and t0 > 0 else NEVER
            return 0
        if not worth_probing(t0, t1 if t1_weighed is None else t1_weighed, pop_first, default):
            self.quiet = NEVER
            return 0
        waited = self.idle
        self.idle, self.idle_s = 0, 0.0
        self.misses += 1  # until drafting switches on (reset)
        self.quiet = 0
        return waited


class PlainCheck:
    """Times the plain step at a load level where the policy would draft but fewer than :data:`PLAIN_SAMPLES` plain
    steps were timed online (:meth:`OnlineCosts.plain_samples`): a policy drafting from its first round never runs
    the steady plain rounds the scheduler times, so its plain-step estimate stays the calibration scaled by what
    other load levels or the verify blocks drifted to: a plain-round overhead extrapolated from few rows can price
    plain rounds far above what they take, and the policy then drafts where drafting loses. One sample is not enough
    (it sets the estimate at its shape alone, and a single cold one reads high). Before
    drafting there it runs k = 0 rounds until the level has them (the first plain round after a drafting one runs
    cold and is not timed; the scheduler times every steady plain round until then), at most ``rounds`` for each
    load level (power-of-two row counts), so a scheduler that does not record costs loses a few rounds once. A
    frozen table never learns: no check."""

    def __init__(self, rounds: int = 8):
        self.rounds = rounds
        self.spent: dict[int, int] = {}  # row_level -> plain rounds run to time the plain step there

    def due(self, costs, n: int) -> bool:
        """Run this round (n rows) at k = 0 to time the plain step? Counts the round when it says yes."""
        if costs is None or costs.frozen or costs.plain_samples(n) >= PLAIN_SAMPLES:
            return False
        b = row_level(n)
        used = self.spent.get(b, 0)
        if used >= self.rounds:
            return False
        self.spent[b] = used + 1
        return True


SWITCH_MARGIN = 0.05  # the predicted gain over plain decoding that switches speculation back on (see switch_on)


def switch_on(gain: float, on: bool, margin: float = SWITCH_MARGIN) -> bool:
    """Does a round draft, given its predicted ``gain`` over plain decoding (tokens per second, drafting / not) and
    whether the last weighed round drafted (``on``)? Hysteresis: drafting stays on while it is predicted to pay at
    all (gain > 1) but comes back on only at a gain of 1 + ``margin``. Switching on has costs the round's model
    does not carry in full (the draft's weights and cache run cold after plain rounds, rows admitted meanwhile are
    prefilled into the draft), and its prediction errs by a few percent either way; near a predicted 1.0x a policy
    flipping on and off pays those costs for nothing.
    e.g. gain 1.03: on stays on, off stays off; gain 1.06 switches on; 0.99 switches off."""
    return gain > 1.0 if on else gain >= 1.0 + margin


def same_rows(view: PolicyView, ids: tuple) -> bool:
    """The view's rows are the requests ``ids``, in that order (a held decision stands only for the rows it was
    weighed for)."""
    rows = view.rows
    return len(rows) == len(ids) and all(r.request_id == i for r, i in zip(rows, ids))


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
        if not same_rows(view, self.ids):
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


class DraftHold:
    """Keeps a drafting decision for the next few rounds while the same rows run (same request ids, in the same
    order), for at most ``rounds`` rounds. Weighing a round costs tens of microseconds of Python per round and more
    per row (a visible share of a small drafting round, and its cold caches slow the forwards after it; the
    policies benchmark times it), and what it reads moves little
    from one round to the next: the tracker takes the held rounds in at the next weighing (it reads each row's
    history since the last call), and a row arriving or leaving ends the hold at once. The price: a fall in
    acceptance is seen up to ``rounds`` rounds later. Near break-even that is a gain too: weighed every round, a
    policy switches off at the first run of rejections that pulls its estimate under break-even and, off, learns
    only from probes."""

    def __init__(self, rounds: int = 4):
        self.rounds = rounds
        self.left = 0
        self.ids: tuple = ()
        self.choices: list[Choice] = []

    def held(self, view: PolicyView) -> list[Choice] | None:
        """The held choices for this round, or None: weigh it."""
        if self.left <= 0:
            return None
        if not same_rows(view, self.ids):
            self.left = 0
            return None
        self.left -= 1
        return self.choices

    def start(self, view: PolicyView, choices: list[Choice]) -> list[Choice]:
        """After a weighed drafting round: hold its choices (marked held in their reasons). Returns ``choices``."""
        self.left = self.rounds
        if self.left > 0:
            self.ids = tuple(r.request_id for r in view.rows)
            self.choices = [Choice(c.k, c.reason + " (held)") for c in choices]
        return choices


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
    there it lets the rule through (so those get measured). Before letting drafts through at a load level with fewer
    than ``PLAIN_SAMPLES`` plain steps timed online, it times them (:class:`PlainCheck`)."""

    def __init__(self, tracker: AcceptanceTracker, probe_every: int = 16, probe_budget: float = 0.05,
                 margin: float = SWITCH_MARGIN, probe_backoff: int = 2):
        self.tracker = tracker
        self.probes = ProbeBudget(probe_every, probe_budget, probe_backoff)
        self.margin = margin
        self.on = False  # did the last weighed round let the rule draft (switch_on's hysteresis)
        self.hold = OffHold()
        self.times = RoundTimes(tracker.k_max)
        self.covered: set = set()
        self.plain = PlainCheck()

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
        need = costs_ready(view.costs, n, self.covered)
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
            if self.plain.due(view.costs, n):
                return [Choice(0, f"gate: timing plain steps at {n} rows before drafting ({rule})")] * n
            return choices
        if self.probes.off_round(view.rows, t0, times[1], per_token, pop[0], self.tracker.default, catch_up=catch):
            return [Choice(min(c.k, 1), f"probe k=1 after {self.probes.every}+ rounds off ({rule})")
                    for c in choices]
        why = f"off: {rule} k={kmax} predicted {gain:.2f}x plain ({n} rows)"
        return self.hold.start(view, [Choice(0, why)] * n, t0, self.probes.quiet)
