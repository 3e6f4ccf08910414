"""``speclab models`` and ``speclab train``: registered by :func:`add_commands`."""

from __future__ import annotations

import argparse
import json

from .args import add_train_arguments


def cmd_presets(args) -> int:
    from ..models.presets import rows

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
    print("use a name as --target (the pair's target) or --draft (its draft); downloads on first use")
    return 0


def cmd_models(args) -> int:
    if getattr(args, "presets", False):
        return cmd_presets(args)
    from . import list_models

    models = list_models()
    keys = ("name", "role", "parameters", "tokenizer", "path")
    if args.json:
        print(json.dumps([{k: m[k] for k in keys} for m in models], indent=2))
        return 0
    if not models:
        print("no family models shipped yet (run `speclab train`)")
        return 0
    w = {k: max(len(k), *(len(f"{m[k]:,}" if k == "parameters" else str(m[k])) for m in models)) for k in keys}
    print("  ".join(k.ljust(w[k]) for k in keys))
    for m in models:
        cells = [str(m["name"]).ljust(w["name"]), str(m["role"]).ljust(w["role"]),
                 f"{m['parameters']:,}".rjust(w["parameters"]), str(m["tokenizer"]).ljust(w["tokenizer"]),
                 str(m["path"])]
        print("  ".join(cells))
    return 0


def cmd_train(args) -> int:
    if args.heads:  # the self-drafting heads on the shipped target, instead of the models
        from .heads import run_from_args as run_heads

        return run_heads(args)
    from .train import run_from_args

    return run_from_args(args)


def add_commands(subparsers) -> None:
    """Register ``models`` and ``train`` on an argparse subparsers object."""
    m = subparsers.add_parser("models", help="list the embedded model family (--presets: the curated hub pairs)")
    m.add_argument("--json", action="store_true", help="print a JSON list")
    m.add_argument("--presets", action="store_true",
                   help="list the curated hub pairs (SmolLM2, Qwen2.5, Llama 3.x) usable as --target/--draft names")
    m.set_defaults(func=cmd_models)

    t = subparsers.add_parser("train", help="rebuild corpus, tokenizer and every family model from a seed",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
