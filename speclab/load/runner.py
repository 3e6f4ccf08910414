"""Running a load test: load levels one after another, each bracketed by ``/metrics`` scrapes, then token
counting, statistics, the fingerprint of each level and the verdict over all of them.

The run never hangs: every request has a timeout (connect to last byte), a closed-loop level ends when
its clients have sent their share, an open-loop level when its arrivals have been sent and answered,
and with ``duration`` a level stops sending at the duration and cancels whatever is still running at
duration + timeout (those requests are failures of kind "deadline").
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from ..errors import SpeclabError
from ..optional import require_package
from . import fingerprint, scrape, stats
from .client import Endpoint, RequestRecord, send
from .prompts import FreshOrder, request_order
from .shapes import Budgets, LoadLevel, arrival_times, default_num_requests
from .tokens import count_tokens, guess_tokenizer, load_tokenizer


def base_url(url: str) -> str:
    """``http://host:port``, ``.../`` or ``.../v1`` -> ``http://host:port`` (what endpoints hang off)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise SpeclabError(f"not an http(s) URL: {url!r} (e.g. http://127.0.0.1:8000)")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass
class LoadSpec:
    """Everything a run needs besides the endpoint."""

    levels: list[LoadLevel]
    prompts: list  # speclab.workloads.Prompt
    num_requests: int | None = None  # per level; None with no duration: shapes.default_num_requests
    duration: float | None = None  # per level, seconds
    seed: int | None = 0
    slos: dict = field(default_factory=dict)
    warmup: int = 1
    tokenizer: str | None = None
    quiet: bool = False
    deadline: float | None = None  # hard limit per level, seconds (default: duration + timeout with a duration)
    loop: str = "auto"  # the client's event loop: auto (uvloop when installed), uvloop or asyncio
    length_spread: float = 0.0  # each request's max_tokens drawn from the endpoint's x [1 - s, 1 + s] (shapes.Budgets)
    fresh: str | None = None  # a salt: every request's prompt made unique (prompts.FreshOrder), no prefix cache helps


async def _closed_loop(client, endpoint, level, order, n, duration, deadline, bar, start,
                       budgets: Budgets | None = None) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_index = 0

    async def worker():
        nonlocal next_index
        while True:
            now = time.perf_counter() - start
            if next_index >= n or (duration is not None and now >= duration):
                return
            i = next_index
            next_index += 1
            p = order[i % len(order)]
            rec = RequestRecord(i, p.id, p.category, sent=now, max_tokens=budgets[i] if budgets else None)
            records.append(rec)
            await send(client, endpoint, p.prompt, rec)
            bar.update(1)

    tasks = [asyncio.create_task(worker()) for _ in range(int(level.value))]
    await _wait(tasks, deadline)
    return records


async def _open_loop(client, endpoint, level, order, n, duration, seed, deadline, bar,
                     start, budgets: Budgets | None = None) -> list[RequestRecord]:
    times = arrival_times(level.value, level.burstiness, seed if seed is not None else 0, num_requests=n,
                          duration=duration)
    records: list[RequestRecord] = []
    tasks = []

    async def one(rec, prompt):
        await send(client, endpoint, prompt, rec)
        bar.update(1)

    for i, t in enumerate(times):
        delay = t - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        p = order[i % len(order)]
        rec = RequestRecord(i, p.id, p.category, sent=time.perf_counter() - start,
                            max_tokens=budgets[i] if budgets else None)
        records.append(rec)
        tasks.append(asyncio.create_task(one(rec, p.prompt)))
    remaining = None if deadline is None else max(0.0, deadline - (time.perf_counter() - start))
    await _wait(tasks, remaining)
    return records


async def _wait(tasks, timeout) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


STALL_S = 0.0005  # the client's event loop waking this late (seconds) is recorded as a stall


async def _loop_lag(samples: list[float], stalls: list[tuple[float, float]], start: float,
                    period: float = 0.002) -> None:
    """Record how late this client's event loop wakes up (seconds), and the intervals (from ``start``) in
    which it could not run: data arriving then is read, and stamped, all at once when the loop resumes,
    which bunches chunk times by the client's fault, not the server's (see fingerprint.client_blurred)."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        now = time.perf_counter()
        late = max(0.0, now - t - period)
        samples.append(late)
        if late > STALL_S:
            stalls.append((t + period - start, now - start))


def _mark_unfinished(records: list[RequestRecord]) -> None:
    for r in records:
        if not r.ok and r.error is None:
            r.error, r.error_kind = "cancelled at the level's deadline", "deadline"


async def _served_model(client, base: str, headers: dict) -> str | None:
    try:
        r = await client.get(f"{base}/v1/models", headers=headers, timeout=10.0)
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


async def run_async(endpoint: Endpoint, spec: LoadSpec) -> dict:
    """Run every level of ``spec`` against ``endpoint``; the result is JSON-ready (see :func:`run`)."""
    from tqdm.auto import tqdm

    tok_given = load_tokenizer(spec.tokenizer) if spec.tokenizer else None
    order = request_order(spec.prompts, spec.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    notes = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout), limits=limits) as client:
        if endpoint.model is None:
            endpoint.model = await _served_model(client, endpoint.base_url, endpoint.headers())
            if endpoint.model is None:
                notes.append("GET /v1/models gave no model id; requests name no model")
        tokenizer = tok_given or guess_tokenizer(endpoint.model)
        if tokenizer is None:
            notes.append("no tokenizer (give --tokenizer): per-chunk token counts come only from the server, "
                         "and the fingerprint falls back to usage totals and chunk times")
        warm = FreshOrder(order, f"{spec.fresh}/warmup") if spec.fresh is not None else order
        for i in range(spec.warmup):  # the first requests of a process pay for lazy initialisation
            await send(client, endpoint, warm[i % len(warm)].prompt, RequestRecord(-1))
        levels_out = []
        for level in spec.levels:
            n = spec.num_requests
            if n is None and spec.duration is None:
                n = default_num_requests(level)
            deadline = spec.deadline
            if deadline is None and spec.duration is not None:
                deadline = spec.duration + endpoint.timeout
            before, why = await scrape.fetch(client, endpoint.base_url, endpoint.headers())
            # request i of a level asks for the same budget from every server measured with the same seed
            budgets = (Budgets(endpoint.max_tokens, spec.length_spread, f"{spec.seed}-{level.label}")
                       if spec.length_spread else None)
            total = n if n is not None else None
            sent = FreshOrder(order, f"{spec.fresh}/{level.label}") if spec.fresh is not None else order
            lag: list[float] = []
            stalls: list[tuple[float, float]] = []
            with tqdm(total=total, desc=level.label, unit="req", disable=spec.quiet, leave=False) as bar:
                t0 = time.perf_counter()
                monitor = asyncio.create_task(_loop_lag(lag, stalls, t0))
                if level.kind == "concurrency":
                    records = await _closed_loop(client, endpoint, level, sent, n if n is not None else math.inf,
                                                 spec.duration, deadline, bar, t0, budgets)
                else:
                    records = await _open_loop(client, endpoint, level, sent, n, spec.duration, spec.seed,
                                               deadline, bar, t0, budgets)
                wall = time.perf_counter() - t0
            monitor.cancel()
            after, why_after = await scrape.fetch(client, endpoint.base_url, endpoint.headers())
            _mark_unfinished(records)
            count_tokens(records, tokenizer)
            summary = stats.summarize(records, wall, spec.slos)
            request_dicts = [r.to_dict() for r in records]
            fp = fingerprint.fingerprint_records(
                request_dicts, stalls, int(level.value) if level.kind == "concurrency" else None)
            fp["client_loop_lag_ms"] = stats.distribution(lag)
            server = scrape.window(before, after) if after is not None else {"unavailable": why_after or why}
            levels_out.append({
                "level": level.to_dict(), "summary": summary, "fingerprint": fp, "server": server,
                "acceptance_vs_outside": scrape.compare(server, fp["accepted_length_estimate"])
                if after is not None else None,
                "latency_vs_server": scrape.latency_agreement(summary, server, fp) if after is not None else None,
                "client_stalls": [[round(a, 6), round(b, 6)] for a, b in stalls],
                "requests": request_dicts,
                **({"fresh_prompts": sent.sent} if spec.fresh is not None else {}),
            })
    v = fingerprint.verdict([(lv["level"]["label"], lv["level"]["value"], lv["fingerprint"]) for lv in levels_out])
    return {
        "url": endpoint.base_url, "endpoint": endpoint.kind, "model": endpoint.model,
        "max_tokens": endpoint.max_tokens, "length_spread": spec.length_spread,
        "max_tokens_label": Budgets(endpoint.max_tokens, spec.length_spread).label,
        "temperature": endpoint.temperature, "timeout_s": endpoint.timeout,
        "tokenizer": getattr(tokenizer, "name_or_path", None), "seed": spec.seed,
        "num_requests": spec.num_requests, "duration_s": spec.duration, "notes": notes,
        "prompt_mode": "repeat" if spec.fresh is None else "fresh",
        "levels": levels_out, "verdict": v,
    }


def loop_factory(name: str = "auto"):
    """The event loop the client runs on: uvloop's (libuv; less of the client's own time per chunk, so its
    stamps lag the arrivals less on a busy machine) when installed and ``name`` is auto or uvloop, else
    asyncio's (None)."""
    if name == "asyncio":
        return None
    if name == "uvloop":
        require_package("--loop", "uvloop")
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _run_fresh(coro, factory):
    if factory is None:
        return asyncio.run(coro)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)
    return run_on_new_loop(coro, factory)


def run_on_new_loop(coro, factory):
    """``coro`` to completion on a fresh loop from ``factory`` (Python 3.10 has no ``asyncio.Runner``): as
    ``asyncio.run`` does, the tasks left over are cancelled and async generators closed before the loop is."""
    loop = factory()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def run(endpoint: Endpoint, spec: LoadSpec) -> dict:
    """Synchronous :func:`run_async` (for the CLI, the benchmark and notebooks) on a fresh event loop
    (:func:`loop_factory`). Called where an event loop already runs in this thread (a Jupyter kernel), it
    runs the load in a worker thread."""
    factory = loop_factory(spec.loop)  # a missing uvloop fails here, in one line
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_fresh(run_async(endpoint, spec), factory)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_run_fresh, run_async(endpoint, spec), factory).result()
