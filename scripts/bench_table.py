#!/usr/bin/env python
"""Turn the JSON of ``speclab bench compare --out DIR`` (DIR/compare.json) into the markdown tables in the README.

    python scripts/bench_table.py bench_out/compare.json
"""

import json
import statistics
import sys


def best_k(rows, method):
    ks = sorted({r["k"] for r in rows if r["method"] == method})
    med = {k: statistics.median(r["tokens_per_s"] for r in rows if r["method"] == method and r["k"] == k)
           for k in ks}
    return max(med, key=med.get)


def main(path):
    rep = json.load(open(path))
    rows = rep["rows"]
    wls = list(dict.fromkeys(r["workload"] for r in rows))
    methods = ["hf-plain", "hf-assisted", "hf-pld", "speclab-plain", "speclab-draft", "speclab-ngram",
               "speclab-draft+events"]
    label = {"hf-plain": "(a) HF generate", "hf-assisted": "(b) HF assisted", "hf-pld": "(c) HF prompt lookup",
             "speclab-plain": "(d) speclab k=0", "speclab-draft": "(e) speclab draft",
             "speclab-ngram": "(f) speclab prompt lookup", "speclab-draft+events": "(e) with events on"}
    out = []
    out.append("| method | best k | " + " | ".join(wls) + " | identical | peak MB |")
    out.append("|---|---:|" + "---:|" * len(wls) + "---|---:|")
    for m in methods:
        k = best_k(rows, m)
        if m == "speclab-draft+events":
            k = best_k(rows, "speclab-draft")
        cells = []
        ident, mem = True, 0.0
        for w in wls:
            r = next(r for r in rows if r["method"] == m and r["workload"] == w and r["k"] == k)
            acc = f", a={r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else ""
            cells.append(f"{r['tokens_per_s']:.0f} ({r['ratio_vs_hf_plain']:.2f}×{acc})")
            ident &= r["identical"]
            mem = max(mem, r["peak_mem_mb"])
        out.append(f"| {label[m]} | {k} | " + " | ".join(cells) + f" | {'yes' if ident else 'NO'} | {mem:.1f} |")
    out.append("")
    out.append("| workload | k | acceptance | tokens/round | measured decode speedup | zero-overhead limit | "
               "efficiency | Leviathan formula |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e in rep["efficiency"]["per_workload"]:
        out.append(f"| {e['workload']} | {e['k']} | {e['acceptance_rate']:.2f} | {e['tokens_per_round']:.2f} | "
                   f"{e['measured_speedup']:.2f} | {e['predicted_speedup']:.2f} | {e['efficiency']:.2f} | "
                   f"{e['leviathan_speedup']:.2f} |")
    out.append("")
    wl = rep["batch"][0].get("workload")
    out.append(f"Batch sweep on the `{wl}` workload (where speculation pays most at batch 1):")
    out.append("")
    out.append("| batch | k | plain tok/s | speculative tok/s | speedup |")
    out.append("|---:|---:|---:|---:|---:|")
    for b in rep["batch"]:
        out.append(f"| {b['batch']} | {b['k']} | {b['plain_tokens_per_s']:.0f} | {b['spec_tokens_per_s']:.0f} | "
                   f"{b['speedup']:.2f} |")
    out.append("")
    out.append(f"Crossover batch (speculation stops paying): **{rep['crossover_batch']}**")
    out.append("")
    out.append("| target | measured | goal | | by method (best k) |")
    out.append("|---|---:|---|---|---|")
    for name, t in rep["targets"].items():
        v = t["value"]
        vs = f"{v:.3f}" if isinstance(v, float) else str(v)
        goal = ("<= " if t.get("lower_is_better") else ">= ") + str(t["goal"]) if not isinstance(t["goal"], bool) \
            else str(t["goal"])
        how = ", ".join(f"{m} {b['value']:.2f} at k={b['k']}" for m, b in t.get("by_method", {}).items())
        out.append(f"| {name} | {vs} | {goal} | {'met' if t['met'] else '**not met**'} | {how} |")
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
