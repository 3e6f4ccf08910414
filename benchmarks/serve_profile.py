"""``python benchmarks/serve_profile.py``: where a plain decoding step's time goes at a server core's row count,
on fresh prompts. The engine alone (no HTTP): ``Scheduler.step`` in a loop over ``--requests`` unique prompts
(``speclab.load.prompts.FreshOrder``) with ``--rows`` running at once, one thread, under cProfile; prints tokens/s,
the functions with the most time of their own, and the share of the cached slots a decoding step's attention
reads that its rows need (a batch attends up to its longest row; the rest is masked).

    python benchmarks/serve_profile.py --rows 16 --out results/
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/serve_profile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16, help="requests running at once (default 16)")
    p.add_argument("--requests", type=int, default=None, help="requests (default 2 x rows)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workload", default="json,code")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default=None, metavar="DIR", help="write serve_profile.json there")
    args = p.parse_args(argv)

    import torch

    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams
    from speclab.engine.scheduler import Scheduler
    from speclab.load.prompts import FreshOrder, load_prompts
    from speclab.models import load_model

    torch.set_num_threads(1)
    target = load_model("target", device="cpu", role="target")
    fresh = FreshOrder(load_prompts(args.workload), "profile")
    n = args.requests or 2 * args.rows
    sched = Scheduler(target, None, None, max_running=args.rows, capacity=args.rows)  # one scheduler, as a core

    def run(first: int) -> tuple[float, int]:
        for i in range(n):
            sched.submit(Request(target.encode(fresh[first + i].prompt), args.max_tokens, SamplingParams(0.0, 0, 1.0),
                                 0, (), True, request_id=f"r{first + i}"))
        t0, steps = time.perf_counter(), 0
        while not sched.idle:
            sched.step()
            steps += 1
        return time.perf_counter() - t0, steps

    run(0)  # warm: the cache is built and the first forwards' costs paid
    slots = count_decode_slots()
    prof = cProfile.Profile()
    prof.enable()
    wall, steps = run(n)
    prof.disable()
    slots.stop()
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())
    top = sorted(((v[2], f"{Path(k[0]).name}:{k[1]}({k[2]})") for k, v in stats.stats.items()), reverse=True)
    rows = [{"function": name, "own_s": s, "share": s / total} for s, name in top[: args.top]]
    print(f"{n * args.max_tokens} tokens in {wall:.2f} s ({n * args.max_tokens / wall:.0f} tok/s), {steps} steps, "
          f"{args.rows} rows")
    for r in rows:
        print(f"{r['share']:>6.1%} {r['own_s']:>8.3f} s  {r['function']}")
    print(f"decoding steps' attention: {slots.share:.1%} of the cached slots read are the rows' own")
    if args.out:
        path = Path(args.out) / "serve_profile.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": args.rows, "tok_s": n * args.max_tokens / wall, "steps": steps,
                                    "top": rows, "decode_attention_slots_needed": slots.share}, indent=1))
        print(f"wrote {path}")
    return 0


class count_decode_slots:
    """Counts, over the multi-row one-token attention calls (decoding steps), the mask's visible slots against
    all slots read; a wrapper around torch's attention while it runs, removed by ``stop``."""

    def __init__(self):
        import torch.nn.functional as F

        self.F, self.orig, self.visible, self.read = F, F.scaled_dot_product_attention, 0, 0

        def counted(q, k, v, attn_mask=None, **kw):
            if q.shape[2] == 1 and q.shape[0] > 1 and attn_mask is not None:
                self.visible += int(attn_mask.sum())
                self.read += attn_mask.numel()
            return self.orig(q, k, v, attn_mask=attn_mask, **kw)

        F.scaled_dot_product_attention = counted

    def stop(self) -> None:
        self.F.scaled_dot_product_attention = self.orig

    @property
    def share(self) -> float:
        return self.visible / self.read if self.read else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
