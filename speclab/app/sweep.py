"""The Sweep tab's run, free of Gradio: its grid checked and bounded, run by :func:`speclab.analysis.sweep.run_sweep`
on a worker thread (:class:`SweepJob`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SpeclabError
from ..limits import check_float, check_int
from .config import MAX_BATCH, MAX_K, MAX_SEED, MAX_TEMPERATURE, AppConfig, as_list, check_model_choice
from .jobs import Job
from .models import get_target, warm_up

MAX_SWEEP_CELLS = 120  # (workload, batch, draft, policy, k) cells incl. baselines
SWEEP_KS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
SWEEP_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@dataclass(frozen=True)
class SweepSettings:
    target: str
    workloads: tuple[str, ...]
    drafts: tuple[str, ...]
    ks: tuple[int, ...]
    batches: tuple[int, ...]
    prompts_per_workload: int
    max_new_tokens: int
    temperature: float
    seed: int = 0

    @property
    def cells(self) -> int:
        return len(self.workloads) * len(self.batches) * (1 + len(self.drafts) * len(self.ks))


def validate_sweep(cfg: AppConfig, target, workloads, drafts, ks, batches, prompts_per_workload, max_new_tokens,
                   temperature, seed=0) -> SweepSettings:
    from ..workloads import list_workloads

    target = check_model_choice(cfg, target, "target")
    known = list_workloads()
    wl = []
    for w in as_list("workloads", workloads):
        if w not in known:
            raise SpeclabError(f"unknown workload {w!r} (known: {', '.join(known) or 'none'})")
        if w not in wl:
            wl.append(w)
    if not wl:
        raise SpeclabError("pick at least one workload")
    ds = []
    for d in as_list("drafts", drafts):
        d = check_model_choice(cfg, d, "draft")
        if d != "none" and d not in ds:
            ds.append(d)
    if not ds:
        raise SpeclabError("pick at least one draft (the k = 0 baseline is always measured)")
    kl = sorted({check_int("k", k, 1, MAX_K) for k in as_list("k values", ks)})
    if not kl:
        raise SpeclabError("pick at least one k")
    bl = sorted({check_int("batch size", b, 1, MAX_BATCH) for b in as_list("batch sizes", batches)})
    if not bl:
        raise SpeclabError("pick at least one batch size")
    s = SweepSettings(target, tuple(wl), tuple(ds), tuple(kl), tuple(bl),
                      check_int("prompts per workload", prompts_per_workload, 1, 32),
                      check_int("max new tokens", max_new_tokens, 1, 128),
                      check_float("temperature", temperature, 0.0, MAX_TEMPERATURE),
                      check_int("seed", seed, 0, MAX_SEED))
    if s.cells > MAX_SWEEP_CELLS:
        raise SpeclabError(f"this sweep has {s.cells} cells (at most {MAX_SWEEP_CELLS}): pick fewer workloads, "
                           f"drafts, k values or batch sizes")
    return s


class SweepJob(Job):
    """``run_sweep`` on a worker thread, so the caller can poll progress and cancel it."""

    def __init__(self, cfg: AppConfig, s: SweepSettings):
        super().__init__(cfg, s, "loading models")
        self.df = None

    def _run(self) -> None:
        from ..analysis.sweep import SweepSpec, run_sweep

        target = get_target(self.cfg, self.s.target)
        for d in self.s.drafts:  # check tokenizers and warm up before measuring anything
            if self._cancel.is_set():
                return
            warm_up(target, d)
        spec = SweepSpec(list(self.s.workloads), list(self.s.drafts), list(self.s.ks), list(self.s.batches),
                         temperature=self.s.temperature, max_new_tokens=self.s.max_new_tokens,
                         prompts_per_workload=self.s.prompts_per_workload, seed=self.s.seed)
        self.df = run_sweep(target, spec, progress=self._progress, cancel=self._cancel.is_set)


def sweep_table(df):
    """The sweep DataFrame for display and CSV: lists as text, floats rounded."""
    if df is None or not len(df):
        return df
    out = df.copy()
    if "per_position_acceptance" in out:
        out["per_position_acceptance"] = out["per_position_acceptance"].map(
            lambda v: " ".join(f"{x:.2f}" for x in v) if isinstance(v, (list, tuple)) else v)
    for c in out.columns:
        if out[c].dtype.kind == "f":
            out[c] = out[c].round(4)
    return out
