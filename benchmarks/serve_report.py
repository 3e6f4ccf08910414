"""The serving experiment's result as text and Altair charts (``python benchmarks/serve_experiment.py`` and
notebook 06). Everything here reads the result dict of :func:`benchmarks.serve_experiment.run_experiment`; charts
are built on :mod:`speclab.load.charts`."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serve_judge import did_letter
from speclab.tables import num

LETTER = {"bursty": "B", "smooth": "S", "late": "L", "unknown": "?"}


def servers_of(result: dict, engine: str, split: bool | None = False) -> list[str]:
    """Server names of an engine in the order they were configured (split-token ones with split=True)."""
    return list(dict.fromkeys(c["server"] for c in result["cells"] if c["engine"] == engine
                              and (split is None or c["split"] == split)))


def _short(server: str) -> str:
    return server.split(" ", 1)[1] if " " in server else server


def _failed_cells(result: dict) -> set:
    return {(r["server"], r["workload"], r["concurrency"]) for r in result["checks"]["pacing"] if not r["ok"]}


def workload_table(result: dict, engine: str, workload: str, split: bool = False) -> str:
    """Rows = concurrency, columns = servers: output tokens/s, p95 TPOT (ms), pacing call (! = the pacing
    check failed) and what the server did (accepted drafts per row-round)."""
    names = servers_of(result, engine, split)
    cells = {(c["server"], c["concurrency"]): c for c in result["cells"]
             if c["engine"] == engine and c["workload"] == workload and c["split"] == split}
    if not cells:
        return ""
    bad = _failed_cells(result)
    w = 24
    lines = [f"{engine}{' (one token per chunk)' if split else ''} · workload {workload}: tok/s, p95 TPOT ms, "
             "pacing (B bursty, S smooth, L late, ? unknown; ! check failed), accepted drafts per round",
             f"{'conc':>5} " + "".join(f"| {_short(n)[:w - 2]:<{w - 2}}" for n in names)]
    for c in sorted({k[1] for k in cells}):
        line = f"{c:>5} "
        for n in names:
            cell = cells.get((n, c))
            if cell is None:
                line += f"| {'':<{w - 2}}"
                continue
            mark = "!" if (n, workload, c) in bad else " "
            acc = (cell.get("inside") or {}).get("accepted_per_round")
            txt = (f"{num(cell['tok_s']):>6} {num(cell['tpot_p95_ms']):>6} {LETTER.get(cell['call'], '?')}{mark}"
                   f"{num(acc, '.2f') if cell['role'] != 'plain' else '':>5}")
            line += f"| {txt:<{w - 2}}"
        lines.append(line)
    return "\n".join(lines)


def _fp_brief(cell: dict) -> str:
    fp = cell["fingerprint"]
    share = fp.get("near_zero_share")
    return (f"c={cell['concurrency']}: {num(share * 100 if share is not None else None, '.0f')}% gaps near zero, "
            f"{num(fp.get('mean_tokens_per_burst'), '.2f')} tok/burst, CV {num(fp.get('cv_token_gaps'), '.2f')}"
            f" -> {cell['call']}")


def verdict_lines(result: dict) -> list[str]:
    """Per server and workload: the verdict, its calls by rising load, what the server did, the check, and
    the fingerprint at the lowest and the highest load."""
    by = {}
    for c in result["cells"]:
        by.setdefault((c["server"], c["workload"]), []).append(c)
    lines = ["verdicts (calls by rising load; did: B accepted >= 0.25 drafts per round, S < 0.03, ~ between):"]
    for vc in result["checks"]["verdict"]:
        cs = sorted(by[(vc["server"], vc["workload"])], key=lambda c: c["concurrency"])
        calls = " ".join(LETTER.get(c, "?") for c in vc["calls"])
        ok = "ok" if vc["ok"] else f"WRONG (expected {' or '.join(vc['allowed'])})"
        lines.append(f"  {vc['server']:<28} {vc['workload']:<10} {vc['verdict'].upper():<12} calls {calls:<12} "
                     f"did {' '.join(vc['did']):<12} {ok}")
        ends = [cs[0]] + ([cs[-1]] if len(cs) > 1 else [])
        lines.append("      " + ";  ".join(_fp_brief(c) for c in ends))
    return lines


def crossover_lines(result: dict) -> list[str]:
    lines = []
    for engine, cx in result["crossover"].items():
        for wl, d in cx["by_workload"].items():
            at = d["stops_paying_at"]
            sp = ", ".join(f"c{c}: {v:.2f}x" for c, v in sorted(d["speedup"].items(), key=lambda kv: int(kv[0])))
            head = (f"fixed k stops paying from concurrency {at}" if at is not None else
                    f"fixed k pays at every level measured (up to {d['highest_measured']})")
            lines.append(f"crossover {engine} {wl}: {head}   ({_short(cx['fixed'])} / plain tok/s: {sp})")
    return lines


def rep_note(r: dict) -> str:
    """A throughput check row's repetition-by-repetition ratios, e.g. '  (by repetition 0.91, 1.02, 0.97)'."""
    paired = r.get("rep_ratios") or []
    return f"  (by repetition {', '.join(f'{x:.2f}' for x in paired)})" if paired else ""


def control_lines(control: list[dict], target: float) -> list[str]:
    """The A/A control's summary: a second plain server over plain, per cell (pooled, and the widest repetition)."""
    if not control:
        return []
    dev = sorted(abs(1.0 - r["ratio"]) for r in control)
    below = sum(1 for r in control if min(r["ratio"], 1.0 / r["ratio"]) < target)  # either server as the reference
    cells = ", ".join(f"{r['workload']} c={r['concurrency']} {r['ratio']:.2f}" for r in control)
    widest = max((abs(1.0 - x) for r in control for x in r["rep_ratios"]), default=None)
    return [f"  A/A control (a second plain server): plain / plain {cells}",
            f"    two identical servers read apart by median {dev[len(dev) // 2]:.1%}, at most {dev[-1]:.1%} per cell"
            + (f" ({widest:.0%} in one repetition)" if widest is not None else "")
            + f"; one of the two would fail the {target:.2f}x throughput check against the other in {below} of "
              f"{len(control)} cells"]


def check_lines(result: dict) -> list[str]:
    checks, summ = result["checks"], result["check_summary"]
    meaning = {"requests": "every request of every cell completed, in every repetition",
               "pacing": "every policy x load cell reads as the server behaved",
               "verdict": "verdict per server and workload",
               "throughput": "adaptive >= 0.95x the better of plain and fixed k at every level",
               "acceptance": "scraped /metrics acceptance = the engine's own counters"}
    lines = ["checks:"]
    for name, s in summ.items():
        lines.append(f"  {name:<11} {s['passed']}/{s['total']} {'PASS' if s['ok'] else 'FAIL'}  ({meaning[name]})")
        bad = [r for r in checks[name] if not r["ok"]]
        for r in bad[:12]:
            if name == "requests":
                kinds = ", ".join(f"{k} {v}" for k, v in r["failures"].items())
                lines.append(f"      {r['server']} {r['workload']} c={r['concurrency']}: {r['failed']} failed ({kinds})"
                             + (f"; e.g. {r['failure_examples'][0]}" if r["failure_examples"] else ""))
            elif name == "pacing":
                lines.append(f"      {r['server']} {r['workload']} c={r['concurrency']}: {r['call']}, expected "
                             f"{r['expected']}")
            elif name == "throughput":
                lines.append(f"      {r['server']} {r['workload']} c={r['concurrency']}: {r['tok_s']:.1f} tok/s = "
                             f"{r['ratio_to_best']:.2f}x the better of plain {num(r['plain_tok_s'])} and fixed "
                             f"{num(r['fixed_tok_s'])}" + rep_note(r)
                             + (f"; control {r['control_ratio']:.2f}" if r.get("control_ratio") else ""))
            elif name == "acceptance":
                lines.append(f"      {r['server']} {r.get('workload', '')} {r.get('concurrency', '')}: {r}")
        if len(bad) > 12:
            lines.append(f"      ... and {len(bad) - 12} more")
    by_server: dict[str, list] = {}
    target = result["thresholds"]["throughput_target"]
    for r in checks["throughput"]:
        by_server.setdefault(r["server"], []).append(r)
    for server, rows in by_server.items():
        ratios = sorted(r["ratio_to_best"] for r in rows)
        paired = sorted(r["rep_ratio_median"] for r in rows if r.get("rep_ratio_median") is not None)
        lines.append(f"  {server}: tok/s / best of plain and fixed k: min {ratios[0]:.2f}, "
                     f"median {ratios[len(ratios) // 2]:.2f} over {len(ratios)} cells"
                     + (f"; repetition by repetition (median per cell): min {paired[0]:.2f}, "
                        f"{sum(1 for x in paired if x >= target)}/{len(paired)} cells at the target"
                        if paired else ""))
    lines += control_lines(result.get("control") or [], target)
    for r in checks["acceptance"]:
        if "engine_log_accepted" in r:
            lines.append(f"  {r['server']}: /metrics since start accepted {num(r['scraped_accepted'], '.0f')} of "
                         f"{num(r['scraped_drafted'], '.0f')} drafted; engine log ({r['log_lines']} lines) "
                         f"{r['engine_log_accepted']} of {r['engine_log_drafted']} -> "
                         f"{'equal' if r['ok'] else 'DIFFER'}")
    return lines


def format_report(result: dict) -> str:
    out = []
    for engine in ("speclab", "vllm"):
        for split in (False, True):
            for wl in result["settings"]["workloads"]:
                t = workload_table(result, engine, wl, split)
                if t:
                    out += [t, ""]
    out += verdict_lines(result) + [""] + crossover_lines(result) + [""] + check_lines(result)
    for n in result.get("notes", []):
        out.append(f"note: {n}")
    if "wall_s" in result:
        out.append(f"({result['wall_s']:.0f} s)")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------ charts


def load_charts(result: dict, engine: str = "speclab", workload: str | None = None):
    """Throughput and p95 TPOT against concurrency, one line per server (split-token runs left out)."""
    from speclab.load.charts import load_chart

    wl = workload or result["settings"]["workloads"][0]
    rows = [{"value": c["concurrency"], "server": c["server"], "tok_s": c["tok_s"], "tpot_p95_ms": c["tpot_p95_ms"],
             "call": c["call"], "load": f"concurrency {c['concurrency']}"}
            for c in result["cells"] if c["engine"] == engine and c["workload"] == wl and not c["split"]]
    return load_chart(rows, series="server", title=f"{engine} · {wl}") if rows else None


def _example(cell: dict) -> dict | None:
    ok = [r for r in cell["requests"] if r.get("ok")]
    return max(ok, key=lambda r: len(r["chunk_times"])) if ok else None


def pacing_charts(result: dict, engine: str = "speclab", workload: str | None = None, split: bool | None = False,
                  servers: list[str] | None = None):
    """Per server, one request's tokens against time at the lowest and the highest load, side by side."""
    import altair as alt

    from speclab.load.charts import pacing_strip

    wl = workload or result["settings"]["workloads"][0]
    rows = []
    for name in servers or servers_of(result, engine, split):
        cs = sorted((c for c in result["cells"] if c["server"] == name and c["workload"] == wl),
                    key=lambda c: c["concurrency"])
        if not cs:
            continue
        ends = [cs[0]] + ([cs[-1]] if len(cs) > 1 else [])
        strips = [pacing_strip(ex, title=f"{name}, c={c['concurrency']}: {c['call']}").properties(width=300, height=150)
                  for c in ends if (ex := _example(c))]
        if strips:
            rows.append(alt.hconcat(*strips))
    return alt.vconcat(*rows).properties(title=f"pacing · {wl}") if rows else None


def calls_chart(result: dict, engine: str | None = None):
    """The pacing call of every cell (colour) with what the server did (letter: B, S, ~) and a cross
    where the pacing check failed; one panel per workload."""
    import altair as alt
    import pandas as pd

    bad = _failed_cells(result)
    rows = [{"server": c["server"], "workload": c["workload"], "concurrency": c["concurrency"], "call": c["call"],
             "mark": did_letter((c.get("inside") or {}).get("accepted_per_round")) if c["role"] != "plain" else "",
             "check": "failed" if (c["server"], c["workload"], c["concurrency"]) in bad else "ok"}
            for c in result["cells"] if engine is None or c["engine"] == engine]
    if not rows:
        return None
    df = pd.DataFrame(rows)
    df["label"] = df["mark"] + df["check"].map({"failed": " ✗", "ok": ""})
    scale = alt.Scale(domain=["bursty", "smooth", "late", "unknown"],
                      range=["#d4760a", "rgb(9, 105, 218)", "rgb(130, 80, 223)", "#8c959f"])
    order = list(dict.fromkeys(df["server"]))
    base = alt.Chart(df).encode(x=alt.X("concurrency:O", title="concurrency"),
                                y=alt.Y("server:N", sort=order, title=None))
    rect = base.mark_rect().encode(color=alt.Color("call:N", scale=scale, title="pacing call"),
                                   tooltip=["server", "workload", "concurrency", "call", "mark", "check"])
    text = base.mark_text(color="white", fontWeight="bold").encode(text="label:N")
    return alt.layer(rect, text).properties(width=180, height=alt.Step(16)).facet(
        column=alt.Column("workload:N", title=None)).properties(
        title="pacing call per cell (letter: what the server did, B bursty / S off / ~ in between; ✗ check failed)")


def save_charts(result: dict, out_dir) -> list[Path]:
    """serve_<engine>_<workload>.html (load), pacing_<engine>_<workload>.html, calls.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for engine in ("speclab", "vllm"):
        for wl in result["settings"]["workloads"]:
            for name, chart in ((f"serve_{engine}_{wl}", load_charts(result, engine, wl)),
                                (f"pacing_{engine}_{wl}", pacing_charts(result, engine, wl, split=None))):
                if chart is not None:
                    paths.append(out / f"{name}.html")
                    chart.save(paths[-1])
    chart = calls_chart(result)
    if chart is not None:
        paths.append(out / "calls.html")
        chart.save(paths[-1])
    return paths
