"""The drafter protocol and a base for stateless drafters.

The contracts themselves (:class:`Drafter`, :class:`Proposal`, :class:`DraftContext`, :class:`Verified`) belong
to the engine, which calls them (:mod:`speclab.engine.drafting`); they are named here too, where drafters are
written.
"""

from __future__ import annotations

from ..engine.drafting import DraftContext, Drafter, Proposal, StopRule, Verified

__all__ = ["DraftContext", "Drafter", "Proposal", "StatelessDrafter", "StopRule", "Verified"]


class StatelessDrafter:
    """Base for drafters that keep no per-row state between rounds (prompt lookup, synthetic)."""

    name = "stateless"
    features: tuple[int, ...] = ()

    def reset(self, capacity: int, max_len: int) -> None:
        pass

    def admit(self, ctx, rows, features) -> None:
        pass

    def commit(self, ctx, verified) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass

    def release(self, n: int) -> None:
        pass
