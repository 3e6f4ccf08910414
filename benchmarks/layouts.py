"""``python benchmarks/layouts.py``: which matmul weight layout is faster on this CPU, per number of activation
rows, and what the engine's choice (:data:`speclab.models.native_llama.FEW_ROWS`) buys end to end. These are torch's
layouts, which the engine uses where the few-row kernel cannot run (``benchmarks/few_rows.py`` compares the two), so
the models here are built without it.

1. **Forwards.** For each model (the target and the draft) and each shape (rows x tokens), one cached
   forward timed with every matmul on the stored W^T (``x @ W^T``) and with every matmul on W as given
   (``F.linear``), interleaved, medians. A model that fits in the cache keeps one layout and is timed on it
   only.
2. **End to end.** ``generate`` on the same prompts with the engine's choice and with W^T everywhere (the
   engine before the choice), interleaved, by this process's CPU time: plain decoding and speculative at
   each k, at each batch size. Outputs must be identical between the two (the check is printed).

Prints two tables and writes JSON (``--out DIR``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import contextlib
import statistics
import time
from pathlib import Path

from speclab.analysis.flags import write_json
from speclab.tables import num

SHAPES = ((1, 1), (1, 2), (1, 3), (1, 5), (2, 1), (4, 1), (8, 1), (2, 5), (12, 1), (16, 1), (32, 1), (8, 5))


@contextlib.contextmanager
def rows_on_linear(lo: int, hi: int):
    """Within the block, matmuls with lo..hi activation rows use F.linear(x, W) (models with both layouts)."""
    from speclab.models import native_llama

    old = native_llama.FEW_ROWS
    native_llama.FEW_ROWS = (lo, hi)
    try:
        yield
    finally:
        native_llama.FEW_ROWS = old


NEVER = (2, 1)  # an empty range: every matmul on W^T
ALWAYS = (2, 1 << 30)  # every matmul with 2+ rows on W


def time_forwards(lm, shapes, reps: int, context: int = 80) -> list[dict]:
    """Per shape: median seconds of one cached forward with W^T everywhere and with W for 2+ rows."""
    import torch

    widest = max(n for n, _ in shapes)
    cache = lm.new_cache(widest, context + max(t for _, t in shapes) + 1)
    cache.forward(torch.randint(0, 100, (widest, context)), torch.zeros(widest, dtype=torch.long), kv_len=context,
                  rows=slice(0, widest))
    modes = {"w_t": NEVER, "w": ALWAYS} if lm.native.both_layouts else {"w_t": NEVER}

    def once(n, T):
        tok = torch.randint(0, 100, (n, T))
        t0 = time.perf_counter()
        cache.forward(tok, torch.full((n,), context), kv_len=context + T, rows=slice(0, n))
        return time.perf_counter() - t0

    out = []
    for n, T in shapes:
        got: dict[str, list[float]] = {m: [] for m in modes}
        for m, rng in modes.items():  # warm-up
            with rows_on_linear(*rng):
                once(n, T)
        for i in range(reps):
            for m in (list(modes) if i % 2 else list(modes)[::-1]):
                with rows_on_linear(*modes[m]):
                    got[m].append(once(n, T))
        row = {"rows": n, "tokens": T, "M": n * T, **{f"{m}_ms": 1e3 * statistics.median(v) for m, v in got.items()}}
        if "w_ms" in row:
            row["w_over_w_t"] = row["w_ms"] / row["w_t_ms"]
        out.append(row)
    return out


def end_to_end(target, drafter, prompts: list[str], batches, ks, reps: int, max_new_tokens: int) -> list[dict]:
    """Per (batch, k): tokens/s by process CPU time with the engine's choice and with W^T everywhere."""
    from speclab.engine import SpeculativeDecoder
    from speclab.models import native_llama

    dec = SpeculativeDecoder(target, drafter)
    modes = {"chosen": native_llama.FEW_ROWS, "w_t_only": NEVER}
    rows = []
    for B in batches:
        for k in ks:
            tps: dict[str, list[float]] = {m: [] for m in modes}
            outs: dict[str, list] = {m: [] for m in modes}
            for i in range(reps + 1):  # the first is a warm-up
                group = [prompts[(i * B + j) % len(prompts)] for j in range(B)]
                for m in (list(modes) if i % 2 else list(modes)[::-1]):
                    with rows_on_linear(*modes[m]):
                        t0 = time.process_time()
                        res = dec.generate(group, k=k, max_new_tokens=max_new_tokens, record=False)
                        dt = time.process_time() - t0
                    if i:
                        tps[m].append(sum(len(o) for o in res.output_tokens) / dt)
                        outs[m].append(res.output_tokens)
            ratios = [a / b for a, b in zip(tps["chosen"], tps["w_t_only"])]
            rows.append({"batch": B, "k": k, "chosen_tok_s": statistics.median(tps["chosen"]),
                         "w_t_only_tok_s": statistics.median(tps["w_t_only"]), "ratio": statistics.median(ratios),
                         "ratios": ratios, "identical": outs["chosen"] == outs["w_t_only"]})
    return rows


def run_layouts_bench(args) -> int:
    from speclab.analysis.sweep import cached_model
    from speclab.defaults import default_draft, default_target, setup_threads
    from speclab.drafters import make_drafter
    from speclab.kernels import few_rows
    from speclab.models import load_model, native_llama
    from speclab.workloads import load_workload

    draft_name = args.draft or default_draft()
    with few_rows.disabled("torch's layouts are what this compares"):
        target = load_model(args.target or default_target(), device="cpu", role="target")
        drafter = make_drafter(draft_name, target, load=cached_model)
    setup_threads(args.threads, target)
    if target.native is None:
        print("benchmarks/layouts.py: the target does not run on the native backend; nothing to compare")
        return 1
    reps = args.reps or 15
    t0 = time.perf_counter()
    forwards = {target.name: time_forwards(target, SHAPES, reps)}
    dlm = getattr(drafter, "lm", None)
    if dlm is not None and dlm.native is not None:
        forwards[dlm.name] = time_forwards(dlm, SHAPES, reps)
    wl = (args.workload or "json").split(",")[0]
    prompts = [p.prompt for p in load_workload(wl)]
    batches = [int(b) for b in (args.batches or "1,4").split(",")]
    ks = [int(k) for k in (args.ks or "0,2,4").split(",")]
    e2e = end_to_end(target, drafter, prompts, batches, ks, max(3, reps // 3) if args.reps else 6,
                     args.max_new_tokens)
    lo, hi = native_llama.FEW_ROWS
    lines = [f"forwards (ms, median of {reps}, interleaved): W^T everywhere vs W for every matmul of 2+ rows; "
             f"the engine uses W for {lo}..{hi} rows in a model kept in both layouts"]
    for name, rows in forwards.items():
        both = "w_ms" in rows[0]
        lines.append(f"[{name}] {'both layouts' if both else 'fits in the cache: W^T only'}")
        lines.append("  rows x tokens      M     W^T        W    W/W^T  engine")
        for r in rows:
            use = "W" if both and lo <= r["M"] <= hi else "W^T"
            lines.append(f"  {r['rows']:>4} x {r['tokens']:<6} {r['M']:>5} {r['w_t_ms']:>7.2f}  "
                         f"{num(r.get('w_ms'), '.2f'):>7}  {num(r.get('w_over_w_t'), '.2f'):>7}  {use}")
    lines.append(f"end to end on {wl}, {args.max_new_tokens} new tokens, draft {draft_name} (tokens/s by process CPU "
                 f"time, medians; ratio = median of the interleaved pairs)")
    lines.append(" batch  k   engine's choice   W^T only   ratio  outputs identical")
    for r in e2e:
        lines.append(f" {r['batch']:>5} {r['k']:>2}   {r['chosen_tok_s']:>15.1f} {r['w_t_only_tok_s']:>10.1f}  "
                     f"{r['ratio']:>6.2f}  {r['identical']}")
    lines.append(f"({time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines))
    if args.json:
        write_json(args.json, {"few_rows": [lo, hi], "forwards": forwards, "end_to_end": e2e, "workload": wl,
                               "draft": draft_name})
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import add_flags, parser, run

    p = parser("layouts", "Matmul weight layouts on the CPU: forwards per number of rows, and generate with the "
               "engine's choice against W^T everywhere.")
    add_flags(p, "target", "draft", "workload", "ks", "batches", "max_new_tokens", "reps", "threads", "out",
              workload=dict(help="the workload of the end-to-end runs (default json)"),
              ks=dict(help="draft lengths, 0 for plain decoding (default 0,2,4)"),
              batches=dict(help="batch sizes (default 1,4)"),
              reps=dict(help="interleaved repetitions: forwards (default 15), and a third of it for generate "
                             "(default 6)"))
    return run(p, run_layouts_bench, argv, "layouts")


if __name__ == "__main__":
    sys.exit(main())
