"""The synthetic landscape's cost model (``speclab bench synthetic``, and the policies benchmark's calibration):
the rounds, active rows and widest draft per round that alpha, k and a budget imply (:func:`round_plan`), a
round's time from calibration batches that accept nothing (:func:`round_times_from_calibration`) or from its
parts (:func:`parts_round_time`), and the acceptance the draws realized (:func:`draws`).
"""

from __future__ import annotations

from ..engine.costs import round_time


def round_plan(alpha, k: int, budget: int, rows: int) -> list[tuple[float, float, list[float]]]:
    """Expected shape of a synthetic batch's rounds: ``rows`` independent rows, each emitting ``budget``
    tokens in rounds of k drafts accepted position by position with probability ``alpha`` (a number
    or one per position), capped so a round never overruns a row's budget (k <= remaining - 1), as the
    scheduler does. Returns, per round r (while any row may be active): (P(the round runs), E[active
    rows | it runs], P(widest draft = w | it runs) for w = 0..k). Pure and exact (no sampling).

    e.g. alpha 1, k 2, budget 3, 1 row: one round of width 2 emits all 3 tokens -> [(1, 1, [0, 0, 1])].
    """
    alphas = [alpha] if isinstance(alpha, (int, float)) else list(alpha)

    def a_at(i):
        return alphas[min(i, len(alphas) - 1)]

    def emit_dist(ke):  # P(accepted = a) for a in 0..ke
        out, surv = [], 1.0
        for i in range(ke):
            out.append(surv * (1 - a_at(i)))
            surv *= a_at(i)
        return out + [surv]

    q = [0.0] * (budget + 1)  # P(remaining = m) for one row
    q[budget] = 1.0
    plan = []
    while 1.0 - q[0] > 1e-9:
        active = 1.0 - q[0]
        p_run = 1.0 - q[0] ** rows
        n_bar = rows * active / p_run
        G = []  # P(row inactive or its capped k <= w)
        for w in range(k + 1):
            G.append(q[0] + sum(q[m] for m in range(1, budget + 1) if min(k, m - 1) <= w))
        width = []
        for w in range(k + 1):
            lo = G[w - 1] ** rows if w > 0 else q[0] ** rows
            width.append((G[w] ** rows - lo) / p_run)
        plan.append((p_run, n_bar, width))
        nq = [0.0] * (budget + 1)
        nq[0] = q[0]
        for m in range(1, budget + 1):
            if q[m]:
                for a, p in enumerate(emit_dist(min(k, m - 1))):
                    nq[m - a - 1] += q[m] * p
        q = nq
    return plan


def predict_decode_time(alpha, k: int, rows: int, budget: int, round_time) -> float:
    """Expected decode-phase seconds of one synthetic batch: sum over rounds of P(run) x sum_w P(width w) x
    round_time(n, w), n = E[active rows] (:func:`round_plan`; ``round_time(n, w)``: seconds of a round of n rows
    whose widest draft is w, w = 0 a plain step)."""
    return sum(p_run * sum(pw * round_time(n, w) for w, pw in enumerate(width) if pw)
               for p_run, n, width in round_plan(alpha, k, budget, rows))


class _Parts:
    """A round's parts timed apart, as the step costs :func:`speclab.engine.costs.round_time` reads."""

    def __init__(self, c: float, forward, overhead, draft=None):
        self.c, self.forward, self.overhead, self.draft = c, forward, overhead, draft

    def target_time(self, rows: int, tokens: int) -> float:
        return self.forward(rows, tokens)

    def draft_time(self, rows: int) -> float:
        return self.c * (self.draft(rows) if self.draft is not None else self.forward(rows, 1))

    def overhead_time(self, rows: int, drafted: bool = True) -> float:
        return self.overhead(rows)


def parts_round_time(c: float, forward, overhead, draft=None):
    """A round's seconds from its parts timed apart: c w draft(n) (the synthetic draft's burn) + forward(n, w + 1)
    (the verify forward) + overhead(n) (per-round host work) (``forward(n, T)``: a target forward of n rows x T
    tokens; ``draft(n)``: the target step the draft's cost is a multiple of, default forward(n, 1)), by the engine's
    rule for a round's cost (:func:`speclab.engine.costs.round_time`)."""
    parts = _Parts(c, forward, overhead, draft)
    return lambda n, w: round_time(parts, n, w)


def draws(history) -> int:
    """Acceptance draws a row's rounds made (``history``: (drafted, accepted) per round): drafts are checked in order
    until the first rejection, so a round that accepted a of d drafted made a draws, plus one if a < d. Accepted
    tokens over draws is the acceptance the synthetic draft realized (its maximum-likelihood alpha), which on 4
    prompts differs from the alpha asked for by a few points. e.g. [(2, 2), (2, 0), (1, 0)] -> 2 + 1 + 1 = 4."""
    return sum(a + (a < d) for d, a in history)


def calibration_widths(k: int, budget: int) -> list[int]:
    """The widest draft of each round of a batch that drafts k tokens a row and accepts none (alpha 0): every round
    emits one token a row, and a row with m tokens left drafts at most m - 1, so all rows run in step through
    ``budget`` rounds, the last k of them narrower. e.g. k 2, budget 4 -> [2, 2, 1, 0]."""
    return [min(k, budget - 1 - r) for r in range(budget)]


def widths_line(times: dict[int, float], w: float) -> float:
    """A round's seconds at width w from those measured at some widths (``times``: width -> seconds, 0 included):
    linear between the two measured around it. e.g. {0: 1, 2: 3}, w 1 -> 2."""
    ws = sorted(times)
    if w in times:
        return times[w]
    hi = next(x for x in ws if x > w)
    lo = max(x for x in ws if x < w)
    return times[lo] + (times[hi] - times[lo]) * (w - lo) / (hi - lo)


def round_times_from_calibration(plain_round: float, calibration: dict[int, float], budget: int) -> dict[int, float]:
    """Seconds of one round at each calibrated width, from the decode times of batches that accept nothing
    (``calibration``: k -> decode seconds of one batch at alpha 0 and k, :func:`calibration_widths`) and a plain
    step (``plain_round``, width 0). Each batch's time is the sum of its rounds; rounds at widths not calibrated
    are read on the line between the calibrated widths around them, so the widths are solved from the narrowest up,
    each a linear equation in its own time. e.g. plain 1 s, k 1 over 3 rounds (widths 1, 1, 0) taking 5 s: a round
    at width 1 takes 2 s."""
    times = {0: plain_round}
    for k in sorted(calibration):
        lo = max(times)  # the widest solved so far: widths between lo and k lie on the line to k's unknown time
        coef, const = 0.0, 0.0
        for w in calibration_widths(k, budget):
            if w <= lo:
                const += widths_line(times, w)
            else:  # (lo, k]: t(lo) + (t(k) - t(lo)) (w - lo) / (k - lo)
                f = (w - lo) / (k - lo)
                coef += f
                const += times[lo] * (1 - f)
        times[k] = (calibration[k] - const) / coef
    return times
