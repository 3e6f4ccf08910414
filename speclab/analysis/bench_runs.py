"""How the policy benchmarks run their configurations (``speclab bench policies`` and ``synthetic``): the grid
and flags they share, bursts at a concurrency level (:func:`at_concurrency`: every request queued, a finished row
replaced at once, as a server runs), and several configurations interleaved step by step (:func:`lockstep`,
:func:`interleave`: this machine's speed drifts by tens of percent over seconds, and steps a few milliseconds apart
see the same one).
"""

from __future__ import annotations

import json
import math
import sys
import time

from ..limits import MAX_BATCH, MAX_K, parse_numbers

QUICK = dict(batches=(1, 4, 16, 64), fixed_ks=(1, 2, 4), max_new_tokens=32, prompts=4)
FULL = dict(batches=(1, 2, 4, 8, 16, 32, 64, 128), fixed_ks=(1, 2, 3, 4, 6, 8), max_new_tokens=64, prompts=8)
SYNTH = dict(alphas=(0.3, 0.5, 0.7, 0.9), ks=(1, 2, 4, 8), batches=(1, 4, 16, 64))
PROMPT_TOKENS = 32  # synthetic: prompts cut to this many tokens


def int_list(s, default, what: str, hi: float) -> list[int]:
    """A comma list of whole numbers >= 1 (batches; fixed k, where k = 0 is plain decoding, always measured)."""
    return parse_numbers(s, what, integer=True, hi=hi) if s else list(default)


def rate_list(s, default, what: str) -> list[float]:
    return parse_numbers(s, what, lo=0, lo_open=False, hi=1) if s else list(default)


def clock_named(name: str):
    return time.process_time if name == "process" else time.perf_counter


def grid(args, synthetic: bool = False) -> dict:
    g = dict(FULL if args.full else QUICK)
    if synthetic:
        g["batches"] = FULL["batches"] if args.full else SYNTH["batches"]
        g["fixed_ks"] = SYNTH["ks"]
    if args.full:
        g["max_new_tokens"] = args.max_new_tokens
    else:
        g["max_new_tokens"] = min(args.max_new_tokens, QUICK["max_new_tokens"])
    g["prompts"] = args.prompts_per_workload or g["prompts"]
    g["batches"] = int_list(args.batches, g["batches"], "--batches", MAX_BATCH)
    g["fixed_ks"] = int_list(args.ks, g["fixed_ks"], "--k (plain decoding, k = 0, is always there)",
                          MAX_K)
    g["reps"] = args.reps or 3
    g["workload"] = args.workload or ("all" if args.full or synthetic else "json,code")
    return g


def mixed_stream(names: list[str]) -> list[tuple[str, str]]:
    """The workloads' prompts interleaved, each with its workload: (w1, w1[0]), (w2, w2[0]), ..., (w1, w1[1]), ..."""
    from ..workloads import load_workload

    lists = [(w, [p.prompt for p in load_workload(w)]) for w in names]
    return [(w, ps[i]) for i in range(max(len(p) for _, p in lists)) for w, ps in lists if i < len(ps)]


def mixed_prompts(names: list[str]) -> list[str]:
    """The workloads' prompts interleaved: w1[0], w2[0], ..., w1[1], w2[1], ... (:func:`mixed_stream`)."""
    return [p for _, p in mixed_stream(names)]


def setup(args):
    from ..defaults import default_draft, setup_threads
    from ..models import load_model

    target = load_model(args.target, device=args.device, role="target")
    setup_threads(args.threads or 1, target)
    return target, args.draft or default_draft()


def logger(args):
    return (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))


def write_report(args, report: dict, text: str) -> int:
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def gmean(xs) -> float:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def budgets(max_new_tokens: int | list[int], n: int) -> list[int]:
    """Each of ``n`` requests' token budget: one number for all, or a list of one per request."""
    return [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)


def _burst(target, drafter, policy, prompts: list[list[int]], concurrency: int, max_new_tokens: int | list[int],
           costs, seed: int):
    """One scheduler of at most ``concurrency`` rows with every prompt queued (greedy, ``max_new_tokens`` each, or a
    list of one budget per prompt): (scheduler, requests). No drafter: plain decoding. Adaptive policies record step
    costs; fixed k does not."""
    from ..engine import Off, Request, Scheduler
    from ..engine.sampling import SamplingParams

    pol = policy if drafter is not None else Off()
    lens = budgets(max_new_tokens, len(prompts))
    longest = max(len(p) + m for p, m in zip(prompts, lens))
    sched = Scheduler(target, drafter, pol, max_running=concurrency, max_waiting=len(prompts), max_len=longest,
                      capacity=concurrency, costs=costs, record_costs=pol.name not in ("fixed", "off"))
    reqs = [Request(list(p), m, SamplingParams(), seed=seed + i, request_id=f"bench-{i}")
            for i, (p, m) in enumerate(zip(prompts, lens))]
    for r in reqs:
        sched.submit(r)
    return sched, reqs


def at_concurrency(target, drafter, policy, prompts: list[list[int]], concurrency: int,
                   max_new_tokens: int | list[int], costs=None, seed: int = 0, clock=time.perf_counter):
    """Decode ``prompts`` (token ids, greedy) through one scheduler that runs at most ``concurrency`` rows,
    every request queued at the start, so a finished row is replaced at once (continuous batching, as a
    server runs under a burst of requests), to the last token. Every configuration does the same work
    (every prompt prefilled, every token generated), so throughputs compare fairly; a window cut while
    requests are still running would not (plain decoding moves its rows in lockstep, speculation does
    not, so the partial progress inside the window differs). Returns (tokens generated, seconds,
    requests)."""
    sched, reqs = _burst(target, drafter, policy, prompts, concurrency, max_new_tokens, costs, seed)
    t = clock()
    sched.run_until_idle()
    spent = clock() - t
    return sum(len(r.generated) for r in reqs), spent, reqs


def lockstep(target, runs: list[tuple], prompts: list[list[int]], concurrency: int,
             max_new_tokens: int | list[int], costs=None, seed: int = 0, clock=time.perf_counter, offset: int = 0,
             shuffle=None) -> list[tuple[int, float, list]]:
    """:func:`at_concurrency` for several configurations at once, interleaved step by step: ``runs`` is a list of
    (drafter or None, policy) pairs, each with its own scheduler over the same ``prompts``; one cycle steps every
    unfinished scheduler once (the order rotating each cycle, starting at ``offset``, or shuffled each cycle by
    ``shuffle``, a ``random.Random``: :func:`interleave`), and each configuration is
    charged the time of its own steps. This machine's speed drifts by tens of percent over seconds (other work on
    the host); configurations run one after another see different speeds, while steps a few milliseconds apart see
    the same one, so ratios between configurations are far tighter. Returns (tokens generated, seconds, requests)
    per run, in order. ``costs``: one table for every run, or a list of one per run."""
    tables = costs if isinstance(costs, list) else [costs] * len(runs)
    scheds, reqs = zip(*[_burst(target, drafter, policy, prompts, concurrency, max_new_tokens, table, seed)
                         for (drafter, policy), table in zip(runs, tables)])
    spent = interleave(scheds, clock, offset, shuffle)
    return [(sum(len(r.generated) for r in rs), t, rs) for rs, t in zip(reqs, spent)]


def interleave(scheds, clock=time.perf_counter, offset: int = 0, shuffle=None) -> list[float]:
    """Step every scheduler that is not idle once per cycle (the order rotating each cycle, starting at ``offset``;
    with ``shuffle``, a ``random.Random``, a fresh order each cycle) until all are idle; returns the seconds each one's
    own steps took. Configurations stepped a few milliseconds apart see the same machine speed (see :func:`lockstep`).
    Rotated, every configuration runs after the same one (but at the turn of the order): on the CPU a step after one
    that read the other layout of the weights runs them cold, so a configuration's neighbour shows in its time.
    Shuffled, every configuration follows every other equally often."""
    spent = [0.0] * len(scheds)
    live = [i for i, s in enumerate(scheds) if not s.idle]
    cycle = offset
    while live:
        if shuffle is not None:
            order = shuffle.sample(live, len(live))
        else:
            j = cycle % len(live)
            order = live[j:] + live[:j]
        for i in order:
            t = clock()
            scheds[i].step()
            spent[i] += clock() - t
        live = [i for i in live if not scheds[i].idle]
        cycle += 1
    return spent
