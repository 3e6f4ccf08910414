"""Every limit a user can hit, checked in one place (the engine, the sweeps, the CLI, the app and the
server all call these), each failure one :class:`SpeclabError` line."""

from __future__ import annotations

import json
import math

from .errors import SpeclabError

MAX_K = 32  # draft tokens per round
MAX_BATCH = 16384  # rows of one SpeculativeDecoder.generate call or one sweep cell
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1


def truthy(v: str | None) -> bool:
    """An on/off setting from the environment: on for 1, true, yes or on (any case, spaces ignored), else off."""
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


def check_int(name: str, v, lo: int, hi: int) -> int:
    """A whole number in [lo, hi]; floats that are whole (4.0) are accepted, bools are not."""
    msg = f"{name} must be a whole number between {lo} and {hi}, got {v!r}"
    if isinstance(v, bool) or v is None or v == "":
        raise SpeclabError(msg)
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise SpeclabError(msg) from None
    if not math.isfinite(f) or f != int(f):
        raise SpeclabError(msg)
    if not lo <= int(f) <= hi:
        raise SpeclabError(f"{name} must be between {lo} and {hi}, got {int(f)}")
    return int(f)


def check_float(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    span = f"{'(' if lo_open else '['}{lo}, {hi}]"
    if isinstance(v, bool):
        raise SpeclabError(f"{name} must be a number in {span}, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise SpeclabError(f"{name} must be a number in {span}, got {v!r}") from None
    if not math.isfinite(f) or f > hi or f < lo or (lo_open and f <= lo):
        raise SpeclabError(f"{name} must be in {span}, got {v!r}")
    return f


def check_k(k, hi: int = MAX_K) -> int:
    return check_int("k (draft length)", k, 0, hi)


def check_batch(b, hi: int = MAX_BATCH) -> int:
    return check_int("batch size", b, 1, hi)


MAX_THREADS = 1024  # torch CPU threads a command may ask for


def check_max_new_tokens(n, hi: int = 1 << 20, name: str = "max_new_tokens") -> int:
    """A token budget >= 1; ``name``: as the caller's user wrote it (``--max-new-tokens``, ``'max_tokens'``)."""
    return check_int(name, n, 1, hi)


def check_paired_run(args, why: str, k_flag: str = "--k") -> None:
    """The flags of a benchmark that pairs speculative runs with plain ones: ``k`` >= 1 (``why``: why plain decoding
    cannot be one of the arms), ``prompts_per_workload``, ``reps`` and ``max_new_tokens``."""
    check_k(args.k)
    if args.k < 1:
        raise SpeclabError(f"{k_flag} must be at least 1 ({why})")
    check_int("--prompts-per-workload", args.prompts_per_workload, 1, 1000)
    check_int("--reps", args.reps, 1, 1000)
    check_max_new_tokens(args.max_new_tokens, name="--max-new-tokens")


def check_threads(n) -> int:
    return check_int("--threads", n, 1, MAX_THREADS)


def check_sampling(temperature, top_p, top_k, vocab: int | None = None) -> tuple[float, float, int]:
    """temperature >= 0 (0 = greedy), top_p in (0, 1], top_k >= 0 (0 = off)."""
    t = check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    p = check_float("top_p", top_p, 0.0, 1.0, lo_open=True)
    k = check_int("top_k", top_k, 0, vocab if vocab else 1 << 30)
    return t, p, k


def check_seed(seed) -> int | None:
    """None (draw a fresh seed) or a whole number >= 0."""
    if seed is None:
        return None
    return check_int("seed", seed, 0, MAX_SEED)


def check_context(prompt_len: int, max_new_tokens: int, context: int, model: str) -> None:
    need = prompt_len + max_new_tokens
    if need > context:
        raise SpeclabError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                           f"context of '{model}' ({context} tokens)")


def parse_numbers(spec, what: str, *, integer: bool = False, lo: float = 0.0, lo_open: bool = True,
                  hi: float = math.inf) -> list:
    """A comma list of numbers from a command line ("1,4,16"), each in (lo, hi] (or [lo, hi]); whole
    numbers when ``integer``. Empty parts are skipped; an empty list is an error."""
    out = []
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise SpeclabError(f"{what}: {part!r} is not a number (give a comma list, e.g. 1,4,16)") from None
        if not math.isfinite(v) or v > hi or v < lo or (lo_open and v <= lo) or (integer and v != int(v)):
            kind = "whole numbers" if integer else "numbers"
            span = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi != math.inf else "")
            raise SpeclabError(f"{what} wants {kind} {span}, got {part}")
        out.append(int(v) if integer else v)
    if not out:
        raise SpeclabError(f"{what}: no values given")
    return out


def parse_json_object(text: str, what: str) -> dict:
    """A JSON object given on a command line (``what`` names the flag in the error)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise SpeclabError(f"{what} is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SpeclabError(f"{what} must be a JSON object")
    return obj
