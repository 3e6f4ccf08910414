"""Drafters: the protocol (:mod:`.base`), a separate draft model (:mod:`.model`), prompt lookup
(:mod:`.lookup`), the synthetic drafter (:mod:`.synthetic`), self-drafting from the target (:mod:`.heads`:
EAGLE and Medusa heads; :mod:`.early_exit`), token trees (:mod:`.trees`), and :func:`make_drafter`
(:mod:`.registry`)."""

from .base import DraftContext, Drafter, Proposal, StatelessDrafter, Verified
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .registry import is_none, make_drafter

__all__ = ["DraftContext", "Drafter", "ModelDrafter", "PromptLookupDrafter", "Proposal", "StatelessDrafter",
           "Verified", "is_none", "make_drafter"]
