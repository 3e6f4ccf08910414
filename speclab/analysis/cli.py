"""``speclab bench``: the acceptance report (default), ``--compare`` (speclab vs Hugging Face),
``--policies`` and ``--synthetic`` (draft-length policies; the synthetic landscape vs the cost model),
``--layouts`` (matmul weight layouts on the CPU), ``--tracker-fit`` (the acceptance tracker's settings by
log-loss)."""

from __future__ import annotations


def check_bench_args(args) -> None:
    """The numbers every ``speclab bench`` mode shares, checked before any model loads: one line for a bad one
    (each mode parses its lists again; ``--ks`` may hold 0 here, plain decoding, and modes that time only drafting
    refuse it themselves)."""
    from ..limits import MAX_BATCH, MAX_K, check_int, check_k, check_max_new_tokens, check_threads, parse_numbers

    if args.reps is not None:
        check_int("--reps", args.reps, 1, 10_000)
    if args.prompts_per_workload is not None:
        check_int("--prompts-per-workload", args.prompts_per_workload, 1, 100_000)
    if getattr(args, "threads", None) is not None:
        check_threads(args.threads)
    check_max_new_tokens(args.max_new_tokens, name="--max-new-tokens")
    check_k(args.k)
    if getattr(args, "requests", None) is not None:
        check_int("--requests", args.requests, 1, 1_000_000)
    if getattr(args, "max_concurrency", None) is not None:
        from ..load.shapes import MAX_CONCURRENCY

        check_int("--max-concurrency", args.max_concurrency, 1, MAX_CONCURRENCY)
    if args.batches:
        parse_numbers(args.batches, "--batches", integer=True, hi=MAX_BATCH)
    if args.ks:
        parse_numbers(args.ks, "--ks", integer=True, lo=0, lo_open=False, hi=MAX_K)
    if getattr(args, "alphas", None):
        parse_numbers(args.alphas, "--alphas", lo=0, lo_open=False, hi=1)
    if getattr(args, "eagle_ks", None):
        parse_numbers(args.eagle_ks, "--eagle-ks", integer=True, hi=MAX_K)


def cmd_bench(args) -> int:
    check_bench_args(args)
    if getattr(args, "serve_experiment", False):
        from .serve_experiment import run_from_args as run_serve_experiment

        return run_serve_experiment(args)
    if getattr(args, "serve", False):
        from .bench_serve import run_serve_bench

        return run_serve_bench(args)
    if getattr(args, "synthetic", False):
        from .bench_synthetic import run_synthetic

        return run_synthetic(args)
    if getattr(args, "policies", False):
        from .bench_policies import run_policies

        return run_policies(args)
    if getattr(args, "tracker_fit", False):
        from .tracker_fit import run_tracker_fit

        return run_tracker_fit(args)
    if getattr(args, "layouts", False):
        from .bench_layouts import run_layouts_bench

        return run_layouts_bench(args)
    if getattr(args, "heads", False):
        from .bench_heads import run_heads_bench

        return run_heads_bench(args)
    if getattr(args, "compare", False):
        from .compare import run_compare

        return run_compare(args)
    from .report import run_from_args

    args.workload = args.workload or "all"
    args.prompts_per_workload = args.prompts_per_workload or 8
    return run_from_args(args)


def add_compare_arguments(p) -> None:
    p.add_argument("--compare", action="store_true", help="speclab vs Hugging Face side by side")
    p.add_argument("--draft", default=None, help="draft model for --compare (default: the family's best draft)")
    p.add_argument("--ks", default=None, help="k values for --compare (default 2,4; --full 2,4,6)")
    p.add_argument("--batches", default=None, help="batch sizes for the --compare batch sweep (default 1,4,16; "
                   "--full 1,2,4,8,16,32,64,128)")
    p.add_argument("--reps", type=int, default=None,
                   help="interleaved repetitions per prompt (default 2; --full 3; --heads 3; --serve: per load level, "
                   "every server in turn, default 1; --serve-experiment: per cell, every speclab server in turn, "
                   "default 1)")
    p.add_argument("--full", action="store_true", help="--compare over the full grid (every workload, 4 prompts, "
                   "k 2,4,6, batches to 128, 3 repetitions: about 20 minutes on 2 cores) instead of the ~3-minute "
                   "default")
    p.add_argument("--device", default=None)


def add_heads_arguments(p) -> None:
    p.add_argument("--heads", action="store_true", help="self-drafting heads, early exit and trees")
    p.add_argument("--budget", type=int, default=8, help="--heads: verification budget of the tree-vs-chain pairs")
    p.add_argument("--exits", action="store_true", help="--heads: early exit at every m (chooses the default m)")
    p.add_argument("--eagle-ks", default="4,6", help="--heads: the EAGLE chain's k values (besides the budget)")
    p.add_argument("--methods", default=None,
                   help="--heads: comma list of method names to run (default: all; 'plain' is always run)")


def add_commands(subparsers) -> None:
    """Register ``bench`` on an argparse subparsers object."""
    from .bench_runs import add_arguments as add_policy_arguments

    b = subparsers.add_parser("bench", help="acceptance per workload and drafter (greedy and T=0.8)")
    b.add_argument("--workload", default=None, help="'all', a workload name, comma list or a .jsonl path "
                   "(default: all; --compare: json,code unless --full)")
    b.add_argument("--k", "-k", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--prompts-per-workload", type=int, default=None,
                   help="(default 8; --compare: 3, --full 4; --heads 4)")
    b.add_argument("--drafter", action="append", default=None,
                   help="drafter to measure (repeatable; default: every family draft and ngram)")
    b.add_argument("--temperature", type=float, action="append", default=None,
                   help="temperature (repeatable; default 0 and 0.8)")
    b.add_argument("--target", default=None, help="target model (default: the family target)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    b.add_argument("--quiet", action="store_true")
    add_compare_arguments(b)
    from .bench_serve import add_serve_arguments

    add_serve_arguments(b)
    from .serve_experiment import add_arguments as add_experiment_arguments

    add_experiment_arguments(b)
    add_heads_arguments(b)
    b.add_argument("--layouts", action="store_true", help="matmul weight layouts on the CPU: forwards per number of "
                   "rows, and generate with the engine's choice against W^T everywhere (--batches, default 1,4; --ks, "
                   "default 0,2,4; --reps, default 15 forwards and 6 generations per cell)")
    add_policy_arguments(b)
    b.add_argument("--tracker-fit", action="store_true",
                   help="the acceptance tracker's settings scored by log-loss on fixed-k histories (no timing; "
                        "--workload, default json,code,tech_prose; --ks, default 1,2,4; --max-new-tokens)")
    b.set_defaults(func=cmd_bench)
