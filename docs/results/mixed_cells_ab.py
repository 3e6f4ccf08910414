"""The policies benchmark's cells of one workload (default: the mixed stream) alone, in lockstep, for quick A/Bs of
goodput variants (session 44; a record of how mixed_first_look_ab.txt was measured, not a speclab command).

    python docs/results/mixed_cells_ab.py BATCH REPS [VARIANTS] [WORKLOAD]

Configurations: plain, fixed-1, fixed-2, fixed-4, goodput, then each comma-separated variant: 'nolook' (goodput
without the first look; needs first_look_tried.diff), 'tol:X' (needs k_tolerance_tried.diff), 'logit' / 'chain'
(goodput with that position prior), 'oracle-J/C' (JSON rows at k = J, code rows at k = C: the first version of
speclab.analysis.kind_oracle). The queue, budgets and lockstep are the benchmark's (seed 0); SHOW=1 prints goodput's
weighed reasons. The reproducible measure of the kind oracle is `speclab bench --policies --oracle`."""

import argparse
import os
import random
import statistics
import sys

from speclab.analysis.bench_runs import lockstep, mixed_stream, setup
from speclab.analysis.kind_oracle import KindOracle
from speclab.analysis.sweep import cached_model
from speclab.drafters import make_drafter
from speclab.engine import SpeculativeDecoder, make_policy
from speclab.engine.costs import ROBUST_REPS, ROBUST_STAT, calibration_clock, calibration_rows
from speclab.engine.policies.goodput import Goodput
from speclab.engine.policies.tracker import AcceptanceTracker
from speclab.load.shapes import spread_lengths
from speclab.workloads import load_workload

SHOW = os.environ.get("SHOW")
B, reps = int(sys.argv[1]), int(sys.argv[2])
variants = [v for v in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if v]
WL = sys.argv[4] if len(sys.argv) > 4 else "mixed"
target, draft_name = setup(argparse.Namespace(target="target", device="cpu", threads=1, draft=None))
if WL == "mixed":
    kinds, texts = map(list, zip(*mixed_stream(["json", "code"])))
else:
    texts = [p.prompt for p in load_workload(WL)]
    kinds = [WL] * len(texts)
ids = [target.encode(p) for p in texts]
n = max(4, B) + B
queue = [ids[i % len(ids)] for i in range(n)]
lengths = spread_lengths(32, n, 0.5, f"0-{WL}-{B}")
drafter0 = make_drafter(draft_name, target, load=cached_model)
spec = SpeculativeDecoder(target, drafter0)
spec.costs.calibrate(target, drafter0, rows=calibration_rows(1, 4, 16, 64), tokens=(1, 2, 3, 4, 5), context=120,
                     reps=ROBUST_REPS, stat=ROBUST_STAT, clock=calibration_clock(target.device, 1))
configs = [("plain", None, 0), ("fixed-1", "fixed", 1), ("fixed-2", "fixed", 2), ("fixed-4", "fixed", 4),
           ("goodput", "goodput", 4)] + [(v, v, 4) for v in variants]


def make(label, spec_name, k):
    if label.startswith("oracle"):
        kj, kc = (int(x) for x in label.split("-")[1].split("/"))
        return KindOracle({f"bench-{i}": kinds[i % len(kinds)] for i in range(n)}, {"json": kj, "code": kc})
    if label == "nolook":
        return Goodput(k_max=4, first_look=False)
    if label.startswith("tol:"):
        return Goodput(k_max=4, k_tolerance=float(label[4:]))
    if label in ("logit", "chain"):
        g = Goodput(k_max=4)
        g.tracker = AcceptanceTracker(4, position_prior=label)
        return g
    return make_policy(spec_name, k)


pols = {label: make(label, p, k) for label, p, k in configs if p}
log = []
goodput, weigh = pols["goodput"], pols["goodput"].choose


def logged(view):
    out = weigh(view)
    if out:
        log.append((len(view.rows), out[0].reason, [round(x, 2) for x in goodput.tracker.population()]))
    return out


goodput.choose = logged
tables = {label: spec.costs.copy() if p not in (None, "fixed") else spec.costs for label, p, _ in configs}
drafters = {label: make_drafter(draft_name, target, load=cached_model) if p else None for label, p, _ in configs}
order = random.Random(0)
tps = {label: [] for label, _, _ in configs}
for rep in range(reps):
    out = lockstep(target, [(drafters[label], pols.get(label)) for label, _, _ in configs], queue, B, lengths,
                   [tables[label] for label, _, _ in configs], 0, calibration_clock(target.device, 1), shuffle=order)
    for rows, why, pop in log if SHOW else []:
        print("  rep", rep, rows, why, pop)
    log.clear()
    for (label, _, _), (ntok, spent, _) in zip(configs, out):
        tps[label].append(ntok / spent)
for label, v in tps.items():
    ratios = [a / b for a, b in zip(v, tps["plain"])]
    print(f"{label:10s} median ratio {statistics.median(ratios):.3f}  {[round(x, 2) for x in ratios]}")
