"""Issue 13's throughput check applied to the A/A control: how often does a server identical to plain reach
0.95x the better of plain and fixed k, in the cells where plain is the better one? Several runs: each, then
all pooled.

An adaptive server can at best be the better of the two in each cell. Where that is plain, the control (a second
plain server, in the same rotation) is such a server, so the share of those cells it misses is how often the
check fails a policy that chose perfectly.
Run: .venv/bin/python docs/results/control_as_adaptive.py RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys

from speclab.analysis.serve_judge import rep_ratios


def one(path: str, target: float = 0.95) -> tuple[list[float], list[bool]]:
    r = json.load(open(path))
    by = {(c["server"], c["workload"], c["concurrency"]): c for c in r["cells"] if not c.get("split")}
    control = [c for c in r["cells"] if c.get("control") and not c.get("split")]
    if not control:
        print(f"{path}: no control cells (run with --control)")
        return [], []
    print(f"\n{path}")
    plain, fixed = "speclab plain", f"speclab fixed k={r['settings']['k']}"
    rows, misses = [], 0
    print(f"{'workload':10} {'c':>3} {'plain':>8} {'fixed':>8} {'control':>8} {'ctl/best':>8} {'paired med':>10}")
    for c in sorted(control, key=lambda c: (c["workload"], c["concurrency"])):
        p, f = by[(plain, c["workload"], c["concurrency"])], by[(fixed, c["workload"], c["concurrency"])]
        if p["tok_s"] < f["tok_s"]:
            continue  # fixed k is the better: no copy of it ran
        ratio = c["tok_s"] / max(p["tok_s"], f["tok_s"])
        paired = rep_ratios(c.get("tok_s_reps"), [p.get("tok_s_reps"), f.get("tok_s_reps")])
        med = statistics.median_low(paired) if paired else None
        rows.append(ratio)
        misses += ratio < target
        print(f"{c['workload']:10} {c['concurrency']:3d} {p['tok_s']:8.1f} {f['tok_s']:8.1f} {c['tok_s']:8.1f} "
              f"{ratio:8.3f} {med if med is None else round(med, 3)!s:>10}")
    print(f"\nplain the better in {len(rows)} of {len(control)} cells; the control (a copy of plain) reached "
          f"{target}x the better of plain and fixed in {len(rows) - misses} of them "
          f"(median {statistics.median(rows):.3f}, lowest {min(rows):.3f})")
    adaptive = [t for t in r["checks"]["throughput"] if t["plain_tok_s"] >= (t["fixed_tok_s"] or 0)]
    print(f"adaptive servers in the same cells: {sum(t['ok'] for t in adaptive)} of {len(adaptive)} at {target}x")
    return rows, [t["ok"] for t in adaptive]


def main(paths: list[str], target: float = 0.95) -> None:
    ctl, ada = [], []
    for path in paths:
        c, a = one(path, target)
        ctl += c
        ada += a
    if len(paths) > 1 and ctl:
        hits = sum(x >= target for x in ctl)
        print(f"\nall {len(paths)} runs: the control reached {target}x in {hits} of {len(ctl)} "
              f"plain-better cells (median {statistics.median(ctl):.3f}); adaptive servers in those cells "
              f"{sum(ada)} of {len(ada)}")


if __name__ == "__main__":
    main(sys.argv[1:])
