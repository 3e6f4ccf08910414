"""``python benchmarks/tracker_fit.py``: how well the acceptance tracker predicts acceptance, per setting.

The adaptive policies decide from :class:`~speclab.engine.policies.AcceptanceTracker`'s per-row, per-position
estimates; its forgetting rate (``decay``) and its pull toward the population (``prior_weight``) trade a row
followed closely against estimates that jump at every miss. Which trade is right is a property of the
workloads, measured without any timing: greedy decoding with fixed k gives the same (drafted, accepted)
history on every run, and replaying those histories through a tracker scores each prediction it would have
made (the conditional acceptance of every position a round reached, before the round) by log-loss. The
tracker's defaults come from this fit (docs/policies.md)."""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import math
import time

from speclab.analysis.flags import write_json
from speclab.engine.policies import POSITION_PRIORS, AcceptanceTracker, PolicyView, RowView

GRID_DECAY = (0.8, 0.9, 0.95, 0.98)
GRID_WEIGHT = (1.0, 2.0, 4.0, 8.0, 16.0)
GRID_POP_DECAY = (0.9, 0.95, 0.98, 0.99, 0.995)
CONCURRENCY = 4  # requests side by side, when recording and when replaying


def replay_log_loss(histories: list[list[tuple[int, int]]], k_max: int, concurrency: int = CONCURRENCY,
                    **params) -> tuple[float, float, int]:
    """Mean log-loss and Brier score of a tracker's predictions over ``histories`` (one list of (drafted,
    accepted) rounds per request), and how many predictions were scored. Requests run ``concurrency`` at a
    time, round by round, one tracker for all (so the population estimate learns across requests, as in a
    run); before each round the tracker predicts c[i] = P(draft i accepted | drafts before it accepted) for
    every row, scored on the positions the round reached (i <= accepted, i < drafted: accepted when i <
    accepted). ``params``: the tracker's settings (decay, prior_weight, default, population_decay).
    e.g. one request, one round (1, 1), default 0.8: one prediction, 0.8 for a success: -ln 0.8 = 0.223."""
    tr = AcceptanceTracker(k_max, **params)
    loss = brier = 0.0
    n = 0
    for g in range(0, len(histories), concurrency):
        group = histories[g:g + concurrency]
        ids = [f"r{g + j}" for j in range(len(group))]
        for t in range(max((len(h) for h in group), default=0)):
            live = [j for j, h in enumerate(group) if t < len(h)]
            rows = tuple(RowView(ids[j], tuple(tuple(x) for x in group[j][:t])) for j in live)
            tr.update(PolicyView(rows, len(rows), 0))
            pop = tr.population()
            for j in live:
                d, a = group[j][t]
                c = tr.conditional(ids[j], pop)
                for i in range(min(d, a + 1, k_max)):
                    y = i < a
                    p = min(max(c[i], 1e-6), 1 - 1e-6)
                    loss -= math.log(p if y else 1.0 - p)
                    brier += (p - y) ** 2
                    n += 1
    return (loss / n, brier / n, n) if n else (float("nan"), float("nan"), 0)


def fit_table(histories: dict[str, list], k_max: int, concurrency: int = CONCURRENCY, decays=GRID_DECAY,
              weights=GRID_WEIGHT, priors=POSITION_PRIORS, pop_decays=GRID_POP_DECAY) -> dict:
    """Log-loss of every (decay, prior_weight) (with the default position prior and population decay), of every
    position prior (with the default decay and weight, columns 'prior=KIND') and of every population decay (columns
    'pop=D') on every key of ``histories`` ('workload:k' -> requests' histories), relative to the tracker's defaults;
    the setting with the lowest mean relative loss."""
    defaults = AcceptanceTracker(k_max)
    base_params = dict(decay=defaults.decay, prior_weight=defaults.w, position_prior=defaults.position_prior,
                       population_decay=defaults.pop_decay)
    settings = {f"{d}/{w}": dict(base_params, decay=d, prior_weight=w) for d in decays for w in weights}
    settings.update({f"prior={p}": dict(base_params, position_prior=p) for p in priors})
    settings.update({f"pop={p}": dict(base_params, population_decay=p) for p in pop_decays})
    rows = {}
    for key, hs in histories.items():
        base = replay_log_loss(hs, k_max, concurrency, **base_params)[0]
        rows[key] = {name: replay_log_loss(hs, k_max, concurrency, **params)[0] / base
                     for name, params in settings.items()}
    mean = {s: sum(r[s] for r in rows.values()) / len(rows) for s in next(iter(rows.values()))} if rows else {}
    best = min(mean, key=mean.get) if mean else None
    return {"defaults": base_params, "relative_log_loss": rows, "mean": mean, "best": best}


def record_histories(target, drafter_name: str, workloads: list[str], ks: list[int], concurrency: int,
                     max_new_tokens: int, prompts: int | None = None) -> dict[str, list]:
    """(drafted, accepted) per round of every request, greedy, fixed k, per 'workload:k'."""
    from speclab.analysis.bench_runs import at_concurrency
    from speclab.analysis.sweep import cached_model
    from speclab.drafters import make_drafter
    from speclab.engine import make_policy
    from speclab.workloads import load_workload

    out = {}
    for wl in workloads:
        texts = [p.prompt for p in load_workload(wl)][:prompts]
        ids = [target.encode(t) for t in texts]
        for k in ks:
            drafter = make_drafter(drafter_name, target, load=cached_model)
            _, _, reqs = at_concurrency(target, drafter, make_policy("fixed", k), ids, concurrency, max_new_tokens)
            out[f"{wl}:{k}"] = [[tuple(x) for x in r.history] for r in reqs]
    return out


def run_tracker_fit(args) -> int:
    from speclab.defaults import default_draft, setup_threads
    from speclab.models import load_model

    t0 = time.perf_counter()
    target = load_model(args.target or "target", device=args.device or "cpu", role="target")
    setup_threads(args.threads, target)
    drafter = args.draft or default_draft()
    workloads = [w for w in (args.workload or "json,code,tech_prose").split(",") if w]
    ks = [int(x) for x in (args.ks or "1,2,4").split(",")]
    hist = record_histories(target, drafter, workloads, ks, CONCURRENCY, args.max_new_tokens,
                            args.prompts_per_workload)
    k_max = max(ks)
    table = fit_table(hist, k_max)
    settings = list(table["mean"])
    d = table["defaults"]
    print(f"tracker fit: draft {drafter}, workloads {','.join(workloads)}, fixed k {ks}, {args.max_new_tokens} new "
          f"tokens, concurrency {CONCURRENCY}; log-loss relative to the defaults (decay {d['decay']}, "
          f"prior_weight {d['prior_weight']}, position prior {d['position_prior']}, population decay "
          f"{d['population_decay']}); lower is better")
    print("decay/weight".ljust(16) + "".join(s.rjust(max(10, len(s) + 1)) for s in settings))
    for key, r in table["relative_log_loss"].items():
        print(key.ljust(16) + "".join(f"{r[s]:.3f}".rjust(max(10, len(s) + 1)) for s in settings))
    print("mean".ljust(16) + "".join(f"{table['mean'][s]:.3f}".rjust(max(10, len(s) + 1)) for s in settings))
    print(f"best: {table['best']} ({table['mean'][table['best']]:.3f} of the defaults' log-loss); "
          f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, {**table, "draft": drafter, "workloads": workloads, "ks": ks,
                               "max_new_tokens": args.max_new_tokens, "histories": hist})
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import add_flags, parser, run

    p = parser("tracker_fit", "The acceptance tracker's settings scored by log-loss on fixed-k histories (no "
               "timing).")
    add_flags(p, "target", "draft", "workload", "ks", "max_new_tokens", "prompts", "device", "threads", "out",
              workload=dict(help="workloads (default json,code,tech_prose)"), ks=dict(help="fixed k values of the "
              "recorded histories (default 1,2,4)"))
    return run(p, run_tracker_fit, argv, "tracker_fit")


if __name__ == "__main__":
    sys.exit(main())
