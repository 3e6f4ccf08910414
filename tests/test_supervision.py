"""What can die or hang around ``speclab serve``, and what the server does about it.

* An engine core SIGKILLed under load (a real ``python -m speclab serve`` on a free port, real HTTP clients):
  its streams end with a clean error event, the other core's finish, new requests and ``/health`` never see a
  500 or a 503 (a core can serve throughout), a replacement is ready within 30 s, and requests spread over both
  again. Cores that keep dying end the server with status 1 and a one-line reason.
* A client that stops reading its stream: the request is cancelled and the connection closed.
* A request past ``request_timeout``: a 504 (or an error event in its stream), its slot freed.
* The HTTP side while a core is stuck in a step: ``/health``, ``/metrics``, ``/v1/models`` and bad requests
  still answer at once, and the request waiting behind the step completes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in SERVE_DEPS),
                                reason="needs fastapi, uvicorn and prometheus_client")
STREAMS = 32  # streams in the killed-core test: 4 run on each core, the rest wait behind them
PROMPTS = ["def fibonacci(n):\n", '{"name": "', "import numpy as np\n", "The quick brown fox", "Once upon a time",
           "SELECT id, name FROM", "# Notes\n\n", "for i in range(10):"]


# ------------------------------------------------------------------------------ helpers
def engine_children(pid: int) -> list[int]:
    """The engine core processes of server ``pid`` (its children named speclab-engine), by /proc."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == pid and comm == "speclab-engine":
            out.append(int(d))
    return sorted(out)


def scrape(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= lab)


def wait_for(condition, timeout: float, what: str) -> float:
    """Poll ``condition`` until it holds; the seconds it took. Fails with ``what`` after ``timeout``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, what
        time.sleep(0.05)
    return time.monotonic() - start


def new_stream() -> dict:
    return {"status": None, "tokens": None, "finish_reason": None, "error": None, "chunks": 0}


async def stream(client: httpx.AsyncClient, url: str, body: dict, out: dict | None = None) -> dict:
    """One streamed request into ``out``: {status, tokens (from usage), finish_reason, error (its error event's
    body), chunks (so far)}."""
    out = new_stream() if out is None else out
    async with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) \
            as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            out["chunks"] += 1
            if "error" in d:
                out["error"] = d["error"]
            elif d.get("usage"):
                out["tokens"] = d["usage"]["completion_tokens"]
            for c in d.get("choices", []):
                out["finish_reason"] = c["finish_reason"] or out["finish_reason"]
    return out


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    """Two engine cores, the defaults otherwise (the family's draft at k = 4)."""
    srv = ServeProcess(["-dp", "2", "--max-num-seqs", "8"], tmp_path_factory.mktemp("supervision") / "serve.log",
                       stdout=False)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.close()


# ------------------------------------------------------------------------------ a core killed under load
@pytest.mark.slow
def test_a_core_killed_under_load_is_replaced_without_a_500(dp_server):
    """32 streams on 8 rows: each core runs 4 and queues 12, so the killed core still holds requests however late
    the kill comes (its cores decode ~800 tokens/s each: with only running streams, a starved test process could
    see them decoding after the core had finished them all)."""
    srv = dp_server
    url = srv.url + "/v1/completions"
    cores = engine_children(srv.proc.pid)
    assert len(cores) == 2, cores
    long = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    seen: list[tuple[str, int, str | None]] = []  # (what, status, error code) of every probe, kill to replacement
    at_kill: dict = {}  # the streams and the server as the kill came (in a failure's message)

    async def probe(client, stop: asyncio.Event):
        i = 0
        while not stop.is_set():
            r = await client.post(url, json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4})
            seen.append(("request", r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))
            seen.append(("health", (await client.get(srv.url + "/health")).status_code, None))
            i += 1
            await asyncio.sleep(0.1)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            t0 = time.monotonic()
            outs = [new_stream() for _ in range(STREAMS)]
            streams = [asyncio.ensure_future(stream(client, url, {**long, "prompt": PROMPTS[i % len(PROMPTS)]},
                                                    outs[i])) for i in range(STREAMS)]
            stop = asyncio.Event()
            prober = asyncio.ensure_future(probe(client, stop))
            while sum(o["chunks"] > 1 for o in outs) < 8:  # both cores' rows are decoding, the rest wait behind them
                await asyncio.sleep(0.02)
            m = await asyncio.to_thread(scrape, srv.url)
            assert metric(m, "vllm:num_requests_running") >= 2, "both cores should be running streams"
            at_kill.update(chunks=[o["chunks"] for o in outs], running=metric(m, "vllm:num_requests_running"),
                           generated=metric(m, "vllm:generation_tokens_total"), since_start=time.monotonic() - t0)
            os.kill(cores[1], signal.SIGKILL)
            killed = time.monotonic()

            def replaced():
                now = engine_children(srv.proc.pid)
                return len(now) == 2 and cores[1] not in now and \
                    metric(scrape(srv.url), "speclab:engine_cores_serving") == 2

            await asyncio.to_thread(wait_for, replaced, 60, "no replacement core became ready")
            ready_s = time.monotonic() - killed
            after = await asyncio.gather(*(client.post(url, json={"prompt": p, "max_tokens": 8}) for p in PROMPTS))
            stop.set()
            await prober
            return [await s for s in streams], ready_s, after

    outs, ready_s, after = asyncio.run(run())
    died = [o for o in outs if o["error"] is not None]
    finished = [o for o in outs if o["error"] is None]
    assert died and finished, (at_kill, outs)  # both cores held streams
    for o in died:
        assert o["status"] == 200 and o["error"]["code"] == "engine_core_died" and o["finish_reason"] is None, o
        assert set(o["error"]) == {"message", "type", "param", "code"}
    for o in finished:
        assert (o["finish_reason"], o["tokens"]) == ("length", 300), o
    assert ready_s < 30, f"the replacement took {ready_s:.1f} s"
    assert [r.status_code for r in after] == [200] * len(PROMPTS), [r.text for r in after]
    # a core could serve throughout: /health never said otherwise, and no probe failed but one the killed core was
    # running (a clean 503 naming the cause, as its streams got)
    assert {s for w, s, _ in seen if w == "health"} == {200}, seen
    assert {(s, c) for w, s, c in seen if w == "request"} <= {(200, None), (503, "engine_core_died")}, seen
    assert sum(1 for w, s, _ in seen if w == "request" and s == 503) <= 1, seen
    m = scrape(srv.url)
    assert metric(m, "speclab:engine_core_deaths_total") == 1
    probes_died = sum(1 for w, s, _ in seen if w == "request" and s == 503)  # a probe the killed core was running
    assert metric(m, "vllm:request_success_total", finished_reason="error") == len(died) + probes_died
    assert "engine core" in srv.output() and "killed by SIGKILL" in srv.output()


@pytest.mark.slow
def test_cores_that_keep_dying_end_the_server_with_one_line(dp_server):
    """Last test of the module's server: it ends it. Killed again and again, the cores' deaths reach 3 within a
    minute and the server exits 1, its last line of output the reason."""
    srv = dp_server
    wait_for(lambda: len(engine_children(srv.proc.pid)) == 2, 60, "the server should have two cores")
    kills = 0
    while srv.proc.poll() is None and kills < 5:
        children = engine_children(srv.proc.pid)
        if children:
            victim = children[0]
            os.kill(victim, signal.SIGKILL)
            kills += 1
            wait_for(lambda v=victim: srv.proc.poll() is not None or v not in engine_children(srv.proc.pid), 30,
                     "a killed core stayed")
        time.sleep(0.3)
    assert srv.proc.wait(60) == 1, srv.output()[-2000:]
    assert kills <= 3
    last = srv.output().strip().splitlines()[-1]
    assert last.startswith("speclab serve: error: engine cores died 3 times within 60 s"), last


# ------------------------------------------------------------------------------ servers in this process
@pytest.fixture(scope="module")
def target():
    from speclab.models import load_model

    return load_model("target", device="cpu", role="target")


def outcome(task: asyncio.Future) -> str:
    """How a finished request task ended, for a failure's message: its status and body, or its exception."""
    if task.exception() is not None:
        return f"{type(task.exception()).__name__}: {task.exception()}"
    r = task.result()
    return f"{r.status_code}: {r.text[:500]}"


def gated_lookup(gate: Path, delay: float = 0.0):
    """An n-gram drafter whose every proposal waits while ``gate`` exists, then ``delay`` seconds: a core held in
    its step for as long as a test wants, and steps no faster than ``delay`` (works across the fork: a file)."""
    from speclab.drafters import PromptLookupDrafter

    class Gated(PromptLookupDrafter):
        def propose(self, *args, **kw):
            while gate.exists():
                time.sleep(0.01)
            time.sleep(delay)
            return super().propose(*args, **kw)

    return Gated(3, 1)


def test_a_client_that_stops_reading_is_cancelled_and_its_connection_closed(target, tmp_path):
    """A client opens a stream and never reads it. Each chunk carries the served name (1 kB here) and the
    connection's buffers are small (set on the listening socket, which accepted connections inherit), so they fill
    within a few hundred tokens; once a chunk has waited the stall timeout, the request is cancelled (its row
    freed, counted as an abort) before its 900 tokens, and the connection is closed."""
    from speclab.engine import Off
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    name = "m" * 1024
    server = Server(target, None, Off(), served_name=name, engine_cores=1, stream_split_tokens=True,
                    stream_stall_timeout=1.0)
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}).encode()
    with InProcessServer(server) as srv:
        srv.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            wait_for(lambda: metric(scrape(srv.url), "vllm:request_success_total", finished_reason="abort") == 1, 60,
                     "the stalled stream was never cancelled")
            m = scrape(srv.url)
            assert metric(m, "vllm:num_requests_running") == 0
            assert metric(m, "vllm:generation_tokens_total") < 900
            s.settimeout(30)
            received = 0
            while chunk := s.recv(1 << 16):  # what was buffered, then the server's close
                received += len(chunk)
            assert 0 < received < 900 * len(name)
        finally:
            s.close()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200


def test_a_request_past_its_deadline_gets_a_504_and_frees_its_slot(target, tmp_path):
    """request_timeout 1 s and a drafter that makes each step take 20 ms, so 900 tokens need at least 4.5 s: the
    plain request gets a 504, the stream an error event, both with code request_timeout; a short request completes."""
    from speclab.engine import make_policy
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    server = Server(target, gated_lookup(tmp_path / "no-gate", 0.02), make_policy(None, 3), served_name="late",
                    engine_cores=1, request_timeout=1.0)
    long = {"prompt": PROMPTS[1], "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    with InProcessServer(server) as srv:
        url = srv.url + "/v1/completions"

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(client.post(url, json=long), stream(client, url, long))

        plain, streamed = asyncio.run(run())
        assert plain.status_code == 504, plain.text
        err = plain.json()["error"]
        assert err["code"] == "request_timeout" and err["type"] == "timeout_error" and err["message"]
        assert streamed["status"] == 200 and streamed["error"]["code"] == "request_timeout"
        assert streamed["finish_reason"] is None
        wait_for(lambda: metric(scrape(srv.url), "vllm:num_requests_running") == 0, 30, "the rows were not freed")
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_the_http_side_answers_while_the_core_is_stuck_in_a_step(target, tmp_path):
    """The core is held inside a step (its drafter waits on a file): /health, /metrics, /v1/models, a bad request
    (400) and a queue-full request (429) all answer meanwhile; released, the held request completes."""
    from speclab.engine import make_policy
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    gate = tmp_path / "gate"
    server = Server(target, gated_lookup(gate), make_policy(None, 3), served_name="held", engine_cores=1,
                    max_num_seqs=1, max_waiting=0)
    with InProcessServer(server) as srv:
        url = srv.url + "/v1/completions"
        gate.touch()

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                # greedy and past EOS: sampled (the API's default), its prefill's token was EOS about 3% of the
                # time, and the request ended before any step could be held
                held = asyncio.ensure_future(client.post(url, json={"prompt": PROMPTS[0], "max_tokens": 8,
                                                                    "temperature": 0, "ignore_eos": True}))
                await asyncio.to_thread(wait_for, lambda: server.engine.running == 1, 30, "the request never ran")
                answers = [(await client.get(srv.url + p)).status_code for p in ("/health", "/metrics", "/v1/models")]
                bad = await client.post(url, json={"prompt": "hi", "max_tokens": -1})
                full = await client.post(url, json={"prompt": "hi", "max_tokens": 2})
                assert not held.done(), outcome(held)  # all of that while the core was still in its step
                gate.unlink()
                return answers, bad, full, await held

        answers, bad, full, held = asyncio.run(run())
    assert answers == [200, 200, 200]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
    assert held.status_code == 200 and held.json()["usage"]["completion_tokens"] == 8
