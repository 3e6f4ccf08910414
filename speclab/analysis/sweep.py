"""Sweeps: workloads x drafts x policies x k x batch sizes, each against a k = 0 baseline measured in
the same sweep on the same prompts (one variable changed). Used by the app, the notebooks and
the benchmark; returns a pandas DataFrame, one row per cell.

Policies (``SweepSpec.policies``, default fixed k only): 'fixed' runs k; an adaptive policy
('goodput', 'heuristic', ...) runs with k as its largest k. One policy object per cell, kept over the
cell's batches (as a server keeps it over requests). Before a draft's cells with a cost-weighing
policy, the decoder's step costs are calibrated once (outside the timed runs; see
``OnlineCosts.calibrate``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..drafters import make_drafter
from ..engine import SpeculativeDecoder
from ..errors import SpeclabError
from ..limits import check_batch, check_k
from ..models import LM, default_device, load_model

_MODELS: dict[tuple, LM] = {}
_MODELS_LOCK = threading.RLock()


def cached_model(spec: str, device=None, role: str = "model", dtype=None) -> LM:
    """Load once per process (the app and notebooks re-run often)."""
    import torch

    dev = torch.device(device) if device is not None else default_device()
    dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)  # load_model's default
    key = (spec, str(dev), str(dt))
    with _MODELS_LOCK:  # two callers asking for the same model at once load it once
        if key not in _MODELS:
            _MODELS[key] = load_model(spec, device=dev, role=role, dtype=dt)
        return _MODELS[key]


def new_drafter(spec: str, target: LM):
    """A fresh drafter over a cached draft model (None for 'none'). Drafters keep per-run state (a
    model drafter's KV cache), so they are never shared between runs; the models they read are."""
    return make_drafter(spec, target, load=cached_model)


@dataclass
class SweepSpec:
    workloads: list[str]
    drafts: list[str]
    ks: list[int] = field(default_factory=lambda: [4])
    batches: list[int] = field(default_factory=lambda: [1])
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    prompts_per_workload: int = 4
    seed: int = 0
    policies: list[str] = field(default_factory=lambda: ["fixed"])


def batches(prompts: list[str], batch: int, n_prompts: int) -> list[list[str]]:
    """n_prompts prompts (cycled if the workload is short), grouped into batches of `batch` rows."""
    if not prompts:
        raise SpeclabError("a workload has no prompts")
    total = max(n_prompts, batch)
    total = ((total + batch - 1) // batch) * batch
    seq = [prompts[i % len(prompts)] for i in range(total)]
    return [seq[i:i + batch] for i in range(0, total, batch)]


def measure(dec: SpeculativeDecoder, groups: list[list[str]], k: int, spec: SweepSpec, policy=None) -> dict:
    """Run every batch; throughput = generated tokens / wall time; acceptance from the events.
    ``policy``: None (fixed k), a name or a Policy object (kept over the batches)."""
    drafted = accepted = row_rounds = gen = 0
    pos_d: dict[int, int] = {}
    pos_a: dict[int, int] = {}
    ttft, tpot = [], []
    wall = 0.0
    for i, g in enumerate(groups):
        t = time.perf_counter()
        res = dec.generate(g, k=k, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                           top_p=spec.top_p, seed=spec.seed + i, policy=policy)
        wall += time.perf_counter() - t
        c = res.recorder.counters()
        drafted += c["drafted"]
        accepted += c["accepted"]
        row_rounds += c["row_rounds"]
        gen += res.metrics["generated_tokens"]
        for p, n in c["pos_drafted"].items():
            pos_d[p] = pos_d.get(p, 0) + n
            pos_a[p] = pos_a.get(p, 0) + c["pos_accepted"].get(p, 0)
        if res.metrics["ttft_ms"] is not None:
            ttft.append(res.metrics["ttft_ms"])
        if res.metrics["tpot_ms"] is not None:
            tpot.append(res.metrics["tpot_ms"])
    import statistics

    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": accepted / row_rounds + 1 if row_rounds else None,
        "row_rounds": row_rounds,
        "per_position_acceptance": [pos_a.get(p, 0) / pos_d[p] for p in sorted(pos_d)],
        "tokens_per_s": gen / wall if wall else None,
        "generated_tokens": gen,
        "wall_s": wall,
        "ttft_ms": statistics.median(ttft) if ttft else None,
        "tpot_ms": statistics.median(tpot) if tpot else None,
    }


def calibrate_for(dec: SpeculativeDecoder, spec: SweepSpec, prompts: list[str]) -> float:
    """Seed ``dec``'s step costs for the sweep's shapes (every batch size and the powers of two below,
    k + 1 tokens up to the largest k), outside any timed run. Returns the seconds spent."""
    if dec.drafter is None:
        return 0.0
    from ..engine.costs import calibration_rows

    rows = calibration_rows(*spec.batches)
    lens = sorted(len(dec.target.encode(p)) for p in prompts[:16]) or [32]
    ctx = lens[len(lens) // 2] + spec.max_new_tokens // 2
    return dec.costs.calibrate(dec.target, dec.drafter, rows=rows,  # a model draft: its phases, as they run
                               tokens=tuple(range(1, max(spec.ks) + 2)), context=ctx)


def run_sweep(target: LM | str, spec: SweepSpec, progress: Callable[[float, str], None] | None = None,
              cancel: Callable[[], bool] | None = None):
    """One row per (workload, batch, draft, policy, k), plus the k = 0 baseline rows (draft 'none')."""
    import pandas as pd

    from ..engine import make_policy
    from ..workloads import load_workload

    if isinstance(target, str):
        target = cached_model(target, role="target")
    if not spec.workloads or not spec.drafts or not spec.ks or not spec.batches or not spec.policies:
        raise SpeclabError("a sweep needs at least one workload, draft, policy, k and batch size")
    for k in spec.ks:
        check_k(k)
    for b in spec.batches:
        check_batch(b)
    pols = [p for p in spec.policies if p != "off"]  # 'off' is the baseline, measured anyway
    for p in spec.policies:
        make_policy(p, 1)  # unknown names fail before anything runs
    cells = [(w, b, d, p, k) for w in spec.workloads for b in spec.batches for d in spec.drafts for p in pols
             for k in spec.ks if k > 0]
    total = len(spec.workloads) * len(spec.batches) + len(cells)
    costly = any(p.split(":")[0] not in ("fixed", "batch-table") for p in pols)
    done = 0
    rows = []
    base_dec = SpeculativeDecoder(target, None)
    decs: dict[str, SpeculativeDecoder] = {}
    for w in spec.workloads:
        prompts = [p.prompt for p in load_workload(w)]
        for b in spec.batches:
            groups = batches(prompts, b, spec.prompts_per_workload)
            if cancel and cancel():
                return pd.DataFrame(rows)
            base = measure(base_dec, groups, 0, spec)
            done += 1
            if progress:
                progress(done / total, f"{w} batch {b} baseline")
            rows.append(dict(workload=w, batch=b, draft="none", policy="off", k=0, temperature=spec.temperature,
                             **base, baseline_tokens_per_s=base["tokens_per_s"], speedup=1.0))
            for d in spec.drafts:
                if d not in decs:
                    decs[d] = SpeculativeDecoder(target, new_drafter(d, target))
                    if costly:
                        calibrate_for(decs[d], spec, prompts)
                dec = decs[d]
                for p in pols:
                    for k in spec.ks:
                        if k == 0:
                            continue
                        if cancel and cancel():
                            return pd.DataFrame(rows)
                        name = p.split(":")[0].strip().lower()
                        pol = None if name == "fixed" else make_policy(p, k)
                        m = measure(dec, groups, k, spec, policy=pol)
                        done += 1
                        if progress:
                            progress(done / total, f"{w} batch {b} {d} {p} k={k}")
                        rows.append(dict(workload=w, batch=b, draft=d, policy=p.strip(), k=k,
                                         temperature=spec.temperature, **m,
                                         baseline_tokens_per_s=base["tokens_per_s"],
                                         speedup=m["tokens_per_s"] / base["tokens_per_s"]))
    return pd.DataFrame(rows)


def crossover_batch(df, group=None):
    """Per (workload, draft, [policy,] k): the smallest batch size where speculation stops paying
    (speedup < 1), None when it pays at every batch size measured."""
    import pandas as pd

    if group is None:
        group = ("workload", "draft", "policy", "k") if "policy" in df.columns else ("workload", "draft", "k")
    out = []
    spec = df[df["k"] > 0]
    for key, g in spec.groupby(list(group)):
        g = g.sort_values("batch")
        losing = g[g["speedup"] < 1.0]
        out.append(dict(zip(group, key), crossover_batch=int(losing["batch"].iloc[0]) if len(losing) else None))
    return pd.DataFrame(out)
