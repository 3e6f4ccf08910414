"""``python benchmarks/suffix_decoding.py``: suffix decoding against prompt lookup and plain decoding.

Batch 1, greedy, on the family's workloads. For every prompt and repetition one rotation runs plain decoding,
then each method (in an order that shifts by one each repetition), then plain decoding again; a method's
speedup on a rotation is its tokens/s over the first plain run's, and the table gives the median over
rotations with the quartiles. The second plain run against the first is the A/A control: how far two
identical configurations land apart on this machine at that moment.

Methods: ``ngram`` (prompt lookup), ``suffix-match`` (the longest earlier match alone), ``suffix`` (suffix trees,
a fresh drafter: only the request's own prompt and output),
and ``suffix+cache`` (its global tree already holding the greedy outputs of the workload's *other* prompts,
as a server's drafter would after serving them; never the prompt's own output). Acceptance = accepted /
drafted tokens over all the runs of that method; tokens per round counts the bonus or recovered token.

Prints a table and writes ``suffix_decoding.json`` into ``--out`` (default ``results/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._cli import add_flags  # noqa: E402

METHODS = ("ngram", "suffix-match", "suffix", "suffix+cache")


def _run(target, drafter, prompt: str, k: int, new: int) -> dict:
    from speclab.engine import SpeculativeDecoder

    dec = SpeculativeDecoder(target, drafter)
    t0 = time.perf_counter()
    res = dec.generate([prompt], k=k if drafter is not None else 0, max_new_tokens=new, record=False)
    dt = time.perf_counter() - t0
    r = res.requests[0]
    return {"seconds": dt, "tokens": len(r.generated), "rounds": r.rounds, "drafted": r.drafted,
            "accepted": r.accepted, "output": list(r.generated)}


def _drafter(method: str, target, spec_options: str, others: list[list[int]]):
    from speclab.drafters import make_drafter

    if method in ("ngram", "suffix-match"):
        return make_drafter(method, target)
    d = make_drafter("suffix" + spec_options, target)
    if method == "suffix+cache":
        for out in others:
            d.remember(out)
    return d


def _summary(workload: str, method: str, runs: list[dict], speedups: list[float]) -> dict:
    s = sorted(speedups)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    return {"workload": workload, "method": method, "speedup": statistics.median(s), "q1": q[0], "q3": q[2],
            "pairs": len(s), "acceptance": accepted / drafted if drafted else None,
            "drafted_per_round": drafted / rounds if rounds else None,
            "tokens_per_round": tokens / rounds if rounds else None}


def run_workload(target, workload: str, args) -> list[dict]:
    from speclab.workloads import load_workload

    prompts = [p.prompt for p in load_workload(workload)][:args.prompts_per_workload]
    # the plain greedy outputs: the others' go into suffix+cache's global tree (greedy output is the same for
    # every method, so these are exactly what a server would have cached)
    outputs = [_run(target, None, p, 0, args.max_new_tokens)["output"] for p in prompts]
    names = list(args.methods)
    runs = {m: [] for m in names + ["plain again"]}
    speedups = {m: [] for m in names + ["plain again"]}
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for i, p in enumerate(prompts):
            others = outputs[:i] + outputs[i + 1:]
            base = _run(target, None, p, 0, args.max_new_tokens)
            rate = base["tokens"] / base["seconds"]
            for m in order:
                r = _run(target, _drafter(m, target, args.suffix_options, others), p, args.k, args.max_new_tokens)
                if r["output"] != base["output"]:
                    raise AssertionError(f"{m} changed the greedy output on {workload} prompt {i}")
                runs[m].append(r)
                speedups[m].append(r["tokens"] / r["seconds"] / rate)
            again = _run(target, None, p, 0, args.max_new_tokens)
            runs["plain again"].append(again)
            speedups["plain again"].append(again["tokens"] / again["seconds"] / rate)
    return [_summary(workload, m, runs[m], speedups[m]) for m in names + ["plain again"]]


def format_table(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    head = f"{'workload':<12}{'method':<14}{'speedup':>9}{'q1..q3':>13}{'pairs':>7}{'accept':>8}{'drafted/rnd':>12}" \
           f"{'tok/rnd':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:<12}{r['method']:<14}{f(r['speedup'], '.2f'):>8}x"
                     f"{f(r['q1'], '.2f') + '..' + f(r['q3'], '.2f'):>13}{r['pairs']:>7}"
                     f"{f(r['acceptance'], '.2f'):>8}{f(r['drafted_per_round'], '.2f'):>12}"
                     f"{f(r['tokens_per_round'], '.2f'):>9}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/suffix_decoding.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target model (default: the family's default target)")
    p.add_argument("--workload", default="all", help="comma list of workloads (default: all the family's)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list out of {', '.join(METHODS)}")
    p.add_argument("--suffix-options", default="",
                   help="options appended to the suffix spec, e.g. ':min_prob=0.2:factor=2' (default: none)")
    p.add_argument("-k", "--k", type=int, default=4, help="largest draft length (default 4)")
    add_flags(p, "prompts", prompts=dict(default=4, help="prompts per workload (default 4)"))
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per run (default 64)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: 1 for tiny models)")
    p.add_argument("--out", default="results", help="folder for suffix_decoding.json (default results/)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from speclab.defaults import default_target, setup_threads
    from speclab.drafters import make_drafter
    from speclab.errors import SpeclabError
    from speclab.limits import check_paired_run
    from speclab.models import load_model
    from speclab.workloads import load_workload, workload_names

    args = parse_args(argv)
    try:
        check_paired_run(args, "plain decoding is the baseline of every pair", k_flag="-k")
        args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in args.methods if m not in METHODS]
        if bad or not args.methods:
            raise SpeclabError(f"--methods: unknown {', '.join(bad) or '(empty)'} (known: {', '.join(METHODS)})")
        workloads = workload_names(args.workload)
        for w in workloads:
            load_workload(w)
        make_drafter("suffix" + args.suffix_options, None)  # a bad option fails before the model loads
        target = load_model(args.target or default_target())
        setup_threads(args.threads, target)
    except SpeclabError as e:
        print(f"suffix_decoding.py: error: {e}", file=sys.stderr)
        return 2
    import torch

    t0 = time.time()
    rows = []
    for w in workloads:
        rows += run_workload(target, w, args)
    print(f"batch 1, greedy, k = {args.k}, {args.prompts} prompts x {args.reps} reps per workload, "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} thread(s), suffix options "
          f"'{args.suffix_options or 'defaults'}'; speedup = tokens/s over plain decoding's in the same rotation "
          f"(median, quartiles); 'plain again' is the A/A control")
    print(format_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"k": args.k, "prompts": args.prompts, "reps": args.reps, "max_new_tokens": args.max_new_tokens,
           "threads": torch.get_num_threads(), "suffix_options": args.suffix_options,
           "wall_seconds": round(time.time() - t0, 1), "rows": rows}
    (out / "suffix_decoding.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out / 'suffix_decoding.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
