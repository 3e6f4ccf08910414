"""Helpers for the notebooks in ``notebooks/``: parameters overridable from the environment (so CI
runs them small) and repeated sweeps. (Tiny random families: :mod:`speclab.testing`.)

Parameters: ``setting("N_PROMPTS", 8, small=2)`` returns, in order of precedence,
``$SPECLAB_NB_N_PROMPTS`` (parsed like the default: int, float, bool, or a comma-separated list),
``small`` when ``$SPECLAB_NB_SMALL=1``, else the default.
"""

from __future__ import annotations

import os

from .limits import truthy

__all__ = ["family_available", "is_small", "repeated_sweep", "setting", "setup_torch"]

PREFIX = "SPECLAB_NB_"


def is_small() -> bool:
    return truthy(os.environ.get(PREFIX + "SMALL"))


def _parse(raw: str, like):
    raw = raw.strip()
    if isinstance(like, bool):
        return truthy(raw)
    if isinstance(like, int):
        return int(raw)
    if isinstance(like, float):
        return float(raw)
    if isinstance(like, (list, tuple)):
        items = [s.strip() for s in raw.split(",") if s.strip()]
        if like and all(isinstance(x, int) for x in like):
            return [int(s) for s in items]
        if like and all(isinstance(x, (int, float)) for x in like):
            return [float(s) for s in items]
        return items
    return raw


def setting(name: str, default, small=None):
    """A notebook parameter: env ``SPECLAB_NB_<NAME>`` > ``small`` (when SPECLAB_NB_SMALL=1) > default."""
    raw = os.environ.get(PREFIX + name.upper())
    if raw is not None and raw.strip() != "":
        return _parse(raw, default if default is not None else small)
    if small is not None and is_small():
        return small
    return default


def setup_torch(threads: int | None = None) -> int:
    """Pin torch's CPU threads (``$SPECLAB_NB_THREADS``, else ``$OMP_NUM_THREADS``, else torch's
    default). On a small shared machine one thread per process avoids oversubscription."""
    import torch

    if threads is None:
        raw = os.environ.get(PREFIX + "THREADS") or os.environ.get("OMP_NUM_THREADS")
        threads = int(raw) if raw else 0
    if threads and threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def family_available(*names: str) -> bool:
    """True when every named model of the embedded family has weights on disk."""
    try:
        from .family import list_models
    except ImportError:
        return False
    have = {m["name"] for m in list_models()}
    return all(n in have for n in names)


TIMING_COLUMNS = ("tokens_per_s", "baseline_tokens_per_s", "speedup", "wall_s", "ttft_ms", "tpot_ms")


def repeated_sweep(target, spec, repeats: int = 3, progress=None):
    """``run_sweep`` ``repeats`` times, one row per cell: timing columns are the median over repeats,
    ``speedup`` is the median throughput over the median baseline throughput, and ``speedup_min`` /
    ``speedup_max`` are the extremes of the per-repeat speedups (the spread). A shared machine has
    bursts of load; in a single pass one burst during a baseline skews every speedup of that
    workload, the median over repeats much less.
    Acceptance is deterministic for greedy decoding and is taken from the first repeat."""
    import pandas as pd

    from .analysis.sweep import run_sweep

    frames = []
    for r in range(max(1, int(repeats))):
        def prog(frac, what, r=r):
            if progress:
                progress((r + frac) / repeats, f"repeat {r + 1}/{repeats}: {what}")
        frames.append(run_sweep(target, spec, progress=prog).assign(repeat=r))
    df = pd.concat(frames, ignore_index=True)
    keys = ["workload", "batch", "draft", "k"] + (["policy"] if "policy" in df.columns else [])
    first = df[df["repeat"] == 0].drop(columns=["repeat"]).set_index(keys)
    g = df.groupby(keys, sort=False)
    for col in TIMING_COLUMNS:
        if col in df:
            first[col] = g[col].median()
    # speedup = median throughput / median baseline throughput of the same (workload, batch)
    base = df[df["k"] == 0].groupby(["workload", "batch"])["tokens_per_s"].median()
    first["baseline_tokens_per_s"] = [base.get((i[0], i[1])) for i in first.index]
    first["speedup"] = first["tokens_per_s"] / first["baseline_tokens_per_s"]
    first["speedup_min"] = g["speedup"].min()
    first["speedup_max"] = g["speedup"].max()
    first["repeats"] = g.size()
    return first.reset_index()
