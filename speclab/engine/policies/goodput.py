"""SmartSpec / TurboSpec: the k that maximises expected committed tokens per expected round time."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...limits import check_k
from .base import Choice, PolicyView
from .tracker import AcceptanceTracker
from .weighing import (
    SWITCH_MARGIN,
    DraftHold,
    OffHold,
    PlainCheck,
    ProbeBudget,
    RoundTimes,
    catch_up_time,
    costs_ready,
    draft_prefill_share,
    round_tokens,
    row_tokens,
    switch_on,
)


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
    (``probe_budget`` of the time spent at k = 0, halved after each probe that found nothing, at most
    ``probe_backoff`` times) allows and the probe is :func:`worth_probing` (so it notices
    acceptance coming back; never at a load where only an implausible acceptance would pay). Before drafting at a
    load level with fewer than ``PLAIN_SAMPLES`` plain steps timed online, it times them (:class:`PlainCheck`).
    Held decisions: a k = 0 decision is kept while nothing can change it (:class:`OffHold`), and a drafting decision
    for the next ``draft_hold`` rounds while the same rows run (:class:`DraftHold`: weighing costs tens of
    microseconds a round, more with more rows)."""

    k_max: int = 4
    probe_every: int = 8
    probe_budget: float = 0.05
    probe_backoff: int = 2
    switch_margin: float = SWITCH_MARGIN
    draft_hold: int = 4
    name: str = field(default="goodput", init=False)

    def __post_init__(self):
        check_k(self.k_max)
        self.tracker = AcceptanceTracker(self.k_max)
        self.times = RoundTimes(self.k_max)
        self.probes = ProbeBudget(self.probe_every, self.probe_budget, self.probe_backoff)
        self.hold = OffHold()
        self.drafting = DraftHold(self.draft_hold)
        self.plain = PlainCheck()
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
        if held is None:
            held = self.drafting.held(view)
        if held is not None:
            return held
        self.tracker.update(view)
        need = costs_ready(view.costs, n, self.covered)
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
            if self.plain.due(view.costs, n):
                return [Choice(0, f"goodput: timing plain steps at {n} rows before drafting k={best}")] * n
        out = [Choice(best, why)] * n
        if best == 0:
            return self.hold.start(view, out, self._raw[0], self.probes.quiet)
        return self.drafting.start(view, out)  # held a few rounds rather than weighed each one

    def draft_stop(self):
        return None
