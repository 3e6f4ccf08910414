"""The Timing tab's run, free of Gradio: baseline and speculative runs of one prompt, interleaved.
"""

from __future__ import annotations

from ..metrics import speedup
from .config import AppConfig
from .decode import DecodeSettings, timed_stream
from .models import get_target, warm_up

TIMING_REPEATS = 5


def run_timing(cfg: AppConfig, s: DecodeSettings, repeats: int = TIMING_REPEATS) -> dict:
    """Baseline and speculative runs of the same prompt (one row), each warmed up, then interleaved
    (baseline, speculative, baseline, ...) ``repeats`` times: the table holds the medians, the gap
    charts the run whose tokens/s is its method's median. Neither method pays the process's first,
    slow forwards, and a burst of load on a shared machine hits both alike."""
    import statistics

    import pandas as pd

    from ..analysis.sweep import new_drafter
    from ..engine import SpeculativeDecoder
    from ..metrics import Recorder

    target = get_target(cfg, s.target)
    warm_up(target, s.drafter_spec if s.speculative else "none")
    prompts = [s.prompt]
    runs = [("baseline (k=0)", None, 0)]
    if s.speculative:
        runs.append((f"{s.drafter_spec} k={s.k}" + (f" ({s.policy})" if s.policy != "fixed" else ""),
                     s.drafter_spec, s.k))
    for _, spec, k in runs:  # warm both paths on this very prompt
        SpeculativeDecoder(target, new_drafter(spec, target) if spec else None).generate(
            prompts, k=k, max_new_tokens=min(8, s.max_new_tokens), record=False)
    per: dict[str, list] = {name: [] for name, _, _ in runs}
    for _ in range(max(1, repeats)):
        for name, spec, k in runs:
            rec = Recorder(target)
            dec = SpeculativeDecoder(target, new_drafter(spec, target) if spec else None)
            for _ev in timed_stream(dec, prompts, s, k, rec):
                pass
            per[name].append(rec)
    gaps, rows, summaries = [], [], {}
    for name, recs in per.items():
        ms = [r.summary() for r in recs]
        tps = [m["tokens_per_s"] or 0.0 for m in ms]
        mid = sorted(range(len(ms)), key=lambda i: tps[i])[len(ms) // 2]  # the median run, for the charts
        med = {key: statistics.median([m[key] for m in ms if m[key] is not None])
               for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "itl_p50_ms", "itl_max_ms")
               if any(m[key] is not None for m in ms)}
        summaries[name] = dict(ms[mid], **med, repeats=len(ms))
        g = recs[mid].gaps_frame()
        g["method"] = name
        gaps.append(g)
        rows.append(dict(method=name, **{key: med.get(key) for key in ("ttft_ms", "tpot_ms", "tokens_per_s",
                                                                      "itl_p50_ms", "itl_max_ms")},
                         repeats=len(ms)))
    names = [n for n, _, _ in runs]
    phases = _phases(target, runs, summaries, len(target.encode(s.prompt)) + s.max_new_tokens // 2)
    sp = speedup(summaries[names[-1]], summaries[names[0]]) if len(names) == 2 else None
    return {"gaps": pd.concat(gaps, ignore_index=True), "ttft": pd.DataFrame(rows), "metrics": summaries,
            "speedup": sp, "phases": phases}


def _phases(target, runs, summaries: dict, context: int):
    """ms per round and phase of each method (its median run), beside the floors measured now."""
    from ..analysis.bench_round import floor_phases, per_round_from_summary, phase_frame
    from ..analysis.sweep import new_drafter

    per = {name: per_round_from_summary(summaries[name]) for name, _, _ in runs}
    spec = [(spec, k) for _, spec, k in runs if spec]
    if spec:
        per.update(floor_phases(target, new_drafter(spec[0][0], target), spec[0][1], context))
    return phase_frame(per)
