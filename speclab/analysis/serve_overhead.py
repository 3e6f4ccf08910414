"""The server's own overhead at concurrency 1, measured request by request: each prompt is served by
``speclab serve`` (one streamed request, nothing else in flight) and generated solo in this process
(what ``speclab generate -k 0`` does), the two back to back and their order alternating, so that the
machine's drifts (on a shared 2-CPU machine, tens of percent within a minute) hit both sides of every
pair alike. Measuring whole load levels against a solo pass afterwards spreads 0.7-1.4x per pair here.

A served request's time is the client's whole call: building and sending the request, the server's
parsing, tokenising and hops, the forwards, and reading the stream to its end (``[DONE]``). So the
ratio charges the server with everything a user of it pays on top of calling ``generate`` directly,
client included.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx


async def served_once(client: httpx.AsyncClient, base_url: str, text: str, max_tokens: int,
                      model: str | None = None) -> tuple[float, int, str]:
    """One greedy streamed completion through ``speclab load``'s client: (seconds from the call to the end of the
    stream, completion tokens from the server's usage, text)."""
    from ..load.client import Endpoint, RequestRecord, send

    endpoint = Endpoint(base_url, model=model, max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    rec = await send(client, endpoint, text, RequestRecord(0))
    wall = time.perf_counter() - t0
    if not rec.ok:
        raise RuntimeError(rec.error)
    if rec.usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return wall, rec.usage["completion_tokens"], rec.text


def interleaved_overhead(base_url: str, texts: list[str], max_tokens: int, solo_one, model: str | None = None
                         ) -> dict:
    """Each text served once and generated solo once (``solo_one(text) -> (seconds, tokens, text)``), back to
    back, served first on even positions and solo first on odd ones. Returns the pairs and:

    * ``ratio``: served tokens/s over solo tokens/s, each summed over all the pairs (the target's figure);
    * ``median_pair``: the median of the per-pair ratios (solo seconds over served seconds, same tokens);
    * ``identical``: pairs whose served text equals the solo text (greedy: all of them)."""

    async def pairs() -> list[dict]:
        out = []
        async with httpx.AsyncClient(timeout=120.0) as client:
            await served_once(client, base_url, texts[0], 2, model)  # the connection is open before the first pair
            for i, text in enumerate(texts):
                if i % 2:
                    s = await served_once(client, base_url, text, max_tokens, model)
                    o = solo_one(text)  # blocks the loop: nothing else is in flight
                else:
                    o = solo_one(text)
                    s = await served_once(client, base_url, text, max_tokens, model)
                out.append({"served_s": s[0], "served_tokens": s[1], "solo_s": o[0], "solo_tokens": o[1],
                            "identical": s[2] == o[2]})
        return out

    return summarize(asyncio.run(pairs()))


def summarize(pairs: list[dict]) -> dict:
    """The figures of :func:`interleaved_overhead` from its pairs."""
    if not pairs:
        return {"pairs": [], "ratio": None, "median_pair": None, "identical": 0}
    served = sum(p["served_tokens"] for p in pairs) / sum(p["served_s"] for p in pairs)
    solo = sum(p["solo_tokens"] for p in pairs) / sum(p["solo_s"] for p in pairs)
    per = [(p["served_tokens"] / p["served_s"]) / (p["solo_tokens"] / p["solo_s"]) for p in pairs
           if p["served_tokens"] and p["solo_tokens"]]
    return {"pairs": pairs, "served_tok_s": served, "solo_tok_s": solo, "ratio": served / solo,
            "median_pair": statistics.median(per) if per else None,
            "identical": sum(1 for p in pairs if p["identical"])}
