"""Acceptance of every drafter on every bundled workload (the standard five and the held-out three), greedy, on
the shipped family: what ``speclab models`` shows beside each drafter.

    python -m speclab.analysis.drafter_acceptance            # writes speclab/drafters/acceptance.json
    python -m speclab.analysis.drafter_acceptance --out DIR  # or DIR/acceptance.json

Acceptance = accepted draft tokens / drafted tokens over the first ``--prompts`` prompts of each workload, all
decoded in one batch (greedy rows are exact per row, so the batch changes no token), k = 4. Deterministic: the
same weights give the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DRAFTERS = ("draft-xs", "draft-xs-distill", "draft-s", "draft-distill", "eagle", "medusa", "early-exit",
            "early-exit:3:tuned", "ngram", "suffix", "suffix-match", "eagle+suffix", "eagle3")


def measure(target, drafters, workloads, prompts: int, k: int, max_new_tokens: int) -> dict[str, dict[str, float]]:
    from ..drafters.registry import make_drafter
    from ..engine.decoder import SpeculativeDecoder
    from ..workloads import load_workload

    out: dict[str, dict[str, float]] = {}
    texts = {w: [p.prompt for p in load_workload(w)[:prompts]] for w in workloads}
    for spec in drafters:
        out[spec] = {}
        for w in workloads:
            res = SpeculativeDecoder(target, make_drafter(spec, target)).generate(
                texts[w], k=k, max_new_tokens=max_new_tokens, temperature=0.0)
            m = res.metrics
            out[spec][w] = round(m["accepted_tokens"] / m["drafted_tokens"], 3) if m["drafted_tokens"] else 0.0
            print(f"{spec:<22}{w:<15}{out[spec][w]:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    from ..defaults import setup_threads
    from ..drafters.catalog import ACCEPTANCE_PATH
    from ..errors import SpeclabError
    from ..models import load_model
    from ..workloads import list_workloads

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma list of drafter specs")
    p.add_argument("--prompts", type=int, default=6, help="prompts per workload (default 6)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", default=None, help="folder for acceptance.json (default: next to speclab.drafters)")
    args = p.parse_args(argv)
    try:
        target = load_model("target")
        setup_threads(None, target)
        workloads = list_workloads()
        acc = measure(target, [d.strip() for d in args.drafters.split(",") if d.strip()], workloads, args.prompts,
                      args.k, args.max_new_tokens)
    except SpeclabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = Path(args.out) / "acceptance.json" if args.out else ACCEPTANCE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"target": "target", "k": args.k, "max_new_tokens": args.max_new_tokens,
                                "prompts_per_workload": args.prompts, "temperature": 0.0,
                                "command": "python -m speclab.analysis.drafter_acceptance", "drafters": acc},
                               indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
