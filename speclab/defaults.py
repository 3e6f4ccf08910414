"""What a new user gets without choosing: the default target and draft (the configuration that pays
on this machine, from measurement), and the CPU thread setting for tiny models."""

from __future__ import annotations


def _family_default(attr: str, fallback: str) -> str:
    """The family's default model name when its weights are present, else ``fallback``."""
    try:
        from . import family

        name = getattr(family, attr)
        if family.resolve(name) is not None:
            return name
    except Exception:  # noqa: BLE001 - no family: fall back
        pass
    return fallback


def default_target() -> str:
    return _family_default("DEFAULT_TARGET", "target")


def default_draft() -> str:
    """The default separate draft model (what commands that compare draft models start from)."""
    return _family_default("DEFAULT_DRAFT", "ngram")


DEFAULT_DRAFTER = "eagle+suffix"  # the fastest drafter on the held-out set: speclab bench heldout


def default_drafter() -> str:
    """What ``speclab generate``, ``speclab serve`` and the app's first screen speculate with: the EAGLE head with
    suffix decoding where the context repeats, when the family's head is shipped; else the default draft model.
    (A server's prefix cache keeps the head's features with each prefix.)"""
    try:
        from .drafters.heads import head_dir

        if head_dir("eagle") is not None and _family_default("DEFAULT_TARGET", "") == "target":
            return DEFAULT_DRAFTER
    except Exception:  # noqa: BLE001 - no heads: the draft model
        pass
    return default_draft()


def setup_threads(threads: int | None, lm=None) -> None:
    """Tiny models on a CPU run fastest on one thread (and several processes on few cores do not
    fight over spinning OpenMP threads); bigger ones get torch's default. ``threads``: None for that choice,
    else 1-1024 (``--threads``)."""
    import torch

    from .limits import check_threads

    if threads is not None:
        threads = check_threads(threads)
    if threads:
        torch.set_num_threads(threads)
    elif lm is not None and lm.device.type == "cpu" and lm.num_parameters() < 50_000_000:
        torch.set_num_threads(1)
