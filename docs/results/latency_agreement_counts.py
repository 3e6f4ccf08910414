"""Issue 13's first target over a `speclab bench --serve-experiment --json` run: in how many speclab cells do the
load tool's TTFT, TPOT, ITL and E2E means agree within 5% with the server's own histograms over the same window?
Recomputed with the current rule (`speclab.load.scrape.latency_agreement`), so older runs read as today's code
would. Run: .venv/bin/python docs/results/latency_agreement_counts.py RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys

from speclab.load.scrape import latency_agreement

KEYS = ("ttft", "tpot", "itl", "e2e")


def main(paths: list[str], tolerance: float = 0.05) -> None:
    for path in paths:
        r = json.load(open(path))
        cells = [c for c in r["cells"] if c.get("engine") == "speclab"]
        ratios = {k: [] for k in KEYS}
        misses = {k: [] for k in KEYS}
        for c in cells:
            agree = latency_agreement(c["summary"], c["server_metrics"], c["fingerprint"])
            for k in KEYS:
                if k in agree:
                    x = agree[k]["ratio"]
                    ratios[k].append(x)
                    if abs(x - 1) > tolerance:
                        misses[k].append(f"{c['server']} {c['workload']} c={c['concurrency']} {x:.3f}")
        print(path)
        for k in KEYS:
            n = len(ratios[k])
            if n:
                med = statistics.median(ratios[k])
                print(f"  {k:5} within {tolerance:.0%}: {n - len(misses[k])} / {n}  (median {med:.3f})")
            for m in misses[k]:
                print(f"      miss: {m}")


if __name__ == "__main__":
    main(sys.argv[1:])
