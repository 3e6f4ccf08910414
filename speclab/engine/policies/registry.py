"""Every policy by name, which ones adapt, calibrating for them, and :func:`make_policy`."""

from __future__ import annotations

import torch

from ...errors import SpeclabError
from ...limits import check_float, check_k
from ..costs import ROBUST_REPS, ROBUST_STAT, calibration_clock, calibration_rows
from .base import Fixed, Off, Policy
from .goodput import Goodput
from .rules import Confidence, Ema, Heuristic
from .table import BatchTable, parse_table

POLICIES: dict[str, type] = {"fixed": Fixed, "off": Off, "batch-table": BatchTable, "heuristic": Heuristic,
                             "ema": Ema, "goodput": Goodput, "confidence": Confidence}
ADAPTIVE = ("heuristic", "ema", "goodput", "confidence")  # decide from acceptance (and costs) as they run


def seed_costs(policy, costs, target, drafter, rows: int, context: int = 96) -> float | None:
    """Calibrate ``costs`` (:class:`~speclab.engine.costs.OnlineCosts`) for every shape ``policy`` chooses
    between at up to ``rows`` rows (k = 0..K), before any timed work, when it weighs step costs (the adaptive
    policies): the seconds spent, or None for a policy that does not read them. A model drafter's draft phases
    are timed as they run (:func:`~speclab.engine.costs.time_draft_phases`); other drafters' are learnt online. The
    fastest of a few runs of each shape (``ROBUST_STAT``): other processes calibrating at the same moment (servers
    started together) preempt some runs, and a median can take a preempted one; timed by the thread's own CPU time
    on a CPU with one torch thread (:func:`~speclab.engine.costs.calibration_clock`: wall-clock runs on a shared
    machine stretch some widths and not others)."""
    if policy.name not in ADAPTIVE or policy.k_max == 0:
        return None
    return costs.calibrate(target, drafter, rows=calibration_rows(rows), tokens=tuple(range(1, policy.k_max + 2)),
                           context=context, reps=ROBUST_REPS, stat=ROBUST_STAT,
                           clock=calibration_clock(target.device, torch.get_num_threads()))


def make_policy(spec, k: int = 4) -> Policy:
    """A policy from a name ('fixed', 'off', ... see ``POLICIES``), a Policy (returned as is), or None
    (fixed k). ``k`` is the draft length of 'fixed' and the largest k of adaptive policies. Arguments
    follow a colon: 'batch-table:1-8=4,9-=0' (its table), 'confidence:0.3' (its threshold)."""
    if spec is None:
        return Fixed(check_k(k)) if k > 0 else Off()
    if not isinstance(spec, str):
        return spec
    name, _, arg = spec.strip().partition(":")
    name = name.strip().lower().replace("_", "-")
    if name not in POLICIES:
        raise SpeclabError(f"unknown policy '{spec}' (known: {', '.join(POLICIES)})")
    cls = POLICIES[name]
    arg = arg.strip()
    if arg and cls not in (BatchTable, Confidence):
        raise SpeclabError(f"policy '{name}' takes no arguments, got '{spec}'")
    if cls is Off:
        return Off()
    if cls is Fixed:
        return Fixed(check_k(k))
    if cls is BatchTable:
        return BatchTable(check_k(k), parse_table(arg) if arg else None)
    if cls is Confidence and arg:
        return Confidence(check_k(k), threshold=check_float("confidence threshold", arg, 0.0, 1.0))
    return cls(k_max=check_k(k))
