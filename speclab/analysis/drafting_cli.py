"""``speclab bench round`` and ``speclab bench heldout``: added to the ``bench`` command's subcommands.

Registered after :mod:`speclab.analysis.cli` (see ``COMMANDS`` in :mod:`speclab.cli`): this module finds the
``bench`` parser's subcommands and adds its two, so the benchmarks stay in their own modules
(:mod:`.bench_round`, :mod:`.bench_heldout`). Where ``bench`` has no subcommands, nothing is added (both still
run as ``python -m speclab.analysis.bench_round`` / ``bench_heldout``).
"""

from __future__ import annotations

import argparse


def _bench_subcommands(subparsers):
    bench = subparsers.choices.get("bench")
    if bench is None:
        return None
    return next((a for a in bench._actions if isinstance(a, argparse._SubParsersAction)), None)  # noqa: SLF001


def _run_round(args) -> int:
    from .bench_round import run_from_args

    return run_from_args(args)


def _run_heldout(args) -> int:
    from .bench_heldout import run_from_args

    return run_from_args(args)


def add_commands(subparsers) -> None:
    from . import bench_heldout, bench_round

    sub = _bench_subcommands(subparsers)
    if sub is None:
        return
    p = sub.add_parser("round", help="one speculative round phase by phase (draft, verify, accept, bookkeeping, "
                       "other), each beside the floor measured on this machine")
    bench_round.add_arguments(p)
    p.set_defaults(func=_run_round)
    p = sub.add_parser("heldout", help="every drafter against plain decoding on the held-out workloads (batch 1, "
                       "greedy, interleaved, with an A/A control)")
    bench_heldout.add_arguments(p)
    p.set_defaults(func=_run_heldout)
