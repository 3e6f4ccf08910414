"""Latency statistics of a load run, with ``vllm bench serve``'s definitions (pure functions).

Per request (times measured by the client from when it had sent the request: its last byte written to the
connection; the client's own time before that, ``send_wait``, is summarised apart as ``send_wait_ms``):

* ``ttft``: arrival of the first chunk that carried output;
* ``e2e``: arrival of the last chunk that carried output (vLLM's ``latency``; ``[DONE]`` and the usage
  chunk follow within microseconds and are not counted);
* ``tpot`` = (e2e - ttft) / (N - 1), N the output tokens (from usage or the tokenizer, never chunks);
  undefined for N <= 1;
* ``itl``: vLLM's ITL, the gap between consecutive output chunks. Under speculation a chunk carries a
  verification round, so this is a per-round gap, not a per-token one;
* ``itl_token``: the per-token inter-arrival gap: a chunk that brings n tokens contributes its gap for
  its first token and n - 1 gaps of zero (the client receives them together). Its mean over a request
  is exactly the request's TPOT whenever the per-chunk counts add up to N.

Summaries over a load level: mean, p50, p90, p95, p99 of each (in milliseconds; ITLs pooled over the
level's requests as vLLM pools them), request and token throughput over the level's wall time, and
goodput: completed requests per second whose TTFT, TPOT and E2E all meet the SLOs given (vLLM's rule:
a request with N <= 1 has TPOT 0 for this purpose).
"""

from __future__ import annotations

import math
from collections import Counter

from ..errors import SpeclabError

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2e", "e2e": "e2e"}


def token_arrivals(chunk_times: list[float], chunk_tokens: list[int]) -> list[float]:
    """Arrival time of every output token: chunk i's time, repeated once per token it carried."""
    return [t for t, n in zip(chunk_times, chunk_tokens) for _ in range(max(0, n))]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def request_metrics(chunk_times: list[float], n_tokens: int | None,
                    chunk_tokens: list[int] | None = None) -> dict:
    """TTFT, E2E, TPOT (seconds), ``itl`` (per chunk) and ``itl_token`` (per token; None without per-chunk
    counts) of one successful request."""
    ttft, e2e = chunk_times[0], chunk_times[-1]
    tpot = (e2e - ttft) / (n_tokens - 1) if n_tokens is not None and n_tokens > 1 else None
    itl_token = gaps(token_arrivals(chunk_times, chunk_tokens)) if chunk_tokens is not None else None
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "itl": gaps(chunk_times), "itl_token": itl_token,
            "output_tokens": n_tokens, "chunks": len(chunk_times)}


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, which vLLM uses)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1000.0) -> dict | None:
    """mean / p50 / p90 / p95 / p99 / max (times ``scale``: seconds -> ms by default) and the count;
    None when there are no values."""
    if not values:
        return None
    s = sorted(values)
    out = {"mean": sum(s) / len(s) * scale}
    out.update({f"p{p}": percentile(s, p) * scale for p in PERCENTILES})
    out["max"] = s[-1] * scale
    out["n"] = len(s)
    return out


def parse_goodput(spec: str | None) -> dict[str, float]:
    """``"ttft:200,tpot:50"`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds). Keys: ttft, tpot, e2el
    (or e2e). Also accepts vLLM's space-separated form."""
    if not spec:
        return {}
    out = {}
    for pair in spec.replace(" ", ",").split(","):
        if not pair.strip():
            continue
        key, sep, val = pair.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise SpeclabError(f"--goodput: {pair!r} is not KEY:MS with KEY one of ttft, tpot, e2el")
        try:
            ms = float(val)
        except ValueError:
            raise SpeclabError(f"--goodput: {val!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise SpeclabError(f"--goodput: {key} must be a positive number of milliseconds, got {val}")
        out[SLO_KEYS[key]] = ms
    return out


def is_good(m: dict, slos: dict[str, float]) -> bool:
    """vLLM's goodput test for one request's metrics (seconds) against SLOs (ms)."""
    for key, ms in slos.items():
        value = m[key] if m[key] is not None else 0.0  # TPOT of a 1-token request counts as 0
        if value * 1000.0 > ms:
            return False
    return True


def summarize(records, duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """One load level's summary from its records (:class:`~speclab.load.client.RequestRecord`)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    per = [request_metrics(r.chunk_times, r.output_tokens, r.chunk_tokens) for r in ok]
    counted = [m["output_tokens"] for m in per]
    out_tokens = sum(counted) if counted and all(n is not None for n in counted) else None
    prompt = [r.prompt_tokens for r in ok]
    in_tokens = sum(prompt) if prompt and all(n is not None for n in prompt) else None
    dur = duration_s if duration_s > 0 else float("nan")
    s = {
        "requests": len(records), "completed": len(ok), "failed": len(failed),
        "failures": dict(Counter(r.error_kind or "error" for r in failed)),
        "failure_examples": list(dict.fromkeys(r.error for r in failed))[:5],
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / dur if out_tokens is not None else None,
        "total_token_throughput": (in_tokens + out_tokens) / dur if None not in (in_tokens, out_tokens) else None,
        "tokens_counted_by": dict(Counter(r.token_source or "unknown" for r in ok)),
        "chunk_tokens_counted_by": dict(Counter(r.chunk_token_source or "unknown" for r in ok)),
        "ttft_ms": distribution([m["ttft"] for m in per]),
        "tpot_ms": distribution([m["tpot"] for m in per if m["tpot"] is not None]),
        "itl_ms": distribution([g for m in per for g in m["itl"]]),
        "itl_token_ms": distribution([g for m in per if m["itl_token"] is not None for g in m["itl_token"]]),
        "e2e_ms": distribution([m["e2e"] for m in per]),
        "send_wait_ms": distribution([r.send_wait for r in ok if r.send_wait is not None]),
    }
    mismatch = [r.token_mismatch for r in ok if r.token_mismatch is not None]
    if mismatch:
        s["tokenizer_vs_usage"] = {"requests_differing": sum(1 for d in mismatch if d),
                                   "total_difference": sum(mismatch), "requests_compared": len(mismatch)}
    if slos:
        good = sum(1 for m in per if is_good(m, slos))
        s["goodput"] = {"slos_ms": dict(slos), "good_requests": good, "request_goodput": good / dur}
    return s
