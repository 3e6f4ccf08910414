"""vLLM's form: k from a table of running-batch ranges."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import SpeclabError
from ...limits import check_k
from .base import Choice, PolicyView


def parse_table(spec: str) -> list[tuple[int, int | None, int]]:
    """'1-8=4,9-32=2,33-=0' -> [(1, 8, 4), (9, 32, 2), (33, None, 0)] (batch ranges, inclusive)."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            rng, k = part.split("=")
            lo, _, hi = rng.partition("-")
            out.append((int(lo), int(hi) if hi.strip() else (None if "-" in rng else int(lo)), int(k)))
        except ValueError:
            raise SpeclabError(f"batch-table entries look like '1-8=4' or '33-=0', got '{part}'") from None
    if not out:
        raise SpeclabError("batch-table needs at least one entry, e.g. '1-8=4,9-=0'")
    for lo, hi, k in out:
        check_k(k)
        if lo < 1 or (hi is not None and hi < lo):
            raise SpeclabError(f"batch-table range {lo}-{hi if hi is not None else ''} is empty")
    return out


@dataclass
class BatchTable:
    """k from the number of running rows, looked up in a table of ranges: vLLM's dynamic speculative
    decoding (``--speculative-config`` ``num_speculative_tokens_per_batch_size``, entries
    ``[start_bs, end_bs, K]`` over the concurrency, K = 0 switching speculation off for a range; vLLM
    docs, features/speculative_decoding/dynamic_speculative_decoding). Written here '1-64=3,65-128=1,
    129-=0'. vLLM's older ``speculative_disable_by_batch_size`` (one threshold) was ignored for several
    releases, then removed. Static: the table is the user's (default: K up to 8 rows, K/2 up to 32,
    off above); it does not look at acceptance or measured costs."""

    k_max: int = 4
    table: list[tuple[int, int | None, int]] | None = None
    name: str = field(default="batch-table", init=False)

    def __post_init__(self):
        K = check_k(self.k_max)
        if self.table is None:
            self.table = [(1, 8, K), (9, 32, max(1, K // 2) if K else 0), (33, None, 0)]
        elif isinstance(self.table, str):
            self.table = parse_table(self.table)
        self.k_max = max([K] + [k for _, _, k in self.table]) if self.table else K

    def lookup(self, n: int) -> tuple[int, str]:
        for lo, hi, k in self.table:
            if lo <= n and (hi is None or n <= hi):
                return k, f"batch-table: {n} rows in {lo}-{hi if hi is not None else ''} -> k={k}"
        return 0, f"batch-table: {n} rows in no range -> k=0"

    def choose(self, view: PolicyView) -> list[Choice]:
        k, why = self.lookup(view.running)
        return [Choice(k, why)] * len(view.rows)

    def draft_stop(self):
        return None
