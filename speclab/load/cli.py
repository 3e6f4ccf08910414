"""``speclab load URL``: measure any OpenAI-compatible streaming server from outside.

Send streaming requests at fixed concurrency levels or Poisson rates; report TTFT, TPOT, ITL (per chunk, as
vLLM, and per token), E2E, throughput and goodput per level; tell from the token pacing whether the server
decodes plainly, speculatively or adaptively; and read the server's own acceptance counters from /metrics.
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from pathlib import Path

from ..errors import SpeclabError
from ..limits import parse_json_object


def _positive(name: str, v, integer=False):
    if v is None:
        return None
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) or (integer and v != int(v)):
        raise SpeclabError(f"{name} must be a positive {'whole ' if integer else ''}number, got {v}")
    return v


def cmd_load(args) -> int:
    from .charts import save_charts
    from .client import Endpoint
    from .prompts import load_prompts
    from .report import format_result
    from .runner import LoadSpec, base_url, run
    from .shapes import check_spread, concurrency_levels, rate_levels
    from .stats import parse_goodput

    if args.concurrency and args.rate:
        raise SpeclabError("give --concurrency or --rate, not both")
    levels = rate_levels(args.rate, args.burstiness) if args.rate else concurrency_levels(args.concurrency or "1")
    _positive("--max-tokens", args.max_tokens, integer=True)
    _positive("--num-requests", args.num_requests, integer=True)
    _positive("--duration", args.duration)
    _positive("--timeout", args.timeout)
    if args.warmup < 0:
        raise SpeclabError(f"--warmup must be >= 0 (unrecorded requests sent first), got {args.warmup}")
    if args.temperature < 0:
        raise SpeclabError(f"--temperature must be >= 0, got {args.temperature}")
    extra = parse_json_object(args.extra_body, "--extra-body") if args.extra_body else {}
    endpoint = Endpoint(base_url(args.url), kind=args.endpoint, model=args.model, api_key=args.api_key,
                        max_tokens=args.max_tokens, temperature=args.temperature, timeout=args.timeout,
                        seed=args.request_seed, extra=extra)
    spec = LoadSpec(levels=levels, prompts=load_prompts(args.workload, args.prompts_file),
                    num_requests=args.num_requests, duration=args.duration, seed=args.seed,
                    slos=parse_goodput(args.goodput), warmup=args.warmup, tokenizer=args.tokenizer, quiet=args.quiet,
                    loop=args.loop, length_spread=check_spread(args.length_spread),
                    fresh=uuid.uuid4().hex if args.prompt_mode == "fresh" else None)
    result = run(endpoint, spec)
    print(format_result(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.charts:
        for p in save_charts(result, args.charts):
            print(f"wrote {p}")
    if not any(lv["summary"]["completed"] for lv in result["levels"]):
        print("speclab load: every request failed", file=sys.stderr)
        return 1
    return 0


def add_commands(subparsers) -> None:
    """Register ``load`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "load", help="load-test any OpenAI-compatible streaming server and fingerprint its pacing",
        description=__doc__.split("\n\n")[1])

    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--workload", default="all", help="bundled workloads: 'all', a name or a comma list")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="prompts from a JSONL file (speclab workload format or Spec-Bench/MT-Bench question.jsonl)")
    p.add_argument("--prompt-mode", choices=("repeat", "fresh"), default="repeat",
                   help="repeat (default): the workload's prompts, again and again; fresh: each request's prompt made "
                        "unique (a nonce in front), so no server's prefix cache can reuse any of it")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.0, metavar="S",
                   help="each request's max_tokens drawn uniformly from max-tokens x [1 - S, 1 + S], the same for "
                        "request i on every server with the same --seed (vllm bench serve's --random-range-ratio; "
                        "default 0: every request max-tokens)")
    p.add_argument("--concurrency", default=None, help="closed-loop levels, comma list (default 1)")
    p.add_argument("--rate", default=None, help="open-loop levels in requests/s, comma list (instead of concurrency)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times with --rate (1 = Poisson; <1 burstier)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: max(16, 4 x concurrency), or 16 with --rate; with --duration "
                        "only, unbounded)")
    p.add_argument("--duration", type=float, default=None, help="seconds per level: stop sending after it")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--request-seed", type=int, default=None, help="'seed' field sent with every request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", default=None, metavar="ttft:MS,tpot:MS",
                   help="SLOs for goodput (keys ttft, tpot, e2el; milliseconds), as vllm bench serve")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="tokenizer for per-chunk token counts: a family model name or a local directory (default: "
                        "the served model id, when it names one; never downloaded)")
    p.add_argument("--extra-body", default=None, metavar="JSON",
                   help='more request fields, e.g. \'{"return_token_ids": true}\' (vLLM: per-chunk token ids)')
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded requests sent first")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, metavar="PATH", help="write the full result (per request and per level)")
    p.add_argument("--charts", default=None, metavar="DIR", help="write Altair charts (HTML) into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the client's event loop; auto (default): uvloop when installed (less client time per chunk), "
                        "else asyncio's")
    p.set_defaults(func=cmd_load)
