"""What every script here shares: a parser with the lab's shared flags (:mod:`speclab.analysis.flags`), and a
``main`` that turns a user's mistake into one line on stderr and exit status 2, as ``speclab`` does."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from speclab.analysis.flags import add_flags, out_path
from speclab.errors import SpeclabError

__all__ = ["add_flags", "out_path", "parser", "run"]


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python benchmarks/{prog}.py", description=description)


def run(p: argparse.ArgumentParser, runner: Callable, argv: list[str] | None, name: str) -> int:
    """Parse ``argv``, point ``args.json`` at ``--out DIR``/``name``.json, run; a SpeclabError is one line."""
    from speclab.cli import Terminated, exit_cleanly_on_sigterm

    args = p.parse_args(argv)
    exit_cleanly_on_sigterm()
    try:
        if getattr(args, "target", "x") is None:
            from speclab.defaults import default_target

            args.target = default_target()
        args.json = str(out_path(args, name))
        return runner(args) or 0
    except SpeclabError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"{p.prog}: terminated (SIGTERM)", file=sys.stderr)
        return 143
