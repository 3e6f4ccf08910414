"""The ``speclab`` command line. This module is the entry point only: ``generate`` lives here, every
other command registers itself from its own package (``models``/``train`` from :mod:`speclab.family`,
``bench``/``advise`` from :mod:`speclab.analysis`, ``serve`` from :mod:`speclab.serve`, ``load`` from
:mod:`speclab.load`). Nothing imports this module.

Every user mistake is one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .errors import SpeclabError

ANSI = {"accepted": "\x1b[32m", "rejected": "\x1b[9;31m", "recovered": "\x1b[33m", "bonus": "\x1b[34m",
        "target": "\x1b[0m"}
RESET = "\x1b[0m"
PLAIN_LEGEND = ("legend (no colour: stdout is not a terminal): [-text-] is a rejected draft, shown where it was "
                "proposed and not part of the output; every other token is output as is (--colour for colours)")
# packages that register subcommands with add_commands(subparsers)
COMMANDS = ("speclab.family.cli", "speclab.analysis.cli",
            "speclab.analysis.advisor_cli", "speclab.serve.cli", "speclab.load.cli")


def colour_tokens(tokens: list[dict], colour: bool = True) -> str:
    out = []
    for t in tokens:
        text = t["text"]
        out.append(f"{ANSI[t['status']]}{text}{RESET}" if colour else
                   (f"[-{text}-]" if t["status"] == "rejected" else text))
    return "".join(out)


def format_metrics(m: dict, baseline: dict | None = None) -> str:
    from .metrics import speedup

    def f(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    ppa = ", ".join(f"{x:.2f}" for x in m.get("per_position_acceptance") or []) or "n/a"
    lines = [
        f"acceptance rate       {f(m['acceptance_rate'])}   (accepted {m['accepted_tokens']} of "
        f"{m['drafted_tokens']} drafted)",
        f"mean accepted length  {f(m['mean_accepted_length'], '.2f')}   (tokens per round, incl. the "
        f"recovered/bonus token)",
        f"per-position accept   {ppa}",
        f"rounds                {m['rounds']}",
        f"tokens/s              {f(m['tokens_per_s'], '.1f')}   ({m['generated_tokens']} tokens in "
        f"{m['wall_s'] * 1e3:.0f} ms)",
        f"TTFT / TPOT           {f(m['ttft_ms'], '.1f')} ms / {f(m['tpot_ms'], '.2f')} ms",
        f"inter-token gap p50/p95/max  {f(m['itl_p50_ms'], '.2f')} / {f(m['itl_p95_ms'], '.2f')} / "
        f"{f(m['itl_max_ms'], '.2f')} ms",
    ]
    if baseline is not None:
        sp = speedup(m, baseline)
        verdict = ""
        if sp is not None and sp < 1.0:
            verdict = "   SLOWER than plain decoding with these settings: try another draft, a smaller k or --policy"
        lines.append(f"speedup vs k=0        {f(sp, '.2f')}x   (baseline {f(baseline['tokens_per_s'], '.1f')} "
                     f"tokens/s, same prompt and settings, measured right after){verdict}")
    return "\n".join(lines)


def cmd_generate(args) -> int:
    from .defaults import setup_threads
    from .drafters import make_drafter
    from .engine import SpeculativeDecoder, make_policy
    from .engine.policies import seed_costs
    from .limits import check_batch, check_k
    from .models import load_model

    check_batch(args.batch)
    check_k(args.k)
    if not args.prompt.strip():
        raise SpeclabError("the prompt is empty")
    policy = make_policy(args.policy, args.k)  # checked before loading models: errors come fast
    target = load_model(args.target, device=args.device, role="target")
    setup_threads(args.threads, target)
    if args.cuda_graphs and target.device.type != "cuda":
        raise SpeclabError(f"--cuda-graphs needs a CUDA device (the target is on {target.device.type})")
    drafter = make_drafter(args.draft, target)
    graphs = args.cuda_graphs  # None: on for CUDA
    dec = SpeculativeDecoder(target, drafter, cuda_graphs=graphs)
    prompts = [args.prompt] * args.batch
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    speculative = drafter is not None and policy.k_max > 0
    if speculative and not args.no_baseline:  # warm both paths: the first forwards of a process are slow
        SpeculativeDecoder(target, None, cuda_graphs=graphs).generate(prompts[:1], k=0, max_new_tokens=4,
                                                                      record=False)
        dec.generate(prompts[:1], k=args.k, max_new_tokens=4, record=False, policy=policy)
    if speculative:  # cost-weighing policies: the step costs, timed before the run
        seed_costs(policy, dec.costs, target, drafter, args.batch,
                   context=len(target.encode(args.prompt)) + args.max_new_tokens // 2)
    res = dec.generate(prompts, k=args.k, policy=policy, **kw)
    base = None
    if speculative and not args.no_baseline:
        base = SpeculativeDecoder(target, None, cuda_graphs=graphs).generate(prompts, k=0, **kw).metrics
    from .metrics import speedup

    if args.json:
        keys = ["acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_s", "ttft_ms",
                "tpot_ms", "rounds"]
        metrics = {k: res.metrics[k] for k in keys}
        metrics.update({k: v for k, v in res.metrics.items() if k not in metrics})
        json.dump({"text": res.texts, "tokens": res.tokens, "metrics": metrics, "seeds": res.seeds,
                   "baseline_metrics": base, "speedup": speedup(res.metrics, base) if base else None,
                   "target": target.name, "draft": drafter.name if drafter else "none", "k": args.k,
                   "policy": policy.name}, sys.stdout)
        print()
        return 0
    colour = sys.stdout.isatty() or os.environ.get("FORCE_COLOR") or args.colour
    print(f"target: {target.name}  ·  draft: {drafter.name if drafter else 'none (plain decoding)'}  ·  "
          f"policy: {policy.name}, k={args.k}  ·  T={args.temperature}  ·  batch={args.batch}  ·  "
          f"seed{'s' if args.batch > 1 else ''}: {', '.join(map(str, res.seeds))}")
    if colour:
        print("legend: " + " ".join(f"{ANSI[s]}{s}{RESET}" for s in ANSI) + "\n")
    else:
        print(PLAIN_LEGEND + "\n")
    for b, toks in enumerate(res.tokens):
        if args.batch > 1:
            print(f"--- row {b}")
        print(args.prompt + colour_tokens(toks, bool(colour)))
    print()
    print(format_metrics(res.metrics, base))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="speclab", description="A lab for speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with speculative decoding and show every token's fate")
    g.add_argument("--prompt", required=True)
    g.add_argument("--target", default=None, help="family name, local HF directory or hub id (default: target)")
    g.add_argument("--draft", default=None,
                   help="draft model (family name, path, hub id), 'ngram' (prompt lookup), 'suffix' (suffix "
                        "decoding), 'eagle', 'medusa', 'early-exit', 'eagle+suffix', 'synthetic:A[:C]' or 'none' "
                        "(`speclab models` lists them; default: eagle+suffix, the EAGLE head with suffix decoding, "
                        "when the family's head is shipped)")
    g.add_argument("-k", type=int, default=4, help="draft length, 0..32 (0 = plain decoding); with an adaptive "
                   "--policy, the largest k it may choose")
    g.add_argument("--policy", default=None, help="draft-length policy (default: fixed k)")
    g.add_argument("--batch", type=int, default=1, help="rows; one prompt is repeated (row b uses seed + b)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=None, help="row b samples with seed + b (default: a fresh seed, "
                   "printed)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the decode and verify forwards as CUDA graphs (default: on for CUDA, off on the CPU)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--no-baseline", action="store_true", help="skip the k = 0 run that measures the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--colour", "--color", action="store_true", help="colour even when not a terminal")
    g.set_defaults(func=cmd_generate)
    for mod in COMMANDS:
        try:
            add = importlib.import_module(mod).add_commands
        except ModuleNotFoundError as e:  # an optional package's dependency is missing
            if e.name and e.name.startswith("speclab") and not mod.startswith(e.name):
                raise
            continue
        add(sub)
    return p


class Terminated(BaseException):
    """SIGTERM arrived (a BaseException, as KeyboardInterrupt: no ``except Exception`` swallows it)."""


def _terminated(signum, frame) -> None:
    raise Terminated


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM's default ends the process at once, running no ``finally`` clause: the servers a benchmark or
    ``speclab load`` started, each in its own process group, would be left running. Raised as :class:`Terminated` in the
    main thread instead, it unwinds the ``with`` blocks that stop them. Only where SIGTERM still has its default
    (a host that handles it keeps its handler; ``speclab serve``'s uvicorn installs its own while it serves)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def main(argv: list[str] | None = None) -> int:
    from .analysis.flags import old_spelling
    from .defaults import default_draft, default_drafter, default_target

    moved = old_spelling(sys.argv[1:] if argv is None else list(argv))
    if moved:  # an old command line fails here, naming its new form, instead of running something else
        print(f"speclab: error: {moved}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    exit_cleanly_on_sigterm()
    if getattr(args, "target", "x") is None:
        args.target = default_target()
    if getattr(args, "draft", "x") is None:
        # generate and serve run the default drafter; bench serve measures the server's default, except beside a
        # peer, which gets the same pair (vLLM loads a draft model, not the family's head)
        serving = args.command == "generate" or (args.command == "bench" and getattr(args, "mode", "") == "serve"
                                                 and not getattr(args, "peer", None))
        args.draft = default_drafter() if serving else default_draft()
    try:
        return args.func(args) or 0
    except SpeclabError as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speclab: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("speclab: terminated (SIGTERM)", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
