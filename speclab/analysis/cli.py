"""``speclab bench``: one subcommand per benchmark; each prints a table and writes its JSON into ``--out DIR``.

* ``acceptance``: acceptance per workload and draft (greedy and T=0.8) on the family;
* ``compare``: speclab against Hugging Face ``generate`` (plain, assisted, prompt lookup), and a batch sweep;
* ``serve``: ``speclab serve`` plain against speculative at rising concurrency (and vLLM, with ``--peer``);
* ``policies``: every draft-length policy against plain decoding and fixed k, per workload, mixed stream and load;
* ``synthetic``: the (acceptance, k, batch) landscape with the synthetic drafter against the cost model;
* ``heads``: self-drafting heads, early exit and trees against separate drafts.

The flags they share are declared once in :mod:`.flags`. One-off experiments live in ``benchmarks/``.
"""

from __future__ import annotations

from .flags import add_flags, out_path

SUBCOMMANDS = ("acceptance", "compare", "serve", "policies", "synthetic", "heads", "round", "heldout")


def check_numbers(args) -> None:
    """The numbers a subcommand takes, checked before any model loads: one line for a bad one."""
    from ..limits import MAX_BATCH, MAX_K, check_int, check_k, check_max_new_tokens, check_threads, parse_numbers

    if getattr(args, "reps", None) is not None:
        check_int("--reps", args.reps, 1, 10_000)
    if getattr(args, "prompts_per_workload", None) is not None:
        check_int("--prompts-per-workload", args.prompts_per_workload, 1, 100_000)
    if getattr(args, "threads", None) is not None:
        check_threads(args.threads)
    if getattr(args, "max_new_tokens", None) is not None:
        check_max_new_tokens(args.max_new_tokens, name="--max-new-tokens")
    if isinstance(getattr(args, "k", None), int):
        check_k(args.k)
    if getattr(args, "requests", None) is not None:
        check_int("--requests", args.requests, 1, 1_000_000)
    if getattr(args, "max_concurrency", None) is not None:
        from ..load.shapes import MAX_CONCURRENCY

        check_int("--max-concurrency", args.max_concurrency, 1, MAX_CONCURRENCY)
    if getattr(args, "batches", None):
        parse_numbers(args.batches, "--batches", integer=True, hi=MAX_BATCH)
    if getattr(args, "ks", None):
        lo = 1 if args.mode in ("policies", "synthetic", "heads") else 0
        what = "--k (plain decoding, k = 0, is always there)" if lo else "--k"
        parse_numbers(args.ks, what, integer=True, lo=0, lo_open=bool(lo), hi=MAX_K)
    if getattr(args, "alphas", None):
        parse_numbers(args.alphas, "--alphas", lo=0, lo_open=False, hi=1)


def cmd_bench(args) -> int:
    check_numbers(args)
    args.json = str(out_path(args, args.mode))
    return RUNNERS[args.mode](args)


def _acceptance(args) -> int:
    from .report import run_from_args

    args.workload = args.workload or "all"
    args.prompts_per_workload = args.prompts_per_workload or 8
    return run_from_args(args)


def _compare(args) -> int:
    from .compare import run_compare

    return run_compare(args)


def _serve(args) -> int:
    from .bench_serve import run_serve_bench

    args.charts = str(out_path(args, "serve").parent / "serve_charts")
    return run_serve_bench(args)


def _policies(args) -> int:
    from .bench_policies import run_policies

    return run_policies(args)


def _synthetic(args) -> int:
    from .bench_synthetic import run_synthetic

    return run_synthetic(args)


def _heads(args) -> int:
    from .bench_heads import run_heads_bench

    return run_heads_bench(args)


RUNNERS = {"acceptance": _acceptance, "compare": _compare, "serve": _serve, "policies": _policies,
           "synthetic": _synthetic, "heads": _heads}


def _acceptance_parser(sub) -> None:
    p = sub.add_parser("acceptance", help="acceptance per workload and draft (greedy and T=0.8) on the family")
    add_flags(p, "target", "draft", "workload", "k", "max_new_tokens", "prompts", "seed", "threads", "out", "quiet",
              draft=dict(action="append", dest="drafter",
                         help="a draft to measure (repeatable; default: every family draft and ngram)"),
              workload=dict(help="'all' (default), a workload name, a comma list or a .jsonl path"),
              prompts=dict(help="prompts taken from each workload (default 8)"))
    p.add_argument("--temperature", type=float, action="append", default=None,
                   help="temperature (repeatable; default 0 and 0.8)")


def _compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="speclab against Hugging Face generate side by side, and a batch sweep "
                       "(~3 minutes; --full: every workload, k 2,4,6, batches to 128, ~20 minutes)")
    add_flags(p, "target", "draft", "workload", "ks", "batches", "max_new_tokens", "prompts", "reps", "full",
              "device", "threads", "out", "quiet",
              workload=dict(help="workloads (default json,code; --full: all)"),
              ks=dict(help="draft lengths (default 2,4; --full 2,4,6)"),
              batches=dict(help="batch sizes of the batch sweep (default 1,4,16; --full 1,2,...,128)"),
              prompts=dict(help="prompts per workload (default 3; --full 4)"),
              reps=dict(help="interleaved repetitions per prompt (default 2; --full 3)"))


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="speclab serve plain against speculative at rising concurrency (and vLLM with "
                       "--peer vllm)")
    add_flags(p, "target", "draft", "k", "workload", "max_new_tokens", "reps", "full", "seed", "threads", "out",
              "quiet", workload=dict(help="workloads (default json,code; --full: all)"),
              max_new_tokens=dict(default=None, help="tokens per request (default 32; --full 64)"),
              reps=dict(help="interleaved repetitions per load level, every server in turn (default 1)"),
              draft=dict(help="the speculative servers' drafter (default: speclab serve's, eagle+suffix; with "
                              "--peer vllm the family's default draft model, which vLLM loads too)"))
    p.add_argument("--policy", dest="spec_policy", default=None, metavar="NAME",
                   help="the speculative server's draft-length policy (default: fixed k)")
    p.add_argument("--concurrency", default=None, help="concurrency levels, a comma list (default 1,2,4,... until "
                   "plain decoding saturates, at most --max-concurrency)")
    p.add_argument("--max-concurrency", type=int, default=None, help="highest level of the doubling (default 16; "
                   "--full 64)")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(4, 2 x concurrency); "
                   "--full max(8, 4 x concurrency))")
    p.add_argument("--peer", choices=("vllm",), default=None, help="also run the same load against vLLM")
    p.add_argument("--vllm-venv", default=None, metavar="PATH", help="vLLM's venv (default $SPECLAB_VLLM_VENV or "
                   "/work/vllm-venv)")
    p.add_argument("--prefix-caching", choices=("on", "off"), default="on", help="the speclab servers' prefix "
                   "caching (default on, as both servers default)")
    p.add_argument("--prompt-mode", choices=("repeat", "fresh"), default=None, help="fresh: each request's prompt "
                   "unique, so no prefix cache helps (default with --peer vllm); repeat: the workload's prompts again "
                   "and again (default otherwise)")
    p.add_argument("--aa", action="store_true", help="an A/A control: a second plain speclab server, identical to "
                   "the first, measured in the same rotation; prints each repetition's ratio of the twins beside the "
                   "ratio to vLLM's plain server, so a gap can be read against the machine's noise")
    p.set_defaults(speculative_config=None)


def _policies_parser(sub) -> None:
    add_policies_flags(sub.add_parser("policies", help="every draft-length policy against plain decoding and fixed "
                                      "k, per workload, mixed stream and load (quick grid unless --full)"))


def add_policies_flags(p) -> None:
    """The flags of ``bench policies`` (also those of ``benchmarks/policy_oracle.py``)."""
    add_flags(p, "target", "draft", "workload", "ks", "batches", "max_new_tokens", "prompts", "reps", "full",
              "clock", "seed", "threads", "device", "out", "quiet",
              workload=dict(help="workloads and their mix (default json,code; --full: all)"),
              ks=dict(help="fixed k values; the largest is the adaptive policies' K (default 1,2,4)"),
              batches=dict(help="concurrency levels (default 1,4,16,64)"),
              max_new_tokens=dict(help="tokens per request, around which budgets spread (at most 32 unless --full; "
                                       "default 64)"),
              prompts=dict(help="requests per workload (default 4; --full 8)"),
              reps=dict(help="interleaved repetitions of the whole grid (default 3)"))
    p.add_argument("--policy", dest="policy_list", default=None, metavar="NAME,...",
                   help="policies to run besides plain and fixed k (default: every one; 'none': none)")
    p.add_argument("--length-spread", type=float, default=0.5, help="each request's token budget drawn uniformly "
                   "from max-new-tokens x [1 - s, 1 + s] (default 0.5; 0: every request max-new-tokens)")
    p.add_argument("--control", action="store_true", help="also a second plain configuration: the A/A control, "
                   "how far two identical configurations read apart")
    p.set_defaults(mode="policies")


def _synthetic_parser(sub) -> None:
    p = sub.add_parser("synthetic", help="the (acceptance, k, batch) landscape with the synthetic drafter against "
                       "the cost model")
    add_flags(p, "target", "workload", "ks", "batches", "max_new_tokens", "prompts", "reps", "full", "clock",
              "seed", "threads", "device", "out", "quiet",
              workload=dict(help="where the prompts come from (default: all)"),
              ks=dict(help="draft lengths (default 1,2,4,8)"), batches=dict(help="batch sizes (default 1,4,16,64)"),
              max_new_tokens=dict(help="tokens per row (at most 32 unless --full; default 64)"),
              reps=dict(help="interleaved repetitions (default 3)"))
    p.add_argument("--alphas", default=None, metavar="A,...", help="acceptance values (default 0.3,0.5,0.7,0.9)")
    p.add_argument("--cost", type=float, default=0.1, help="draft step cost C, in target steps (default 0.1)")
    p.set_defaults(draft=None)


def _heads_parser(sub) -> None:
    p = sub.add_parser("heads", help="self-drafting heads, early exit and trees against separate drafts (batch 1, "
                       "greedy)")
    add_flags(p, "target", "workload", "ks", "max_new_tokens", "prompts", "reps", "clock", "device", "threads",
              "out", "quiet",
              ks=dict(default="4,6", help="draft lengths: the first is every chain's k, all are the EAGLE chain's "
                                          "(default 4,6)"),
              prompts=dict(help="prompts per workload (default 4)"), reps=dict(help="interleaved repetitions "
                                                                                    "(default 3)"))
    p.add_argument("--budget", type=int, default=8, help="verification budget of the tree-vs-chain pairs (default 8)")
    p.add_argument("--exits", action="store_true", help="early exit at every layer m instead (chooses the default m)")
    p.add_argument("--methods", default=None, help="comma list of method names to run (default: all; 'plain' "
                   "always runs)")


def add_commands(subparsers) -> None:
    """Register ``bench`` and its subcommands on an argparse subparsers object."""
    b = subparsers.add_parser("bench", help="benchmarks: " + ", ".join(SUBCOMMANDS),
                              description="One subcommand per benchmark: each prints a table and writes its JSON "
                                          "into --out DIR (default results/). One-off experiments live in "
                                          "benchmarks/ (python benchmarks/NAME.py --help).")
    sub = b.add_subparsers(dest="mode", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for make in (_acceptance_parser, _compare_parser, _serve_parser, _policies_parser, _synthetic_parser,
                 _heads_parser, _round_parser, _heldout_parser):
        make(sub)
    b.set_defaults(func=cmd_bench)


def _round_parser(sub) -> None:
    from . import bench_round

    p = sub.add_parser("round", help="one speculative round phase by phase (draft, verify, accept, bookkeeping, "
                       "other), each beside the floor measured on this machine")
    bench_round.add_arguments(p)
    p.set_defaults(func=bench_round.run_from_args)  # its own runner: --out is a folder it writes round.json into


def _heldout_parser(sub) -> None:
    from . import bench_heldout

    p = sub.add_parser("heldout", help="every drafter against plain decoding on the held-out workloads (batch 1, "
                       "greedy, interleaved, with an A/A control)")
    bench_heldout.add_arguments(p)
    p.set_defaults(func=bench_heldout.run_from_args)
