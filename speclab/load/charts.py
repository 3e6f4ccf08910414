"""Altair charts of load runs: throughput and p95 TPOT against load, a pacing strip (tokens against time
for one request) and a histogram of per-token gaps. Every function takes plain data (a run's result
dict, or rows) and returns a chart; :func:`save_charts` writes a run's three as HTML."""

from __future__ import annotations

import math
from pathlib import Path

from .report import level_rows
from .stats import token_arrivals


def load_chart(rows: list[dict], series: str | None = None, title: str = ""):
    """Output tokens/s and p95 TPOT against load, side by side. ``rows``: dicts with ``value`` (the load),
    ``tok_s``, ``tpot_p95_ms`` and, when comparing servers or policies, a ``series`` column named by
    ``series``."""
    import altair as alt
    import pandas as pd

    df = pd.DataFrame(rows)
    color = alt.Color(f"{series}:N", title=series) if series else alt.value("#0969da")
    x = alt.X("value:Q", title="load (concurrency or requests/s)", scale=alt.Scale(type="log", base=2),
              axis=alt.Axis(values=sorted(set(df["value"]))))
    tip = [c for c in ("load", series, "tok_s", "tpot_p95_ms", "call") if c and c in df.columns]
    thr = alt.Chart(df).mark_line(point=True).encode(x=x, y=alt.Y("tok_s:Q", title="output tokens/s"),
                                                     color=color, tooltip=tip)
    tpot = alt.Chart(df).mark_line(point=True).encode(x=x, y=alt.Y("tpot_p95_ms:Q", title="p95 TPOT (ms)"),
                                                      color=color, tooltip=tip)
    return alt.hconcat(thr.properties(width=300, height=220, title="throughput"),
                       tpot.properties(width=300, height=220, title="p95 TPOT")).properties(title=title)


def pacing_strip(record: dict, title: str = ""):
    """Tokens received against time for one request (a record dict with ``chunk_times`` and
    ``chunk_tokens``): speculation climbs in steps, plain decoding in an even staircase."""
    import altair as alt
    import pandas as pd

    times = record["chunk_times"]
    counts = record.get("chunk_tokens") or [1] * len(times)
    arrivals = token_arrivals(times, counts)
    df = pd.DataFrame({"ms": [t * 1000 for t in arrivals], "tokens": list(range(1, len(arrivals) + 1))})
    return alt.Chart(df).mark_line(interpolate="step-after", point=True).encode(
        x=alt.X("ms:Q", title="ms since the request was sent"), y=alt.Y("tokens:Q", title="tokens received"),
        tooltip=["ms", "tokens"]).properties(width=420, height=220, title=title or "pacing of one request")


def gaps_histogram(records: list[dict], title: str = ""):
    """Per-token arrival gaps of a level's successful requests, on log-spaced bins (a gap of zero, tokens
    that came in the same chunk, goes in the first bin): speculation is bimodal, plain decoding one hump."""
    import altair as alt
    import pandas as pd

    vals = []
    for r in records:
        if not r.get("ok"):
            continue
        counts = r.get("chunk_tokens") or [1] * len(r["chunk_times"])
        arr = token_arrivals(r["chunk_times"], counts)
        vals += [max(b - a, 1e-5) * 1000 for a, b in zip(arr, arr[1:])]  # ms, floor 0.01 ms for the log
    df = pd.DataFrame({"log10_ms": [math.log10(v) for v in vals]})
    return alt.Chart(df).mark_bar().encode(
        x=alt.X("log10_ms:Q", bin=alt.Bin(step=0.1), title="per-token gap, log10(ms) (-2 = same chunk)"),
        y=alt.Y("count():Q", title="gaps")).properties(width=420, height=220, title=title or "per-token gaps")


def _example(level: dict) -> dict | None:
    ok = [r for r in level["requests"] if r.get("ok")]
    return max(ok, key=lambda r: len(r["chunk_times"])) if ok else None


def save_charts(result: dict, out_dir: str | Path) -> list[Path]:
    """Write load.html (throughput and p95 TPOT by load), pacing.html (one request at the lowest and the
    highest load) and gaps.html (gap histograms, same levels) into ``out_dir``."""
    import altair as alt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    chart = load_chart(level_rows(result), title=f"{result['url']} ({result['model']})")
    paths.append(out / "load.html")
    chart.save(paths[-1])
    ends = [result["levels"][0]] + ([result["levels"][-1]] if len(result["levels"]) > 1 else [])
    strips = [pacing_strip(ex, title=f"{lv['level']['label']}") for lv in ends if (ex := _example(lv))]
    hists = [gaps_histogram(lv["requests"], title=f"{lv['level']['label']}") for lv in ends]
    if strips:
        paths.append(out / "pacing.html")
        alt.hconcat(*strips).save(paths[-1])
    paths.append(out / "gaps.html")
    alt.hconcat(*hists).save(paths[-1])
    return paths
