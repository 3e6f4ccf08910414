"""The cost model of speculative decoding (Leviathan, Kalman & Matias, 2023, "Fast Inference from
Transformers via Speculative Decoding", ICML; Theorem 3.8 and Corollary 3.9).

With ``a`` the probability that the target accepts a draft token (assumed i.i.d. per token) and
``k`` drafts per round, a round emits a truncated geometric number of tokens::

    E[tokens per round] = (1 - a^(k+1)) / (1 - a)                      (= k + 1 when a = 1)

A round costs k draft steps plus one target forward over k+1 positions. With ``c`` = draft step
time / target step time and the verify forward costing ``v`` target steps (the paper takes v = 1:
on a GPU, scoring k+1 positions costs about as much as one), the expected wall-time speedup over
plain decoding is::

    speedup(a, k, c) = (1 - a^(k+1)) / ((1 - a) (k c + v))

Pure functions, no torch: the notebooks and tests use them; :func:`step_costs` (torch, lazy
import) measures ``c`` and ``v`` on the machine at hand.
"""

from __future__ import annotations

import math
import time

__all__ = [
    "best_k",
    "cost_ratio",
    "expected_speedup",
    "expected_tokens_per_round",
    "speedup_curve",
    "step_costs",
    "time_forward",
    "verify_costs",
]


def _check(a: float, k: int | None = None, c: float | None = None) -> None:
    if not (isinstance(a, (int, float)) and 0.0 <= a <= 1.0) or math.isnan(a):
        raise ValueError(f"acceptance rate a must be in [0, 1], got {a!r}")
    if k is not None and (int(k) != k or k < 0):
        raise ValueError(f"k must be a non-negative integer, got {k!r}")
    if c is not None and (c < 0 or math.isnan(c)):
        raise ValueError(f"cost ratio c must be >= 0, got {c!r}")


def expected_tokens_per_round(a: float, k: int) -> float:
    """Expected tokens a round emits (accepted drafts + the target's recovered/bonus token):
    1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a). Comparable to ``mean_accepted_length``."""
    _check(a, k)
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_speedup(a: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected wall-time speedup of speculative decoding over plain target decoding:
    (1 - a^(k+1)) / ((1 - a)(k c + v)); k = 0 gives 1 / v (1 with the paper's v = 1)."""
    _check(a, k, c)
    if v <= 0:
        raise ValueError(f"verify cost v must be > 0, got {v!r}")
    return expected_tokens_per_round(a, k) / (k * c + v)


def _v_at(v, k: int) -> float:
    """Verify cost at k: None -> 1 (the paper), a number, a callable v(k) or a mapping {k: v}."""
    if v is None:
        return 1.0
    if callable(v):
        return float(v(k))
    if hasattr(v, "__getitem__") and not isinstance(v, (str, bytes)):
        return float(v[k])
    return float(v)


def best_k(a: float, c: float, k_max: int = 16, v: float | None = None) -> int:
    """The k in 0..k_max that maximises :func:`expected_speedup` (0: do not speculate).

    ``v`` may be a number, a callable ``v(k)`` or a mapping ``{k: v}`` (measured verify cost of k+1
    positions, in target steps); default 1.
    Ties go to the smaller k (fewer wasted draft steps).
    """
    _check(a, None, c)
    best, best_s = 0, -1.0
    for k in range(int(k_max) + 1):
        s = expected_speedup(a, k, c, _v_at(v, k)) if k > 0 else 1.0
        if s > best_s + 1e-12:
            best, best_s = k, s
    return best


def speedup_curve(a: float, c: float, ks, v=None) -> list[dict]:
    """Rows {k, expected_tokens_per_round, expected_speedup} for plotting against measurements."""
    out = []
    for k in ks:
        out.append({"k": int(k), "expected_tokens_per_round": expected_tokens_per_round(a, k),
                    "expected_speedup": expected_speedup(a, k, c, _v_at(v, k)) if k > 0 else 1.0})
    return out


# ----------------------------------------------------------------------------------------------
# measuring c (and v) on this machine


def _stepper(lm, batch: int, context: int, tokens: int, vocab: int | None = None):
    """A closure that runs one cached forward of ``tokens`` new positions per row after ``context``
    prompt positions, through the model's own KV cache (the engine's code path). Every call writes
    the same slots, so every call costs the same."""
    import torch

    dev = lm.device
    V = min(lm.vocab_size, vocab or lm.vocab_size)
    cache = lm.new_cache(batch, context + tokens)
    zero = torch.zeros(batch, dtype=torch.long, device=dev)
    cache.forward(torch.randint(0, V, (batch, context), device=dev), zero, kv_len=context)
    cache.commit(zero + context)
    tok = torch.randint(0, V, (batch, tokens), device=dev)
    start = zero + context
    return lambda: cache.forward(tok, start, kv_len=context + tokens)


def interleaved_times(fns: dict, reps: int, warmup: int = 3, device=None) -> dict:
    """Median seconds of each callable, timed round-robin (a, b, c, a, b, c, ...) so that load
    bursts on a shared machine hit them alike."""
    import statistics

    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    times = {name: [] for name in fns}
    for i in range(reps + warmup):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def step_costs(target, draft=None, ks=(), *, batch: int = 1, context: int = 128, reps: int = 40) -> dict:
    """Median seconds of one target decode step, one draft decode step (``draft``: an LM or None)
    and one target verification of k+1 positions for each k in ``ks``, all against a cache of
    ``context`` positions and timed interleaved. The one timer behind :func:`cost_ratio`,
    :func:`verify_costs`, :func:`time_forward` and ``speclab bench --compare``."""
    ks = [int(k) for k in ks if int(k) > 0]
    fns = {"target": _stepper(target, batch, context, 1)}
    if draft is not None:
        fns["draft"] = _stepper(draft, batch, context, 1, vocab=target.vocab_size)
    fns.update({k: _stepper(target, batch, context, k + 1) for k in ks})
    med = interleaved_times(fns, reps, device=target.device)
    return {"target_step_s": med["target"], "draft_step_s": med.get("draft"),
            "verify_s": {k: med[k] for k in ks}}


def time_forward(lm, batch: int = 1, context: int = 64, tokens: int = 1, steps: int = 20, warmup: int = 3,
                 repeats: int = 3) -> float:
    """Median seconds of one cached forward of ``tokens`` new positions per row after ``context``
    prompt positions (tokens=1: a decode step; tokens=k+1: a verify)."""
    return interleaved_times({"f": _stepper(lm, batch, context, tokens)}, steps * repeats, warmup,
                             device=lm.device)["f"]


def cost_ratio(draft_lm, target_lm, batch: int = 1, context: int = 64, steps: int = 20, repeats: int = 3) -> float:
    """c = draft decode-step time / target decode-step time, measured here (interleaved timings)."""
    sc = step_costs(target_lm, draft_lm, (), batch=batch, context=context, reps=steps * repeats)
    return sc["draft_step_s"] / sc["target_step_s"]


def verify_costs(lm, ks, batch: int = 1, context: int = 64, steps: int = 20, repeats: int = 3) -> dict[int, float]:
    """v(k) = time of one forward over k+1 positions / time of a one-token step, for each k in ``ks``
    (v(0) = 1), from interleaved timings."""
    sc = step_costs(lm, None, ks, batch=batch, context=context, reps=steps * repeats)
    return {int(k): (sc["verify_s"][int(k)] / sc["target_step_s"] if int(k) else 1.0) for k in ks}
