"""The pacing fingerprint: is a server speculating, judged only from when its tokens arrive (pure functions).

Speculative decoding commits a verification round's tokens together: the client sees a token after a
full round's wait and the rest of the round's tokens right behind it. Plain decoding commits one token
per step, so tokens arrive evenly spaced. Whether the server sends a round as one chunk or splits it
into one-token chunks, the *per-token* arrival gaps show the same thing: a chunk of n tokens means one
real gap and n - 1 gaps of zero; n one-token chunks written back to back mean one real gap and n - 1
gaps of (nearly) zero. So the rule works on per-token gaps and needs no per-chunk token counts when the
server splits, only the chunk times.

The rule (constants below):

1. Per request, per-token gaps after the first burst (so the prefill token and anything sent with it
   do not count). A gap is *near zero* when it is below ``NEAR_ZERO`` (0.2) times the request's mean
   per-token gap (its TPOT). Plain decoding's gaps scatter around the mean, far from 0.2x of it;
   within-round gaps are micro- or milliseconds against rounds of many milliseconds.
2. Tokens joined by near-zero gaps form a *burst*. The outside estimate of the mean accepted length
   (tokens per round, the recovered/bonus token included, as vLLM's mean acceptance length = 1 +
   accepted / drafts) is the mean tokens per chunk after the first when chunks carry several tokens
   (one round each; ``ESTIMATE_CHUNKS``: > 1.05 on average), and the mean burst size when every chunk
   carries one token (a server that splits rounds). Chunks are the server's own grouping, so they stay
   right when delivery bunches several of them; bursts are all a split stream offers.
3. Bursts also come from late delivery: when the server's streaming side or the client falls behind
   (a busy machine), tokens of several plain steps reach the client together, after a wait as long as
   those steps. Two statistics tell the two apart, pooled over a level: the *pace ratio*, the median
   gap before multi-token bursts over the median gap before one-token bursts, and the *pace slope*, a
   robust (Theil-Sen) fit of the gap before a burst against its size, as a share of a one-token
   burst's gap. A verification round takes about as long whatever it accepts, so speculation keeps the
   ratio near 1 and the slope near 0; late delivery makes each extra token wait one more step (ratio
   1.5-2 or far more, slope about 1). Measured on speclab serve and vLLM (draft model and n-gram, 1 to
   16 concurrent requests, on 2 busy cores): speculation 0.70-1.56 and -0.10-0.11; plain decoding
   delivered late 1.45-2.6 (750 when a whole stream came at once) and 0.35-1.4 (slope 0.35 once).
   Both rise as well when a server mixes plain steps with verification rounds in one level (an adaptive
   policy that drafts in some rounds and not in others: its multi-token bursts come after the longer
   rounds, and longer drafts take longer and yield larger bursts). The third statistic tells that apart:
   the *per-token pace*, the median over multi-token bursts of gap / tokens, over the median one-token
   gap. Late delivery conserves the pace (each token of a late burst still waited one step: about 1);
   a round that drafts pays off only when it brings its tokens faster than plain steps (below 1).
   On speclab serve with adaptive policies mixing rounds: 0.52-0.80 where the
   first two called them late.
4. The client's own stalls: :mod:`.runner` records when this client's event loop woke up late (the
   process was descheduled or busy). Data that arrived meanwhile is read, and stamped, all at once
   when it resumes, which can squeeze a real gap to nothing, but only a gap shorter than the stall:
   so the gaps of chunks stamped during a stall of at least ``MIN_STALL`` (0.5) x the request's mean
   token gap, or soon after it (within the near-zero threshold, at least ``STALL_AFTER``), are unknown
   and left out (:func:`client_blurred`).
   A closed-loop level's own ramps: gaps through which fewer of its requests were in flight than it has
   clients (the client still sending, the last requests running alone) ran below its load, and an
   adaptive server may draft there; they and the tokens after them are left out (:func:`below_level`),
   unless fewer than ``MIN_GAPS`` gaps would be left.
5. A load level is **smooth** when fewer than ``BURSTY_SHARE`` (8%) of its per-token gaps, pooled over
   its requests, are near zero (mean burst < 1.09 tokens). Otherwise, when it has at least
   ``MIN_PACE_BURSTS`` (8) one-token and multi-token bursts each, it is **late** when the pace ratio is
   at least ``LAG_PACE`` (1.4), the pace slope at least ``LAG_SLOPE`` (0.25) and the per-token pace at
   least ``LAG_PER_TOKEN`` (0.8), **bursty** if not (requiring all three keeps one noisy statistic from
   calling speculation late); with fewer bursts it is
   **bursty** when at least ``STRONG_SHARE`` (15%) of the gaps are near zero inside bursts that came faster
   than plain steps (a burst whose wait per token is ``LAG_PER_TOKEN`` x a one-token burst's or more is late
   delivery, set aside: :func:`spec_share`) and **unknown** below that (too little to tell speculation from late
   delivery). A level with fewer than ``MIN_GAPS`` (20)
   known gaps is **unknown**.
6. The verdict over the levels, ordered by load: **plain** when every known level is smooth (or late);
   **speculative** when every one is bursty; **adaptive** when the lowest load is bursty, the highest
   smooth and burstiness never comes back once lost (needs >= 2 levels); otherwise **inconclusive**.

Also reported as evidence, not used by the rule: the coefficient of variation of the per-token gaps
(about sqrt(s / (1 - s)) for a share s of zero gaps between even rounds; plain decoding stays low),
the CV of the chunk gaps, the largest burst, and histograms of tokens per chunk, tokens per burst and
gaps relative to the mean.

Limits: speculation accepting almost nothing (mean burst < 1.09 tokens) reads as plain; a speculative
server whose delivery also lags can read as late (plain), and so can one whose drafting rounds bring their
tokens no faster than its plain steps (a per-token pace of 0.8 or more: drafting that does not pay); a
starved client leaves too few trustworthy gaps, and the level is unknown.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import Counter

NEAR_ZERO = 0.2
BURSTY_SHARE = 0.08
STRONG_SHARE = 0.15
MIN_GAPS = 20
LAG_PACE = 1.4
LAG_SLOPE = 0.25
LAG_PER_TOKEN = 0.8
MIN_PACE_BURSTS = 8  # one-token and multi-token bursts each, for the pace ratio and slope
PAIR_SPAN = 20  # the slope compares each burst with the next 20 of its request
ESTIMATE_CHUNKS = 1.05
STALL_AFTER = 0.002  # seconds after a client stall during which chunk timestamps are not trusted (at least)
MIN_STALL = 0.5  # client stalls shorter than this x the request's gap between bursts cannot fake a near-zero gap
REL_BINS = ((0.0, 0.2, "<0.2"), (0.2, 0.5, "0.2-0.5"), (0.5, 1.5, "0.5-1.5"), (1.5, 3.0, "1.5-3"),
            (3.0, math.inf, ">=3"))  # gap / the request's mean per-token gap


def _cv(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    if mean <= 0:
        return None
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


def client_blurred(times: list[float], stalls: list[tuple[float, float]], min_stall: float = 0.0,
                   after: float = STALL_AFTER) -> list[bool]:
    """Which chunk timestamps this client's own stalls may have bunched: stamped during a stall (an
    interval in which its event loop could not run on time, see :mod:`.runner`; the loop resumes a little
    before the monitor notices) or within ``after`` seconds of its end, when data that had arrived
    meanwhile is read, and stamped, all at once. Only stalls of at least ``min_stall`` count: a shorter
    one cannot turn a gap longer than itself into a near-zero one. ``times`` and ``stalls`` on one clock."""
    stalls = sorted(s for s in stalls if s[1] - s[0] >= min_stall)
    starts, ends = [s for s, _ in stalls], [e for _, e in stalls]
    out = []
    for t in times:
        i = bisect_left(ends, t - after)  # the first stall that ends no earlier than t - after
        out.append(i < len(stalls) and starts[i] < t)
    return out


def below_level(chunk_times: list[list[float]], concurrency: int,
                sent: list[float] | None = None) -> list[list[bool]]:
    """Per request (its chunk times, all requests on one clock) and per chunk, whether fewer than
    ``concurrency`` requests were in flight through the whole gap before that chunk, a request being in
    flight from ``sent`` (when it was on the wire; default: its first chunk) to its last chunk, as a
    closed-loop load tool counts its concurrency. Such gaps belong to a level's ramp up (the client still
    sending) or its ramp down (the last requests running alone): the server ran fewer rows than the level
    names, and an adaptive server may draft in them. A request's first chunk has no gap before it: False."""
    starts_of = sent if sent is not None else [t[0] if t else 0.0 for t in chunk_times]
    spans = [(s0, t[-1]) for s0, t in zip(starts_of, chunk_times) if t]
    starts, ends = sorted(s0 for s0, _ in spans), sorted(e for _, e in spans)
    out = []
    for times in chunk_times:
        flags = [False]
        for a, b in zip(times, times[1:]):
            # spans that started by a, less those that ended before b, plus those that did both (inside the gap)
            n = bisect_right(starts, a) - bisect_left(ends, b)
            if n < concurrency:
                n += sum(1 for s0, e in spans if a < s0 and e < b)
            flags.append(n < concurrency)
        out.append(flags if times else [])
    return out


def pace_slope(bursts_per_request: list[list[tuple]]) -> float | None:
    """How much longer the wait before a burst is per extra token in it, as a share of a one-token
    burst's wait: a Theil-Sen fit of gap = a + b (size - 1) over pairs of nearby bursts of different
    sizes within each request, returning b / a. Speculation: about 0 (a round takes as long whatever it
    accepts); late delivery: about 1 (each extra token waited one more step). None with < 10 pairs."""
    slopes = []
    for bursts in bursts_per_request:
        b = [(g, n) for g, n in bursts if g is not None]
        for i in range(len(b)):
            for j in range(i + 1, min(len(b), i + 1 + PAIR_SPAN)):
                if b[i][1] != b[j][1]:
                    slopes.append((b[j][0] - b[i][0]) / (b[j][1] - b[i][1]))
    if len(slopes) < 10:
        return None
    slope = _median(sorted(slopes))
    intercept = _median(sorted(g - slope * (n - 1) for bursts in bursts_per_request for g, n in bursts
                               if g is not None))
    return slope / intercept if intercept > 0 else math.inf


def request_pacing(chunk_times: list[float], chunk_tokens: list[int] | None = None,
                   n_tokens: int | None = None, blurred: list[bool] | None = None,
                   truncated: bool = False, below: list[bool] | None = None) -> dict | None:
    """One request's pacing features, or None when it has no gaps.

    ``chunk_tokens``: tokens per chunk, when known. Without them but with ``n_tokens`` (usage) equal to
    the number of chunks, each chunk holds one token; with more, the per-token gaps are the chunk gaps
    plus one zero per token beyond one per chunk (exact as a multiset; the order, and so the bursts and
    the pace ratio, is then unknown). With neither, each chunk counts as one token
    (``assumed_one_per_chunk``), which is right only for a server that splits chunks one token each.

    ``blurred``: per chunk, True when the client's own stall may have delayed its timestamp
    (:func:`client_blurred`). The gap before such a chunk is unknown: left out of the near-zero share and
    the pace ratio; it starts a burst of its own, and neither that burst nor the one before it counts
    towards the mean burst size (their edges are unknown).

    ``below``: per chunk, True when the gap before it ran below the level's load (:func:`below_level`):
    the chunk's leading gap and the zeros of its extra tokens are all unknown, and its size does not count
    towards the accepted-length estimate (counted in ``below_level_chunks``).

    ``truncated``: the request stopped at max_tokens, so its last round may have been cut short: its last
    chunk and last burst do not count towards the accepted-length estimate (the server counts the
    round's accepted drafts all the same)."""
    chunk_gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    assumed = chunk_tokens is None and n_tokens is None
    if chunk_tokens is None and (n_tokens is None or n_tokens == len(chunk_times)):
        chunk_tokens = [1] * len(chunk_times)  # as many tokens as chunks: one each
    blurred = blurred or [False] * len(chunk_times)
    below = below or [False] * len(chunk_times)
    sizes = None
    if chunk_tokens:
        kept = [n for n, w in zip(chunk_tokens[1:], below[1:]) if not w]  # a round below the level's load is not
        sizes = kept[:-1] if truncated and not below[-1] else kept    # the level's; nor a last one cut short
    out = {"chunk_sizes": sizes, "chunk_gaps": chunk_gaps, "assumed_one_per_chunk": assumed,
           "blurred_chunks": sum(1 for b in blurred[1:] if b),
           "below_level_chunks": sum(1 for b, w in zip(blurred[1:], below[1:]) if w and not b)}
    if chunk_tokens is None:  # a multiset of gaps: no order, no bursts
        extra = max(0, (n_tokens or 0) - len(chunk_times))
        gaps = [g for g, b, w in zip(chunk_gaps, blurred[1:], below[1:]) if not (b or w)] + [0.0] * extra
        if not gaps or sum(gaps) <= 0:
            return None
        mean = sum(gaps) / len(gaps)
        thr = NEAR_ZERO * mean
        out.update({"gaps": gaps, "mean_gap": mean, "threshold": thr, "near_zero": sum(1 for g in gaps if g < thr),
                    "relative_gaps": [g / mean for g in gaps], "bursts": None, "tokens": len(gaps), "n_bursts": None})
        return out
    # per-token gaps in order: (gap, known); a chunk of n tokens gives its leading gap, then n - 1 zeros. A
    # blurred chunk's leading gap is unknown; all of a chunk below the level's load is (not the level's round)
    chunks = [(t, n, b, w) for t, n, b, w in zip(chunk_times, chunk_tokens, blurred, below) if n > 0]
    token_gaps: list[tuple[float, bool]] = [(0.0, True)] * (chunks[0][1] - 1) if chunks else []
    for (t0, *_), (t1, n, b, w) in zip(chunks, chunks[1:]):
        token_gaps.append((t1 - t0, not (b or w)))
        token_gaps += [(0.0, not w)] * (n - 1)
    total = sum(g for g, _ in token_gaps)
    if not token_gaps or total <= 0:
        return None
    mean = total / len(token_gaps)  # the request's TPOT
    thr = NEAR_ZERO * mean
    # drop the first burst (the prefill token and whatever came with it): up to the first real gap
    first = next((i for i, (g, k) in enumerate(token_gaps) if k and g >= thr), len(token_gaps))
    token_gaps = token_gaps[first:]
    bursts: list[list] = []  # [gap before the burst or None when unknown, tokens in it]
    for g, known in token_gaps:
        if not known:
            bursts.append([None, 1])
        elif g >= thr:
            bursts.append([g, 1])
        else:
            bursts[-1][1] += 1
    gaps = [g for g, k in token_gaps if k]
    if not gaps:
        return None
    # bursts whose edges are both known measure the accepted length: not one that starts with an unknown
    # gap, not the one before it (where it ends is unknown), not a last one cut short by max_tokens
    clean = [b[0] is not None and (i + 1 == len(bursts) or bursts[i + 1][0] is not None)
             for i, b in enumerate(bursts)]
    if truncated and clean:
        clean[-1] = False
    out.update({"gaps": gaps, "mean_gap": mean, "threshold": thr, "near_zero": sum(1 for g in gaps if g < thr),
                "relative_gaps": [g / mean for g in gaps], "bursts": [tuple(b) for b in bursts],
                "tokens": sum(b[1] for b, c in zip(bursts, clean) if c), "n_bursts": sum(clean)})
    return out


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    return sorted_values[n // 2] if n % 2 else (sorted_values[n // 2 - 1] + sorted_values[n // 2]) / 2


def _hist(values) -> dict:
    return {str(k): v for k, v in sorted(Counter(values).items())}


def spec_share(bursts: list, near: int, n_gaps: int) -> float:
    """The share of a level's gaps that are near zero *inside bursts that came faster than plain steps*: a
    multi-token burst whose gap before it, per token, is at least ``LAG_PER_TOKEN`` x the median one-token burst's
    gap (or unknown) is set aside as late delivery, since each of its tokens waited about a step. Used where a level
    has too few bursts for the pace statistics: one stall of a plain server's streaming side (CI, 2 busy cores)
    delivered 6 tokens together after 6 steps' wait, and with two more such pairs that was 30% of the level's 23
    gaps near zero, read as bursty. Without one-token bursts to compare with, every near-zero gap counts.
    e.g. one-token gaps of 10 ms, a burst of 6 after 60 ms: set aside; a burst of 3 after 12 ms: counted (2 gaps)."""
    if not n_gaps:
        return 0.0
    one = sorted(g for g, s in bursts if s == 1 and g is not None)
    if not one:
        return near / n_gaps
    m1 = _median(one)
    late = sum(s - 1 for g, s in bursts if s > 1 and (g is None or g / s >= LAG_PER_TOKEN * m1))
    return max(0, near - late) / n_gaps


def level_fingerprint(pacings: list[dict | None]) -> dict:
    """Pool one load level's request pacings into the level's fingerprint and its bursty/smooth call."""
    ps = [p for p in pacings if p is not None]
    n_gaps = sum(len(p["gaps"]) for p in ps)
    near = sum(p["near_zero"] for p in ps)
    rel = [r for p in ps for r in p["relative_gaps"]]
    sizes = [s for p in ps if p["chunk_sizes"] is not None for s in p["chunk_sizes"]]
    bursts = [b for p in ps if p["bursts"] is not None for b in p["bursts"]]
    chunk_gaps_rel = []
    for p in ps:
        if len(p["chunk_gaps"]) > 1 and sum(p["chunk_gaps"]) > 0:
            m = sum(p["chunk_gaps"]) / len(p["chunk_gaps"])
            chunk_gaps_rel += [g / m for g in p["chunk_gaps"]]
    share = near / n_gaps if n_gaps else None
    if ps and all(p["n_bursts"] is not None for p in ps):
        n_b = sum(p["n_bursts"] for p in ps)
        per_burst = sum(p["tokens"] for p in ps) / n_b if n_b else None
    else:
        long_gaps = n_gaps - near
        per_burst = n_gaps / long_gaps if long_gaps else None
    one = sorted(g for g, s in bursts if s == 1 and g is not None)
    multi = sorted(g for g, s in bursts if s > 1 and g is not None)
    pace = slope = per_token = None
    if len(one) >= MIN_PACE_BURSTS and len(multi) >= MIN_PACE_BURSTS:
        m1 = _median(one)
        pace = _median(multi) / m1 if m1 > 0 else math.inf
        slope = pace_slope([p["bursts"] for p in ps if p["bursts"] is not None])
        per_token = _median(sorted(g / s for g, s in bursts if s > 1 and g is not None)) / m1 if m1 > 0 else math.inf
    if n_gaps < MIN_GAPS:
        call = "unknown"
    elif share < BURSTY_SHARE:
        call = "smooth"
    elif pace is not None:
        late = pace >= LAG_PACE and (slope is None or slope >= LAG_SLOPE) and per_token >= LAG_PER_TOKEN
        call = "late" if late else "bursty"
    else:
        call = "bursty" if spec_share(bursts, near, n_gaps) >= STRONG_SHARE else "unknown"
    per_chunk = sum(sizes) / len(sizes) if sizes else None
    known = [g for g, _ in bursts if g is not None]
    if per_chunk is not None and per_chunk > ESTIMATE_CHUNKS:
        estimate, source = per_chunk, "tokens per chunk"
    else:
        estimate, source = per_burst, "tokens per burst"
    return {
        "call": call,
        "accepted_length_estimate": estimate,
        "estimate_from": source,
        "requests": len(ps),
        "token_gaps": n_gaps,
        "near_zero_share": share,
        "mean_tokens_per_burst": per_burst,
        "mean_tokens_per_chunk": per_chunk,
        "burst_gap_ms": sum(known) / len(known) * 1e3 if known else None,  # the mean wait before a burst (a round)
        "cv_token_gaps": _cv(rel),
        "cv_chunk_gaps": _cv(chunk_gaps_rel),
        "pace_ratio": pace,
        "pace_slope": slope,
        "pace_per_token": per_token,
        "max_burst": max((s for _, s in bursts), default=None),
        "tokens_per_chunk_hist": _hist(sizes) if sizes else None,
        "tokens_per_burst_hist": _hist(s for _, s in bursts) if bursts else None,
        "relative_gap_hist": {name: sum(1 for r in rel if lo <= r < hi) for lo, hi, name in REL_BINS},
        "assumed_one_token_per_chunk": any(p["assumed_one_per_chunk"] for p in ps),
        "blurred_chunks": sum(p["blurred_chunks"] for p in ps),
        "below_level_chunks": sum(p["below_level_chunks"] for p in ps),
    }


def fingerprint_records(records: list[dict], stalls: list[tuple[float, float]] | None = None,
                        concurrency: int | None = None) -> dict:
    """A level's fingerprint from its request records as JSON dicts (``RequestRecord.to_dict``: ``ok``,
    ``sent``, ``chunk_times``, ``chunk_tokens``, ``output_tokens``, ``finish_reason``) and the client's
    stalls in that level (seconds from the level's start), as :mod:`.runner` stores them: a saved run can be
    judged again. ``concurrency``: a closed-loop level's clients; the gaps through which fewer requests were
    in flight are left out (:func:`below_level`), unless that leaves fewer than ``MIN_GAPS`` (a level of a
    few requests is mostly ramp): then every gap counts and ``judged_below_level`` says so. None (open-loop
    levels) keeps every gap."""
    stalls = [tuple(s) for s in stalls or []]
    below = [None] * len(records)  # per record: its chunks' below-level flags, or None
    if concurrency:
        below = below_level([[r["sent"] + t for t in r.get("chunk_times") or []] for r in records], concurrency,
                            [r["sent"] for r in records])
    fp = _fingerprint(records, stalls, below)
    fp["judged_below_level"] = False
    if concurrency and fp["token_gaps"] < MIN_GAPS:
        whole = _fingerprint(records, stalls, [None] * len(records))
        if whole["token_gaps"] > fp["token_gaps"]:
            n_below = sum(sum(w[1:]) for r, w in zip(records, below) if r.get("ok"))
            fp = dict(whole, judged_below_level=True, below_level_chunks=n_below)
    return fp


def _fingerprint(records: list[dict], stalls: list[tuple[float, float]], below: list) -> dict:
    pacings = []
    for r, w in zip(records, below):
        if not r.get("ok"):
            continue
        times = r["chunk_times"]
        n = r.get("output_tokens") or sum(r.get("chunk_tokens") or []) or len(times)
        tpot = (times[-1] - times[0]) / (n - 1) if n > 1 else 0.0  # the request's mean per-token gap
        # a stall merges two chunks into one burst only if it is about as long as the gap between them: the gaps
        # between bursts (a round each on a speculating server, a token each on a plain one), not the per-token
        # mean, which a speculating server's bursts make several times shorter
        long = sorted(g for g in (b - a for a, b in zip(times, times[1:])) if g >= NEAR_ZERO * tpot)
        between = max(tpot, _median(long)) if long else tpot
        blurred = client_blurred([r["sent"] + t for t in times], stalls, min_stall=MIN_STALL * between,
                                 after=max(STALL_AFTER, NEAR_ZERO * tpot))
        pacings.append(request_pacing(times, r.get("chunk_tokens"), r.get("output_tokens"), blurred,
                                      truncated=r.get("finish_reason") == "length", below=w))
    return level_fingerprint(pacings)


def _evidence_line(label: str, fp: dict) -> str:
    if fp["call"] == "unknown" and fp["token_gaps"] < MIN_GAPS:
        return f"{label}: only {fp['token_gaps']} token gaps (need {MIN_GAPS}): unknown"
    parts = [f"{label}: {fp['near_zero_share'] * 100:.0f}% of token gaps near zero (< {NEAR_ZERO:g}x the mean)"]
    if fp["mean_tokens_per_burst"] is not None:
        parts.append(f"{fp['mean_tokens_per_burst']:.2f} tokens per burst")
    if fp["mean_tokens_per_chunk"] is not None:
        parts.append(f"{fp['mean_tokens_per_chunk']:.2f} per chunk")
    if fp["cv_token_gaps"] is not None:
        parts.append(f"gap CV {fp['cv_token_gaps']:.2f}")
    if fp["pace_ratio"] is not None:
        parts.append(f"pace ratio {fp['pace_ratio']:.2f}")
    if fp.get("pace_slope") is not None:
        parts.append(f"pace slope {fp['pace_slope']:.2f}")
    if fp.get("pace_per_token") is not None:
        parts.append(f"per-token pace {fp['pace_per_token']:.2f}")
    if fp["max_burst"] is not None:
        parts.append(f"largest burst {fp['max_burst']}")
    if fp.get("blurred_chunks"):
        parts.append(f"{fp['blurred_chunks']} chunk gaps left out (stamped right after this client stalled)")
    if fp.get("judged_below_level"):
        parts.append(f"judged on every gap: only {MIN_GAPS - 1} or fewer with the level's clients all in flight")
    elif fp.get("below_level_chunks"):
        parts.append(f"{fp['below_level_chunks']} left out (fewer requests in flight than the level's clients)")
    line = ", ".join(parts) + f" -> {fp['call']}"
    if fp["call"] == "late":
        line += (f" (bursts come after waits {fp['pace_ratio']:.1f}x as long as single tokens do, each of their "
                 f"tokens no faster than a single one: late delivery, not speculation; counted as smooth)")
    elif fp["call"] == "unknown":
        line += (f" (fewer than {MIN_PACE_BURSTS} bursts of each kind and under {STRONG_SHARE:.0%} near-zero gaps: "
                 f"too little to tell speculation from late delivery)")
    return line


def verdict_of_calls(calls: list[str]) -> str:
    """The verdict rule alone (rule 6), from per-level calls ordered by rising load: "late" counts as
    smooth, "unknown" levels are skipped. e.g. [bursty, bursty, late] -> adaptive; [smooth, bursty] ->
    inconclusive; [] -> inconclusive."""
    calls = [{"late": "smooth"}.get(c, c) for c in calls if c != "unknown"]
    if not calls:
        return "inconclusive"
    if all(c == "smooth" for c in calls):
        return "plain"
    if all(c == "bursty" for c in calls):
        return "speculative"
    flips = sum(1 for a, b in zip(calls, calls[1:]) if a != b)
    return "adaptive" if calls[0] == "bursty" and calls[-1] == "smooth" and flips == 1 else "inconclusive"


def verdict(levels: list[tuple[str, float, dict]]) -> dict:
    """The server's verdict from its levels' fingerprints: ``levels`` = [(label, load, fingerprint)], any
    order (sorted here by load). Returns {"verdict", "evidence": [lines], "calls": [...]}."""
    levels = sorted(levels, key=lambda x: x[1])
    evidence = [_evidence_line(label, fp) for label, _, fp in levels]
    calls = [{"late": "smooth"}.get(fp["call"], fp["call"]) for _, _, fp in levels if fp["call"] != "unknown"]
    v = verdict_of_calls(calls)
    if not calls:
        evidence.append("no load level gave enough evidence: send more requests or more max tokens")
    elif v == "plain":
        evidence.append("evenly paced at every load: plain decoding (or speculation accepting too little to see)")
    elif v == "speculative":
        evidence.append("tokens arrive in bursts at every load: speculative decoding")
        bs = [fp["accepted_length_estimate"] for _, _, fp in levels if fp["call"] == "bursty"]
        if len(bs) >= 2 and bs[0] and bs[-1] and bs[-1] - 1 < 0.5 * (bs[0] - 1):
            evidence.append(f"bursts shrink with load ({bs[0]:.2f} -> {bs[-1]:.2f} tokens): the draft length "
                            "may adapt to load without switching off")
        if len(calls) == 1:
            evidence.append("one load level: telling adaptive from speculative needs at least two")
    elif v == "adaptive":
        evidence.append("bursty at low load, smooth at high load: speculation is switched off as load rises")
    else:
        evidence.append(f"bursty/smooth pattern {' -> '.join(calls)} by rising load fits neither plain, "
                        "speculative nor adaptive")
    return {"verdict": v, "evidence": evidence, "calls": [fp["call"] for _, _, fp in levels]}
