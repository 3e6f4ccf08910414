"""Numbers in text tables: one formatting rule for every printed report (the CLI's, the benchmarks', the
load tool's, the app's), so that a missing value reads the same everywhere."""

from __future__ import annotations


def num(x, spec: str = ".1f", missing: str = "-") -> str:
    """``x`` formatted with ``spec``, or ``missing`` when there is no value. e.g. num(3.14159, ".2f") -> '3.14',
    num(None) -> '-'."""
    return missing if x is None else format(x, spec)
