"""The published per-row rules behind the cost gate: Hugging Face's heuristic, SGLang-style EMA tiers, draft
confidence (HF's threshold and AdaEDL's entropy bound)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...errors import SpeclabError
from ...limits import check_float, check_k
from .base import Choice, PolicyView, RowView
from .tracker import AcceptanceTracker
from .weighing import CostGate


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

    def _held(self, view: PolicyView) -> list[Choice] | None:
        """Behind the gate, the k = 0 decision it holds (:class:`~.weighing.OffHold`: the rule is not asked), or None
        once the tracker has taken the view in (the rule chooses, the gate weighs it)."""
        if not self.gate:
            return None
        held = self._gate.held(view)
        if held is None:
            self._tracker.update(view)
        return held

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
        if (held := self._held(view)) is not None:
            return held
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
        if (held := self._held(view)) is not None:
            return held
        out = []
        for r in view.rows:
            k, ema = self.row_k(r)
            out.append(Choice(k, f"ema tier k={k}" + (f" (ema {ema:.2f})" if ema is not None else "")))
        return self._gated(view, out, "ema", self._st)


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
