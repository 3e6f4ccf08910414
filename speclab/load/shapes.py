"""Load shapes: a fixed number of concurrent clients, or open-loop arrivals at a given rate.

Rate arrivals follow ``vllm bench serve``: inter-arrival times are gamma distributed with shape =
``burstiness`` and mean = 1 / rate (burstiness 1 is a Poisson process; below 1 arrivals clump, above 1
they even out, infinity is a fixed interval). When the run is bounded by a request count the arrival
times are rescaled so the last one lands at n / rate, as vLLM does, so that throughput does not depend
on the seed's luck; when it is bounded by a duration only, arrivals stop at the duration.

Output lengths: each request may ask for its own ``max_tokens``, drawn uniformly around a mean
(:class:`Budgets`, ``--length-spread``), as ``vllm bench serve --random-range-ratio`` draws its output lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ..errors import SpeclabError
from ..limits import parse_numbers

MAX_ARRIVALS = 100_000  # a duration-bounded open-loop run at a silly rate must not build a huge list
MAX_CONCURRENCY = 4096  # streams at one closed-loop level


@dataclass(frozen=True)
class LoadLevel:
    """One load level: ``kind`` "concurrency" (``value`` clients, each sending its next request when the
    previous one ends) or "rate" (``value`` requests/s arriving regardless of completions)."""

    kind: str
    value: float
    burstiness: float = 1.0

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        b = "" if self.burstiness == 1.0 else f", burstiness {self.burstiness:g}"
        return f"rate {self.value:g}/s{b}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "burstiness": self.burstiness, "label": self.label}


def concurrency_levels(spec: str) -> list[LoadLevel]:
    """``"1,4,16"`` -> three closed-loop levels, in the order given."""
    return [LoadLevel("concurrency", v) for v in parse_numbers(spec, "--concurrency", integer=True, hi=MAX_CONCURRENCY)]


def rate_levels(spec: str, burstiness: float = 1.0) -> list[LoadLevel]:
    """``"2,8"`` -> two open-loop levels at 2 and 8 requests/s."""
    if not (burstiness > 0):
        raise SpeclabError(f"--burstiness must be positive, got {burstiness}")
    return [LoadLevel("rate", v, float(burstiness)) for v in parse_numbers(spec, "--rate")]


def arrival_times(rate: float, burstiness: float, seed: int, num_requests: int | None = None,
                  duration: float | None = None) -> list[float]:
    """Seconds after the level starts at which each request is sent.

    Intervals are gamma(shape=burstiness, scale=1 / (rate * burstiness)), mean 1 / rate. With a request
    count the times are rescaled so the last is at ``num_requests / rate``; with only a duration they
    stop at ``duration``; with both, whichever comes first."""
    if num_requests is None and duration is None:
        raise SpeclabError("an open-loop run needs a request count or a duration")
    rng = random.Random(seed)
    times: list[float] = []
    t = 0.0
    limit = num_requests if num_requests is not None else MAX_ARRIVALS
    while len(times) < limit:
        if math.isinf(burstiness):
            t += 1.0 / rate
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
        if num_requests is None and t > duration:  # one past the end, dropped below
            break
    if num_requests is not None and times and times[-1] > 0:
        scale = (num_requests / rate) / times[-1]
        times = [x * scale for x in times]
    if duration is not None:
        times = [x for x in times if x <= duration]
    return times


def default_num_requests(level: LoadLevel) -> int:
    """Requests per level when neither a count nor a duration is given: enough for every client to send
    a few (closed loop), or 16 arrivals (open loop)."""
    if level.kind == "concurrency":
        return max(16, 4 * int(level.value))
    return 16


def check_spread(spread: float) -> float:
    """A length spread in [0, 1) (e.g. 0.5: budgets from half to one and a half times the mean)."""
    if not (isinstance(spread, (int, float)) and 0 <= spread < 1):
        raise SpeclabError(f"--length-spread must be in [0, 1), got {spread}")
    return float(spread)


class Budgets:
    """Request i's token budget, drawn uniformly from [mean (1 - spread), mean (1 + spread)] (rounded, at least 1)
    by a generator seeded with ``seed``, in request order and on demand (a duration-bounded run has no request
    count): the same seed gives the same budget to request i on every server and configuration. Spread 0: ``mean``
    for every request.

    Served requests end at different lengths. With every request the same length, plain decoding's rows finish in
    the same round and the rows that replace them are prefilled in one forward, while a server that drafts has rows
    that finish rounds apart and are replaced one forward each: a measurement artifact, not a property of either.
    e.g. mean 32, spread 0.5: budgets in 16..48, mean about 32."""

    def __init__(self, mean: int, spread: float = 0.0, seed=0):
        self.mean, self.spread = int(mean), check_spread(spread)
        self.lo = max(1, round(self.mean * (1 - self.spread)))
        self.hi = max(1, round(self.mean * (1 + self.spread)))
        self._rng = random.Random(seed)
        self._drawn: list[int] = []

    def __getitem__(self, i: int) -> int:
        if not self.spread:
            return self.mean
        while len(self._drawn) <= i:
            self._drawn.append(self._rng.randint(self.lo, self.hi))
        return self._drawn[i]

    def first(self, n: int) -> list[int]:
        """The first ``n`` budgets."""
        return [self[i] for i in range(n)]

    @property
    def label(self) -> str:
        """e.g. '32' or '32 (each 16..48)'."""
        return str(self.mean) if not self.spread else f"{self.mean} (each {self.lo}..{self.hi})"


def spread_lengths(mean: int, n: int, spread: float, seed) -> list[int]:
    """``n`` token budgets drawn around ``mean`` (:class:`Budgets`). e.g. mean 32, spread 0: [32] * n."""
    return Budgets(mean, spread, seed).first(n)
