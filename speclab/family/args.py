"""The arguments of ``speclab train`` (and ``python -m speclab.family.train``), in a module of their own so
that registering the command imports no torch and the training modules import no command line."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import FAMILY_DIR


def add_train_arguments(p: argparse.ArgumentParser, heads: bool = True) -> None:
    """The training options; ``heads``: offer ``--heads`` (``speclab train`` dispatches it to :mod:`.heads`)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes-scale", type=float, default=1.0,
                   help="scale every model's training tokens (and so its wall time) by this factor")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="train only this model (repeatable); others are kept")
    p.add_argument("--out", type=Path, default=FAMILY_DIR, help="family directory (default: the package's)")
    p.add_argument("--runs", type=Path, default=Path("runs/family"), help="checkpoint directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-bf16", action="store_true",
                   help="train in fp32 (default: bf16 autocast where the device has bf16 instructions)")
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--no-acceptance", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument("--device", default="cpu", help="cpu or cuda (a GPU: scale the budgets with --minutes-scale)")
    p.add_argument("--batch-scale", type=int, default=1, metavar="N",
                   help="N x every model's batch and tokens, same steps and schedules (the GPU-trained family: "
                        "--device cuda --batch-scale 10 --large-corpus)")
    p.add_argument("--large-corpus", action="store_true",
                   help="the larger corpus (standard library + torch, transformers and numpy sources, more records "
                        "and copy-heavy text; speclab.family.specs.LARGE_CORPUS) for long runs")
    if heads:
        p.add_argument("--heads", action="store_true",
                       help="train the self-drafting heads (EAGLE, Medusa, early-exit adapter) on the shipped target "
                            "instead of the models (speclab.family.heads; --only picks heads by name)")
