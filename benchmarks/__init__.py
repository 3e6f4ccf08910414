"""Experiments and one-off benchmarks, outside the package: each is run as ``python benchmarks/NAME.py --help``
from the repository root, imports speclab, prints a table and writes its JSON into ``--out DIR`` (default
``results/``). The benchmarks users run every day are ``speclab bench`` subcommands instead."""
