"""Optional packages a flag asks for by name (uvicorn's httptools parser, uvloop's event loop): one check, one
line of error, in one place for every command that takes such a flag."""

from __future__ import annotations

import importlib.util

from .errors import SpeclabError


def require_package(flag: str, name: str) -> None:
    """``flag name`` asked for the package ``name`` explicitly: a one-line error when it is not installed."""
    if importlib.util.find_spec(name) is None:
        raise SpeclabError(f"{flag} {name}: the package '{name}' is not installed (pip install {name})")
