"""The engine: the step scheduler (:mod:`.scheduler`) and its thin batch wrapper
(:class:`SpeculativeDecoder`, :mod:`.decoder`), requests (:mod:`.request`), draft-length policies
(:mod:`.policies`), online step costs (:mod:`.costs`), the pure acceptance math (:mod:`.acceptance`,
:mod:`.sampling`) and event assembly (:mod:`.rounds`)."""

from .decoder import GenerationResult, SpeculativeDecoder
from .policies import Choice, Fixed, Off, Policy, PolicyView, RowView, make_policy
from .request import Request
from .scheduler import QueueFull, Scheduler, sync

__all__ = ["Choice", "Fixed", "GenerationResult", "Off", "Policy", "PolicyView", "QueueFull", "Request", "RowView",
           "Scheduler", "SpeculativeDecoder", "make_policy", "sync"]
