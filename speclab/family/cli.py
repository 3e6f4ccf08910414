"""``speclab models`` and ``speclab train``: registered by :func:`add_commands`."""

from __future__ import annotations

import argparse
import json

from .args import add_train_arguments


def cmd_models(args) -> int:
    from .listing import format_listing, listing

    entries = listing()
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    print(format_listing(entries))
    return 0


def cmd_measure(args) -> int:
    from .listing import run_measure

    return run_measure(args)


def cmd_train(args) -> int:
    if args.heads:  # the self-drafting heads on the shipped target, instead of the models
        from .heads import run_from_args as run_heads

        return run_heads(args)
    from .train import run_from_args

    return run_from_args(args)


def add_commands(subparsers) -> None:
    """Register ``models`` and ``train`` on an argparse subparsers object."""
    m = subparsers.add_parser("models", help="list the embedded model family and every drafter, with its acceptance")
    m.add_argument("--json", action="store_true", help="print a JSON list")
    m.set_defaults(func=cmd_models)
    sub = m.add_subparsers(dest="models_command", metavar="{measure}")
    ms = sub.add_parser("measure", help="measure the acceptance of listed drafters that show 'not measured' and "
                        "store it in the family's acceptance report")
    from .listing import add_measure_arguments

    add_measure_arguments(ms)
    ms.set_defaults(func=cmd_measure)

    t = subparsers.add_parser("train", help="rebuild corpus, tokenizer and every family model from a seed",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_train_arguments(t)
    t.set_defaults(func=cmd_train)
