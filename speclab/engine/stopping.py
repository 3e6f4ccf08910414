"""Where a request's output ends: an EOS token, its token budget, or a stop string."""

from __future__ import annotations

import time

from .request import FINISHED, Request, find_stop


def cut(target, req: Request, new: list[int]) -> tuple[list[int], str | None]:
    """The part of ``new`` the request keeps, and why it ends (None: it goes on).

    Every EOS id of ``target`` ends it (the EOS token is kept), so does its budget, so does a stop string (the
    output text ends before it; the tokens up to the one that completed it are kept)."""
    reason = None
    if not req.ignore_eos:
        eos = target.eos_token_ids
        for i, t in enumerate(new):
            if t in eos:
                new, reason = new[: i + 1], "eos"
                break
    if len(new) >= req.remaining:
        new = new[: req.remaining]
        reason = reason or "length"
    if req.stop and new:
        dec = target.decode
        before = len(dec(req.generated))
        longest = max(len(s) for s in req.stop)
        for m in range(1, len(new) + 1):
            text = dec(req.generated + new[:m])
            at = find_stop(text, req.stop, search_from=max(0, before - longest + 1))
            if at is not None:
                req.stop_at = at
                return new[:m], "stop"
    return new, reason


def finish(req: Request, reason: str) -> None:
    """The request is done (the first reason given stands)."""
    req.status = FINISHED
    req.finish_reason = req.finish_reason or reason
    req.finish_time = time.perf_counter()
