"""``speclab models`` (the family's models and every drafter, with its measured acceptance per workload) and
``speclab models measure`` (measures the drafters listed as "not measured" and stores them in the family's
acceptance report)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpeclabError
from . import list_models
from .drafters import (
    ACCEPTANCE,
    acceptance_conditions,
    acceptance_path,
    list_drafters,
    load_acceptance,
    merge_acceptance,
)

KEYS = ("name", "role", "parameters", "tokenizer", "path")
NOT_MEASURED = "not measured"


def listing(family_dir: Path | str | None = None, acceptance: Path | str | None = None) -> list[dict]:
    """Every shipped model (the target too: ``acceptance`` None, it is not a drafter), then every drafter that
    is not a model. A drafter's ``acceptance`` maps each workload to its greedy acceptance rate, None where
    it was not measured."""
    drafters = list_drafters(family_dir, acceptance)
    by_name = {d["name"]: d for d in drafters}
    out = []
    for m in list_models(family_dir):
        d = by_name.pop(m["name"], None)
        out.append({k: m[k] for k in KEYS} | {"about": d["about"] if d else m["role"],
                                             "acceptance": d["acceptance"] if d else None})
    return out + [d for d in drafters if d["name"] in by_name]


def _cell(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def format_listing(entries: list[dict], acceptance: Path | str | None = None) -> str:
    """Two tables: the models (as before), then the drafters with acceptance per workload."""
    lines = []
    models = [e for e in entries if e["path"] and e["tokenizer"]]
    if models:
        w = {k: max(len(k), *(len(f"{m[k]:,}" if k == "parameters" else str(m[k])) for m in models)) for k in KEYS}
        lines.append("  ".join(k.ljust(w[k]) for k in KEYS))
        for m in models:
            lines.append("  ".join([str(m["name"]).ljust(w["name"]), str(m["role"]).ljust(w["role"]),
                                    f"{m['parameters']:,}".rjust(w["parameters"]),
                                    str(m["tokenizer"]).ljust(w["tokenizer"]), str(m["path"])]))
    else:
        lines.append("no family models shipped yet (run `speclab train`)")
    drafters = [e for e in entries if e["acceptance"] is not None]
    cond = acceptance_conditions(acceptance)
    workloads = cond["workloads"] or sorted({w for d in drafters for w in d["acceptance"]})
    nw = max([len("drafter (--draft)")] + [len(d["name"]) for d in drafters])
    rw = max([len("role")] + [len(d["role"]) for d in drafters])
    cw = [max(6, len(w)) for w in workloads]
    head = f"{'drafter (--draft)':<{nw}}  {'role':<{rw}}  {'params':>9}  " + "  ".join(
        f"{w:>{c}}" for w, c in zip(workloads, cw))
    lines += ["", head, "-" * len(head)]
    for d in drafters:
        acc = d["acceptance"]
        params = f"{d['parameters']:,}" if d["parameters"] else "-"
        cells = ("  ".join(f"{_cell(acc.get(w)):>{c}}" for w, c in zip(workloads, cw))
                 if any(v is not None for v in acc.values()) else NOT_MEASURED)
        lines.append(f"{d['name']:<{nw}}  {d['role']:<{rw}}  {params:>9}  {cells}")
    lines.append(f"acceptance = accepted / drafted tokens at k = {cond['k']}, greedy, {cond['max_new_tokens']} new "
                 f"tokens, {cond['prompts_per_workload']} prompts per workload, target {cond['target']} "
                 f"({cond['file']})")
    if any(all(v is None for v in d["acceptance"].values()) for d in drafters):
        lines.append(f"'{NOT_MEASURED}': `speclab models measure` measures those drafters and stores the result there")
    return "\n".join(lines)


def add_measure_arguments(p) -> None:
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter spec to measure (repeatable; default: every listed drafter not measured yet)")
    p.add_argument("--workload", default=None, help="comma list of workloads (default: the report's)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload (default: all, as the report)")
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="temperature (repeatable; default 0 and 0.8, as the report)")
    p.add_argument("--k", "-k", type=int, default=None, help="draft length (default: the report's)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default: the report's)")
    p.add_argument("--file", default=None, help=f"the report to add to (default: the family's {ACCEPTANCE})")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 for tiny models)")


def run_measure(args) -> int:
    """Measure with :func:`speclab.analysis.report.acceptance_report` under the report's own conditions and
    merge the rows into it."""
    from ..analysis.report import TEMPERATURES, acceptance_report
    from ..defaults import setup_threads
    from ..limits import check_int, check_k, check_max_new_tokens
    from ..models import load_model
    from ..workloads import workload_names

    path = Path(args.file) if args.file else acceptance_path()
    old = load_acceptance(path)
    k = check_k(args.k if args.k is not None else old.get("k") or 4)
    new_tokens = check_max_new_tokens(args.max_new_tokens if args.max_new_tokens is not None
                                      else old.get("max_new_tokens") or 64, name="--max-new-tokens")
    for key, v in (("k", k), ("max_new_tokens", new_tokens)):
        if old["rows"] and old.get(key) is not None and v != old[key]:
            raise SpeclabError(f"{path} was measured with {key} = {old[key]}, not {v}: measure into another --file")
    prompts = None if args.prompts is None else check_int("--prompts", args.prompts, 1, 1000)
    workloads = workload_names(args.workload or ",".join(old.get("workloads") or []) or "all")
    drafters = args.drafter or [d["name"] for d in list_drafters(acceptance=path)
                                if all(v is None for v in d["acceptance"].values())]
    if not drafters:
        print(f"every listed drafter is measured already ({path}); name one with --drafter to measure it again")
        return 0
    target = old.get("target") or "target"
    from ..drafters import make_drafter

    lm = load_model(target)
    setup_threads(args.threads, lm)
    for d in drafters:
        make_drafter(d, lm)  # a bad spec fails before any run
    print(f"measuring {', '.join(drafters)} on {', '.join(workloads)} (k = {k}, {new_tokens} new tokens, "
          f"{prompts or 'all'} prompts per workload) ...", flush=True)
    report = acceptance_report(workloads, target=target, drafters=drafters, k=k, max_new_tokens=new_tokens,
                               prompts_per_workload=prompts,
                               temperatures=tuple(args.temperature) if args.temperature else TEMPERATURES,
                               seed=old.get("seed", 0))
    try:
        merged = merge_acceptance(report, path)
    except ValueError as e:
        raise SpeclabError(f"{path}: {e}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    for r in report["rows"]:
        print(f"  {r['workload']:<12} {r['drafter']:<22} T={r['temperature']:g}  acceptance "
              f"{_cell(r['acceptance_rate'])}  tokens/round {_cell(r['mean_accepted_length'])}")
    print(f"wrote {len(report['rows'])} rows into {path}")
    return 0
