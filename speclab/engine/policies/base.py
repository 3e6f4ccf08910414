"""What a policy sees and returns (:class:`RowView`, :class:`PolicyView`, :class:`Choice`), the protocol, and the two
rules that need nothing else: fixed k and off."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ...limits import check_k


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
