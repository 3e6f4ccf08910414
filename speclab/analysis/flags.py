"""The flags the ``speclab bench`` subcommands and ``speclab advise`` share, declared once: each is a :class:`Flag`
(its spelling and argparse keywords) in :data:`FLAGS`, and a subcommand picks the ones it reads by name with
:func:`add_flags`, overriding a default or a help line where its own differs. One idea has one spelling: ``--draft``
(never ``--drafter``), ``--k`` (one value or a comma list, never ``--ks``), ``--reps`` (interleaved repetitions of
the whole measurement), ``--out DIR`` (where the JSON goes; never ``--json PATH``).

:data:`OLD_SPELLINGS` maps the spellings these commands no longer take to their new form, so that an old command
line fails in one line that names the new one instead of running something else.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT = "results"


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)


FLAGS: dict[str, Flag] = {
    "target": Flag(("--target",), dict(default=None, help="target model: family name, local HF directory or hub id "
                                                          "(default: the family target)")),
    "draft": Flag(("--draft",), dict(default=None, help="draft: a family draft, a path or hub id, 'ngram' (prompt "
                                                        "lookup) (default: the family's default draft)")),
    "workload": Flag(("--workload",), dict(default=None, help="'all', a workload name, a comma list or a .jsonl "
                                                              "path")),
    "k": Flag(("-k", "--k"), dict(type=int, default=4, help="draft length (default 4)")),
    "ks": Flag(("-k", "--k"), dict(dest="ks", default=None, metavar="K,...", help="draft lengths, a comma list")),
    "batches": Flag(("--batches",), dict(default=None, metavar="B,...", help="batch sizes, a comma list")),
    "max_new_tokens": Flag(("--max-new-tokens",), dict(type=int, default=64, help="tokens generated per request "
                                                                                  "(default 64)")),
    "prompts": Flag(("--prompts-per-workload",), dict(type=int, default=None, metavar="N",
                                                      help="prompts taken from each workload")),
    "reps": Flag(("--reps",), dict(type=int, default=None, help="interleaved repetitions of the whole measurement")),
    "full": Flag(("--full",), dict(action="store_true", help="the full grid instead of the quick default")),
    "seed": Flag(("--seed",), dict(type=int, default=0, help="random seed (default 0)")),
    "threads": Flag(("--threads",), dict(type=int, default=None, help="torch CPU threads (default 1)")),
    "device": Flag(("--device",), dict(default=None, help="cpu or cuda (default: cuda when present)")),
    "clock": Flag(("--clock",), dict(choices=("wall", "process"), default="wall",
                                     help="time by wall clock (default) or by this process's CPU time (steadier on a "
                                          "shared machine; meaningful with --threads 1)")),
    "out": Flag(("--out",), dict(default=DEFAULT_OUT, metavar="DIR", help=f"write the JSON result (and any charts) "
                                                                          f"into DIR (default: {DEFAULT_OUT}/)")),
    "quiet": Flag(("--quiet",), dict(action="store_true", help="no progress lines")),
}


def add_flags(parser: argparse.ArgumentParser, *names: str, **overrides: dict) -> None:
    """Add the named :data:`FLAGS` to ``parser``; ``overrides``: {name: {argparse keyword: value}} for this one."""
    for name in names:
        f = FLAGS[name]
        parser.add_argument(*f.names, **{**f.kwargs, **overrides.get(name, {})})


def out_path(args, name: str) -> Path:
    """Where a command writes its JSON: ``--out DIR``/``name``.json (the folder made on demand)."""
    out = Path(args.out or DEFAULT_OUT)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{name}.json"


def write_json(path: Path | str, obj, **kw) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, **kw) + "\n", encoding="utf-8")
    print(f"wrote {p}")
    return p


# spellings that no longer parse -> what to write instead (per command; "" = any subcommand of it)
BENCH_MODES = {"--compare": "speclab bench compare", "--serve": "speclab bench serve",
               "--policies": "speclab bench policies", "--synthetic": "speclab bench synthetic",
               "--heads": "speclab bench heads", "--layouts": "python benchmarks/layouts.py",
               "--tracker-fit": "python benchmarks/tracker_fit.py",
               "--serve-experiment": "python benchmarks/serve_experiment.py"}
BENCH_FLAGS = {"--drafter": "--draft (repeatable)", "--ks": "--k (one value or a comma list)",
               "--json": "--out DIR (the JSON goes into DIR)", "--policy-list": "--policy (a comma list)",
               "--spec-policy": "--policy", "--speculative-config": "--draft and --k",
               "--charts": "--out DIR (charts go into DIR)", "--eagle-ks": "--k (a comma list: the EAGLE chain's k "
               "values)", "--oracle": "python benchmarks/policy_oracle.py"}
ADVISE_MODES = {"--validate": "speclab advise validate", "--measure-cpu": "speclab advise measure-cpu",
                "--check-cpu": "python benchmarks/cpucheck.py"}
ADVISE_FLAGS = {"--target-params": "--target-model PARAMS[:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM] (speclab advise "
                "what-if)", "--draft-params": "--draft-model PARAMS[:...] (speclab advise what-if)",
                "--layers": "--target-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--hidden": "--target-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--kv-heads": "--target-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--head-dim": "--target-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--draft-layers": "--draft-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--draft-hidden": "--draft-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--draft-kv-heads": "--draft-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--draft-head-dim": "--draft-model PARAMS:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM",
                "--json": "--out DIR (the JSON goes into DIR)"}


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def old_spelling(argv: list[str]) -> str | None:
    """One line naming the new form when ``argv`` (without the program name) uses a spelling ``bench`` or
    ``advise`` no longer takes; None otherwise."""
    if not argv or argv[0] not in ("bench", "advise"):
        return None
    cmd, rest = argv[0], argv[1:]
    modes, flags = (BENCH_MODES, BENCH_FLAGS) if cmd == "bench" else (ADVISE_MODES, ADVISE_FLAGS)
    for old, new in modes.items():
        if _given(rest, old):
            return f"`speclab {cmd} {old}` is now `{new}`"
    if cmd == "bench" and rest and rest[0].startswith("-") and rest[0] not in ("-h", "--help"):
        return ("speclab bench needs a subcommand first: acceptance, compare, serve, policies, synthetic or heads "
                "(the acceptance report is now `speclab bench acceptance`)")
    for old, new in flags.items():
        if _given(rest, old):
            return f"speclab {cmd}: {old} is now {new}"
    return None
