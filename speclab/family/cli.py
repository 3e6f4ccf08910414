"""``speclab models`` and ``speclab train``: registered by :func:`add_commands`."""

from __future__ import annotations

import argparse
import json

from .args import add_train_arguments


def cmd_presets(args) -> int:
    from ..models.presets import rows, step_times

    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    for r in table:
        size = f"{r['target_parameters'] / 1e9:.2f}B <- {r['draft_parameters'] / 1e9:.2f}B"
        print(f"{r['name']:<14} {r['target']} <- {r['draft']}  ({size})")
        if r["eagle3_head"]:
            print(f"{'':<14} EAGLE-3 head: {r['eagle3_head']}")
        if r["published"]:
            print(f"{'':<14} published: {r['published']} [{r['source']}]")
        for note in r["notes"]:
            print(f"{'':<14} note: {note}")
        m = r["measured"]
        if m:
            print(f"{'':<14} measured ({m['measured_on']}): a decode step {m['decode_ms']:.0f} ms, a round at k = 4 "
                  f"{m['round_ms']:.0f} ms; speculation pays above {m['break_even_tokens_per_round']:.2f} tokens a "
                  f"round")
    print("use a name as --target (the pair's target) or --draft (its draft); downloads on first use")
    print(f"measured: {step_times().get('command', 'not measured')}")
    return 0


def cmd_models(args) -> int:
    if getattr(args, "presets", False):
        return cmd_presets(args)
    from ..drafters.catalog import drafter_entries, model_acceptance
    from . import list_models

    models = list_models()
    keys = ("name", "role", "parameters", "tokenizer", "path")
    # the draft models, then every drafter that is not one (heads, early exit, lookups), each with its acceptance
    rows = [{**{k: m[k] for k in keys}, "acceptance": model_acceptance(m["name"])} for m in models]
    rows += drafter_entries() if models else []
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not models:
        print("no family models shipped yet (run `speclab train`)")
        return 0
    w = {k: max(len(k), *(len(f"{m[k]:,}" if k == "parameters" else str(m[k])) for m in rows)) for k in keys}
    print("  ".join(k.ljust(w[k]) for k in keys))
    for m in rows:
        cells = [str(m["name"]).ljust(w["name"]), str(m["role"]).ljust(w["role"]),
                 f"{m['parameters']:,}".rjust(w["parameters"]), str(m["tokenizer"]).ljust(w["tokenizer"]),
                 str(m["path"])]
        print("  ".join(cells))
    _print_acceptance(rows)
    return 0


NOT_DRAFTERS = ("target", "mismatched")  # shipped models that draft for nothing


def _print_acceptance(rows: list[dict]) -> None:
    """Acceptance per workload (greedy, k = 4, measured on the shipped family) of every drafter: "not measured"
    where the catalog's file has no figures for it, never a guess."""
    from ..drafters.catalog import ACCEPTANCE_PATH, measured_acceptance

    drafters = [r for r in rows if r["role"] not in NOT_DRAFTERS]
    if not drafters:
        return
    wls = list(dict.fromkeys(w for r in drafters for w in r["acceptance"]))
    info = measured_acceptance()
    if wls:
        print(f"\nacceptance (greedy, k = {info.get('k', 4)}, {info.get('prompts_per_workload', '?')} prompts per "
              f"workload; {info.get('command', '')})")
    else:
        print(f"\nacceptance: not measured yet ({ACCEPTANCE_PATH.name} is absent)")
    nw = max(len("drafter"), *(len(r["name"]) for r in drafters))
    print("drafter".ljust(nw) + "".join(f"{w.replace('heldout_', 'held-out ')[:14]:>15}" for w in wls))
    for r in drafters:
        acc = r["acceptance"]
        cells = "".join(f"{acc[w]:>15.2f}" if w in acc else f"{'-':>15}" for w in wls) if acc else "   not measured"
        print(r["name"].ljust(nw) + cells)
    if any(not r["acceptance"] for r in drafters):
        print("not measured: `python -m speclab.analysis.drafter_acceptance` measures every drafter and writes "
              f"speclab/drafters/{ACCEPTANCE_PATH.name}")


def cmd_train(args) -> int:
    if args.heads:  # the self-drafting heads on the shipped target, instead of the models
        from .heads import run_from_args as run_heads

        return run_heads(args)
    from .train import run_from_args

    return run_from_args(args)


def add_commands(subparsers) -> None:
    """Register ``models`` and ``train`` on an argparse subparsers object."""
    m = subparsers.add_parser("models", help="list the embedded model family and every drafter, with measured "
                              "acceptance per workload (--presets: the curated hub pairs)")
    m.add_argument("--json", action="store_true", help="print a JSON list")
    m.add_argument("--presets", action="store_true",
                   help="list the curated hub pairs (SmolLM2, Qwen2.5, Llama 3.x) usable as --target/--draft names")
    m.set_defaults(func=cmd_models)

    t = subparsers.add_parser("train", help="rebuild corpus, tokenizer and every family model from a seed",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
