"""speclab: a lab for exploring the trade-offs of speculative decoding."""

import sys
from importlib.machinery import ModuleSpec
from importlib.util import module_from_spec
from pathlib import Path

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


def _kernels_folder() -> None:
    """Make the repository's top-level ``kernels/`` folder ``speclab.kernels`` when running from a checkout.

    An installed wheel holds it as speclab/kernels (setup.py maps the folder there) and needs nothing. The folder is
    never a top-level package of its own: ``kernels`` is Hugging Face's kernel library, which transformers imports
    when it is installed, and a folder of ours by that name first on sys.path would stand in for it."""
    here = Path(__file__).resolve().parent
    folder = here.parent / "kernels"
    if (here / "kernels").is_dir() or not (folder / "rejection.py").is_file() or __name__ + ".kernels" in sys.modules:
        return
    spec = ModuleSpec(__name__ + ".kernels", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    sys.modules[spec.name] = globals()["kernels"] = module_from_spec(spec)  # bound too, as an import would bind it


_kernels_folder()
