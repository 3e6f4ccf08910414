"""Acceptance report: per workload and per drafter, acceptance rate and mean accepted length at k,
greedy and at temperature 0.8, measured with the speculative decoding engine.

    speclab bench acceptance --workload all --k 4 --out results
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..family import DEFAULT_TARGET, list_models

TEMPERATURES = (0.0, 0.8)


def default_drafters() -> list[str]:
    """Every shipped draft model (undistilled and distilled) plus prompt lookup (``ngram``)."""
    names = [m["name"] for m in list_models() if m["role"] in ("draft", "distilled-draft")]
    return names + ["ngram"]


def acceptance_report(workloads: str | list[str] = "all", *, target: str = DEFAULT_TARGET,
                      drafters: list[str] | None = None, k: int = 4, max_new_tokens: int = 64,
                      prompts_per_workload: int | None = 8, temperatures=TEMPERATURES, seed: int = 0,
                      batch_size: int = 8, progress=None) -> dict:
    """Run the engine over every (workload, drafter, temperature) and collect its metrics
    (:func:`speclab.analysis.sweep.measure`: acceptance = accepted / drafted over all the prompts)."""
    from ..drafters import make_drafter
    from ..engine import SpeculativeDecoder
    from ..models import load_model
    from ..workloads import load_workload, workload_names
    from .sweep import SweepSpec, measure

    names = workload_names(workloads)
    drafters = drafters or default_drafters()
    target_lm = load_model(target)
    made = {d: make_drafter(d, target_lm) for d in drafters}
    rows = []
    t0 = time.time()
    for w in names:
        prompts = [p.prompt for p in load_workload(w)][:prompts_per_workload or None]
        groups = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        for d in drafters:
            dec = SpeculativeDecoder(target_lm, made[d])
            for temp in temperatures:
                spec = SweepSpec([w], [d], [k], [batch_size], temperature=temp, max_new_tokens=max_new_tokens,
                                 seed=seed)
                m = measure(dec, groups, k, spec)
                row = {"workload": w, "drafter": d, "temperature": temp, "k": k, "prompts": len(prompts),
                       "acceptance_rate": None if m["acceptance_rate"] is None else round(m["acceptance_rate"], 4),
                       "mean_accepted_length": None if m["mean_accepted_length"] is None
                       else round(m["mean_accepted_length"], 4),
                       "row_rounds": m["row_rounds"], "tokens_per_s": round(m["tokens_per_s"], 1)}
                rows.append(row)
                if progress:
                    progress(row)
    return {"target": target, "k": k, "max_new_tokens": max_new_tokens, "seed": seed,
            "workloads": names, "drafters": drafters, "rows": rows, "wall_seconds": round(time.time() - t0, 1)}


def format_report(report: dict) -> str:
    """One table: rows = workload x drafter; columns = acceptance and mean accepted length per temperature."""
    temps = sorted({r["temperature"] for r in report["rows"]})
    by = {(r["workload"], r["drafter"], r["temperature"]): r for r in report["rows"]}
    dw = max([14] + [len(d) for d in report["drafters"]])
    head = f"{'workload':<12} {'drafter':<{dw}}" + "".join(
        f" {'acc@T=' + format(t, 'g'):>9} {'len@T=' + format(t, 'g'):>9}" for t in temps)
    lines = [f"acceptance at k={report['k']} (target {report['target']}, {report['max_new_tokens']} new tokens; "
             f"len = tokens per round incl. the bonus/recovered token)", head, "-" * len(head)]

    def f(x):
        return f"{x:9.3f}" if isinstance(x, (int, float)) else f"{'-':>9}"

    for w in report["workloads"]:
        for d in report["drafters"]:
            cells = ""
            for t in temps:
                r = by.get((w, d, t), {})
                cells += f" {f(r.get('acceptance_rate'))} {f(r.get('mean_accepted_length'))}"
            lines.append(f"{w:<12} {d:<{dw}}{cells}")
    return "\n".join(lines)


def distill_pairs(models: list[dict] | None = None) -> list[tuple[str, str]]:
    """(distilled, undistilled) drafts of the same architecture, from the manifest."""
    models = list_models() if models is None else models
    plain = [m for m in models if m["role"] == "draft"]
    return [(d["name"], u["name"]) for d in models if d["role"] == "distilled-draft"
            for u in plain if u.get("architecture") == d.get("architecture")]


def check_targets(report: dict, best_draft: str, pairs: list[tuple[str, str]] | None = None) -> dict[str, bool]:
    """The design goals of the family, checked on a report (greedy and T=0.8 separately).
    ``pairs``: (distilled, undistilled of the same size); default: from the manifest."""
    by = {(r["workload"], r["drafter"], r["temperature"]): r for r in report["rows"]}
    pairs = distill_pairs() if pairs is None else pairs
    out = {}
    for t in sorted({r["temperature"] for r in report["rows"]}):
        def acc(w, d, t=t):
            r = by.get((w, d, t))
            return r["acceptance_rate"] if r and r["acceptance_rate"] is not None else float("nan")

        ws = report["workloads"]
        if "creative" in ws:
            for w in ("code", "json"):
                if w in ws:
                    out[f"T={t:g} {best_draft} {w} >= creative + 0.15"] = (
                        acc(w, best_draft) >= acc("creative", best_draft) + 0.15)
        for distilled, undistilled in pairs:
            if distilled in report["drafters"] and undistilled in report["drafters"]:
                out[f"T={t:g} {distilled} > {undistilled} on every workload"] = all(
                    acc(w, distilled) > acc(w, undistilled) for w in ws)
        if "json" in ws:
            r = by.get(("json", best_draft, t))
            out[f"T={t:g} {best_draft} mean accepted length on json >= 2.5"] = bool(
                r and r["mean_accepted_length"] and r["mean_accepted_length"] >= 2.5)
        if "copy" in ws and "ngram" in report["drafters"]:
            models = [d for d in report["drafters"] if d != "ngram"]
            out[f"T={t:g} ngram beats every model draft on copy"] = all(
                acc("copy", "ngram") > acc("copy", d) for d in models)
    return out


def run_from_args(args) -> int:
    from ..errors import SpeclabError
    from ..family import BEST_DRAFT

    if not list_models():
        raise SpeclabError("no family models are shipped yet; run `speclab train` first")
    drafters = args.drafter or None
    temps = tuple(args.temperature) if args.temperature else TEMPERATURES
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    def progress(row):
        if not args.quiet:
            print(f"  {row['workload']:<12} {row['drafter']:<16} T={row['temperature']:<4g} "
                  f"acc={row['acceptance_rate']} len={row['mean_accepted_length']}", flush=True)

    rep = acceptance_report(args.workload, target=args.target or DEFAULT_TARGET, drafters=drafters, k=args.k,
                            max_new_tokens=args.max_new_tokens, prompts_per_workload=args.prompts_per_workload,
                            temperatures=temps, seed=args.seed, progress=progress)
    rep["checks"] = check_targets(rep, BEST_DRAFT)
    print(format_report(rep))
    for name, ok in rep["checks"].items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rep, indent=2) + "\n")
        print(f"wrote {path}")
    return 0
