"""What the advisor reads (:func:`read_inputs`, :func:`parse_acceptance`): acceptance, step costs and latencies
from lab and load results, each figure with its source. The fields each reader uses: docs/advisor.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import SpeclabError
from .advisor import Inputs, Workload
from .costmodel import MeasuredCosts, alpha_from_rate


def _num(x) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _per_position(x) -> list[float] | None:
    if isinstance(x, str):
        x = x.strip()
        if not x:
            return None
        try:
            x = json.loads(x)
        except ValueError:
            return None
    if isinstance(x, (list, tuple)) and x and all(_num(v) is not None for v in x):
        return [min(max(float(v), 0.0), 1.0) for v in x]
    return None


def _from_acceptance_report(d: dict, inp: Inputs, draft: str | None, temperature: float) -> None:
    rows = d["rows"]
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    if draft is None:  # the drafter with the best mean accepted length over the workloads
        def mean_len(dr):
            vals = [r["mean_accepted_length"] for r in rows if r["drafter"] == dr and r["mean_accepted_length"]]
            return sum(vals) / len(vals) if vals else 0.0
        draft = max(drafters, key=mean_len)
    elif draft not in drafters:
        raise SpeclabError(f"drafter '{draft}' is not in the acceptance report (it has: {', '.join(drafters)})")
    k = int(d.get("k", 4))
    temps = sorted({float(r["temperature"]) for r in rows})
    t = min(temps, key=lambda x: abs(x - temperature))
    for r in rows:
        if r["drafter"] != draft or float(r["temperature"]) != t or r["mean_accepted_length"] is None:
            continue
        inp.workloads.append(Workload(r["workload"], mean_length=float(r["mean_accepted_length"]), k=k,
                                      source="measured"))
    inp.draft, inp.target = draft, d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append(f"acceptance: speclab bench report, drafter {draft}, k={k}, T={t:g}")


def _from_compare(d: dict, inp: Inputs) -> None:
    eff = d.get("efficiency") or {}
    for r in d["rows"]:
        if r.get("method") != "speclab-draft" or r.get("tokens_per_round") is None:
            continue
        if any(w.name == r["workload"] for w in inp.workloads):
            continue  # one k per workload: the first listed
        inp.workloads.append(Workload(r["workload"], mean_length=float(r["tokens_per_round"]), k=int(r["k"]),
                                      source="measured"))
    sc = eff.get("step_costs") or {}
    if sc:
        first = next(iter(sc.values()))
        inp.costs = MeasuredCosts.from_step_costs(first, rows=1, source="measured (speclab bench compare)")
    batch = d.get("batch") or []
    if batch:
        wl = batch[0].get("workload")
        for w in inp.workloads:
            if w.name == wl:
                w.measured_crossover, w.crossover_measured = d.get("crossover_batch"), True
    inp.draft, inp.target = d.get("draft"), d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append(f"acceptance and batch-1 step costs: speclab bench compare (draft {d.get('draft')})")


def _from_sweep(rows: list[dict], inp: Inputs, draft: str | None, concurrency: int | None) -> None:
    spec = [r for r in rows if int(r.get("k", 0)) > 0 and r.get("draft") not in (None, "none")]
    if not spec:
        raise SpeclabError("the sweep has no speculative rows (k > 0)")
    drafts = list(dict.fromkeys(r["draft"] for r in spec))
    if draft is None:
        draft = max(drafts, key=lambda d: max((_num(r.get("speedup")) or 0) for r in spec if r["draft"] == d))
    elif draft not in drafts:
        raise SpeclabError(f"draft '{draft}' is not in the sweep (it has: {', '.join(drafts)})")
    for wname in dict.fromkeys(r["workload"] for r in spec):
        mine = [r for r in spec if r["workload"] == wname and r["draft"] == draft]
        if not mine:
            continue
        kk = max(int(r["k"]) for r in mine)
        at_k = [r for r in mine if int(r["k"]) == kk]
        ref = min(at_k, key=lambda r: int(r["batch"]))
        w = Workload(wname, per_position=_per_position(ref.get("per_position_acceptance")),
                     mean_length=_num(ref.get("mean_accepted_length")), k=kk, source="measured")
        if w.per_position is None and w.mean_length is None and _num(ref.get("acceptance_rate")) is not None:
            w.alpha = alpha_from_rate(float(ref["acceptance_rate"]), kk)
        by_batch = sorted(at_k, key=lambda r: int(r["batch"]))
        if len(by_batch) > 1:
            losing = [int(r["batch"]) for r in by_batch if (_num(r.get("speedup")) or 0) < 1.0]
            w.measured_crossover, w.crossover_measured = (losing[0] if losing else None), True
        inp.workloads.append(w)
    base = [r for r in rows if int(r.get("k", 0)) == 0]
    if base:
        C = concurrency or 1
        b = min(base, key=lambda r: abs(int(r["batch"]) - C))
        if _num(b.get("tpot_ms")) is not None:
            inp.tpot_ms, inp.tpot_source = float(b["tpot_ms"]), "measured"
        if _num(b.get("ttft_ms")) is not None:
            inp.ttft_ms, inp.ttft_source = float(b["ttft_ms"]), "measured"
    inp.draft = draft
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append(f"acceptance and plain TTFT/TPOT: a speclab sweep (draft {draft})")


def _from_load(d: dict, inp: Inputs, concurrency: int | None, name: str) -> None:
    levels = d.get("levels") or []
    if not levels:
        raise SpeclabError("the load result has no levels")
    conc = [lv for lv in levels if (lv.get("level") or {}).get("kind") == "concurrency"]
    pool = conc or levels
    target_c = concurrency or max(int((lv.get("level") or {}).get("value") or 1) for lv in pool)
    lv = min(pool, key=lambda x: abs(float((x.get("level") or {}).get("value") or 1) - target_c))
    s = lv.get("summary") or {}
    ttft, tpot = (s.get("ttft_ms") or {}).get("mean"), (s.get("tpot_ms") or {}).get("mean")
    if ttft is not None:
        inp.ttft_ms, inp.ttft_source = float(ttft), "scraped"
    if tpot is not None:
        inp.tpot_ms, inp.tpot_source = float(tpot), "scraped"
    if s.get("output_tokens") and s.get("completed"):
        inp.output_tokens, inp.output_source = s["output_tokens"] / s["completed"], "scraped"
    if conc and concurrency is None:
        inp.concurrency, inp.concurrency_source = int(target_c), "scraped"
    spec_any = False
    for level in [lv] + [x for x in levels if x is not lv]:  # acceptance: this level first
        server = level.get("server") or {}
        sd, sg = server.get("spec_decode") or {}, server.get("sglang") or {}
        if sd.get("drafts"):
            spec_any = True
            pp = _per_position(sd.get("per_position_acceptance"))
            inp.workloads.append(Workload(name, per_position=pp, mean_length=_num(sd.get("mean_acceptance_length")),
                                          k=len(pp) if pp else None,
                                          alpha=None if pp else _num(sd.get("acceptance_rate")), source="scraped"))
            break
        if sg.get("accept_length"):
            spec_any = True
            inp.workloads.append(Workload(name, mean_length=float(sg["accept_length"]), k=None,
                                          alpha=_num(sg.get("accept_rate")), source="scraped"))
            break
    inp.tpot_is_plain = not spec_any
    if spec_any:
        inp.notes.append("the load run's TPOT was measured with speculation on: used for the decode share only")
    vals = sorted(((lv.get("level") or {}).get("value") or 0, ((lv.get("summary") or {}).get("ttft_ms") or {})
                   .get("p50")) for lv in pool)
    vals = [(v, t) for v, t in vals if t]
    if len(vals) >= 2 and vals[-1][1] > 3 * vals[0][1]:
        inp.queueing = (f"TTFT p50 grows from {vals[0][1]:.0f} ms at load {vals[0][0]:g} to {vals[-1][1]:.0f} ms at "
                        f"load {vals[-1][0]:g} (scraped)")
    inp.target = inp.target or d.get("model")
    inp.notes.append(f"traffic: speclab load result ({d.get('url', '?')}, level {lv['level'].get('label')})")


def _from_bench_serve(d: dict, inp: Inputs, concurrency: int | None) -> None:
    """``speclab bench serve``: the speculative server's acceptance per workload (lowest load), plain's TPOT."""
    rows = d["rows"]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        spec = sorted((r for r in rows if r["workload"] == wl and r.get("server_acceptance_length")),
                      key=lambda r: r["concurrency"])
        if spec and not any(w.name == wl for w in inp.workloads):
            inp.workloads.append(Workload(wl, mean_length=float(spec[0]["server_acceptance_length"]), k=None,
                                          source="scraped"))
    plain = [r for r in rows if r["server"] == "speclab plain" and _num(r.get("tpot_mean_ms")) is not None]
    if plain:
        C = concurrency or min(r["concurrency"] for r in plain)
        p = min(plain, key=lambda r: abs(r["concurrency"] - C))
        inp.tpot_ms, inp.tpot_source, inp.tpot_is_plain = float(p["tpot_mean_ms"]), "measured", True
        if _num(p.get("ttft_mean_ms")) is not None:
            inp.ttft_ms, inp.ttft_source = float(p["ttft_mean_ms"]), "measured"
    inp.target = d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append("acceptance and plain TTFT/TPOT: speclab bench serve")


def _from_bench_policies(d: dict, inp: Inputs) -> None:
    """``speclab bench policies``: each workload's acceptance at its largest fixed k, smallest batch."""
    fixed = [r for r in d["rows"] if r.get("policy") == "fixed" and r.get("acceptance_rate") is not None
             and r["workload"] != "mixed"]
    for wl in dict.fromkeys(r["workload"] for r in fixed):
        mine = [r for r in fixed if r["workload"] == wl]
        r = max(mine, key=lambda r: (r["k"], -r["batch"]))
        if not any(w.name == wl for w in inp.workloads):
            inp.workloads.append(Workload(wl, alpha=alpha_from_rate(float(r["acceptance_rate"]), int(r["k"])),
                                          source="measured"))
    inp.draft, inp.target = inp.draft or d.get("draft"), d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append(f"acceptance: speclab bench policies (draft {d.get('draft')}, fixed k)")


def _from_bench_heads(d: dict, inp: Inputs) -> None:
    """``speclab bench heads``: per workload, the fastest method's mean accepted length."""
    rows = [r for r in d["rows"] if r.get("method") != "plain" and r.get("mean_accepted_length")]
    for wl in dict.fromkeys(r["workload"] for r in rows):
        best = max((r for r in rows if r["workload"] == wl), key=lambda r: r.get("speedup") or 0)
        if not any(w.name == wl for w in inp.workloads):
            inp.workloads.append(Workload(wl, mean_length=float(best["mean_accepted_length"]), k=int(best["k"]),
                                          source="measured"))
            inp.notes.append(f"acceptance on {wl}: speclab bench heads, its fastest method ({best['method']})")
            inp.draft = inp.draft or best.get("spec")  # the drafter whose step costs matter
    inp.target = d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"


def measure_step_costs(inp: Inputs, target: str | None, draft: str | None, k_max: int, log=print) -> MeasuredCosts:
    """The step costs a result did not carry, timed here on the model it names (a family model or a local
    directory) or on the family's target, with its draft (the result's, else the family's default): target forwards
    at a few row counts up to twice the expected concurrency and 1..k_max+1 tokens, one draft step per row count,
    interleaved, on one thread by this process's CPU time (other work on the machine does not inflate it). Says so in
    one line; a result from a model this machine cannot load offline is refused in one line naming the flag that
    models it instead."""
    import time
    from pathlib import Path

    import torch

    from ..defaults import default_draft, default_target
    from ..family import resolve
    from .sweep import cached_model, new_drafter

    name = target or inp.target or default_target()
    if resolve(name) is None and not Path(name).is_dir():
        raise SpeclabError(f"the result names no step costs and its model '{name}' is not one this machine can time "
                           f"offline: model its hardware with `speclab advise what-if --hardware PRESET "
                           f"--target-model SHAPE`")
    t0 = time.perf_counter()
    tgt = cached_model(name, device="cpu", role="target")
    draft = draft or (inp.draft if inp.draft not in (None, "", "DRAFT") else default_draft())
    try:
        drafter = new_drafter(draft, tgt)
    except SpeclabError as e:
        raise SpeclabError(f"timing the step costs here: {e}; name the draft to time with --draft") from None
    dlm = getattr(drafter, "lm", None)
    top = min(64, max(4, 2 * (inp.concurrency or 1)))
    rows = sorted({1, top} | {r for r in (4, 16) if r < top})  # interpolated between, extrapolated past the top
    tokens = sorted({1, 3, int(k_max) + 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        costs = MeasuredCosts.measure(tgt, dlm, rows=rows, tokens=tokens, reps=5,
                                      clock=time.process_time)
    finally:
        torch.set_num_threads(threads)
    costs.source = "timed on this machine"
    inp.draft = inp.draft or draft
    free = "" if dlm is not None else ": no separate model, its steps counted as free"
    log(f"step costs: the result has none, so they were timed on this machine ({tgt.name}, draft {draft}{free}, "
        f"{time.perf_counter() - t0:.0f} s); for other hardware use `speclab advise what-if --hardware PRESET`")
    return costs


def _from_check_cpu(d: dict, inp: Inputs) -> None:
    for c in d["cells"]:
        if c["workload"].startswith("synthetic:") or any(w.name == c["workload"] for w in inp.workloads):
            continue
        if c.get("mean_accepted_length") is not None:
            inp.workloads.append(Workload(c["workload"], mean_length=c["mean_accepted_length"], k=int(c["k"]),
                                          source="measured"))
    sc = [v for kname, v in d["step_costs"].items() if not kname.startswith("synthetic:")]
    if sc:
        inp.costs = MeasuredCosts.from_dict(sc[0])
        inp.costs.source = "measured (benchmarks/cpucheck.py)"
    inp.draft, inp.target = d.get("draft"), d.get("target")
    inp.tokenizer_match, inp.tokenizer_source = True, "measured"
    inp.notes.append("acceptance and step costs per shape: benchmarks/cpucheck.py")


def _what_it_is(d) -> str:
    if isinstance(d, dict) and "cells" in d and "verdicts" in d:
        return "a serving experiment "
    if isinstance(d, dict) and "cells" in d and "landscape" in str(d.get("command", "")) or (
            isinstance(d, dict) and d.get("cells") and "alpha" in d["cells"][0]):
        return "a synthetic-drafter result (its acceptance is chosen, not measured) "
    if isinstance(d, dict) and "verdicts" in d:
        return "an advice "
    return "this file "


def read_inputs(paths, inp: Inputs | None = None, *, draft: str | None = None, temperature: float = 0.0,
                concurrency: int | None = None, workload_name: str = "served") -> Inputs:
    """Read lab and load results into :class:`Inputs` (figures from later files add to earlier ones)."""
    inp = inp or Inputs()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SpeclabError(f"no such file: {p}")
        try:
            if path.suffix.lower() == ".csv":
                import pandas as pd

                _from_sweep(pd.read_csv(path).to_dict("records"), inp, draft, concurrency)
                continue
            d = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise SpeclabError(f"{p}: not a JSON or CSV file the advisor can read ({e.__class__.__name__})") from None
        try:
            if isinstance(d, dict) and "levels" in d:
                _from_load(d, inp, concurrency, workload_name)
            elif isinstance(d, dict) and "cells" in d and "step_costs" in d:
                _from_check_cpu(d, inp)
            elif isinstance(d, dict) and "efficiency" in d and "rows" in d:
                _from_compare(d, inp)
            elif isinstance(d, dict) and "rows" in d and d["rows"] and "drafter" in d["rows"][0]:
                _from_acceptance_report(d, inp, draft, temperature)
            elif isinstance(d, dict) and d.get("rows") and "server" in d["rows"][0]:
                _from_bench_serve(d, inp, concurrency)
            elif isinstance(d, dict) and d.get("rows") and "config" in d["rows"][0]:
                _from_bench_policies(d, inp)
            elif isinstance(d, dict) and d.get("rows") and "method" in d["rows"][0] and "budget" in d:
                _from_bench_heads(d, inp)
            elif isinstance(d, list) and d and isinstance(d[0], dict) and "workload" in d[0] and "batch" in d[0]:
                _from_sweep(d, inp, draft, concurrency)
            elif isinstance(d, dict) and isinstance(d.get("rows"), list) and d["rows"] and "batch" in d["rows"][0]:
                _from_sweep(d["rows"], inp, draft, concurrency)
            else:
                raise SpeclabError(f"{p}: {_what_it_is(d)}holds no acceptance the advisor can read (it reads speclab "
                                   f"bench acceptance|compare|serve|policies|heads, a sweep, speclab load --json, "
                                   f"benchmarks/cpucheck.py); give --acceptance NAME:RATE instead")
        except (KeyError, TypeError, IndexError) as e:
            raise SpeclabError(f"{p}: missing or malformed field {e} for the advisor") from None
    return inp


def parse_acceptance(spec: str) -> list[Workload]:
    """'json:0.7,code:0.35' (per-token rates) or 'json:0.9/0.8/0.6' (per position) -> workloads."""
    out = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, val = part.rpartition(":")
        if not sep or not name.strip() or not val.strip():
            raise SpeclabError(f"--acceptance wants NAME:RATE[,NAME:RATE...] (RATE in [0, 1], or a per-position "
                               f"list a/b/c), got '{part}'")
        vals = [_num(v) for v in val.split("/")]
        if any(v is None or not 0.0 <= v <= 1.0 for v in vals):
            raise SpeclabError(f"--acceptance: '{val}' for '{name}' is not a rate in [0, 1] (or a/b/c per position)")
        if len(vals) == 1:
            out.append(Workload(name.strip(), alpha=vals[0], source="assumed"))
        else:
            out.append(Workload(name.strip(), per_position=vals, source="assumed"))
    if not out:
        raise SpeclabError("--acceptance is empty")
    return out
