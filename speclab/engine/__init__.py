"""The engine: the step scheduler (:mod:`.scheduler`: queue and admission) over the running rows' slots
(:mod:`.batch`), the prefill of admitted requests (:mod:`.prefill`) and one verification round (:mod:`.round`:
propose, verify, accept); its thin batch wrapper (:class:`SpeculativeDecoder`, :mod:`.decoder`), requests
(:mod:`.request`), the drafting contracts drafters implement (:mod:`.drafting`), draft-length policies
(:mod:`.policies`), step costs and the cost of a round (:mod:`.costs`, sampled by :mod:`.cost_sampler`), the pure
acceptance math (:mod:`.acceptance`, :mod:`.sampling`) and event assembly (:mod:`.rounds`)."""

from .batch import sync
from .decoder import GenerationResult, SpeculativeDecoder
from .policies import Choice, Fixed, Off, Policy, PolicyView, RowView, make_policy
from .request import Request
from .scheduler import QueueFull, Scheduler

__all__ = ["Choice", "Fixed", "GenerationResult", "Off", "Policy", "PolicyView", "QueueFull", "Request", "RowView",
           "Scheduler", "SpeculativeDecoder", "make_policy", "sync"]
