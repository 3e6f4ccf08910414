"""Draft-length policies: each round, how many tokens each running row drafts (0 = no speculation).

A policy is small and pure: :meth:`Policy.choose` maps a :class:`PolicyView` (every running row's
acceptance history, the number of running and waiting requests, the step costs measured online) to
one :class:`Choice` per row. The scheduler caps each choice by the row's budget (a round emits up to
k+1 tokens) and reports both in the events. A policy may also end a row's draft early inside the
round (:meth:`Policy.draft_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..errors import SpeclabError
from ..limits import check_k


@dataclass(frozen=True)
class RowView:
    """What a policy may know about one running row."""

    request_id: str
    history: tuple[tuple[int, int], ...]  # (drafted, accepted) per round, oldest first
    pos_drafted: tuple[int, ...] = ()  # per draft position: times verified
    pos_accepted: tuple[int, ...] = ()  # ... and accepted
    remaining: int = 1 << 30  # tokens this row may still emit
    greedy: bool = True

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


POLICIES: dict[str, type] = {"fixed": Fixed, "off": Off}


def make_policy(spec, k: int = 4) -> Policy:
    """A policy from a name ('fixed', 'off', ... see ``POLICIES``), a Policy (returned as is), or None
    (fixed k). ``k`` is the draft length of 'fixed' and the largest k of adaptive policies."""
    if spec is None:
        return Fixed(check_k(k)) if k > 0 else Off()
    if not isinstance(spec, str):
        return spec
    name = spec.strip().lower()
    if name not in POLICIES:
        raise SpeclabError(f"unknown policy '{spec}' (known: {', '.join(POLICIES)})")
    cls = POLICIES[name]
    if cls is Off:
        return Off()
    if cls is Fixed:
        return Fixed(check_k(k))
    return cls(k_max=check_k(k))
