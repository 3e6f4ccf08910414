"""``speclab bench heldout``: every drafter against plain decoding on text the family never trained on.

The held-out workloads (``datasets/heldout_{json,code,prose}.jsonl``, see ``scripts/build_heldout.py``) at
batch 1, greedy: for each prompt and repetition one rotation runs plain decoding, every method, then plain
decoding again, in an order that shifts by one each repetition. A method's speedup on a rotation is its
tokens/s over the first plain run's; the table gives the median over rotations (and the quartiles), the
acceptance rate and tokens per round. The second plain run against the first is the A/A control: how far
apart two identical configurations land on this machine. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from ..workloads import HELDOUT_WORKLOADS
from .flags import out_path, write_json

DEFAULT_METHODS = ("default", "eagle", "ngram", "suffix", "eagle+suffix")


@dataclass
class Counter:
    """Subscriber: drafted and accepted tokens and rounds (no probabilities asked for)."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def __call__(self, ev) -> None:
        if getattr(ev, "phase", None) != "verify":
            return
        self.rounds += 1
        for rr in ev.rows:
            self.drafted += rr.num_drafted
            self.accepted += rr.num_accepted


@dataclass
class Cell:
    workload: str
    method: str
    speedups: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    tokens: int = 0

    def summary(self) -> dict:
        s = sorted(self.speedups)
        q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0], s[0], s[0]] if s else [float("nan")] * 3
        return {"workload": self.workload, "method": self.method, "speedup": statistics.median(s) if s else None,
                "q1": q[0], "q3": q[2], "pairs": len(s),
                "acceptance": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_round": self.tokens / self.rounds if self.rounds else None}


def _timed(decoder, prompt: str, k: int, max_new_tokens: int) -> tuple[float, int, Counter]:
    c = Counter()
    unsub = decoder.hooks.subscribe(c, probs=False)
    try:
        t0 = time.perf_counter()
        res = decoder.generate(prompt, k=k, max_new_tokens=max_new_tokens, temperature=0.0, record=False)
        dt = time.perf_counter() - t0
    finally:
        unsub()
    return dt, len(res.output_tokens[0]), c


def run_heldout(target, methods: dict[str, object], k: int, workloads: list[str], prompts_per: int, reps: int,
                max_new_tokens: int, make=None) -> list[dict]:
    """``methods``: name -> drafter spec; ``make(spec)`` gives a fresh drafter (default: make_drafter)."""
    from ..drafters.registry import make_drafter
    from ..engine.decoder import SpeculativeDecoder
    from ..workloads import load_workload

    make = make or (lambda spec: make_drafter(spec, target))
    cells: dict[tuple[str, str], Cell] = {}
    names = list(methods)
    for w in workloads:
        prompts = [p.prompt for p in load_workload(w)[:prompts_per]]
        for name in ["plain again", *names]:
            cells[(w, name)] = Cell(w, name)
        for p in prompts:  # warm every path on this workload
            for name in names[:1]:
                SpeculativeDecoder(target, make(methods[name])).generate(p, k=k, max_new_tokens=8, record=False)
        for rep in range(reps):
            for p in prompts:
                order = names[rep % len(names):] + names[:rep % len(names)] if names else []
                t_plain, n_plain, _ = _timed(SpeculativeDecoder(target, None), p, 0, max_new_tokens)
                base = n_plain / t_plain
                for name in order:
                    dt, n, c = _timed(SpeculativeDecoder(target, make(methods[name])), p, k, max_new_tokens)
                    cell = cells[(w, name)]
                    cell.speedups.append((n / dt) / base)
                    cell.drafted += c.drafted
                    cell.accepted += c.accepted
                    cell.rounds += c.rounds
                    cell.tokens += n
                t2, n2, _ = _timed(SpeculativeDecoder(target, None), p, 0, max_new_tokens)
                cells[(w, "plain again")].speedups.append((n2 / t2) / base)
    return [c.summary() for c in cells.values()]


def format_table(rows: list[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"{'workload':<15}{'method':<22}{'speedup':>9}{'q1..q3':>14}{'pairs':>7}{'accept':>8}{'tok/rnd':>9}"]
    for r in rows:
        lines.append(f"{r['workload']:<15}{r['method']:<22}{f(r['speedup'], '.2f'):>8}x"
                     f"{f(r['q1'], '.2f') + '..' + f(r['q3'], '.2f'):>14}{r['pairs']:>7}{f(r['acceptance'], '.2f'):>8}"
                     f"{f(r['tokens_per_round'], '.2f'):>9}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    from .flags import add_flags

    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list of drafter specs; 'default' is the family's default draft (default: "
                        + ",".join(DEFAULT_METHODS) + ")")
    add_flags(p, "target", "workload", "k", "prompts", "reps", "max_new_tokens", "threads", "out",
              workload=dict(default=",".join(HELDOUT_WORKLOADS), help="comma list of workloads (default: the "
                                                                      "three held-out ones)"),
              prompts=dict(default=4, help="prompts per workload (default 4)"),
              reps=dict(default=2, help="interleaved repetitions (default 2)"))


def run_from_args(args) -> int:
    import torch

    from ..defaults import default_draft, default_target, setup_threads
    from ..errors import SpeclabError
    from ..limits import check_paired_run
    from ..models import load_model
    from ..workloads import load_workload, workload_names

    check_paired_run(args, "plain decoding is the baseline every method is paired with")
    workloads = workload_names(args.workload)
    for w in workloads:
        load_workload(w)  # a bad name fails before any model loads
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    if not specs:
        raise SpeclabError("--methods is empty")
    target = load_model(args.target or default_target())
    setup_threads(args.threads, target)
    methods = {(f"{default_draft()} (default)" if s == "default" else s): (default_draft() if s == "default" else s)
               for s in specs}
    from ..drafters.registry import make_drafter

    for spec in methods.values():
        make_drafter(spec, target)  # a bad spec fails before the runs
    rows = run_heldout(target, methods, args.k, workloads, args.prompts_per_workload, args.reps,
                       args.max_new_tokens)
    print(f"batch 1, greedy, k = {args.k}, {args.prompts_per_workload} prompts x {args.reps} reps per workload, "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} thread(s); speedup = tokens/s over plain "
          f"decoding's in the same rotation (median, quartiles); 'plain again' is the A/A control")
    print(format_table(rows))
    write_json(out_path(args, "heldout"), {"k": args.k, "prompts": args.prompts_per_workload, "reps": args.reps,
                                           "max_new_tokens": args.max_new_tokens, "rows": rows})
    return 0


def main(argv=None) -> int:
    import argparse
    import sys

    from ..errors import SpeclabError

    p = argparse.ArgumentParser(prog="speclab bench heldout", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    try:
        return run_from_args(p.parse_args(argv))
    except SpeclabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
