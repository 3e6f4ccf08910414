"""``speclab bench policies``: every draft-length policy against plain decoding.

Plain decoding (k = 0), fixed k for each k in the grid, and every policy of
``speclab.engine.policies`` (adaptive ones with the grid's largest k as their K), on each workload and on a *mixed*
stream (the workloads' prompts interleaved), at concurrency levels from 1 to past the crossover. A level B is a
burst of max(requests, B) + B requests at concurrency B: one scheduler runs at most B rows, every request is queued
at the start and a finished row is replaced at once (continuous batching, as a server runs); throughput over the
whole burst (prefill and the final drain included: every configuration does the same work). Each request's budget is
drawn around ``--max-new-tokens`` (:func:`spread_lengths`, ``--length-spread``), the same draws for every
configuration: served requests end at different lengths, and with one length for all, plain decoding's rows finish
together and are replaced by one prefill forward while a configuration that ever drafted pays one forward per row.
All configurations of a cell run at once, interleaved step by step (:func:`lockstep`: each its own scheduler,
charged the time of its own steps, in a fresh random order every cycle), because this machine's speed drifts by tens
of percent over seconds; the whole grid repeats ``--reps`` times; a cell's speedup is the median of its repetitions'
ratios to plain decoding (:func:`paired_ratios`). The spec decoder's step costs are calibrated once before anything
is timed (``OnlineCosts.calibrate``; its seconds are reported, not counted), and are learnt online over the run, as
a server would: each adaptive configuration from a copy of its own (a stop rule's draft phases must not move
goodput's predictions). One policy object per (cell, configuration), kept over the repetitions (a server keeps its
policy and what it learnt about the traffic). Every output is checked token-identical to plain greedy decoding.
Targets: goodput >= 0.95x the best fixed k in hindsight (k = 0 included) in every cell; on the mixed
stream goodput beats every single fixed k over the load levels (geometric mean of the speedups); no adaptive policy
below 0.97x plain in any cell.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from ..load.shapes import Budgets, check_spread, spread_lengths
from .bench_runs import (
    clock_named,
    gmean,
    grid,
    lockstep,
    logger,
    mixed_stream,
    setup,
    write_report,
)

CONTROL = "plain-again"  # --control: a second plain configuration, the A/A control


def policy_configs(fixed_ks: list[int], names: list[str], control: bool = False) -> list[tuple[str, str | None, int]]:
    """(label, policy spec or None for plain, k): plain, fixed-k for each k, then each policy at K; with ``control``,
    a second plain configuration last (:data:`CONTROL`: reported, never a candidate for the best fixed k)."""
    K = max(fixed_ks)
    out = [("plain", None, 0)] + [(f"fixed-{k}", "fixed", k) for k in fixed_ks]
    out += [(n, n, K) for n in names if n not in ("fixed", "off")]
    return out + [(CONTROL, None, 0)] if control else out


def run_policies(args) -> int:
    import torch

    from ..drafters import make_drafter
    from ..engine import SpeculativeDecoder, make_policy
    from ..engine.costs import ROBUST_REPS, ROBUST_STAT, calibration_clock, calibration_rows
    from ..engine.policies import ADAPTIVE, POLICIES
    from ..workloads import load_workload, workload_names
    from .sweep import cached_model

    g = grid(args)
    log = logger(args)
    clock = clock_named(args.clock)
    target, draft_name = setup(args)
    names = [s.strip() for s in args.policy_list.split(",") if s.strip()] if args.policy_list else list(POLICIES)
    names = [] if names == ["none"] else names
    for n in names:
        make_policy(n, 1)
    configs = policy_configs(g["fixed_ks"], names, control=getattr(args, "control", False))
    K = max(g["fixed_ks"])
    M, n_prompts, levels = g["max_new_tokens"], g["prompts"], g["batches"]
    wls = workload_names(g["workload"])
    texts = {w: [p.prompt for p in load_workload(w)] for w in wls}
    mixed_kinds = []
    if len(wls) > 1:
        mixed_kinds, texts["mixed"] = map(list, zip(*mixed_stream(wls)))
    ids = {w: [target.encode(p) for p in ps] for w, ps in texts.items()}
    cells = [(w, B) for w in ids for B in levels]
    # per cell: a burst of max(prompts, B) + B requests at concurrency B, their budgets spread around M
    queue = {(w, B): [ids[w][i % len(ids[w])] for i in range(max(n_prompts, B) + B)] for w, B in cells}
    spread = check_spread(getattr(args, "length_spread", 0.0))
    lengths = {(w, B): spread_lengths(M, len(q), spread, f"{args.seed}-{w}-{B}") for (w, B), q in queue.items()}
    longest = max(max(v) for v in lengths.values())
    drafter = make_drafter(draft_name, target, load=cached_model)
    spec = SpeculativeDecoder(target, drafter)  # its step costs are the ones every adaptive policy reads

    # ---- untimed: greedy references, calibration, warm-up
    uniq = {tuple(p): p for q in queue.values() for p in q}
    ref = {}
    plain_dec = SpeculativeDecoder(target, None)
    keys = list(uniq)
    for i in range(0, len(keys), 32):
        out = plain_dec.generate([uniq[k] for k in keys[i:i + 32]], k=0, max_new_tokens=longest, record=False)
        ref.update(zip(keys[i:i + 32], out.output_tokens))
    lens = sorted(len(p) for p in uniq.values())
    ctx = lens[len(lens) // 2] + M // 2
    t0 = time.perf_counter()
    # timed as seed_costs times (`speclab generate --policy`, `speclab serve --spec-policy`): the thread's CPU time on a
    # CPU with one torch thread, and the online samples with it (OnlineCosts.clock; in lockstep, with nothing else
    # running, goodput read the same either way: 11 and 10 of 12 cells, paired median 0.996)
    spec.costs.calibrate(target, drafter, rows=calibration_rows(*levels), tokens=tuple(range(1, K + 2)),
                         context=ctx, reps=ROBUST_REPS, stat=ROBUST_STAT,
                         clock=calibration_clock(target.device, torch.get_num_threads()))
    calib_s = time.perf_counter() - t0
    log(f"[policies] calibrated step costs in {calib_s:.1f} s (not timed)")
    for B in levels:
        group = [keys[i % len(keys)] for i in range(B)]
        plain_dec.generate([list(x) for x in group], k=0, max_new_tokens=4, record=False)
        spec.generate([list(x) for x in group], k=K, max_new_tokens=4, record=False)

    # one policy object per (cell, configuration), kept over the repetitions (a server keeps its policy)
    policies = {(w, B, label): make_policy(p, k) for w, B in cells for label, p, k in configs if p is not None}
    runs: dict[tuple, list[tuple[int, float]]] = {}  # (w, B, label) -> (tokens, seconds) per repetition
    stats: dict[tuple, dict] = {}
    identical: dict[tuple, bool] = {}
    t_run = time.perf_counter()
    # each adaptive configuration learns its own copy of the calibrated table, over every cell, as a server keeps
    # one (shared, one policy's rounds would move another's predictions: a stop rule's draft phases are not goodput's)
    tables = {label: spec.costs.copy() if pol_spec in ADAPTIVE else spec.costs for label, pol_spec, _ in configs}
    # a drafter per configuration: a model draft's cache belongs to one scheduler (the weights are shared)
    drafters = {label: make_drafter(draft_name, target, load=cached_model) if pol_spec else None
                for label, pol_spec, _ in configs}
    order = random.Random(args.seed)  # every configuration after every other equally often (interleave)
    for rep in range(g["reps"]):
        for w, B in cells:
            out = lockstep(target, [(drafters[label], policies.get((w, B, label))) for label, _, _ in configs],
                           queue[(w, B)], B, lengths[(w, B)], [tables[label] for label, _, _ in configs], args.seed,
                           clock,
                           shuffle=order)
            for (label, pol_spec, k), (ntok, spent, reqs) in zip(configs, out):
                key = (w, B, label)
                runs.setdefault(key, []).append((ntok, spent))
                st = stats.setdefault(key, dict(drafted=0, accepted=0, rounds=0, zero=0))
                for r in reqs:
                    st["drafted"] += r.drafted
                    st["accepted"] += r.accepted
                    st["rounds"] += r.rounds
                    st["zero"] += sum(1 for d, _ in r.history if d == 0)
                ok = all(r.generated == ref[tuple(r.prompt_ids)][:r.max_new_tokens] for r in reqs)
                identical[key] = identical.get(key, True) and ok
        log(f"[policies] repetition {rep + 1}/{g['reps']} done ({time.perf_counter() - t_run:.0f} s)")

    results = []
    for w, B in cells:
        tps = {label: [n / t for n, t in runs[(w, B, label)]] for label, _, _ in configs}
        base = statistics.median(tps["plain"])
        for label, pol_spec, k in configs:
            key = (w, B, label)
            st = stats[key]
            ratios = paired_ratios(tps[label], tps["plain"])
            results.append(dict(
                workload=w, batch=B, config=label, policy="control" if label == CONTROL else pol_spec or "off", k=k,
                tokens_per_s=statistics.median(tps[label]), speedup=statistics.median(ratios),
                speedup_min=min(ratios), speedup_max=max(ratios), speedups=ratios,
                speedup_of_medians=statistics.median(tps[label]) / base,
                acceptance_rate=st["accepted"] / st["drafted"] if st["drafted"] else None,
                mean_drafted=st["drafted"] / st["rounds"] if st["rounds"] else 0.0,
                off_share=st["zero"] / st["rounds"] if st["rounds"] else 1.0,
                identical=identical[key], adaptive=(pol_spec in ADAPTIVE)))
    report = dict(
        command="speclab bench " + " ".join(sys.argv[2:]), target=target.name, draft=draft_name,
        device=str(target.device), clock=args.clock, max_new_tokens=M, length_spread=spread,
        tokens_per_cell={f"{w}@{B}": sum(v) for (w, B), v in lengths.items()}, requests_per_cell=n_prompts,
        batches=levels, fixed_ks=g["fixed_ks"], K=K, reps=g["reps"], workloads=list(ids),
        calibration_s=calib_s, run_s=time.perf_counter() - t_run, costs=spec.costs.snapshot(),
        learnt_costs={label: t.snapshot() for label, t in tables.items() if t is not spec.costs}, rows=results)
    after = getattr(args, "after_grid", None)  # more runs on the same cells (benchmarks/policy_oracle.py)
    if after is not None and "mixed" in ids:
        fixed_labels = [label for label, p, _ in configs if p in (None, "fixed") and label != CONTROL]
        report.update(after(
            target, draft_name, results, [(label, k) for label, p, k in configs if label in fixed_labels],
            wls, dict(queue=queue, lengths=lengths, kinds=mixed_kinds, levels=levels, reps=g["reps"], seed=args.seed,
                 clock=clock, costs=spec.costs, log=log, ref=ref)))
    report["targets"] = policy_targets(report)
    return write_report(args, report, format_policies(report))


def paired_ratios(tps: list[float], plain: list[float]) -> list[float]:
    """Each repetition's throughput over plain decoding's in the same repetition: the quantity a lockstep run keeps
    tight (its configurations step a few milliseconds apart, so each repetition's ratio sees one speed of the
    machine). A cell's speedup is their median. The ratio of the two medians instead would pair a
    configuration's median repetition with plain's, often another repetition on a machine whose speed drifts by tens
    of percent between them. e.g. plain [100, 50, 90], a policy [105, 60, 80]: ratios [1.05, 1.2, 0.889], median
    1.05; the ratio of the medians, 80 / 90 = 0.889, is the third repetition's alone."""
    return [x / b for x, b in zip(tps, plain)]


def policy_targets(rep: dict) -> dict:
    """The benchmark's targets, computed from the rows (pure: tested on a hand-built report)."""
    rows = rep["rows"]
    by = {(r["workload"], r["batch"], r["config"]): r for r in rows}
    fixed = [r["config"] for r in rows if r["policy"] in ("fixed", "off")]
    fixed = list(dict.fromkeys(fixed))
    cells = list(dict.fromkeys((r["workload"], r["batch"]) for r in rows))
    t = {}
    if any(r["config"] == "goodput" for r in rows):
        worst = None
        for w, B in cells:
            best = max(fixed, key=lambda c: by[(w, B, c)]["speedup"])
            ratio = by[(w, B, "goodput")]["speedup"] / by[(w, B, best)]["speedup"]
            if worst is None or ratio < worst[0]:
                worst = (ratio, w, B, best)
        t["goodput_vs_best_fixed"] = dict(value=worst[0], goal=0.95, where=f"{worst[1]} batch {worst[2]}",
                                          best_fixed=worst[3])
        if any(w == "mixed" for w, _ in cells):
            levels = [B for w, B in cells if w == "mixed"]
            gm = {c: gmean(by[("mixed", B, c)]["speedup"] for B in levels) for c in fixed + ["goodput"]}
            best = max(fixed, key=gm.get)
            t["mixed_goodput_vs_best_single_k"] = dict(value=gm["goodput"] / gm[best], goal=1.0, strict=True,
                                                       best_fixed=best, goodput_gmean=gm["goodput"],
                                                       best_fixed_gmean=gm[best])
    adaptive = [r for r in rows if r["adaptive"]]
    if adaptive:
        low = min(adaptive, key=lambda r: r["speedup"])
        t["adaptive_vs_plain_floor"] = dict(value=low["speedup"], goal=0.97,
                                            where=f"{low['config']} on {low['workload']} batch {low['batch']}")
    control = [r for r in rows if r["policy"] == "control"]
    if control:  # not a goal: how far two identical configurations read apart, the cells' noise floor
        dev = sorted(abs(r["speedup"] - 1.0) for r in control)
        worst = max(control, key=lambda r: abs(r["speedup"] - 1.0))
        t["control_apart"] = dict(value=statistics.median(dev), goal="info", max=dev[-1],
                                  where=f"{worst['workload']} batch {worst['batch']} ({worst['speedup']:.3f}x)")
    oracle = rep.get("oracle")
    if oracle:  # not a goal: the most the mixed-stream target can ask of a policy that learns each row's kind
        labels = [c for c in oracle[0]["speedup"] if c != "kind-oracle"]
        gm = {c: gmean(o["speedup"][c] for o in oracle) for c in labels + ["kind-oracle"]}
        best = max(labels, key=gm.get)
        t["mixed_oracle_vs_best_single_k"] = dict(value=gm["kind-oracle"] / gm[best], goal="info", best_fixed=best,
                                                  oracle_gmean=gm["kind-oracle"], best_fixed_gmean=gm[best])
    t["all_identical"] = dict(value=all(r["identical"] for r in rows)
                              and all(o.get("identical", True) for o in oracle or []), goal=True)
    for v in t.values():
        if v["goal"] == "info":
            v["met"] = True
        elif isinstance(v["goal"], bool):
            v["met"] = v["value"] == v["goal"]
        elif v.get("strict"):
            v["met"] = v["value"] > v["goal"]
        else:
            v["met"] = v["value"] >= v["goal"]
    return t


def _budget_text(rep: dict) -> str:
    """The requests' token budgets as the header states them. e.g. '32 new tokens (each 16..48)'."""
    b = Budgets(rep["max_new_tokens"], rep.get("length_spread", 0.0))
    return f"{b.mean} new tokens" + (f" (each {b.lo}..{b.hi})" if b.spread else "")


def format_policies(rep: dict) -> str:
    rows = rep["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fixed = list(dict.fromkeys(r["config"] for r in rows if r["policy"] in ("fixed", "off")))
    by = {(r["workload"], r["batch"], r["config"]): r for r in rows}
    L = [f"target {rep['target']}  draft {rep['draft']}  device {rep['device']}  clock {rep['clock']}  "
         f"{_budget_text(rep)}  concurrency = batch, bursts of max({rep['requests_per_cell']}, "
         f"batch) + batch requests  "
         f"reps {rep['reps']}  adaptive K={rep['K']}  calibration {rep['calibration_s']:.1f} s (untimed)  "
         f"run {rep['run_s']:.0f} s",
         "speedup vs plain decoding (median over repetitions of each repetition's ratio); 'best' = best fixed k in "
         "hindsight (k=0 included); goodput/best; (mean drafted per round, share of rounds off) for adaptive policies",
         ""]
    w0 = max(8, *(len(c) for c in configs))
    for w in rep["workloads"]:
        L.append(f"[{w}]")
        L.append(f"{'batch':>6}{'plain tok/s':>12}" + "".join(f"{c:>{w0 + 1}}" for c in configs[1:]) +
                 f"{'best':>{w0 + 1}}{'gp/best':>8}")
        for B in rep["batches"]:
            if (w, B, "plain") not in by:
                continue
            line = f"{B:>6}{by[(w, B, 'plain')]['tokens_per_s']:>12.1f}"
            for c in configs[1:]:
                r = by[(w, B, c)]
                mark = "" if r["identical"] else "!"
                line += f"{r['speedup']:>{w0}.2f}{mark or ' '}"
            best = max(fixed, key=lambda c: by[(w, B, c)]["speedup"])
            gp = by.get((w, B, "goodput"))
            line += f"{best:>{w0 + 1}}" + (f"{gp['speedup'] / by[(w, B, best)]['speedup']:>8.2f}" if gp else "")
            L.append(line)
        ad = [c for c in configs if by[(w, rep["batches"][0], c)]["adaptive"]]
        if ad:
            L.append("   k/off: " + "; ".join(
                f"{c} " + " ".join(f"b{B}:{by[(w, B, c)]['mean_drafted']:.1f}/{by[(w, B, c)]['off_share']:.0%}"
                                   for B in rep["batches"]) for c in ad))
        L.append("")
    if rep.get("oracle"):
        cs = list(rep["oracle"][0]["speedup"])
        w1 = max(w0, *(len(c) for c in cs))
        L.append("[mixed, kind oracle: each request drafted at its workload's best fixed k above, "
                 "in its own lockstep run]")
        L.append(f"{'batch':>6}{'plain tok/s':>12}" + "".join(f"{c:>{w1 + 1}}" for c in cs[1:]) + "  oracle's k")
        for o in rep["oracle"]:
            L.append(f"{o['batch']:>6}{o['plain_tokens_per_s']:>12.1f}"
                     + "".join(f"{o['speedup'][c]:>{w1}.2f}{' ' if o.get('identical', True) else '!'}" for c in cs[1:])
                     + "  " + " ".join(f"{w}={k}" for w, k in o["ks"].items()))
        L.append("")
    for name, t in rep["targets"].items():
        v = t["value"]
        vs = f"{v:.3f}" if isinstance(v, float) else str(v)
        extra = {k: x for k, x in t.items() if k not in ("value", "goal", "met", "strict")}
        op = ">" if t.get("strict") else ">="
        said = "info" if t["goal"] == "info" else "MET" if t["met"] else "NOT MET"
        L.append(f"target {name:<32} {vs:>7}  goal {op} {t['goal']}  {said}  "
                 + ", ".join(f"{k}={x:.3f}" if isinstance(x, float) else f"{k}={x}" for k, x in extra.items()))
    return "\n".join(L)
