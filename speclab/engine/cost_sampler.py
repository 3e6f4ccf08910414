"""Step costs sampled from the rounds as they run: a subscriber of each round's clock readings.

The round itself only reads the cost table's clock (:meth:`OnlineCosts.clock`) between its phases and hands the
readings to its subscribers; which rounds make good samples, and what they are samples of, is decided here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import PLAIN_SAMPLES, OnlineCosts

# every steady round until this many samples are recorded (OnlineCosts.version), then one steady round in
# COST_STRIDE of each kind (drafting, plain): recording between two forwards runs its Python on cold caches, a cost
# worth paying while the tables are young and not on every round after
COST_WARM = 128
COST_STRIDE = 4


@dataclass
class RoundClock:
    """One round's readings of the cost table's clock, and its shape."""

    rows: int  # rows in the round
    drafted: bool  # the round proposed drafts
    steps: int  # draft steps run
    block: int  # tokens per row in the verify forward (drafts + 1)
    after_prefill: bool  # the same step prefilled new rows before the round
    start: float  # the round began
    chosen: float  # the policy had chosen and the draws were made
    drafted_at: float  # the drafts were on the host
    verified_at: float  # the verify forward was done
    late_admit: float = 0.0  # seconds of the drafter's late prefill, inside the draft phase but not part of it
    late_tokens: int = 0  # tokens that late prefill took in (0: none ran)


class CostSampler:
    """Records into ``costs`` the steady rounds' draft, verify and overhead times.

    Steady rounds only: right after a round without drafts the draft's weights are cold and its cache catches up
    on every plain round's token, a switching cost a policy pays once, not per drafting round; likewise a plain
    step right after a drafting round runs the target's weights cold (the draft's forwards and the verify block
    displaced them), and so does one right after a prefill in the same step. Nor is the first drafting round of a
    fresh scheduler: it touches the draft's cache and the verify's buffers for the first time, and as the first
    sample of its shape it would price drafting off. Of those, every one while the tables are young, then one in
    ``COST_STRIDE``, and every plain step at a load level until it has ``PLAIN_SAMPLES``."""

    def __init__(self, costs: OnlineCosts):
        self.costs = costs
        self.drafted_last = False  # the last round drafted (its draft phase is then a steady one's cost sample)
        self.drafted_ever = False  # a round has drafted (the first one is a fresh engine's warm-up: not a sample)
        self.unsampled = [0, 0]  # steady plain / drafting rounds since the last one whose costs were recorded

    def __call__(self, rc: RoundClock) -> None:
        end = self.costs.clock()
        if rc.late_tokens:
            self.costs.record_draft_prefill(rc.late_tokens, rc.late_admit)
        if self._sample(rc):
            if rc.drafted and self.drafted_last:
                self.costs.record_draft(rc.rows, rc.steps, rc.drafted_at - rc.chosen - rc.late_admit)
            self.costs.record_target(rc.rows, rc.block, rc.verified_at - rc.drafted_at)
            # the round's work outside the forwards (weighed against the forwards)
            self.costs.record_overhead(rc.rows, end - rc.verified_at + rc.chosen - rc.start, rc.drafted)
        self.drafted_last = rc.drafted
        self.drafted_ever = self.drafted_ever or rc.drafted

    def _sample(self, rc: RoundClock) -> bool:
        steady = self.drafted_ever if rc.drafted else not (self.drafted_last or rc.after_prefill)
        if not steady:
            return False
        kind = int(rc.drafted)
        if (self.costs.version < COST_WARM or self.unsampled[kind] >= COST_STRIDE - 1
                or (not rc.drafted and self.costs.plain_samples(rc.rows) < PLAIN_SAMPLES)):
            self.unsampled[kind] = 0
            return True
        self.unsampled[kind] += 1
        return False
