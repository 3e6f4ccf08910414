"""One error shape: every error ``speclab serve`` sends, whatever its status and wherever it comes from (request
parsing, authentication, routing, admission, the engine, a deadline, shutdown, a stream that fails after its
200), is ``{"error": {"message", "type", "param", "code"}}`` with a one-line message and a string ``code``.
A server in this process (uvicorn on a thread) with an API key, one row, no queue, a drafter that can be held
inside a step (a file) and one that raises on a poison token, and a deadline."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path

import httpx
import pytest

SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in SERVE_DEPS),
                                reason="needs fastapi, uvicorn and prometheus_client")
KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}
POISON = 2047


def check_shape(body: dict, status: int, code: str) -> dict:
    err = body["error"]
    assert set(body) == {"error"} and set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["code"], str) and err["code"] == code, (status, err)
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def drafter(gate: Path):
    from speclab.drafters import PromptLookupDrafter

    class HeldOrFaulty(PromptLookupDrafter):
        def propose(self, ctx, *args, **kw):
            if any(POISON in row for row in ctx.host):
                raise RuntimeError("injected fault")
            while gate.exists():
                time.sleep(0.01)
            return super().propose(ctx, *args, **kw)

    return HeldOrFaulty(3, 1)


def test_every_error_has_the_openai_shape_with_a_string_code(tmp_path):
    from speclab.engine import make_policy
    from speclab.models import load_model
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    target = load_model("target", device="cpu", role="target")
    gate = tmp_path / "gate"
    server = Server(target, drafter(gate), make_policy(None, 3), served_name="errs", engine_cores=1, max_num_seqs=1,
                    max_waiting=0, api_key=KEY, request_timeout=20.0)
    seen = []

    def expect(r: httpx.Response, status: int, code: str) -> dict:
        assert r.status_code == status, (r.status_code, r.text)
        seen.append(status)
        return check_shape(r.json(), status, code)

    with InProcessServer(server) as srv:
        url = srv.url + "/v1/completions"
        with httpx.Client(timeout=60) as c:
            expect(c.post(url, content=b"{oops", headers={**AUTH, "Content-Type": "application/json"}), 400,
                   "invalid_json")
            assert expect(c.post(url, json={"prompt": "hi", "top_p": 0}, headers=AUTH), 400,
                          "invalid_value")["param"] == "top_p"
            expect(c.post(url, json={"prompt": "hi", "model": "other"}, headers=AUTH), 400, "model_not_found")
            expect(c.post(url, json={"prompt": "hi", "echo": True}, headers=AUTH), 400, "unsupported_parameter")
            expect(c.post(url, json={"prompt": "word " * 1200}, headers=AUTH), 400, "context_length_exceeded")
            expect(c.post(url, json={"prompt": "hi"}), 401, "invalid_api_key")
            expect(c.get(srv.url + "/v1/nothing-here", headers=AUTH), 404, "not_found")
            expect(c.get(url, headers=AUTH), 405, "method_not_allowed")
            # the engine's step raises for this request only: a 500, and as a stream an error event
            expect(c.post(url, json={"prompt": [5, POISON, 6], "max_tokens": 4}, headers=AUTH), 500, "engine_error")
            with c.stream("POST", url, json={"prompt": [5, POISON, 6], "max_tokens": 4, "stream": True},
                          headers=AUTH) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and events[-1] == "[DONE]"
            check_shape(json.loads(events[-2]), 500, "engine_error")
            # one row, no queue: held inside its step, the next request is a 429
            gate.touch()

            async def held():
                async with httpx.AsyncClient(timeout=60) as ac:
                    first = asyncio.ensure_future(ac.post(url, json={"prompt": "hi", "max_tokens": 4}, headers=AUTH))
                    while server.engine.running == 0:
                        await asyncio.sleep(0.01)
                    second = await ac.post(url, json={"prompt": "hi", "max_tokens": 4}, headers=AUTH)
                    gate.unlink()
                    return second, await first

            second, first = asyncio.run(held())
            expect(second, 429, "rate_limit_exceeded")
            assert first.status_code == 200
            # shutting down: 503
            server.draining = True
            expect(c.post(url, json={"prompt": "hi", "max_tokens": 2}, headers=AUTH), 503, "server_shutting_down")
            server.draining = False
            # the deadline: 504
            server.engine.request_timeout = 0.3
            gate.touch()
            try:
                expect(c.post(url, json={"prompt": "hi", "max_tokens": 4}, headers=AUTH), 504, "request_timeout")
            finally:
                gate.unlink()
    assert sorted(set(seen)) == [400, 401, 404, 405, 429, 500, 503, 504]
