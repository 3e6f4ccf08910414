"""The models a run uses: loaded once per process and shared read-only (:func:`speclab.analysis.sweep.cached_model`),
warmed up once per (target, draft); every run builds its own decoder and drafter (a model drafter keeps a KV
cache, so sharing one between two users' runs would mix them up).
"""

from __future__ import annotations

import os
import threading

from .config import AppConfig

_WARM: set = set()
_WARM_LOCK = threading.Lock()


def get_target(cfg: AppConfig, spec: str):
    from ..analysis.sweep import cached_model

    lm = cached_model(spec, device=cfg.device, role="target")
    _setup_threads(lm)
    return lm


def _setup_threads(lm) -> None:
    try:
        from ..defaults import setup_threads

        if not os.environ.get("OMP_NUM_THREADS"):
            setup_threads(None, lm)
    except Exception:
        pass


def warm_up(target, drafter_spec: str) -> None:
    """One tiny run per (target, draft) the first time they are used: the first forward of a
    process is slow and would distort the first measurement."""
    key = (id(target), drafter_spec)
    with _WARM_LOCK:
        if key in _WARM:
            return
    from ..analysis.sweep import new_drafter
    from ..engine import SpeculativeDecoder

    prompt = "Hello world. " * 4
    for spec in ("none", drafter_spec):
        d = new_drafter(spec, target)
        SpeculativeDecoder(target, d).generate([prompt, prompt], k=2 if d else 0, max_new_tokens=6, record=True)
    with _WARM_LOCK:
        _WARM.add(key)
