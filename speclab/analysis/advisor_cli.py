"""``speclab advise``: the advisor's command (the rubric is :mod:`.advisor`, its inputs :mod:`.advisor_inputs`),
with its checks of the cost model: --validate, --measure-cpu, --check-cpu."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import SpeclabError
from ..limits import parse_numbers
from . import advisor
from .advisor import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS, advise, make_deployment
from .advisor_inputs import parse_acceptance, read_inputs


def cmd_advise(args) -> int:
    from ..limits import check_float, check_int, check_k

    if args.measure_cpu:
        return _cmd_measure_cpu(args)
    if args.validate:
        from .published import format_validation, validate

        rows = validate()
        print(format_validation(rows))
        if args.json:
            _write(args.json, rows)
        return 0
    if args.check_cpu:
        return _cmd_check_cpu(args)
    check_k(args.k_max)
    if args.k_max == 0:
        raise SpeclabError("--k-max must be at least 1")
    if args.concurrency is not None:
        check_int("--concurrency", args.concurrency, 1, 1 << 20)
    inp = read_inputs(args.inputs or [], draft=args.draft_name, temperature=args.temperature,
                      concurrency=args.concurrency, workload_name=args.workload_name)
    if args.acceptance:
        typed = parse_acceptance(args.acceptance)
        inp.workloads = [w for w in inp.workloads if w.name not in {t.name for t in typed}] + typed
    for name, src in (("ttft_ms", "ttft_source"), ("tpot_ms", "tpot_source"), ("output_tokens", "output_source")):
        v = getattr(args, name)
        if v is not None:
            check_float(f"--{name.replace('_', '-')}", v, 0.0, 1e9)
            setattr(inp, name, float(v))
            setattr(inp, src, "assumed")
            if name == "tpot_ms":
                inp.tpot_is_plain = True
    if args.prompt_tokens is not None:
        inp.prompt_tokens = check_float("--prompt-tokens", args.prompt_tokens, 1.0, 1e9)
    if args.tokenizer_match is not None:
        inp.tokenizer_match, inp.tokenizer_source = args.tokenizer_match == "yes", "assumed"
    if args.concurrency is not None:
        inp.concurrency, inp.concurrency_source = args.concurrency, "assumed"
    if not inp.workloads:
        raise SpeclabError("no acceptance to judge: give --acceptance NAME:RATE[,...] or --from a lab/load result")
    dep = make_deployment(
        args.hardware, inputs=inp, target_model=args.target_model, target_params=args.target_params,
        bytes_per_param=args.bytes_per_param, layers=args.layers, hidden=args.hidden, kv_heads=args.kv_heads,
        head_dim=args.head_dim, draft_model=args.draft_model, draft_params=args.draft_params,
        draft_layers=args.draft_layers, draft_hidden=args.draft_hidden, draft_kv_heads=args.draft_kv_heads,
        draft_head_dim=args.draft_head_dim, draft_cost=args.draft_cost, context=args.context,
        overhead_ms=args.overhead_ms, draft_overhead_ms=args.draft_overhead_ms, k_max=args.k_max,
        target_name=args.target_name, draft_name=args.draft_name, method=args.method, concurrency=args.concurrency)
    advice = advise(inp, dep)
    print(advice.format())
    if args.json:
        _write(args.json, advice.to_dict())
    return 0


def _write(path: str, obj) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    print(f"wrote {p}")


def _cmd_measure_cpu(args) -> int:
    from .roofline import CPU_PRESET_PATH, measure_cpu, save_cpu_preset

    r = measure_cpu()
    m = r["measured"]
    print(f"cpu ({m['cpu']}, 1 thread, torch {m['torch']}, {m['date']}): memory bandwidth {r['bandwidth'] / 1e9:.1f} "
          f"GB/s (median {m['bandwidth_median'] / 1e9:.1f}; {m['copy_mb']} MB copies), cache bandwidth "
          f"{m['cache_bandwidth'] / 1e9:.1f} GB/s ({m['cache_kb']} KB copies), fp32 matmul "
          f"{r['peak_flops'] / 1e9:.1f} GFLOP/s (median {m['peak_flops_median'] / 1e9:.1f}; n={m['matmul_n']})")
    if not args.no_save:
        print(f"wrote {save_cpu_preset(r, args.json or CPU_PRESET_PATH)} (the 'cpu' preset)")
    elif args.json:
        _write(args.json, r)
    return 0


def _cmd_check_cpu(args) -> int:
    import sys

    from .cpucheck import check_cpu, format_check, write_json

    batches = parse_numbers(args.batches, "--batches", integer=True)
    synthetic = []
    for part in (args.synthetic or "").split(","):
        if part.strip():
            bits = part.split(":")
            try:
                alpha, cost = map(float, bits)  # two numbers, or a ValueError
            except ValueError:
                alpha = cost = math.nan
            if not (math.isfinite(alpha) and math.isfinite(cost)):
                raise SpeclabError(f"--synthetic wants ALPHA:COST[,ALPHA:COST...], got '{part}'")
            synthetic.append((alpha, cost))
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    command = (f"speclab advise --check-cpu --workload {args.workload} -k {args.k} --batches {args.batches} "
               f"--max-new-tokens {args.max_new_tokens} --reps {args.reps} --clock {args.clock}"
               + (f" --synthetic {args.synthetic}" if args.synthetic else "")
               + (f" --target {args.target_name}" if args.target_name else "")
               + (f" --draft {args.draft_name}" if args.draft_name else ""))
    rep = check_cpu(args.target_name, args.draft_name, args.workload, args.k, batches, args.max_new_tokens,
                    reps=args.reps, clock=args.clock, synthetic=synthetic, log=log, command=command)
    print(format_check(rep))
    if args.json:
        print(f"wrote {write_json(rep, args.json)}")
    return 0


SHAPE_DIMS = ("layers", "hidden", "kv-heads", "head-dim")


def add_commands(subparsers) -> None:
    """Register ``advise`` on an argparse subparsers object."""
    from .roofline import SHAPES, preset_names

    a = subparsers.add_parser(
        "advise", help="should this deployment speculate? the rubric applied to measured numbers, and a GPU what-if",
        description=advisor.__doc__.split("\n\n")[1])

    g = a.add_argument_group("traffic (files and typed figures)")
    g.add_argument("--from", dest="inputs", action="append", default=None, metavar="PATH",
                   help="a lab or load result: speclab bench [--compare] --json, a sweep CSV/JSON, speclab load "
                        "--json, speclab advise --check-cpu --json (repeatable)")
    g.add_argument("--acceptance", default=None, metavar="NAME:RATE,...",
                   help="per-token acceptance per workload, e.g. json:0.7,code:0.35 (or NAME:r1/r2/r3 per position)")
    g.add_argument("--ttft-ms", type=float, default=None, help="time to first token (ms)")
    g.add_argument("--tpot-ms", type=float, default=None, help="plain decoding's time per output token (ms); "
                   "calibrates the roofline's per-step overhead")
    g.add_argument("--output-tokens", type=float, default=None, help=f"mean output tokens per request (default "
                   f"{DEFAULT_OUTPUT_TOKENS})")
    g.add_argument("--prompt-tokens", type=float, default=None, help=f"mean prompt tokens (for a modelled TTFT; "
                   f"default {DEFAULT_PROMPT_TOKENS})")
    g.add_argument("--concurrency", type=int, default=None, help="expected concurrent requests (default: the load "
                   "run's, else 1)")
    g.add_argument("--tokenizer-match", choices=["yes", "no"], default=None, help="do draft and target share a "
                   "tokenizer (lab results: checked)")
    g.add_argument("--draft", dest="draft_name", default=None,
                   help="the draft to read from a result with several, and to name in flags")
    g.add_argument("--temperature", type=float, default=0.0, help="the temperature to read from an acceptance report")
    g.add_argument("--workload-name", default="served", help="the workload name for a load run's acceptance")
    d = a.add_argument_group("deployment")
    d.add_argument("--hardware", default=None, help=f"preset: {', '.join(preset_names())} (default: the step costs "
                   f"measured in a --from result)")
    d.add_argument("--target", dest="target_name", default=None, help="the target's name for the engine flags "
                   "(--check-cpu: the target to load)")
    d.add_argument("--target-model", default=None, help=f"a named shape: {', '.join(SHAPES)}")
    d.add_argument("--target-params", type=float, default=None, help="target parameters read per forward (e.g. 8e9)")
    d.add_argument("--bytes-per-param", type=float, default=2.0, help="bytes per parameter (2: bf16; 1: fp8)")
    for dim in SHAPE_DIMS:  # the KV cache's shape, when the model is not a named one
        d.add_argument(f"--{dim}", type=int, default=0)
    d.add_argument("--draft-model", default=None, help="a named shape for the draft")
    d.add_argument("--draft-params", type=float, default=None, help="draft parameters read per draft step")
    for dim in SHAPE_DIMS:
        d.add_argument(f"--draft-{dim}", type=int, default=0)
    d.add_argument("--draft-cost", type=float, default=None, help="draft step as a fraction of the target step "
                   "(instead of a draft shape; 0 for prompt lookup)")
    d.add_argument("--method", choices=["draft_model", "ngram", "eagle", "eagle3"], default=None,
                   help="how the engines name the drafter (default draft_model; ngram for --draft ngram)")
    d.add_argument("--context", type=int, default=1024, help="cached tokens per row during decode (KV traffic)")
    d.add_argument("--overhead-ms", type=float, default=None, help="fixed cost per forward (default 0, or fitted to "
                   "--tpot-ms)")
    d.add_argument("--draft-overhead-ms", type=float, default=None, help="fixed cost per draft step (default: the "
                   "per-forward overhead)")
    d.add_argument("--k-max", type=int, default=8, help="the largest k considered")
    m = a.add_argument_group("checks")
    m.add_argument("--validate", action="store_true", help="the model against published measurements (a table)")
    m.add_argument("--measure-cpu", action="store_true", help="measure this machine's roofline (1 thread) and store "
                   "it as the 'cpu' preset")
    m.add_argument("--no-save", action="store_true", help="with --measure-cpu: print, do not store")
    m.add_argument("--check-cpu", action="store_true", help="predicted vs measured speedups of the embedded family, "
                   "measured in this run")
    m.add_argument("--workload", default="all", help="--check-cpu workloads ('all' or a comma list)")
    m.add_argument("-k", type=int, default=4, help="--check-cpu draft length")
    m.add_argument("--batches", default="1,8", help="--check-cpu batch sizes (the smallest and the largest matter)")
    m.add_argument("--max-new-tokens", type=int, default=48)
    m.add_argument("--reps", type=int, default=3, help="--check-cpu interleaved repetitions")
    m.add_argument("--clock", choices=["process", "wall"], default="process",
                   help="--check-cpu clock: this process's CPU time (robust to other load; default) or wall time")
    m.add_argument("--synthetic", default=None, metavar="ALPHA:COST,...",
                   help="--check-cpu: extra cells with the synthetic drafter (known acceptance and cost)")
    m.add_argument("--quiet", action="store_true")
    a.add_argument("--json", default=None, metavar="PATH", help="also write the result as JSON")
    a.set_defaults(func=cmd_advise)
