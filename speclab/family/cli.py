"""``speclab models`` and ``speclab train``: registered by :func:`add_commands`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import FAMILY_DIR


def cmd_models(args) -> int:
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
    from .train import run_from_args

    return run_from_args(args)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes-scale", type=float, default=1.0,
                   help="scale every model's training tokens (and so its wall time) by this factor")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="train only this model (repeatable); others are kept")
    p.add_argument("--out", type=Path, default=FAMILY_DIR, help="family directory (default: the package's)")
    p.add_argument("--runs", type=Path, default=Path("runs/family"), help="checkpoint directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--no-acceptance", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument("--device", default="cpu", help="cpu or cuda (a GPU: scale the budgets with --minutes-scale)")
    p.add_argument("--batch-scale", type=int, default=1, metavar="N",
                   help="N x every model's batch and tokens, same steps and schedules (the GPU-trained family: "
                        "--device cuda --batch-scale 10 --large-corpus)")
    p.add_argument("--large-corpus", action="store_true",
                   help="the larger corpus (standard library + torch, transformers and numpy sources, more records "
                        "and copy-heavy text; speclab.family.train.LARGE_CORPUS) for long runs")
    p.add_argument("--heads", action="store_true",
                   help="train the self-drafting heads (EAGLE, Medusa, early-exit adapter) on the shipped target "
                        "instead of the models (speclab.family.heads; --only picks heads by name)")


def add_commands(subparsers) -> None:
    """Register ``models`` and ``train`` on an argparse subparsers object."""
    m = subparsers.add_parser("models", help="list the embedded model family")
    m.add_argument("--json", action="store_true", help="print a JSON list")
    m.set_defaults(func=cmd_models)

    t = subparsers.add_parser("train", help="rebuild corpus, tokenizer and every family model from a seed",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
