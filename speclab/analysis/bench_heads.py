"""``speclab bench heads``: self-drafting (EAGLE, Medusa, early exit) against the separate drafts and
prompt lookup, and token trees against chains at the same verification budget.

Every method decodes the same prompts per workload, greedy, batch 1, the same max_new_tokens; runs are
interleaved (every method on a prompt, then the next prompt; ``--reps`` rounds) after a recorded pass
that measures acceptance and checks every output token-identical to plain decoding. Medians per prompt.

Columns per (method, workload):

* ``len``: mean accepted length = accepted drafts / row rounds + 1 (the target's recovered or bonus
  token included), from the recorded pass;
* ``round ms``: cost per round = (median run time - median prefill time) / rounds, median over prompts;
  ``round/step``: the same in plain decode steps (plain decoding's time per token, same prompts);
* ``speedup``: plain decoding's total time over the method's (same tokens: outputs are identical).

``--exits`` measures early exit at every m (untuned, and tuned where a trained adapter exists): the
acceptance-vs-cost table behind :data:`speclab.drafters.early_exit.DEFAULT_EXIT`. ``--clock process``
times by this process's CPU time instead of the wall clock (with one thread, much steadier on a machine
shared with other jobs; it leaves out time spent waiting for a core).

    speclab bench heads --workload all --prompts-per-workload 4 --reps 3 --max-new-tokens 64 --out DIR
    speclab bench heads --exits --workload code,json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

SEPARATE_DRAFTS = ("draft-xs-distill", "draft-distill")


@dataclass(frozen=True)
class Method:
    name: str  # the row label
    spec: str  # a make_drafter spec ("none": plain decoding)
    k: int  # the round's budget: drafts for a chain, nodes for a tree
    group: str = ""  # "chain" / "tree" for the tree-vs-chain pairs, with the same ``pair`` label
    pair: str = ""
    policy: str | None = None  # a draft-length policy (speclab.engine.policies), k its largest k


def _has_head(name: str, target) -> bool:
    """A shipped head that was trained on this target."""
    from ..drafters.heads import load_head
    from ..errors import SpeclabError

    try:
        load_head(name, target)
    except SpeclabError:
        return False
    return True


def default_methods(target, k: int, budget: int, eagle_ks: tuple[int, ...] = ()) -> list[Method]:
    B = budget
    out = [Method("plain", "none", 0)]
    if _has_head("eagle", target):
        out += [Method(f"eagle k={e}", "eagle", e) for e in dict.fromkeys((k, *eagle_ks)) if e != B]
        out += [Method(f"eagle chain {B}", "eagle", B, "chain", "eagle"),
                Method(f"eagle tree {B}", f"eagle:tree=dynamic:nodes={B}", B, "tree", "eagle")]
    if _has_head("medusa", target):
        out += [Method(f"medusa k={min(k, 4)}", "medusa", min(k, 4)),
                Method(f"medusa chain {B}", "medusa", B, "chain", "medusa"),
                Method(f"medusa tree {B}", f"medusa:tree=dynamic:nodes={B}", B, "tree", "medusa")]
    from ..drafters.early_exit import DEFAULT_EXIT

    m = min(DEFAULT_EXIT, target.n_layers - 1)
    out.append(Method(f"early-exit k={k}", f"early-exit:{m}", k))
    if _has_head(f"exit-{m}", target):
        out.append(Method(f"early-exit tuned k={k}", f"early-exit:{m}:tuned", k))
    from pathlib import Path

    from ..family import DEFAULT_TARGET, resolve

    family_target = resolve(DEFAULT_TARGET)  # the separate drafts share its tokenizer, no other target's
    if family_target is not None and Path(target.path).resolve() == family_target.resolve() \
            and all(resolve(d) is not None for d in SEPARATE_DRAFTS):
        out += [Method(f"{d} k={k}", d, k) for d in SEPARATE_DRAFTS]
        out += [Method(f"{SEPARATE_DRAFTS[0]} chain {B}", SEPARATE_DRAFTS[0], B, "chain", SEPARATE_DRAFTS[0]),
                Method(f"{SEPARATE_DRAFTS[0]} tree {B}", f"{SEPARATE_DRAFTS[0]}:tree=dynamic:nodes={B}", B, "tree",
                       SEPARATE_DRAFTS[0])]
    out += [Method(f"ngram k={k}", "ngram", k),
            Method(f"ngram chain {B}", "ngram", B, "chain", "ngram"),
            Method(f"ngram tree {B}", f"ngram:tree=dynamic:nodes={B}", B, "tree", "ngram")]
    return out


def exit_methods(target, k: int) -> list[Method]:
    out = [Method("plain", "none", 0)]
    for m in range(1, target.n_layers):
        out.append(Method(f"exit m={m}", f"early-exit:{m}", k, "untuned", str(m)))
        if _has_head(f"exit-{m}", target):
            out.append(Method(f"exit m={m} tuned", f"early-exit:{m}:tuned", k, "tuned", str(m)))
    return out


def run_methods(target, methods: list[Method], workloads: list[str], n_prompts: int, max_new: int, reps: int,
                log=lambda *a: None, clock=time.perf_counter) -> list[dict]:
    """The interleaved runner: one row per (method, workload). ``clock``: wall time, or this process's CPU
    time (``time.process_time``: with one thread, steadier on a shared machine)."""
    from ..drafters import make_drafter
    from ..engine import SpeculativeDecoder, sync
    from ..workloads import load_workload

    dev = target.device
    decs = {m.name: SpeculativeDecoder(target, make_drafter(m.spec, target)) for m in methods}
    plain = decs[methods[0].name]
    rows = []
    for w in workloads:
        prompts = [target.encode(p.prompt) for p in load_workload(w)[:n_prompts]]
        stats = {m.name: dict(acc=0, drafted=0, row_rounds=0, rounds=[], identical=True, tokens=0,
                              times=[[] for _ in prompts]) for m in methods}
        pre = [[] for _ in prompts]
        ref = []
        for i, ids in enumerate(prompts):  # recorded pass: acceptance, rounds, identity (also the warm-up)
            for m in methods:
                r = decs[m.name].generate([ids], k=m.k, max_new_tokens=max_new, policy=m.policy)
                c, s = r.recorder.counters(), stats[m.name]
                if m is methods[0]:
                    ref.append(r.output_tokens[0])
                s["identical"] &= r.output_tokens[0] == ref[i]
                s["acc"] += c["accepted"]
                s["drafted"] += c["drafted"]
                s["row_rounds"] += c["row_rounds"]
                s["rounds"].append(max(1, c["row_rounds"]))
                s["tokens"] += len(r.output_tokens[0])
        for _ in range(reps):
            for i, ids in enumerate(prompts):
                sync(dev)
                t0 = clock()
                plain.generate([ids], k=0, max_new_tokens=1, record=False)  # prefill + first token
                sync(dev)
                pre[i].append(clock() - t0)
                for m in methods:
                    sync(dev)
                    t0 = clock()
                    decs[m.name].generate([ids], k=m.k, max_new_tokens=max_new, record=False, policy=m.policy)
                    sync(dev)
                    stats[m.name]["times"][i].append(clock() - t0)
        pre_med = [statistics.median(p) for p in pre]
        base = stats[methods[0].name]
        base_t = [statistics.median(t) for t in base["times"]]
        step = statistics.median((base_t[i] - pre_med[i]) / max(1, len(ref[i]) - 1) for i in range(len(prompts)))
        for m in methods:
            s = stats[m.name]
            med = [statistics.median(t) for t in s["times"]]
            per_round = statistics.median((med[i] - pre_med[i]) / s["rounds"][i] for i in range(len(prompts)))
            rows.append(dict(method=m.name, spec=m.spec, k=m.k, policy=m.policy, group=m.group, pair=m.pair, workload=w,
                             mean_accepted_length=s["acc"] / s["row_rounds"] + 1 if s["row_rounds"] else None,
                             acceptance_rate=s["acc"] / s["drafted"] if s["drafted"] else None,
                             rounds=sum(s["rounds"]), tokens=s["tokens"], tokens_per_s=s["tokens"] / sum(med),
                             cost_per_round_ms=per_round * 1e3, cost_per_round_steps=per_round / step,
                             speedup=sum(base_t) / sum(med), identical=s["identical"]))
        log(f"[heads] {w}: done")
    return rows


def _row(rows, method, w):
    return next((r for r in rows if r["method"] == method and r["workload"] == w), None)


def targets(rows: list[dict], workloads: list[str], k: int, budget: int) -> dict:
    """The heads benchmark's targets, computed from the rows."""
    t: dict = {}
    eagle = f"eagle k={k}"
    for w in ("json", "code"):
        e = _row(rows, eagle, w)
        seps = [r for r in (_row(rows, f"{d} k={k}", w) for d in SEPARATE_DRAFTS) if r]
        if e and seps:
            best = max(seps, key=lambda r: r["mean_accepted_length"])
            t[f"eagle_len_{w}"] = dict(value=e["mean_accepted_length"], goal=f">= {best['method']} "
                                       f"{best['mean_accepted_length']:.2f}",
                                       met=e["mean_accepted_length"] >= best["mean_accepted_length"])
            t[f"eagle_round_cost_{w}"] = dict(value=e["cost_per_round_ms"], goal=f"< {best['method']} "
                                              f"{best['cost_per_round_ms']:.2f} ms",
                                              met=e["cost_per_round_ms"] < best["cost_per_round_ms"])
    eagles = [r for r in rows if r["method"].startswith("eagle") and r["workload"] == "code"]
    if eagles:
        best = max(eagles, key=lambda r: r["speedup"])
        t["eagle_speedup_code"] = dict(value=best["speedup"], goal=">= 1.5", method=best["method"],
                                       met=best["speedup"] >= 1.5)
    for pair in sorted({r["pair"] for r in rows if r["group"] == "tree"}):
        wins = {}
        for w in workloads:
            c = next((r for r in rows if r["pair"] == pair and r["group"] == "chain" and r["workload"] == w), None)
            tr = next((r for r in rows if r["pair"] == pair and r["group"] == "tree" and r["workload"] == w), None)
            if c and tr:
                wins[w] = (round(tr["mean_accepted_length"], 3), round(c["mean_accepted_length"], 3))
        if wins:
            t[f"tree_beats_chain_{pair}"] = dict(value=wins, goal=f"tree {budget} > chain {budget} on every workload",
                                                 met=all(a > b for a, b in wins.values()))
    t["all_identical"] = dict(value=all(r["identical"] for r in rows), goal=True,
                              met=all(r["identical"] for r in rows))
    return t


def format_rows(rows: list[dict], workloads: list[str]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    w0 = max(len(m) for m in methods) + 2
    L = [f"{'method':<{w0}}" + "".join(f"{w:>26}" for w in workloads) + f"{'ident':>7}",
         f"{'':<{w0}}" + "".join(f"{'len  round ms(steps)  x':>26}" for _ in workloads)]
    for m in methods:
        cells, ok = "", True
        for w in workloads:
            r = _row(rows, m, w)
            ok &= r["identical"]
            ln = "-" if r["k"] == 0 else f"{r['mean_accepted_length']:.2f}"
            cells += f"{ln:>6} {r['cost_per_round_ms']:>7.2f} ({r['cost_per_round_steps']:.2f}) {r['speedup']:>5.2f}"
        L.append(f"{m:<{w0}}{cells}{('yes' if ok else 'NO'):>7}")
    return "\n".join(L)


def format_targets(t: dict) -> str:
    L = []
    for name, v in t.items():
        val = round(v["value"], 3) if isinstance(v["value"], float) else json.dumps(v["value"])
        how = f" ({v['method']})" if "method" in v else ""
        L.append(f"{name:<28} {val!s:<60} goal {v['goal']}: {'met' if v['met'] else 'MISSED'}{how}")
    return "\n".join(L)


def best_exit(rows: list[dict]) -> dict:
    """Per (m, tuned or not): mean accepted length, round cost and speedup averaged over the workloads; the
    best by speedup."""
    by: dict = {}
    for r in rows:
        if r["k"] == 0:
            continue
        by.setdefault((r["pair"], r["group"]), []).append(r)
    table = [dict(m=int(m), kind=g, mean_accepted_length=statistics.mean(x["mean_accepted_length"] for x in rs),
                  cost_per_round_steps=statistics.mean(x["cost_per_round_steps"] for x in rs),
                  speedup=statistics.mean(x["speedup"] for x in rs)) for (m, g), rs in sorted(by.items())]
    return {"table": table, "best": max(table, key=lambda r: r["speedup"]) if table else None}


HEADS_PROMPTS, HEADS_REPS = 4, 3  # defaults: prompts per workload, interleaved repetitions


def run_heads_bench(args) -> int:
    from ..defaults import setup_threads
    from ..models import load_model
    from ..workloads import workload_names

    args.prompts_per_workload = args.prompts_per_workload or HEADS_PROMPTS
    args.reps = args.reps or HEADS_REPS
    torch.manual_seed(0)
    target = load_model(args.target or "target", device=args.device, role="target")
    setup_threads(args.threads or 1, target)
    wls = workload_names(args.workload)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    eks = tuple(int(x) for x in str(args.ks).split(",") if x.strip())  # --k: the first is every chain's k
    k, B = eks[0], args.budget
    methods = exit_methods(target, k) if args.exits else default_methods(target, k, B, eks)
    if args.methods:
        keep = {s.strip() for s in args.methods.split(",")}
        methods = [m for m in methods if m.name in keep or m.name == "plain"]
    log(f"[heads] {len(methods)} methods: " + ", ".join(m.name for m in methods))
    t0 = time.time()
    clock_name = args.clock
    clock = time.process_time if clock_name == "process" else time.perf_counter
    rows = run_methods(target, methods, wls, args.prompts_per_workload, args.max_new_tokens, args.reps, log, clock)
    report = dict(command="speclab bench " + " ".join(sys.argv[2:]), target=target.name, device=str(target.device),
                  threads=torch.get_num_threads(), clock=clock_name, k=k, budget=B, max_new_tokens=args.max_new_tokens,
                  prompts_per_workload=args.prompts_per_workload, reps=args.reps, workloads=wls,
                  methods=[asdict(m) for m in methods], rows=rows, wall_seconds=round(time.time() - t0, 1))
    print(f"target {target.name}, greedy, batch 1, {args.prompts_per_workload} prompts x {args.max_new_tokens} "
          f"tokens per workload, {args.reps} interleaved reps (medians, {clock_name} clock); len = accepted/round + 1; "
          f"round cost in ms and in plain decode steps; x = speedup over plain decoding")
    print(format_rows(rows, wls))
    if args.exits:
        report["exits"] = best_exit(rows)
        print("\nearly exit by m (means over workloads):")
        for r in report["exits"]["table"]:
            print(f"  m={r['m']} {r['kind']:<8} len {r['mean_accepted_length']:.2f}  round "
                  f"{r['cost_per_round_steps']:.2f} steps  speedup {r['speedup']:.2f}")
        if report["exits"]["best"]:
            b = report["exits"]["best"]
            print(f"best: m={b['m']} ({b['kind']})")
    else:
        report["targets"] = targets(rows, wls, k, B)
        print("\n" + format_targets(report["targets"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0
