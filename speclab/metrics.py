"""Metrics built only from events.

Raw counters are recorded; ratios are derived when read. Definitions:

* ``acceptance_rate`` = accepted drafts / verified drafts (None when nothing was drafted).
* ``mean_accepted_length`` = tokens emitted per verification round and row, *counting* the
  recovered or bonus token the target adds every round: accepted / row_rounds + 1. Plain decoding
  scores 1.0; a perfect draft with k = 4 scores 5.0. (The first token, from prefill, is not a round.)
* ``per_position_acceptance[i]`` = P(draft i+1 accepted | it was verified), over row-rounds.
* ``ttft_ms``: run start to a row's first token (median over rows); ``tpot_ms``: a row's time after
  its first token divided by its remaining tokens (median over rows); ``tokens_per_s``: generated
  tokens of all rows / wall time; ``latency_p50_ms``/``p95``: per-row (request) completion time;
  ``itl_*``: gaps between consecutive tokens of a row (tokens of one round share a timestamp, so
  speculation streams in bursts: many zero gaps, then one long one).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from .events import Event, RoundEvent, RunFinished, RunStarted


def speedup(metrics: dict | None, baseline: dict | None, key: str = "tokens_per_s") -> float | None:
    """The one speedup: a run's throughput over its baseline's (same prompts and settings, k = 0).
    Accepts metric dicts (``tokens_per_s``) or plain numbers; None when either is missing."""
    a = metrics.get(key) if isinstance(metrics, dict) else metrics
    b = baseline.get(key) if isinstance(baseline, dict) else baseline
    if a is None or b is None or not b:
        return None
    return a / b


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    idx = (len(s) - 1) * q
    lo, hi = int(idx), min(int(idx) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (idx - lo)


class Recorder:
    """A hook subscriber that keeps one run's events and derives its metrics."""

    def __init__(self, lm=None):
        self.lm = lm  # for token text
        self.start: RunStarted | None = None
        self.rounds: list[RoundEvent] = []
        self.finished: RunFinished | None = None

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, RunStarted):
            if self.start is None:
                self.start = ev
        elif isinstance(ev, RoundEvent):
            if self.start is not None and ev.run_id == self.start.run_id:
                self.rounds.append(ev)
        elif isinstance(ev, RunFinished):
            if self.start is not None and ev.run_id == self.start.run_id:
                self.finished = ev

    # ------------------------------------------------------------------ counters
    def counters(self) -> dict:
        drafted = accepted = row_rounds = 0
        pos_drafted: dict[int, int] = defaultdict(int)
        pos_accepted: dict[int, int] = defaultdict(int)
        phase: dict[str, float] = defaultdict(float)
        for ev in self.rounds:
            for name, t in ev.timings.items():
                phase[name] += t
            if ev.phase == "prefill":
                continue
            for rr in ev.rows:
                row_rounds += 1
                drafted += rr.num_drafted
                accepted += rr.num_accepted
                for i in range(rr.num_drafted):
                    pos_drafted[i] += 1
                    if i < rr.num_accepted:
                        pos_accepted[i] += 1
        return dict(drafted=drafted, accepted=accepted, row_rounds=row_rounds,
                    rounds=sum(1 for ev in self.rounds if ev.phase != "prefill"),
                    pos_drafted=dict(pos_drafted), pos_accepted=dict(pos_accepted), phase_s=dict(phase))

    def token_times(self) -> dict[int, list[float]]:
        """Row -> host time at which each emitted token became known."""
        times: dict[int, list[float]] = defaultdict(list)
        for ev in self.rounds:
            for rr in ev.rows:
                times[rr.row].extend([ev.time] * len(rr.emitted))
        return times

    def summary(self) -> dict:
        c = self.counters()
        t0 = self.start.time if self.start else 0.0
        wall = self.finished.wall_s if self.finished else (self.rounds[-1].time - t0 if self.rounds else 0.0)
        times = self.token_times()
        n_tokens = sum(len(v) for v in times.values())
        ttft = [(v[0] - t0) * 1e3 for v in times.values() if v]
        tpot = [(v[-1] - v[0]) * 1e3 / (len(v) - 1) for v in times.values() if len(v) > 1]
        lat = [(v[-1] - t0) * 1e3 for v in times.values() if v]
        gaps = [(b - a) * 1e3 for v in times.values() for a, b in zip(v, v[1:])]
        k = self.start.k if self.start else 0
        npos = max(c["pos_drafted"], default=-1) + 1
        ppa = [c["pos_accepted"].get(i, 0) / c["pos_drafted"][i] for i in range(npos) if c["pos_drafted"].get(i)]
        return {
            "acceptance_rate": c["accepted"] / c["drafted"] if c["drafted"] else None,
            "mean_accepted_length": c["accepted"] / c["row_rounds"] + 1 if c["row_rounds"] else None,
            "per_position_acceptance": ppa,
            "rounds": c["rounds"],
            "row_rounds": c["row_rounds"],
            "drafted_tokens": c["drafted"],
            "accepted_tokens": c["accepted"],
            "generated_tokens": n_tokens,
            "wall_s": wall,
            "tokens_per_s": n_tokens / wall if wall > 0 else None,
            "ttft_ms": statistics.median(ttft) if ttft else None,
            "tpot_ms": statistics.median(tpot) if tpot else None,
            "latency_p50_ms": _pct(lat, 0.5),
            "latency_p95_ms": _pct(lat, 0.95),
            "itl_p50_ms": _pct(gaps, 0.5),
            "itl_p95_ms": _pct(gaps, 0.95),
            "itl_max_ms": max(gaps) if gaps else None,
            "phase_ms": {name: t * 1e3 for name, t in c["phase_s"].items()},
            "k": k,
            "batch": self.start.batch_size if self.start else None,
            "drafter": self.start.drafter if self.start else None,
            "policy": self.start.policy if self.start else None,
            "seeds": list(self.start.seeds) if self.start else [],
        }

    # ------------------------------------------------------------------ per token
    def token_dicts(self) -> list[list[dict]]:
        """Per row: {token, text, status, round, draft_prob, target_prob} in display order."""
        rows: dict[int, list[dict]] = defaultdict(list)
        for ev in self.rounds:
            for rr in ev.rows:
                for t in rr.tokens:
                    text = t.text or (self.lm.token_text(t.token) if self.lm is not None else "")
                    rows[rr.row].append({"token": t.token, "text": text, "status": t.status, "round": ev.round,
                                         "draft_prob": t.draft_prob, "target_prob": t.target_prob})
        n = self.start.batch_size if self.start else (max(rows) + 1 if rows else 0)
        return [rows.get(b, []) for b in range(n)]

    def tokens_frame(self):
        import pandas as pd

        recs = [dict(row=b, **d) for b, row in enumerate(self.token_dicts()) for d in row]
        return pd.DataFrame(recs, columns=["row", "token", "text", "status", "round", "draft_prob", "target_prob"])

    def rounds_frame(self):
        """One line per round and row: drafted, accepted, emitted, the chosen k and why, phase timings,
        time since start."""
        import pandas as pd

        t0 = self.start.time if self.start else 0.0
        recs = []
        for ev in self.rounds:
            for rr in ev.rows:
                recs.append(dict(round=ev.round, phase=ev.phase, row=rr.row, drafted=rr.num_drafted,
                                 accepted=rr.num_accepted, emitted=len(rr.emitted), k=rr.k, k_reason=rr.k_reason,
                                 running=ev.running, waiting=ev.waiting, t_ms=(ev.time - t0) * 1e3,
                                 **{f"{k}_ms": v * 1e3 for k, v in ev.timings.items()}))
        return pd.DataFrame(recs)

    def gaps_frame(self):
        """Inter-token gaps per row (ms)."""
        import pandas as pd

        t0 = self.start.time if self.start else 0.0
        recs = []
        for row, v in self.token_times().items():
            prev = t0
            for i, t in enumerate(v):
                recs.append(dict(row=row, index=i, t_ms=(t - t0) * 1e3, gap_ms=(t - prev) * 1e3))
                prev = t
        return pd.DataFrame(recs)

    def frame(self):
        """The summary as a one-line DataFrame."""
        import pandas as pd

        s = dict(self.summary())
        s["per_position_acceptance"] = str([round(x, 3) for x in s["per_position_acceptance"]])
        s.pop("phase_ms")
        return pd.DataFrame([s])
