"""speclab: a lab for exploring the trade-offs of speculative decoding."""

from .errors import SpeclabError

__version__ = "0.1.0"

__all__ = ["SpeclabError", "load_model", "make_drafter", "SpeculativeDecoder", "HookRegistry", "Recorder",
           "SamplingParams", "__version__"]


def __getattr__(name):  # lazy: `import speclab` stays cheap (no torch import until needed)
    if name == "load_model":
        from .models import load_model
        return load_model
    if name == "make_drafter":
        from .drafters import make_drafter
        return make_drafter
    if name == "SpeculativeDecoder":
        from .engine import SpeculativeDecoder
        return SpeculativeDecoder
    if name == "HookRegistry":
        from .events import HookRegistry
        return HookRegistry
    if name == "Recorder":
        from .metrics import Recorder
        return Recorder
    if name == "SamplingParams":
        from .sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
