"""``speclab bench synthetic``: the (acceptance, k, batch) landscape against the cost model.

The synthetic drafter (``synthetic:ALPHA:C``) at every (alpha, k, batch), greedy,
EOS ignored (every row emits exactly ``--max-new-tokens``), prompts cut to their first 32 tokens,
each against plain decoding at the same batch. The decode-phase speedup (a prefill-only run
subtracted from both) is compared with the cost model: the number of rounds, the active rows and the widest draft
w per round follow exactly from alpha, k and the budget (:func:`round_plan`), and a round of n rows at width w
costs what it costs in the decode loop, measured by calibration batches that accept nothing (alpha 0, one per k;
:func:`round_times_from_calibration`) and the plain runs (w = 0). Beside it: the prediction from a round's parts
timed apart, C*w*t(n,1) (the synthetic draft's burn) + t(n, w+1) (verify) + o(n) (per-round host work; t from
target forwards timed between the runs of every repetition, o(n) from the plain runs), the prediction at the
acceptance the draws realized (:func:`draws`), and Leviathan et al.'s formula with the measured verify cost,
E[tokens]/(k C + v). Every configuration runs interleaved step by step in a fresh random order each cycle.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from .bench_runs import (
    PROMPT_TOKENS,
    SYNTH,
    clock_named,
    grid,
    interleave,
    logger,
    mixed_prompts,
    rate_list,
    setup,
    write_report,
)
from .round_plan import draws, parts_round_time, predict_decode_time, round_times_from_calibration, widths_line


def run_synthetic(args) -> int:
    from ..drafters.synthetic import SyntheticDrafter
    from ..engine import SpeculativeDecoder
    from ..engine.costs import OnlineCosts, calibration_rows, interpolate, time_shapes
    from ..workloads import workload_names
    from .costmodel import expected_speedup
    from .sweep import batches

    g = grid(args, synthetic=True)
    log = logger(args)
    clock = clock_named(args.clock)
    target, _ = setup(args)
    alphas = rate_list(args.alphas, SYNTH["alphas"], "--alphas")
    ks, levels = g["fixed_ks"], g["batches"]
    c, M, n_prompts = args.cost, g["max_new_tokens"], g["prompts"]
    # prompts cut to their first PROMPT_TOKENS tokens: the text does not matter to a synthetic draft, and short
    # prompts keep the prefill (subtracted from every run) small next to the decode phase being measured
    prompts = [target.encode(p)[:PROMPT_TOKENS] for p in mixed_prompts(workload_names(g["workload"]))]
    groups = {B: batches(prompts, B, max(B, n_prompts)) for B in levels}
    used = list({tuple(p): list(p) for gs in groups.values() for grp in gs for p in grp}.values())

    # ---- untimed: oracles, the draft's cost unit (a target step per row count), warm-up
    t0 = time.perf_counter()
    lens = sorted(len(p) for p in used)
    ctx = lens[len(lens) // 2] + M // 2
    rows, widths = calibration_rows(*levels), tuple(range(1, max(ks) + 2))
    burn = OnlineCosts()
    burn.calibrate(target, None, rows=rows, tokens=(1,), context=ctx, clock=clock, reps=5)
    # calibration runs, not cells: the prefill alone, plain decoding, and batches that accept nothing (alpha 0, one
    # per k: every round drafts k tokens a row and emits one, so their rounds are known exactly and their times give
    # a round's time at each width, round_times_from_calibration)
    calib = [("prefill", None, 0), ("plain", None, 0)] + [(f"calib-k{k}", 0.0, k) for k in ks]
    configs = calib + [(f"a{a}-k{k}", a, k) for a in alphas for k in ks]
    # one drafter per configuration, by label: configurations run side by side, each row with its own draws
    plain = SpeculativeDecoder(target, None)
    decs, oracle = {}, None
    for label, a, k in configs:
        if a is None:
            continue
        d = SyntheticDrafter(target, a, c)
        if oracle is None:
            d.prepare(used, M, rows=())
            oracle = d.oracle
        d.oracle = oracle  # one oracle per prompt for every configuration
        d.step_costs, d.context, d.clock = burn, ctx, clock  # one cost unit for all, on the bench's clock
        decs[label] = SpeculativeDecoder(target, d)
    for B in levels:
        grp = groups[B][0]
        plain.generate(grp, k=0, max_new_tokens=4, record=False, stop_on_eos=False)
        decs[configs[-1][0]].generate(grp, k=max(ks), max_new_tokens=4, record=False, stop_on_eos=False)
    prep_s = time.perf_counter() - t0
    log(f"[synthetic] oracles, step costs and warm-up in {prep_s:.1f} s (not timed)")

    times: dict[tuple, list[float]] = {}
    ident: dict[tuple, bool] = {}
    acc: dict[tuple, list[int]] = {}
    shapes = []  # per repetition: target forward times by (rows, tokens), timed between the runs
    t_run = time.perf_counter()
    order = random.Random(args.seed)
    for rep in range(g["reps"]):
        for B in levels:
            # every configuration of a group runs interleaved step by step (:func:`interleave`): this machine's
            # speed drifts by tens of percent over seconds, so configurations run one after another measured
            # speedups whose repetitions disagreed by 24% in the median cell
            spent = {label: 0.0 for label, _, _ in configs}
            outs = {label: [] for label, _, _ in configs}
            counts = {label: [0, 0, 0] for label, _, _ in configs}  # drafted, accepted, draws (realized_alpha)
            for i, grp in enumerate(groups[B]):
                runs = [(plain if a is None else decs[label]).scheduler(
                    grp, k=k, max_new_tokens=1 if label == "prefill" else M, seed=args.seed + i, stop_on_eos=False)
                    for label, a, k in configs]
                took = interleave([sched for sched, _ in runs], clock, shuffle=order)
                for (label, _, _), (_, reqs), t in zip(configs, runs, took):
                    spent[label] += t
                    outs[label].append([list(r.generated) for r in reqs])
                    counts[label][0] += sum(r.drafted for r in reqs)
                    counts[label][1] += sum(r.accepted for r in reqs)
                    counts[label][2] += sum(draws(r.history) for r in reqs)
            for label, _, _ in configs:
                times.setdefault((B, label), []).append(spent[label])
                acc[(B, label)] = counts[label]
                if label != "prefill":
                    ident[(B, label)] = ident.get((B, label), True) and outs[label] == outs["plain"]
        shapes.append(time_shapes(target, rows, widths, ctx, 3, clock=clock, plain_apart=False))
        log(f"[synthetic] repetition {rep + 1}/{g['reps']} done ({time.perf_counter() - t_run:.0f} s)")

    # ---- the model: forwards timed in every repetition (median), per-round overhead o(B) from the plain runs
    table = OnlineCosts()
    table.set_calibrated({key: statistics.median(sh[key] for sh in shapes) for key in shapes[0]})
    med = {key: statistics.median(v) for key, v in times.items()}
    over = {}
    for B in levels:
        G = len(groups[B])
        per_round = (med[(B, "plain")] - med[(B, "prefill")]) / (G * (M - 1))
        over[B] = max(per_round - table.target_time(B, 1), 0.0)
    lv = sorted(over)

    def overhead(n):
        return interpolate(lv, lambda b: over[b], n) or 0.0

    def forward(n, T):
        return table.target_time(n, T)

    def unit(n):
        return burn.target_time(n, 1)

    parts = parts_round_time(c, forward, overhead, draft=unit)
    # the cost model: a round's time at n rows and width w, measured in the loop by the calibration batches that
    # accept nothing (their rounds are known exactly; acceptance changes how many rounds a batch takes, not what one
    # costs), between the batch sizes by interpolation
    per_width = {}
    for B in levels:
        G = len(groups[B])
        plain_round = (med[(B, "plain")] - med[(B, "prefill")]) / (G * (M - 1))
        per_width[B] = round_times_from_calibration(
            plain_round, {k: (med[(B, f"calib-k{k}")] - med[(B, "prefill")]) / G for k in ks}, M - 1)

    def round_time(n, w):
        return interpolate(lv, lambda b: widths_line(per_width[b], w), n)

    cells = []
    for B in levels:
        G = len(groups[B])
        dec_plain = med[(B, "plain")] - med[(B, "prefill")]
        for label, a, k in configs[len(calib):]:
            dec_spec = med[(B, label)] - med[(B, "prefill")]
            measured = dec_plain / dec_spec
            predicted = dec_plain / (G * predict_decode_time(a, k, B, M - 1, round_time))
            from_parts = dec_plain / (G * predict_decode_time(a, k, B, M - 1, parts))
            v = forward(B, k + 1) / forward(B, 1)
            d_n, a_n, n_draws = acc[(B, label)]
            realized = a_n / n_draws if n_draws else a
            at_realized = dec_plain / (G * predict_decode_time(realized, k, B, M - 1, round_time))
            # the cell's own repeatability: its speedup in each repetition (the same prefill subtracted)
            per_rep = [(p - f) / (x - f) for p, f, x in zip(times[(B, "plain")], times[(B, "prefill")],
                                                            times[(B, label)])]
            spread = max(abs(r / measured - 1) for r in per_rep)
            cells.append(dict(alpha=a, k=k, batch=B, measured_speedup=measured, predicted_speedup=predicted,
                              error=predicted / measured - 1, leviathan_v_speedup=expected_speedup(a, k, c, v),
                              parts_predicted_speedup=from_parts, parts_error=from_parts / measured - 1,
                              realized_alpha=realized, predicted_at_realized=at_realized,
                              error_at_realized=at_realized / measured - 1,
                              verify_cost_v=v, overhead_ms=over[B] * 1e3,
                              measured_acceptance=a_n / d_n if d_n else None,
                              rep_speedups=per_rep, rep_spread=spread,
                              identical=ident[(B, label)]))
    cross = {}
    for a in alphas:
        for k in ks:
            lose = [x["batch"] for x in cells if x["alpha"] == a and x["k"] == k and x["measured_speedup"] < 1.0]
            cross[f"{a}:{k}"] = min(lose) if lose else None
    def to_crossover(x):
        cx = cross[f"{x['alpha']}:{x['k']}"]
        return cx is None or x["batch"] <= cx

    upto = [x for x in cells if to_crossover(x)]
    worst = max(upto, key=lambda x: abs(x["error"]))
    report = dict(command="speclab bench " + " ".join(sys.argv[2:]), target=target.name, device=str(target.device),
                  clock=args.clock, cost=c, max_new_tokens=M, prompts_per_cell=n_prompts, batches=levels,
                  alphas=alphas, ks=ks, reps=g["reps"], prepare_s=prep_s, run_s=time.perf_counter() - t_run,
                  step_costs=table.snapshot()["calibrated_target"],
                  overhead_ms={str(b): o * 1e3 for b, o in over.items()},
                  round_ms={str(b): {str(w): t * 1e3 for w, t in per_width[b].items()} for b in levels},
                  calibration_identical=all(ident[(B, f"calib-k{k}")] for B in levels for k in ks),
                  cells=cells, crossover_batch=cross,
                  targets=dict(
                      model_error_to_crossover=dict(value=abs(worst["error"]), goal=0.15, lower_is_better=True,
                                                    where=f"alpha {worst['alpha']} k {worst['k']} "
                                                          f"batch {worst['batch']}",
                                                    met=abs(worst["error"]) <= 0.15),
                      model_error_all=dict(value=max(abs(x["error"]) for x in cells), goal=0.15, lower_is_better=True,
                                           met=max(abs(x["error"]) for x in cells) <= 0.15),
                      cells_within_15pct=dict(value=f"{sum(abs(x['error']) <= 0.15 for x in upto)}/{len(upto)}",
                                              goal="all", met=all(abs(x["error"]) <= 0.15 for x in upto)),
                      # not the goal (that is at the alpha asked for): the model at the acceptance the draws realized
                      cells_within_15pct_at_realized_alpha=dict(
                          value=f"{sum(abs(x['error_at_realized']) <= 0.15 for x in upto)}/{len(upto)} (worst "
                                f"{max(abs(x['error_at_realized']) for x in upto):.1%})", goal="info", met=True),
                      # not a goal: how well the measurement agrees with itself (every repetition within 15% of
                      # the cell's median); a model cannot be held to less than this
                      cells_repeatable_15pct=dict(value=f"{sum(x['rep_spread'] <= 0.15 for x in upto)}/{len(upto)}",
                                                  goal="info", met=True),
                      all_identical=dict(value=all(x["identical"] for x in cells), goal=True,
                                         met=all(x["identical"] for x in cells))))
    return write_report(args, report, format_synthetic(report))


def format_synthetic(rep: dict) -> str:
    L = [f"target {rep['target']}  device {rep['device']}  clock {rep['clock']}  synthetic draft cost "
         f"C={rep['cost']}  {rep['max_new_tokens']} new tokens (EOS ignored)  {rep['prompts_per_cell']} "
         f"prompts/cell  reps {rep['reps']}  "
         f"prepare {rep['prepare_s']:.1f} s (untimed)  run {rep['run_s']:.0f} s",
         "decode-phase speedup vs plain: measured / cost model (error = predicted/measured - 1) / Leviathan with "
         "measured verify cost v", ""]
    L.append(f"{'alpha':>6}{'k':>3}" + "".join(f"{'b' + str(B):>22}" for B in rep["batches"]) + f"{'crossover':>11}")
    by = {(x["alpha"], x["k"], x["batch"]): x for x in rep["cells"]}
    for a in rep["alphas"]:
        for k in rep["ks"]:
            line = f"{a:>6}{k:>3}"
            for B in rep["batches"]:
                x = by[(a, k, B)]
                mark = "" if x["identical"] else "!"
                line += f"{x['measured_speedup']:>8.2f}/{x['predicted_speedup']:.2f}({x['error']:+.0%})/" \
                        f"{x['leviathan_v_speedup']:.2f}{mark}".rjust(22)
            cx = rep["crossover_batch"][f"{a}:{k}"]
            L.append(line + f"{cx if cx is not None else '-':>11}")
    L.append("")
    L.append("per-round overhead o(batch), ms: " + ", ".join(f"b{b}: {o:.3f}" for b, o in rep["overhead_ms"].items()))
    if "round_ms" in rep:
        L.append("a round's time by width w, ms (plain runs and the alpha-0 calibration): " + "; ".join(
            f"b{b}: " + " ".join(f"w{w} {t:.2f}" for w, t in ws.items()) for b, ws in rep["round_ms"].items()))
        errs = sorted(abs(x["parts_error"]) for x in rep["cells"])
        L.append(f"the model from parts timed apart (forwards + burn + o(batch)): {sum(e <= 0.15 for e in errs)}"
                 f"/{len(errs)} cells within 15%, worst {errs[-1]:.0%}")
    spreads = sorted(x["rep_spread"] for x in rep["cells"])
    L.append(f"repeatability: each cell's repetitions differ from its median speedup by up to {spreads[0]:.0%} .. "
             f"{spreads[-1]:.0%} (median cell {spreads[len(spreads) // 2]:.0%})")
    for name, t in rep["targets"].items():
        v = t["value"]
        vs = f"{v:.3f}" if isinstance(v, float) else str(v)
        op = "<=" if t.get("lower_is_better") else ">="
        verdict = "info" if t["goal"] == "info" else ("MET" if t["met"] else "NOT MET")
        L.append(f"target {name:<28} {vs:>7}  goal {op} {t['goal']}  {verdict}"
                 + (f"  worst at {t['where']}" if "where" in t else ""))
    return "\n".join(L)
