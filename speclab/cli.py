"""``speclab`` command line: generate, models, train, bench.

Every user mistake is one line on stderr and exit status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import SpeclabError

ANSI = {"accepted": "\x1b[32m", "rejected": "\x1b[9;31m", "recovered": "\x1b[33m", "bonus": "\x1b[34m",
        "target": "\x1b[0m"}
RESET = "\x1b[0m"


def _family_default(attr: str, fallback: str) -> str:
    """The family's default model name when its weights are present, else ``fallback``."""
    try:
        from . import family

        name = getattr(family, attr)
        if family.resolve(name) is not None:
            return name
    except Exception:  # noqa: BLE001 - no family: fall back
        pass
    return fallback


def default_target() -> str:
    return _family_default("DEFAULT_TARGET", "target")


def default_draft() -> str:
    return _family_default("DEFAULT_DRAFT", "ngram")


def colour_tokens(tokens: list[dict], colour: bool = True) -> str:
    out = []
    for t in tokens:
        text = t["text"]
        out.append(f"{ANSI[t['status']]}{text}{RESET}" if colour else
                   (f"[-{text}-]" if t["status"] == "rejected" else text))
    return "".join(out)


def format_metrics(m: dict) -> str:
    def f(x, spec=".3f"):
        return "n/a" if x is None else format(x, spec)

    ppa = ", ".join(f"{x:.2f}" for x in m.get("per_position_acceptance") or []) or "n/a"
    return "\n".join([
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
    ])


def setup_threads(threads: int | None, lm=None) -> None:
    """Tiny models on a CPU run fastest on one thread (and several processes on few cores do not
    fight over spinning OpenMP threads); bigger ones get torch's default."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    elif lm is not None and lm.device.type == "cpu" and lm.num_parameters() < 50_000_000:
        torch.set_num_threads(1)


def cmd_generate(args) -> int:
    from .drafters import make_drafter
    from .engine import MAX_K, SpeculativeDecoder
    from .models import load_model

    if args.batch < 1:
        raise SpeclabError(f"--batch must be at least 1, got {args.batch}")
    if not 0 <= args.k <= MAX_K:
        raise SpeclabError(f"-k must be between 0 and {MAX_K}, got {args.k}")
    if not args.prompt.strip():
        raise SpeclabError("the prompt is empty")
    target = load_model(args.target, device=args.device, role="target")
    setup_threads(args.threads, target)
    drafter = make_drafter(args.draft, target)
    dec = SpeculativeDecoder(target, drafter)
    prompts = [args.prompt] * args.batch
    res = dec.generate(prompts, k=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.json:
        keys = ["acceptance_rate", "mean_accepted_length", "per_position_acceptance", "tokens_per_s", "ttft_ms",
                "tpot_ms", "rounds"]
        metrics = {k: res.metrics[k] for k in keys}
        metrics.update({k: v for k, v in res.metrics.items() if k not in metrics})
        json.dump({"text": res.texts, "tokens": res.tokens, "metrics": metrics,
                   "target": target.name, "draft": drafter.name if drafter else "none", "k": args.k},
                  sys.stdout)
        print()
        return 0
    colour = sys.stdout.isatty() or os.environ.get("FORCE_COLOR") or args.colour
    print(f"target {target.name}  draft {drafter.name if drafter else 'none'}  k={args.k}  "
          f"T={args.temperature}  batch={args.batch}")
    legend = " ".join(f"{ANSI[s]}{s}{RESET}" if colour else s for s in ANSI)
    print(f"legend: {legend}\n")
    for b, toks in enumerate(res.tokens):
        if args.batch > 1:
            print(f"--- row {b}")
        print(args.prompt + colour_tokens(toks, bool(colour)))
    print()
    print(format_metrics(res.metrics))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="speclab", description="A lab for speculative decoding.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate with speculative decoding and show every token's fate")
    g.add_argument("--prompt", required=True)
    g.add_argument("--target", default=None, help="family name, local HF directory or hub id (default: target)")
    g.add_argument("--draft", default=None,
                   help="draft model (family name, path, hub id), 'ngram' (prompt lookup) or 'none'")
    g.add_argument("-k", type=int, default=4, help="draft length, 0..32 (0 = plain decoding)")
    g.add_argument("--batch", type=int, default=1, help="rows; one prompt is repeated (a seed per row)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--colour", "--color", action="store_true", help="colour even when not a terminal")
    g.set_defaults(func=cmd_generate)
    try:
        from .family.cli import add_commands
    except ImportError:
        add_commands = None
    if add_commands is not None:
        add_commands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "target", "x") is None:
        args.target = default_target()
    if getattr(args, "draft", "x") is None:
        args.draft = default_draft()
    try:
        return args.func(args) or 0
    except SpeclabError as e:
        print(f"speclab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speclab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
