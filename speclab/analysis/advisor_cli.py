"""``speclab advise``: the advisor's command (the rubric is :mod:`.advisor`, its inputs :mod:`.advisor_inputs`).

* ``speclab advise --from RESULT.json``: the verdict on measured traffic. It reads any result the lab writes; where
  the result carries no step costs, it times them on this machine (the family's target and draft, a few seconds)
  and says so in one line;
* ``speclab advise what-if --hardware PRESET --target-model SHAPE ...``: the same rubric on a modelled deployment
  (the roofline of a hardware preset and model shapes);
* ``speclab advise validate``: the cost model against published measurements;
* ``speclab advise measure-cpu``: measure this machine's roofline and store it as the ``cpu`` preset.

The check of the cost model against speedups measured here is ``python benchmarks/cpucheck.py``.
"""

from __future__ import annotations

import argparse

from ..errors import SpeclabError
from . import advisor
from .advisor import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS, advise, make_deployment
from .advisor_inputs import parse_acceptance, read_inputs
from .flags import write_json

ADVICE_FILE = "advice.json"


def _traffic(args):
    """The traffic figures: the --from results, then the typed flags over them."""
    from ..limits import check_float, check_int, check_k

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
        what = "the results given hold no acceptance (a run without speculation?)" if args.inputs else \
            "no acceptance to judge"
        raise SpeclabError(f"{what}: give --acceptance NAME:RATE[,...] or --from a result measured with speculation")
    return inp


def cmd_advise(args) -> int:
    inp = _traffic(args)
    if inp.costs is None:
        from .advisor_inputs import measure_step_costs

        inp.costs = measure_step_costs(inp, args.target_name, args.draft_name, args.k_max, log=print)
    dep = make_deployment(None, inputs=inp, k_max=args.k_max, target_name=args.target_name,
                          draft_name=args.draft_name, method=args.method, concurrency=args.concurrency)
    return _report(args, advise(inp, dep))


def cmd_what_if(args) -> int:
    inp = _traffic(args)
    t, d = _shape_spec(args.target_model, "--target-model"), _shape_spec(args.draft_model, "--draft-model")
    dep = make_deployment(
        args.hardware, inputs=inp, target_model=t.get("name"), target_params=t.get("params"),
        bytes_per_param=args.bytes_per_param, layers=t.get("layers", 0), hidden=t.get("hidden", 0),
        kv_heads=t.get("kv_heads", 0), head_dim=t.get("head_dim", 0), draft_model=d.get("name"),
        draft_params=d.get("params"), draft_layers=d.get("layers", 0), draft_hidden=d.get("hidden", 0),
        draft_kv_heads=d.get("kv_heads", 0), draft_head_dim=d.get("head_dim", 0), draft_cost=args.draft_cost,
        context=args.context, overhead_ms=args.overhead_ms, draft_overhead_ms=args.draft_overhead_ms,
        k_max=args.k_max, target_name=args.target_name, draft_name=args.draft_name, method=args.method,
        concurrency=args.concurrency)
    return _report(args, advise(inp, dep))


def _shape_spec(spec: str | None, flag: str) -> dict:
    """A named shape, or PARAMS[:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM] (the four sizes give the KV cache's traffic)."""
    if not spec:
        return {}
    parts = spec.split(":")
    try:
        params = float(parts[0])
    except ValueError:
        return {"name": spec}
    try:
        dims = [int(x) for x in parts[1:]]
    except ValueError:
        dims = None
    if dims is None or len(dims) not in (0, 4) or params <= 0:
        raise SpeclabError(f"{flag} wants a named shape or PARAMS[:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM] "
                           f"(e.g. 8e9:32:4096:8:128), got '{spec}'")
    return dict(params=params, **dict(zip(("layers", "hidden", "kv_heads", "head_dim"), dims)))


def _report(args, advice) -> int:
    print(advice.format())
    if args.out:
        from pathlib import Path

        write_json(Path(args.out) / ADVICE_FILE, advice.to_dict(), allow_nan=False)
    return 0


def cmd_validate(args) -> int:
    from pathlib import Path

    from .published import format_validation, validate

    rows = validate()
    print(format_validation(rows))
    if args.out:
        write_json(Path(args.out) / "validation.json", rows, allow_nan=False)
    return 0


def cmd_measure_cpu(args) -> int:
    from .roofline import CPU_PRESET_PATH, measure_cpu, save_cpu_preset

    r = measure_cpu()
    m = r["measured"]
    print(f"cpu ({m['cpu']}, 1 thread, torch {m['torch']}): memory bandwidth {r['bandwidth'] / 1e9:.1f} GB/s (median "
          f"{m['bandwidth_median'] / 1e9:.1f}; {m['copy_mb']} MB copies), cache bandwidth "
          f"{m['cache_bandwidth'] / 1e9:.1f} GB/s ({m['cache_kb']} KB copies), fp32 matmul "
          f"{r['peak_flops'] / 1e9:.1f} GFLOP/s (median {m['peak_flops_median'] / 1e9:.1f}; n={m['matmul_n']})")
    if not args.no_save:
        print(f"wrote {save_cpu_preset(r, CPU_PRESET_PATH)} (the 'cpu' preset)")
    if args.out:
        from pathlib import Path

        write_json(Path(args.out) / "cpu_roofline.json", r)
    return 0


def _add_traffic_flags(p, suppress: bool = False) -> None:
    """The traffic flags, on ``advise`` and again on ``what-if`` (there with SUPPRESS defaults, so a flag given
    before the subcommand is not reset by the subcommand's default)."""

    def add(*names, **kw):
        if suppress:
            kw["default"] = argparse.SUPPRESS
        p.add_argument(*names, **kw)

    add("--from", dest="inputs", action="append", default=None, metavar="PATH",
        help="a result the lab writes: speclab bench acceptance|compare, a sweep (CSV or JSON), speclab load --json, "
             "python benchmarks/cpucheck.py (repeatable)")
    add("--acceptance", default=None, metavar="NAME:RATE,...",
        help="per-token acceptance per workload, e.g. json:0.7,code:0.35 (or NAME:r1/r2/r3 per position)")
    add("--ttft-ms", type=float, default=None, help="time to first token (ms)")
    add("--tpot-ms", type=float, default=None, help="plain decoding's time per output token (ms)")
    add("--output-tokens", type=float, default=None, help=f"mean output tokens per request (default "
        f"{DEFAULT_OUTPUT_TOKENS})")
    add("--prompt-tokens", type=float, default=None, help=f"mean prompt tokens (default {DEFAULT_PROMPT_TOKENS})")
    add("--concurrency", type=int, default=None, help="expected concurrent requests (default: the load run's, "
        "else 1)")
    add("--tokenizer-match", choices=["yes", "no"], default=None, help="do draft and target share a tokenizer "
        "(lab results: checked)")
    add("--draft", dest="draft_name", default=None, help="the draft to read from a result with several, and to "
        "name in the engines' flags")
    add("--target", dest="target_name", default=None, help="the target's name in the engines' flags")
    add("--temperature", type=float, default=0.0, help="the temperature to read from an acceptance report")
    add("--workload-name", default="served", help="the workload name for a load run's acceptance")
    add("--method", choices=["draft_model", "ngram", "eagle", "eagle3"], default=None,
        help="how the engines name the drafter (default draft_model; ngram for --draft ngram)")
    add("--k-max", type=int, default=8, help="the largest k considered (default 8)")
    add("--out", default=None, metavar="DIR", help=f"also write the advice as JSON into DIR/{ADVICE_FILE}")


def _add_what_if(sub) -> None:
    from .roofline import SHAPES, preset_names

    w = sub.add_parser("what-if", help="the rubric on a modelled deployment: a hardware preset and model shapes")
    _add_traffic_flags(w, suppress=True)
    d = w.add_argument_group("deployment")
    d.add_argument("--hardware", required=True, help=f"preset: {', '.join(preset_names())}")
    d.add_argument("--target-model", default=None, metavar="SHAPE", help=f"a named shape ({', '.join(SHAPES)}) or "
                   "PARAMS[:LAYERS:HIDDEN:KV_HEADS:HEAD_DIM], e.g. 8e9:32:4096:8:128")
    d.add_argument("--draft-model", default=None, metavar="SHAPE", help="the draft's shape, the same way")
    d.add_argument("--draft-cost", type=float, default=None, help="draft step as a fraction of the target step "
                   "(instead of a draft shape; 0 for prompt lookup)")
    d.add_argument("--bytes-per-param", type=float, default=2.0, help="bytes per parameter (2: bf16; 1: fp8)")
    d.add_argument("--context", type=int, default=1024, help="cached tokens per row during decode (KV traffic)")
    d.add_argument("--overhead-ms", type=float, default=None, help="fixed cost per forward (default 0, or fitted "
                   "to --tpot-ms)")
    d.add_argument("--draft-overhead-ms", type=float, default=None, help="fixed cost per draft step (default: the "
                   "per-forward overhead)")
    w.set_defaults(func=cmd_what_if)


def add_commands(subparsers) -> None:
    """Register ``advise`` and its subcommands on an argparse subparsers object."""
    a = subparsers.add_parser("advise", help="should this deployment speculate? the rubric on measured numbers "
                              "(--from), a modelled deployment (what-if), and checks of the cost model",
                              description=advisor.__doc__.split("\n\n")[1], epilog=__doc__.split("\n\n")[1])
    _add_traffic_flags(a)
    a.set_defaults(func=cmd_advise)
    sub = a.add_subparsers(dest="advise_mode", required=False, metavar="{what-if,validate,measure-cpu}")
    _add_what_if(sub)
    v = sub.add_parser("validate", help="the cost model against published measurements (a table)")
    v.add_argument("--out", default=None, metavar="DIR", help="also write the table as JSON into DIR")
    v.set_defaults(func=cmd_validate)
    m = sub.add_parser("measure-cpu", help="measure this machine's roofline (1 thread) and store it as the 'cpu' "
                       "preset")
    m.add_argument("--no-save", action="store_true", help="print, do not store")
    m.add_argument("--out", default=None, metavar="DIR", help="also write the measurement as JSON into DIR")
    m.set_defaults(func=cmd_measure_cpu)


