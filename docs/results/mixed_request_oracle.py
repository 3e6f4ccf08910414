"""At one row on the mixed stream: a per-request oracle (each request at its own best k, found by timing it alone at
k = 0..4 in lockstep) beside the kind oracle and every fixed k (session 44)."""
import argparse
import random
import statistics
import sys

from speclab.analysis.bench_runs import lockstep, mixed_stream, setup
from speclab.analysis.kind_oracle import KindOracle
from speclab.analysis.sweep import cached_model
from speclab.drafters import make_drafter
from speclab.engine import Choice, Fixed, Off
from speclab.engine.costs import calibration_clock
from speclab.load.shapes import spread_lengths

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
target, draft_name = setup(argparse.Namespace(target="target", device="cpu", threads=1, draft=None))
kinds, texts = map(list, zip(*mixed_stream(["json", "code"])))
ids = [target.encode(p) for p in texts]
B = 1
n = max(4, B) + B
queue = [ids[i % len(ids)] for i in range(n)]
qk = [kinds[i % len(ids)] for i in range(n)]
lengths = spread_lengths(32, n, 0.5, f"0-mixed-{B}")
clock = calibration_clock(target.device, 1)
order = random.Random(0)
KS = (0, 1, 2, 3, 4)
dr = {k: make_drafter(draft_name, target, load=cached_model) if k else None for k in KS}
best = {}
for i in range(n):
    t = {k: [] for k in KS}
    for _ in range(5):
        out = lockstep(target, [(dr[k], Fixed(k) if k else Off()) for k in KS], [queue[i]], 1, [lengths[i]], None, 0,
                       clock, shuffle=order)
        for k, (ntok, s, _) in zip(KS, out):
            t[k].append(ntok / s)
    med = {k: statistics.median(v) for k, v in t.items()}
    best[f"bench-{i}"] = max(KS, key=med.get)
    print(i, qk[i], lengths[i], {k: round(v / med[0], 3) for k, v in med.items()}, "best k", best[f"bench-{i}"])


class PerRequest:
    name = "request-oracle"

    def __init__(self, ks):
        self.ks, self.k_max = ks, 4

    def choose(self, view):
        return [Choice(self.ks.get(r.request_id, 0), "request oracle") for r in view.rows]

    def draft_stop(self):
        return None


configs = [("plain", None, Off()), ("fixed-1", 1, Fixed(1)), ("fixed-2", 2, Fixed(2)), ("fixed-4", 4, Fixed(4)),
           ("kind-oracle", 4, KindOracle({f"bench-{i}": qk[i] for i in range(n)}, {"json": 4, "code": 0})),
           ("request-oracle", 4, PerRequest(best))]
drafters = [make_drafter(draft_name, target, load=cached_model) if k else None for _, k, _ in configs]
tps = {c: [] for c, _, _ in configs}
for _ in range(reps):
    out = lockstep(target, [(d, p) for d, (_, _, p) in zip(drafters, configs)], queue, 1, lengths, None, 0, clock,
                   shuffle=order)
    for (c, _, _), (ntok, s, _) in zip(configs, out):
        tps[c].append(ntok / s)
for c in tps:
    r = [a / b for a, b in zip(tps[c], tps["plain"])]
    print(f"{c:15s} median ratio {statistics.median(r):.3f}  {[round(x, 2) for x in r]}")
