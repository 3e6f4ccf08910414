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

The general model (what the advisor predicts with) replaces the two constants by step costs that
depend on the batch: a round of B rows at draft length k costs ``k draft(B) + target(B, k+1)`` and
emits ``1 + r_1 + ... + r_k`` tokens per row, where ``r_i`` is the probability that the first i drafts
are all accepted (measured per position, or ``a^i`` for i.i.d. acceptance)::

    speedup(B, k) = (1 + r_1 + ... + r_k) * target(B, 1) / (k draft(B) + target(B, k+1))

The step costs come from the roofline of named hardware (:class:`speclab.analysis.roofline.RooflineCosts`)
or from timed forwards (:class:`MeasuredCosts`). With a verify that costs one step whatever k is
(``target(B, k+1) = target(B, 1)``) and ``draft(B) = c target(B, 1)`` it is Leviathan's formula.
"""

from __future__ import annotations

import math
import time

__all__ = [
    "MeasuredCosts",
    "alpha_from_mean_length",
    "alpha_from_rate",
    "batch_table",
    "best_k",
    "best_k_for_batch",
    "cost_ratio",
    "expected_speedup",
    "expected_tokens_per_round",
    "predict",
    "predicted_crossover",
    "round_time",
    "speedup_curve",
    "speedup_vs_batch",
    "step_costs",
    "survival",
    "time_forward",
    "tokens_per_round",
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


def interleaved_times(fns: dict, reps: int, warmup: int = 3, device=None, clock=time.perf_counter) -> dict:
    """Median seconds of each callable, timed round-robin (a, b, c, a, b, c, ...) so that load
    bursts on a shared machine hit them alike. ``clock``: wall time by default; ``time.process_time``
    counts only this process's CPU time (on one thread, what wall time would be on an idle machine)."""
    import statistics

    import torch

    cuda = device is not None and torch.device(device).type == "cuda"
    times = {name: [] for name in fns}
    for i in range(reps + warmup):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
            t = clock()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append(clock() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def step_costs(target, draft=None, ks=(), *, batch: int = 1, context: int = 128, reps: int = 40) -> dict:
    """Median seconds of one target decode step, one draft decode step (``draft``: an LM or None)
    and one target verification of k+1 positions for each k in ``ks``, all against a cache of
    ``context`` positions and timed interleaved. The one timer behind :func:`cost_ratio`,
    :func:`verify_costs`, :func:`time_forward` and ``speclab bench compare``."""
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


# ----------------------------------------------------------------------------------------------
# acceptance: from a rate, a mean accepted length or per-position measurements to r_1..r_k


def _acceptance_list(acceptance) -> list[float] | None:
    if isinstance(acceptance, (list, tuple)):
        vals = [float(x) for x in acceptance]
        for x in vals:
            if not (0.0 <= x <= 1.0):
                raise ValueError(f"per-position acceptance values must be in [0, 1], got {x!r}")
        return vals
    return None


def survival(acceptance, k: int) -> list[float]:
    """r_i = P(the first i drafts of a round are all accepted), for i = 1..k.

    ``acceptance`` is a per-token rate ``a`` (i.i.d.: r_i = a^i) or a list of per-position acceptance
    as the engine's ``per_position_acceptance`` and vLLM's per-position counters report it: position
    i's accepted count over the rounds that drafted it, which already requires every earlier position
    to be accepted, so the list *is* r_1, r_2, ... (non-increasing up to noise; forced so here).
    Positions beyond the list continue with the last measured conditional rate r_m / r_(m-1)."""
    _check(0.0, k)
    vals = _acceptance_list(acceptance)
    if vals is None:
        _check(acceptance)
        return [float(acceptance) ** i for i in range(1, int(k) + 1)]
    if not vals:
        raise ValueError("per-position acceptance is empty")
    r: list[float] = []
    for x in vals[: int(k)]:
        r.append(min(x, r[-1]) if r else x)
    if len(r) < k:
        prev = r[-2] if len(r) >= 2 else 1.0
        cond = r[-1] / prev if prev > 0 else 0.0
        while len(r) < k:
            r.append(r[-1] * cond)
    return r


def tokens_per_round(acceptance, k: int) -> float:
    """Expected tokens a round emits per row: 1 + r_1 + ... + r_k (the recovered/bonus token counts).
    With a rate ``a`` this is :func:`expected_tokens_per_round`."""
    return 1.0 + sum(survival(acceptance, k))


def _solve(f, target: float) -> float:
    """The a in [0, 1] with f(a) = target, f increasing (bisection, 60 halvings)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def alpha_from_mean_length(tau: float, k: int) -> float:
    """The i.i.d. rate a whose expected tokens per round at k is ``tau`` (a published mean accepted
    length, bonus token included): solves (1 - a^(k+1)) / (1 - a) = tau."""
    _check(0.0, k)
    if not (1.0 <= tau <= k + 1):
        raise ValueError(f"a mean accepted length at k={k} must be in [1, {k + 1}], got {tau!r}")
    return _solve(lambda a: expected_tokens_per_round(a, k), tau)


def alpha_from_rate(rate: float, k: int) -> float:
    """The i.i.d. rate a that gives acceptance rate ``rate`` = accepted / drafted at fixed k (what
    ``speclab bench`` and vLLM report): solves (a + a^2 + ... + a^k) / k = rate. Not ``rate`` itself:
    a rejection stops the round, so later positions are accepted less often."""
    _check(rate, k)
    if k == 0:
        raise ValueError("an acceptance rate needs k >= 1")
    return _solve(lambda a: sum(a ** i for i in range(1, k + 1)) / k, rate)


# ----------------------------------------------------------------------------------------------
# step costs measured per shape (on a CPU the roofline misses: see docs/advisor.md)


class MeasuredCosts:
    """Step costs from timed forwards, in the interface the predictions read: ``target_time(rows,
    tokens)`` and ``draft_time(rows)`` in seconds (the engine's :class:`~speclab.engine.costs.OnlineCosts`
    answers the same two questions from a live run). Unmeasured shapes are interpolated linearly, along
    the rows at each measured token count, then along the tokens."""

    def __init__(self, target: dict[tuple[int, int], float], draft: dict[int, float] | None = None,
                 source: str = "measured"):
        if not target:
            raise ValueError("measured costs need at least one target forward")
        self.target = {(int(r), int(t)): float(s) for (r, t), s in target.items()}
        self.draft = {int(r): float(s) for r, s in (draft or {}).items()}
        self.source = source

    def target_time(self, rows: int, tokens: int) -> float:
        from ..engine.costs import interpolate  # the engine's interpolation rule, so both predict alike

        by_tokens: dict[int, list[int]] = {}
        for r, t in sorted(self.target):
            by_tokens.setdefault(t, []).append(r)
        return interpolate(sorted(by_tokens), lambda t: interpolate(by_tokens[t], lambda r: self.target[(r, t)], rows),
                           tokens)

    def draft_time(self, rows: int) -> float:
        from ..engine.costs import interpolate

        return interpolate(sorted(self.draft), self.draft.__getitem__, rows) or 0.0 if self.draft else 0.0

    @property
    def max_rows(self) -> int:
        """The largest row count measured: predictions beyond it are extrapolated."""
        return max(r for r, _ in self.target)

    def to_dict(self) -> dict:
        return {"target": {f"{r}x{t}": s for (r, t), s in sorted(self.target.items())},
                "draft": {str(r): s for r, s in sorted(self.draft.items())}, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> MeasuredCosts:
        tgt = {}
        for key, s in d["target"].items():
            r, t = key.split("x")
            tgt[(int(r), int(t))] = s
        return cls(tgt, {int(r): s for r, s in d.get("draft", {}).items()}, d.get("source", "measured"))

    @classmethod
    def from_step_costs(cls, sc: dict, rows: int = 1, source: str = "measured") -> MeasuredCosts:
        """From :func:`step_costs` output (one batch size): target step, verify of k+1, draft step."""
        tgt = {(rows, 1): sc["target_step_s"]}
        for k, s in (sc.get("verify_s") or {}).items():
            tgt[(rows, int(k) + 1)] = s
        draft = {rows: sc["draft_step_s"]} if sc.get("draft_step_s") is not None else {}
        return cls(tgt, draft, source)

    @staticmethod
    def steppers(target, draft=None, rows=(1,), tokens=(1,), context: int = 128) -> dict:
        """One callable per shape to time: ("t", rows, tokens) target forwards and ("d", rows, 1) draft
        steps, each through the model's own KV cache after ``context`` positions."""
        fns = {}
        for r in rows:
            for t in tokens:
                fns[("t", int(r), int(t))] = _stepper(target, int(r), context, int(t))
            if draft is not None:
                fns[("d", int(r), 1)] = _stepper(draft, int(r), context, 1, vocab=target.vocab_size)
        return fns

    @classmethod
    def from_times(cls, med: dict, source: str = "measured") -> MeasuredCosts:
        """From {("t"|"d", rows, tokens): seconds} (the keys of :meth:`steppers`)."""
        return cls({(r, t): s for (kind, r, t), s in med.items() if kind == "t"},
                   {r: s for (kind, r, _), s in med.items() if kind == "d"}, source=source)

    @classmethod
    def measure(cls, target, draft=None, rows=(1,), tokens=(1,), context: int = 128, reps: int = 20,
                clock=time.perf_counter) -> MeasuredCosts:
        """Time the engine's cached forwards of the target at every (rows, tokens) and one draft step at
        every rows, all interleaved (a load burst on a shared machine hits them alike)."""
        med = interleaved_times(cls.steppers(target, draft, rows, tokens, context), reps, device=target.device,
                                clock=clock)
        return cls.from_times(med, f"timed forwards (context {context}, median of {reps}, interleaved)")


# ----------------------------------------------------------------------------------------------
# predictions from step costs (roofline or measured) and acceptance


def round_time(costs, rows: int, k: int, *, verify_tokens: int | None = None, draft_steps: int | None = None,
               overhead: float = 0.0) -> float:
    """Seconds of one round of ``rows`` rows: plain decoding (k = 0) is one target step; speculation is
    ``draft_steps`` (default k) draft steps and one target forward over ``verify_tokens`` (default k+1;
    a tree verifies more) positions per row. ``overhead``: host seconds per round outside the forwards.
    The engine's rule (:func:`speclab.engine.costs.round_time`), which the live policies weigh with too."""
    from ..engine.costs import round_time as engine_round_time  # here: the pure functions above need no torch

    return engine_round_time(costs, rows, k, verify_tokens=verify_tokens, draft_steps=draft_steps, overhead=overhead)


def predict(costs, acceptance, k: int, rows: int = 1, *, mean_length: float | None = None,
            verify_tokens: int | None = None, draft_steps: int | None = None, round_overhead: float = 0.0,
            spec_round_overhead: float | None = None) -> dict:
    """Predicted decode at ``rows`` concurrent rows and draft length k against plain decoding on the
    same costs: tokens per round, step and round seconds, TPOT (seconds per token of one row), tokens/s
    of all rows, and the speedup. ``mean_length`` overrides the tokens per round (a published mean
    accepted length measured at this k); ``spec_round_overhead`` defaults to ``round_overhead``."""
    tpr = float(mean_length) if mean_length is not None else tokens_per_round(acceptance, k)
    plain = round_time(costs, rows, 0, overhead=round_overhead)
    if k == 0:
        spec, tpr = plain, 1.0
    else:
        spec = round_time(costs, rows, k, verify_tokens=verify_tokens, draft_steps=draft_steps,
                          overhead=round_overhead if spec_round_overhead is None else spec_round_overhead)
    return {"k": int(k), "rows": int(rows), "tokens_per_round": tpr, "plain_step_s": plain, "round_s": spec,
            "plain_tpot_s": plain, "tpot_s": spec / tpr, "plain_tokens_per_s": rows / plain,
            "tokens_per_s": rows * tpr / spec, "speedup": tpr * plain / spec}


def best_k_for_batch(costs, acceptance, rows: int, k_max: int, tol: float = 0.0, **kw) -> tuple[int, float]:
    """The k in 0..k_max with the highest predicted speedup at ``rows`` rows (0: do not speculate) and
    that speedup; ties go to the smaller k, and so does any k within ``tol`` (relative) of the best."""
    speeds = [1.0] + [predict(costs, acceptance, k, rows, **kw)["speedup"] for k in range(1, int(k_max) + 1)]
    top = max(speeds)
    best = next(k for k, s in enumerate(speeds) if s >= top * (1 - tol) - 1e-12)
    return best, speeds[best]


def speedup_vs_batch(costs, acceptance, batches, k_max: int, k: int | None = None, **kw) -> list[dict]:
    """One row per batch size: the best k there and its speedup, and the speedup at a fixed ``k``."""
    out = []
    for b in batches:
        kb, sb = best_k_for_batch(costs, acceptance, int(b), k_max, **kw)
        row = {"batch": int(b), "best_k": kb, "best_speedup": sb}
        if k:
            p = predict(costs, acceptance, k, int(b), **kw)
            row.update(k=int(k), speedup=p["speedup"], tpot_s=p["tpot_s"], plain_tpot_s=p["plain_tpot_s"])
        out.append(row)
    return out


def predicted_crossover(costs, acceptance, k_max: int, k: int | None = None, max_batch: int = 4096,
                        **kw) -> int | None:
    """The smallest batch size at which speculation stops paying (speedup <= 1 at the fixed ``k``, or
    at every k <= k_max when ``k`` is None); None when it still pays at ``max_batch``. Doubles the
    batch, then bisects (the speedup falls as the batch grows: the verify turns compute-bound)."""
    def pays(b: int) -> bool:
        if k:
            return predict(costs, acceptance, k, b, **kw)["speedup"] > 1.0 + 1e-9
        return best_k_for_batch(costs, acceptance, b, k_max, **kw)[0] > 0

    if not pays(1):
        return 1
    lo, hi = 1, 2
    while pays(hi):
        if hi >= max_batch:
            return None
        lo, hi = hi, min(2 * hi, max_batch)
    while hi - lo > 1:  # pays(lo), not pays(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pays(mid) else (lo, mid)
    return hi


def batch_table(costs, acceptance, k_max: int, max_batch: int = 256, **kw) -> list[tuple[int, int, int]]:
    """The best k for every batch size 1..max_batch as vLLM's ``num_speculative_tokens_per_batch_size``
    wants it: inclusive ranges (start, end, k) with k = 0 where speculation does not pay. A k within 1%
    of the best counts as the best (so near-ties do not flip the table back and forth)."""
    out: list[list[int]] = []
    for b in range(1, int(max_batch) + 1):
        kb = best_k_for_batch(costs, acceptance, b, k_max, tol=0.01, **kw)[0]  # within 1%: the smaller k
        if out and out[-1][2] == kb:
            out[-1][1] = b
        else:
            out.append([b, b, kb])
    return [tuple(r) for r in out]
