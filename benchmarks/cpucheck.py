"""``python benchmarks/cpucheck.py``: does the cost model predict the speedups measured on this machine?

In one run, for each workload and each batch size: time the engine's forwards per shape (target at
rows x {1, k+1} tokens, one draft step at each row count), run plain and speculative decoding on the
same prompts (interleaved, medians), and predict the speculative decode time from the step costs and
the acceptance the run measured. The comparison is over the decode phase (first token to last), the
part speculation changes.

The prediction, per batch of B rows:

* plain decoding: every row emits one token per round, so N-1 rounds of ``target(B, 1) + o(B)``,
  where ``o(B)`` is the host time per round outside the forwards (argmax, bookkeeping), calibrated
  from the plain run itself: plain time is therefore exact by construction;
* speculation: row b emits ``m_b`` tokens per round (its measured mean accepted length), so it needs
  ``(N-1) / m_b`` rounds; rows leave as they finish, so the batch runs ragged: the rounds with n rows
  left cost ``k draft(n) + target(n, k+1) + o(n)`` each (the same host time per round as plain);
* predicted speedup = plain time / predicted speculative time.

Two sets of step costs are compared: the forwards timed here (``MeasuredCosts``), and the roofline of
the measured ``cpu`` preset with one per-forward overhead fitted to the timed one-token target step
(the ideal model: it misses where tiny models live in the cache and the overhead is not constant).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json
import statistics
import time
from pathlib import Path

from speclab.analysis.costmodel import MeasuredCosts, interleaved_times
from speclab.engine.costs import round_time
from speclab.errors import SpeclabError
from speclab.tables import num

TOLERANCE = 0.20  # the target: predictions within 20% of the measured speedups


def _run(dec, group, k: int, n: int, kw: dict, clock) -> tuple[float, list[dict]]:
    """One generate call: its duration on ``clock`` and per row its tokens, rounds and accepted drafts."""
    t = clock()
    res = dec.generate(group, k=k, max_new_tokens=n, **kw)
    dt = clock() - t
    return dt, [{"tokens": len(r.generated) - 1, "rounds": r.rounds, "accepted": r.accepted, "drafted": r.drafted}
                for r in res.requests]


def ragged_time(costs, k: int, tokens_per_row: list[float], tokens_per_round: list[float], overhead) -> float:
    """Seconds for a batch whose row b needs ``tokens_per_row[b]`` decode tokens at
    ``tokens_per_round[b]`` per round, rows leaving as they finish (``overhead(n)``: host seconds per
    round with n rows). k = 0 is plain decoding (one token per round)."""
    need = sorted(t / (m if k else 1.0) for t, m in zip(tokens_per_row, tokens_per_round))  # rounds per row
    total, done = 0.0, 0.0
    for i, r in enumerate(need):
        n = len(need) - i  # rows still running until this one finishes
        if r > done:
            total += (r - done) * round_time(costs, n, k, overhead=overhead(n))
            done = r
    return total


def _overhead_fn(points: dict[int, float]):
    """Host seconds per round at n rows, linear between the measured batch sizes (flat outside)."""
    pts = sorted(points.items())

    def f(n: int) -> float:
        if n <= pts[0][0]:
            return pts[0][1]
        for (a, ya), (b, yb) in zip(pts, pts[1:]):
            if n <= b:
                return ya + (yb - ya) * (n - a) / (b - a)
        return pts[-1][1]

    return f


def _measure(prompts, batches, plain_dec, spec_dec, k, N, reps, prompts_per_batch1, fns, kw, tick) -> dict:
    """Plain and speculative runs of the same groups of prompts (B = 1: several single prompts;
    larger B: one group), full and prefill-only, with one timing of every step shape after each
    run: all interleaved, so a load burst on a shared machine hits everything alike."""
    groups = [(b, [prompts[(j * b + i) % len(prompts)] for i in range(b)])
              for b in batches for j in range(prompts_per_batch1 if b == 1 else 1)]
    times = {(g, m): [] for g in range(len(groups)) for m in ("plain", "spec", "plain1", "spec1")}
    rows_seen: dict[int, list[dict]] = {}
    shape_times: dict = {key: [] for key in fns}

    def time_shapes():
        for key, s in interleaved_times(fns, 1, warmup=0, clock=tick).items():
            shape_times[key].append(s)

    _run(plain_dec, groups[0][1], 0, 4, kw, tick)  # warm up both paths and the timing caches
    _run(spec_dec, groups[0][1], k, 4, kw, tick)
    interleaved_times(fns, 1, warmup=1, clock=tick)
    for _ in range(reps):
        for g, (b, group) in enumerate(groups):
            times[(g, "plain")].append(_run(plain_dec, group, 0, N, kw, tick)[0])
            time_shapes()
            dt, rows = _run(spec_dec, group, k, N, kw, tick)
            times[(g, "spec")].append(dt)
            rows_seen[g] = rows  # greedy: every repetition emits the same tokens (synthetic: same seeds)
            time_shapes()
            times[(g, "plain1")].append(_run(plain_dec, group, 0, 1, kw, tick)[0])  # prefill + first token
            times[(g, "spec1")].append(_run(spec_dec, group, k, 1, kw, tick)[0])

    def decode(g, m):  # decode phase: the whole run minus prefill and the first token
        return max(statistics.median(times[(g, m)]) - statistics.median(times[(g, m + "1")]), 1e-9)

    return {"groups": groups, "rows": rows_seen, "decode": decode,
            "shapes": {key: statistics.median(v) for key, v in shape_times.items()}}


def _cells(label, run, costs, roof, k, N, batches, tpr_of, log) -> list[dict]:
    """Measured vs predicted speedup per batch size for one measured set of runs."""
    groups, decode = run["groups"], run["decode"]
    plain_over = {}
    for b in batches:  # host seconds per round outside the forwards, from the plain runs
        per_round = statistics.median(decode(g, "plain") / (N - 1) for g, (bb, _) in enumerate(groups) if bb == b)
        plain_over[b] = max(0.0, per_round - costs.target_time(b, 1))
    ofn = _overhead_fn(plain_over)
    out = []
    for b in batches:
        gs = [g for g, (bb, _) in enumerate(groups) if bb == b]
        wp = sum(decode(g, "plain") for g in gs)
        ws = sum(decode(g, "spec") for g in gs)
        pred_m = pred_r = 0.0
        acc = drafted = rounds = 0
        for g in gs:
            rows = run["rows"][g]
            toks = [x["tokens"] for x in rows]
            tpr = [tpr_of(x) for x in rows]
            pred_m += ragged_time(costs, k, toks, tpr, ofn)
            if roof is not None:
                pred_r += ragged_time(roof, k, toks, tpr, ofn)
            acc += sum(x["accepted"] for x in rows)
            drafted += sum(x["drafted"] for x in rows)
            rounds += sum(x["rounds"] for x in rows)
        measured = wp / ws
        cell = {"workload": label, "batch": b, "prompts": len(gs) * b, "k": k,
                "acceptance_rate": acc / drafted if drafted else None,
                "mean_accepted_length": acc / rounds + 1 if rounds else None,
                "plain_decode_s": wp, "spec_decode_s": ws, "measured_speedup": measured,
                "predicted_spec_s": pred_m, "predicted_speedup": wp / pred_m,
                "roofline_spec_s": pred_r if roof is not None else None,
                "roofline_speedup": wp / pred_r if roof is not None else None,
                "host_overhead_per_round_s": plain_over[b]}
        cell["error"] = cell["predicted_speedup"] / measured - 1
        cell["roofline_error"] = cell["roofline_speedup"] / measured - 1 if roof is not None else None
        cell["within_tolerance"] = abs(cell["error"]) <= TOLERANCE
        out.append(cell)
        log(f"[check-cpu] {label} batch {b}: measured {measured:.2f}x, predicted {cell['predicted_speedup']:.2f}x "
            f"({cell['error']:+.0%})")
    return out


def check_cpu(target: str | None = None, draft: str | None = None, workloads="all", k: int = 4,
              batches=(1, 8), max_new_tokens: int = 48, prompts_per_batch1: int = 2, reps: int = 3,
              seed: int = 0, clock: str = "process", synthetic=(), log=None, command: str | None = None) -> dict:
    """Measure step costs, acceptance and speedups with the engine, then predict; see the module doc.
    ``synthetic``: (alpha, cost) pairs run as extra cells on the first workload's prompts with the
    synthetic drafter (a draft step of exactly ``cost`` x the target step: a check of the cost side)."""
    import torch

    from speclab.analysis.costmodel import tokens_per_round
    from speclab.analysis.roofline import ModelShape, RooflineCosts, fit_overhead, hardware
    from speclab.analysis.sweep import cached_model, new_drafter
    from speclab.defaults import default_draft, default_target
    from speclab.drafters import make_drafter
    from speclab.engine import SpeculativeDecoder
    from speclab.limits import check_batch, check_k, check_max_new_tokens
    from speclab.workloads import load_workload, workload_names

    log = log or (lambda *a: None)
    k = check_k(k)
    if k == 0:
        raise SpeclabError("the CPU check needs k >= 1 (k = 0 is the baseline it compares against)")
    batches = sorted({check_batch(b, 64) for b in batches})
    N = check_max_new_tokens(max_new_tokens)
    if N < 8:
        raise SpeclabError("the CPU check needs --max-new-tokens of at least 8 (a few rounds per row)")
    if clock not in ("process", "wall"):
        raise SpeclabError(f"--clock must be 'process' or 'wall', got '{clock}'")
    names = workload_names(workloads)
    torch.set_num_threads(1)
    tgt = cached_model(target or default_target(), device="cpu", role="target")
    draft_name = draft or default_draft()
    model_drafter = new_drafter(draft_name, tgt)
    if model_drafter is None or getattr(model_drafter, "lm", None) is None:
        raise SpeclabError(f"the CPU check needs a draft model (got '{draft_name}'): its step cost is timed")
    dlm = model_drafter.lm
    cpu = hardware("cpu")  # raises with the command to run when the preset was never measured
    tshape, dshape = ModelShape.from_lm(tgt), ModelShape.from_lm(dlm)
    plain_dec = SpeculativeDecoder(tgt, None)
    kw = dict(record=False, stop_on_eos=False, seed=seed)
    tick = time.process_time if clock == "process" else time.perf_counter
    rows_all = range(1, max(batches) + 1)

    cells, costs_by_wl = [], {}
    t_start = time.time()
    for w in names:
        prompts = [p.prompt for p in load_workload(w)]
        ctx = int(statistics.median(len(tgt.encode(p)) for p in prompts[:max(batches)])) + N // 2
        fns = MeasuredCosts.steppers(tgt, dlm, rows=rows_all, tokens=(1, k + 1), context=ctx)
        run = _measure(prompts, batches, plain_dec, SpeculativeDecoder(tgt, model_drafter), k, N, reps,
                       prompts_per_batch1, fns, kw, tick)
        costs = MeasuredCosts.from_times(run["shapes"], f"timed forwards ({clock} time, context {ctx})")
        # the ideal model: the cpu roofline, one per-forward overhead fitted to the timed one-token step
        over = fit_overhead(cpu, tshape, costs.target_time(1, 1), context=ctx)
        roof = RooflineCosts(hardware(cpu, overhead_s=over), tshape, dshape, context=ctx)
        costs_by_wl[w] = {"context": ctx, "roofline_overhead_per_forward_s": over, **costs.to_dict()}
        cells += _cells(w, run, costs, roof, k, N, batches, lambda x: x["accepted"] / x["rounds"] + 1
                        if x["rounds"] else 1.0, log)
    for alpha, cost in synthetic:  # a draft of known quality and cost: predicted from alpha itself
        label = f"synthetic:{alpha:g}:{cost:g}"
        prompts = [p.prompt for p in load_workload(names[0])]
        sd = make_drafter(label, tgt)
        sd.prepare(prompts[:max(batches) * max(1, prompts_per_batch1)], N, rows=tuple(rows_all))
        ctx = int(statistics.median(len(tgt.encode(p)) for p in prompts[:max(batches)])) + N // 2
        fns = MeasuredCosts.steppers(tgt, None, rows=rows_all, tokens=(1, k + 1), context=ctx)
        run = _measure(prompts, batches, plain_dec, SpeculativeDecoder(tgt, sd), k, N, reps, prompts_per_batch1,
                       fns, kw, tick)
        tt = MeasuredCosts.from_times(run["shapes"]).target
        costs = MeasuredCosts(tt, {r: cost * tt[(r, 1)] for r in rows_all}, f"timed forwards ({clock} time); "
                              f"draft step = {cost:g} x the target step")
        costs_by_wl[label] = {"context": ctx, "expected_tokens_per_round": tokens_per_round(alpha, k),
                              **costs.to_dict()}
        # the realised acceptance, as for the workloads: over a few dozen rounds it strays from alpha by
        # chance, and this cell checks the cost side (a draft of known cost), not the dice
        cells += _cells(label, run, costs, None, k, N, batches, lambda x: x["accepted"] / x["rounds"] + 1
                        if x["rounds"] else 1.0, log)
    ok = all(c["within_tolerance"] for c in cells if not c["workload"].startswith("synthetic:"))
    return {"command": command or "python benchmarks/cpucheck.py",
            "date": time.strftime("%Y-%m-%d %H:%M"), "target": tgt.name, "draft": dlm.name, "k": k,
            "batches": batches, "workloads": names, "max_new_tokens": max_new_tokens, "reps": reps, "clock": clock,
            "threads": torch.get_num_threads(), "cpu_preset": {"bandwidth": cpu.bandwidth, "peak_flops": cpu.peak_flops,
                                                               "measured": cpu.measured},
            "tolerance": TOLERANCE, "cells": cells, "step_costs": costs_by_wl, "all_within_tolerance": ok,
            "wall_seconds": round(time.time() - t_start, 1)}


def format_check(rep: dict) -> str:
    L = [f"check-cpu: target {rep['target']}, draft {rep['draft']}, k={rep['k']}, {rep['max_new_tokens']} new tokens, "
         f"{rep['reps']} interleaved reps, {rep['threads']} thread, {rep['clock']} time (decode phase, greedy)",
         f"{'workload':<18}{'batch':>6}{'acc len':>8}{'measured':>10}{'predicted':>11}{'error':>8}"
         f"{'roofline':>10}{'error':>8}  within {rep['tolerance']:.0%}"]
    for c in rep["cells"]:
        roof = "-" if c["roofline_speedup"] is None else f"{c['roofline_speedup']:.2f}x"
        rerr = num(c["roofline_error"], "+.0%")
        L.append(f"{c['workload']:<18}{c['batch']:>6}{c['mean_accepted_length'] or 0:>8.2f}"
                 f"{c['measured_speedup']:>9.2f}x{c['predicted_speedup']:>10.2f}x{c['error']:>+8.0%}"
                 f"{roof:>10}{rerr:>8}  {'yes' if c['within_tolerance'] else 'NO'}")
    L.append("predicted: timed per-shape step costs + measured acceptance + host time per round from the plain "
             "run; roofline: the measured cpu preset with one per-forward overhead fitted to the timed step")
    L.append(f"every workload within {rep['tolerance']:.0%}: {'yes' if rep['all_within_tolerance'] else 'NO'}  "
             f"({rep['wall_seconds']} s)")
    return "\n".join(L)


def write_json(rep: dict, path: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    return p


def run_from_args(args) -> int:
    import math

    from speclab.limits import parse_numbers

    batches = parse_numbers(args.batches, "--batches", integer=True)
    synthetic = []
    for part in (args.synthetic or "").split(","):
        if part.strip():
            try:
                alpha, cost = map(float, part.split(":"))  # two numbers, or a ValueError
            except ValueError:
                alpha = cost = math.nan
            if not (math.isfinite(alpha) and math.isfinite(cost)):
                raise SpeclabError(f"--synthetic wants ALPHA:COST[,ALPHA:COST...], got '{part}'")
            synthetic.append((alpha, cost))
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    command = "python benchmarks/cpucheck.py " + " ".join(sys.argv[1:])
    rep = check_cpu(args.target, args.draft, args.workload, args.k, batches, args.max_new_tokens, reps=args.reps,
                    clock=args.clock, synthetic=synthetic, log=log, command=command)
    print(format_check(rep))
    print(f"wrote {write_json(rep, args.json)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import add_flags, parser, run

    p = parser("cpucheck", "Predicted against measured speedups of the embedded family on this CPU, measured in "
               "this run; `speclab advise --from` reads its JSON.")
    add_flags(p, "target", "draft", "workload", "k", "batches", "max_new_tokens", "reps", "clock", "out", "quiet",
              workload=dict(default="all", help="workloads ('all' or a comma list)"),
              batches=dict(default="1,8", help="batch sizes (the smallest and the largest matter; default 1,8)"),
              max_new_tokens=dict(default=48, help="tokens per row (default 48)"),
              reps=dict(default=3, help="interleaved repetitions (default 3)"),
              clock=dict(default="process", help="this process's CPU time (robust to other load; default) or "
                                                 "wall time"))
    p.add_argument("--synthetic", default=None, metavar="ALPHA:COST,...",
                   help="extra cells with the synthetic drafter (known acceptance and cost)")
    return run(p, run_from_args, argv, "cpucheck")


if __name__ == "__main__":
    sys.exit(main())
