"""``python benchmarks/few_rows.py``: what the few-row kernel (kernels/few_rows.c) buys the target's forward.

The target is loaded twice in one process: once with the kernel and once as the engine runs without it (W^T,
and W as given for 2-10 rows when the weights exceed the cache). Per shape (rows x tokens), one cached forward
is timed on each, every shape and model in each repetition, with a third timing of the kernel model as the A/A
control; medians. The table gives each forward against its own one-row step (the verify's price in plain
steps) and the kernel's against torch's. Greedy outputs of plain decoding and of speculation with the default
drafter must be identical on both models (printed).

    python benchmarks/few_rows.py --reps 40 --out results/few_rows

Prints a table and writes JSON (``--out DIR``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import statistics
import time

from benchmarks._cli import add_flags, parser, run

SHAPES = ((1, 1), (1, 2), (1, 3), (1, 5), (1, 8), (2, 1), (4, 1), (2, 5))
PROMPTS = ('{"service": "billing", "replicas": 3, "ports": [', "def parse_version(text):\n    ", "The river")


def load_both(name: str):
    """(the target with the kernel, the target as the engine runs it without); None if the kernel cannot run."""
    from speclab.kernels import few_rows
    from speclab.models import load_model

    if few_rows.load() is None:
        return None
    fast = load_model(name, device="cpu", role="target")
    with few_rows.disabled("off for the comparison"):
        plain = load_model(name, device="cpu", role="target")
    assert fast.native.few_rows and not plain.native.few_rows
    return fast, plain


def time_forwards(models: dict, shapes, reps: int, context: int) -> list[dict]:
    import torch

    widest = max(n for n, _ in shapes)
    caches = {}
    for name, lm in models.items():
        c = lm.new_cache(widest, context + max(t for _, t in shapes) + 1)
        c.forward(torch.randint(0, 100, (widest, context)), torch.zeros(widest, dtype=torch.long), kv_len=context,
                  rows=slice(0, widest))
        caches[name] = c
    runs = ("kernel", "torch", "kernel_again")  # the third: the A/A control, the same model read twice
    toks = {shape: torch.randint(0, 100, shape) for shape in shapes}
    got = {(shape, r): [] for shape in shapes for r in runs}
    with torch.inference_mode():
        # every shape and model in each repetition, the order reversed every other one: a slow spell of a
        # shared machine lands on all of them alike
        for i in range(reps + 1):
            for shape in (shapes if i % 2 else shapes[::-1]):
                n, T = shape
                for r in (runs if i % 2 else runs[::-1]):
                    cache = caches["torch" if r == "torch" else "kernel"]
                    t0 = time.perf_counter()
                    cache.forward(toks[shape], torch.full((n,), context), kv_len=context + T, rows=slice(0, n))
                    if i:
                        got[(shape, r)].append(time.perf_counter() - t0)
    out = [{"rows": n, "tokens": T, **{f"{r}_ms": 1e3 * statistics.median(got[((n, T), r)]) for r in runs}}
           for n, T in shapes]
    one = next(r for r in out if (r["rows"], r["tokens"]) == (1, 1))
    for r in out:
        r["kernel_over_plain_step"] = r["kernel_ms"] / one["kernel_ms"]
        r["torch_over_plain_step"] = r["torch_ms"] / one["torch_ms"]
        r["kernel_over_torch"] = r["kernel_ms"] / r["torch_ms"]
        r["aa"] = r["kernel_again_ms"] / r["kernel_ms"]
    return out


def identical_outputs(fast, plain, drafter_name: str) -> bool:
    from speclab.analysis.sweep import new_drafter
    from speclab.engine import SpeculativeDecoder

    outs = []
    for lm in (fast, plain):
        got = []
        for spec, k in ((None, 0), (drafter_name, 4)):
            dec = SpeculativeDecoder(lm, new_drafter(spec, lm) if spec else None)
            got.append(dec.generate(list(PROMPTS), k=k, max_new_tokens=32, record=False).output_tokens)
        outs.append(got)
    return outs[0][0] == outs[0][1] == outs[1][0] == outs[1][1]


def run_few_rows(args) -> int:
    from speclab.analysis.flags import write_json
    from speclab.defaults import default_drafter, setup_threads
    from speclab.kernels import few_rows
    from speclab.tables import num

    both = load_both(args.target)
    if both is None:
        print(f"benchmarks/few_rows.py: the kernel does not run here: {few_rows.reason()}")
        return 1
    fast, plain = both
    setup_threads(args.threads, fast)
    rows = time_forwards({"kernel": fast, "torch": plain}, SHAPES, args.reps or 30, args.context)
    same = identical_outputs(fast, plain, default_drafter())
    print(f"target {args.target}, cached forwards after {args.context} positions, medians of {args.reps or 30} "
          "interleaved runs (ms)")
    head = f"{'rows x tokens':>13} {'kernel':>8} {'torch':>8} {'kernel/torch':>12} {'kernel/step':>11} " \
           f"{'torch/step':>10} {'A/A':>6}"
    print(head)
    for r in rows:
        print(f"{r['rows']:>6} x {r['tokens']:<4} {num(r['kernel_ms'], '.3f'):>8} {num(r['torch_ms'], '.3f'):>8} "
              f"{num(r['kernel_over_torch'], '.2f'):>11}x {num(r['kernel_over_plain_step'], '.2f'):>10}x "
              f"{num(r['torch_over_plain_step'], '.2f'):>9}x {num(r['aa'], '.2f'):>5}x")
    print(f"greedy outputs identical (plain and speculative, with and without the kernel): {same}")
    write_json(args.json, {"target": args.target, "context": args.context, "reps": args.reps or 30,
                           "forwards": rows, "identical_outputs": same})
    return 0 if same else 1


def build_parser():
    p = parser("few_rows", "the few-row kernel against torch's matmul in the target's forward")
    add_flags(p, "target", "reps", "threads", "out")
    p.add_argument("--context", type=int, default=128, help="cached positions before the timed forward")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), run_few_rows, argv, "few_rows")


if __name__ == "__main__":
    sys.exit(main())
