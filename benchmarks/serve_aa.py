"""``python benchmarks/serve_aa.py``: the A/A control for serving comparisons. Two identical plain ``speclab serve``
processes, ``speclab load`` with fresh prompts (every prompt unique: no prefix cache helps) at each concurrency,
the levels interleaved and the order of the two alternating, repeated; prints tokens/s per server and the A/B
ratio per repetition. A gap between two different servers within this spread cannot be told from no difference.

    python benchmarks/serve_aa.py --concurrency 4,16,32 --reps 3 --out results/
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/serve_aa.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="4,16,32", help="levels, comma list (default 4,16,32)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", default="json")
    p.add_argument("--out", default=None, metavar="DIR", help="write serve_aa.json there")
    args = p.parse_args(argv)

    from speclab.load import Endpoint, LoadSpec, concurrency_levels, run
    from speclab.load.prompts import load_prompts
    from speclab.load.servers import speclab_serve

    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = load_prompts(args.workload)
    out: dict = {c: {"A": [], "B": []} for c in levels}
    servers = [speclab_serve(None, "none"), speclab_serve(None, "none")]
    try:
        for rep in range(args.reps):
            for c in levels:
                for i in ((0, 1) if (rep + c) % 2 == 0 else (1, 0)):
                    ep = Endpoint(servers[i].url, max_tokens=args.max_tokens, temperature=0.0, timeout=300.0)
                    ls = LoadSpec(levels=concurrency_levels(str(c)), prompts=prompts, num_requests=args.requests,
                                  warmup=1 if rep == 0 else 0, quiet=True, fresh=f"aa/{rep}/{c}")
                    out[c]["AB"[i]].append(run(ep, ls)["levels"][0]["summary"]["output_throughput"])
    finally:
        for s in servers:
            s.stop()
    rows = []
    print(f"{'conc':>5}{'A tok/s':>10}{'B tok/s':>10}{'A/B median':>12}  A/B per repetition")
    for c in levels:
        a, b = out[c]["A"], out[c]["B"]
        ratios = [x / y for x, y in zip(a, b) if x and y]
        row = {"concurrency": c, "a_tok_s": a, "b_tok_s": b, "ratios": ratios,
               "median_ratio": statistics.median(ratios) if ratios else None}
        rows.append(row)
        print(f"{c:>5}{statistics.median(a):>10.0f}{statistics.median(b):>10.0f}"
              f"{row['median_ratio'] or float('nan'):>12.2f}  {', '.join(f'{r:.2f}' for r in ratios)}")
    if args.out:
        path = Path(args.out) / "serve_aa.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": rows, "requests": args.requests, "max_tokens": args.max_tokens}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
