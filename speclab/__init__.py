"""speclab: a lab for exploring the trade-offs of speculative decoding."""

from .errors import SpeclabError

__version__ = "0.1.0"

__all__ = ["SpeclabError", "load_model", "make_drafter", "SpeculativeDecoder", "HookRegistry", "Recorder",
           "SamplingParams", "__version__"]


_LAZY = {"load_model": "models", "make_drafter": "drafters", "SpeculativeDecoder": "engine",
         "HookRegistry": "events", "Recorder": "metrics", "SamplingParams": "sampling"}


def __getattr__(name):  # lazy: `import speclab` stays cheap (no torch import until needed)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(name)
