"""``speclab load``: measure any OpenAI-compatible streaming server from outside (docs/load.md).

One job per module: :mod:`.prompts` (what to send), :mod:`.shapes` (when: concurrency levels, Poisson
arrivals), :mod:`.client` (one streamed request -> a record), :mod:`.tokens` (token counts from usage or
a tokenizer, never chunks), :mod:`.stats` (TTFT, TPOT, ITL, E2E, goodput; vLLM's definitions),
:mod:`.fingerprint` (pacing -> plain / speculative / adaptive), :mod:`.scrape` (server acceptance from
/metrics), :mod:`.runner` (levels end to end), :mod:`.report` (text), :mod:`.charts` (Altair),
:mod:`.servers` (``speclab serve`` / vLLM as child processes), :mod:`.cli` (the command).

The names below load on first use, so registering the command costs the ``speclab`` CLI no imports.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Endpoint": "client", "RequestRecord": "client", "LoadSpec": "runner", "base_url": "runner",
            "run": "runner", "run_async": "runner", "LoadLevel": "shapes", "concurrency_levels": "shapes",
            "rate_levels": "shapes"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
