"""``speclab serve`` against real servers: ``python -m speclab serve`` started on free local ports and driven
with ``httpx`` over HTTP (streaming and not), outputs checked token for token against solo
``SpeculativeDecoder.generate`` runs computed here with the same models. Plus the pure pieces
(incremental detokenisation, ``--speculative-config`` parsing) and an engine fault injected into a
server running in this process.

Servers (launched together, once per module, while this process loads its reference models; the
embedded family, ``--threads 1``):
* ``main``: the defaults (eagle+suffix, k = 4) with an API key;
* ``small``: ``--max-num-seqs 2 --max-waiting-requests 2``, n-gram drafting (k = 3), one token per chunk;
  SIGTERM'd by the last server test.
Plain decoding and an injected engine fault run on servers inside this process (uvicorn on a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

from speclab.errors import SpeclabError
from speclab.ports import free_port
from speclab.serve.inprocess import InProcessServer

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["def fibonacci(n):\n", '{"name": "', "import numpy as np\n", "The quick brown fox", "Once upon a time",
           "SELECT id, name FROM", "# Notes\n\n", "for i in range(10):"]
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}

SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in SERVE_DEPS),
                                reason="needs fastapi, uvicorn and prometheus_client")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Launched now, waited for on first use (``servers[name].ready``)."""
    logs = tmp_path_factory.mktemp("serve-logs")
    procs = {
        "main": ServeProcess(["--api-key", KEY], logs / "serve-main.log"),
        "small": ServeProcess(["--max-num-seqs", "2", "--max-waiting-requests", "2", "--speculative-config",
                               json.dumps(NGRAM), "--stream-split-tokens", "--http", "h11", "--loop", "asyncio"],
                              logs / "serve-small.log"),  # the pure-Python HTTP parser, asyncio's loop (main: defaults)
    }
    try:
        yield procs
    finally:
        for p in procs.values():  # all at once: each takes seconds to exit
            p.stop()
        for p in procs.values():
            p.close()


@pytest.fixture(scope="module")
def models():
    from speclab.defaults import default_drafter
    from speclab.drafters import make_drafter
    from speclab.models import load_model

    target = load_model("target", device="cpu", role="target")
    return {"target": target, "draft": make_drafter("draft-xs-distill", target),
            "default": make_drafter(default_drafter(), target),  # what the "main" server runs with its defaults
            "ngram": make_drafter("ngram", target, max_ngram=3, min_ngram=1)}


def reference(models, drafter: str | None, k: int, body: dict, chat: bool = False):
    """The solo run the server must reproduce: (text, token ids, finish reason)."""
    from speclab.engine import SpeculativeDecoder

    target = models["target"]
    prompt = target.apply_chat(body["messages"]) if chat else body["prompt"]
    res = SpeculativeDecoder(target, models[drafter] if drafter else None).generate(
        [prompt], k=k, max_new_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0),
        top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0), seed=body.get("seed", 0), record=False,
        stop=tuple([body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", ())),
        stop_on_eos=not body.get("ignore_eos", False))
    return res.texts[0], res.output_tokens[0], FINISH[res.finish_reasons[0]]


# ------------------------------------------------------------------------------ HTTP helpers
def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


async def running_on(server, core: int | None, *requests, timeout: float = 60.0) -> None:
    """Wait until the engine (or its core ``core``) reports a running request, for at most ``timeout`` s: a core
    that never runs it fails the test with what it saw, never hangs it."""
    engine = server.engine
    deadline = time.monotonic() + timeout

    def running() -> int:
        return engine.running if core is None else engine.cores[core].running

    while running() == 0 and not any(r.done() for r in requests) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    ended = [repr(r.result() if r.exception() is None else r.exception()) for r in requests if r.done()]
    if running() == 0 and engine.process:  # where the core is: its stack into this test's captured stderr
        for w in engine.workers:
            if w is not None and w.is_alive():
                os.kill(w.pid, signal.SIGUSR1)
        await asyncio.sleep(1.0)
    assert running() > 0, (f"the engine{'' if core is None else f' core {core}'} never ran the request (alive: "
                           f"{engine.alive}; ended: {ended or 'none'})")


async def post(client: httpx.AsyncClient, url: str, body: dict, headers=AUTH) -> dict:
    """One request, streamed or not, folded into {status, text, token_ids, finish_reason, usage, speculation,
    chunks (token ids per content chunk)}."""
    if not body.get("stream"):
        r = await client.post(url, json=body, headers=headers)
        d = r.json()
        if r.status_code != 200:
            return {"status": r.status_code, "body": d}
        c = d["choices"][0]
        text = c["message"]["content"] if "message" in c else c["text"]
        return {"status": 200, "text": text, "token_ids": c.get("token_ids"), "finish_reason": c["finish_reason"],
                "usage": d["usage"], "speculation": d["speculation"],
                "prompt_token_ids": d.get("prompt_token_ids") or c.get("prompt_token_ids")}
    out = {"status": 200, "text": "", "token_ids": [], "chunks": [], "usage": None, "speculation": None,
           "finish_reason": None, "events": []}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": json.loads(await r.aread())}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            out["events"].append(data)
            if data == "[DONE]":
                continue
            d = json.loads(data)
            prompt_ids = d.get("prompt_token_ids") or next((c["prompt_token_ids"] for c in d.get("choices", [])
                                                             if "prompt_token_ids" in c), None)
            if prompt_ids is not None:
                assert "prompt_token_ids" not in out  # once, in the first chunk
                out["prompt_token_ids"] = prompt_ids
            if "error" in d:
                out["error"] = d["error"]
                continue
            if d.get("usage"):
                assert d["choices"] == []
                out["usage"], out["speculation"] = d["usage"], d["speculation"]
            for c in d["choices"]:
                delta = c.get("delta", {})
                out["text"] += c.get("text", "") or delta.get("content", "") or ""
                if "token_ids" in c:
                    out["token_ids"] += c["token_ids"]
                    out["chunks"].append(c["token_ids"])
                if c["finish_reason"] is not None:
                    out["finish_reason"] = c["finish_reason"]
    assert out["events"][-1] == "[DONE]", out["events"][-3:]
    return out


def families(url: str):
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text))


def scrape(url: str) -> dict:
    """/metrics as {(sample name, frozenset(labels)): value}."""
    return {(s.name, frozenset(s.labels.items())): s.value for fam in families(url) for s in fam.samples}


def metric(m: dict, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in m.items() if n == name and want <= lab)


# ------------------------------------------------------------------------------ a) staggered, exact
def _cases() -> list[tuple[str, dict, bool]]:
    """16 requests: completions and chat, streamed and not, greedy and sampled (seeded), stop strings."""
    cases = []
    for i in range(16):
        chat = i % 4 == 3
        body = {"max_tokens": 20 + (i % 3) * 4, "return_token_ids": True, "stream": i % 2 == 0,
                "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        else:
            body["prompt"] = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 1:
            body.update(temperature=0.8, seed=1000 + i, top_p=0.95 if i % 2 else 1.0, top_k=40 if i % 5 == 1 else 0)
        else:
            body["temperature"] = 0.0
        if i in (0, 8):
            body["stop"] = [" | ", "zzz"] if i == 0 else "\n"
        if i == 5:
            body["ignore_eos"] = True
        cases.append((f"case{i}", body, chat))
    return cases


@pytest.mark.slow
def test_staggered_concurrent_requests_equal_solo_generate(servers, models):
    url = servers["main"].ready.url
    cases = _cases()
    refs = [reference(models, "default", 4, body, chat) for _, body, chat in cases]
    assert any(r[2] == "stop" and b.get("stop") for r, (_, b, _) in zip(refs, cases)), "no case hits a stop string"

    async def one(client, i, body, chat):
        await asyncio.sleep(0.03 * i)  # arrivals spread over time: requests join a batch already running
        return await post(client, url + ("/v1/chat/completions" if chat else "/v1/completions"), body)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i, b, c) for i, (_, b, c) in enumerate(cases)))

    outs = asyncio.run(run())
    multi_token_chunk = False
    for (name, body, chat), (text, ids, finish), out in zip(cases, refs, outs):
        assert out["status"] == 200, (name, out)
        assert out["token_ids"] == ids, name
        assert out["text"] == text, name
        assert out["finish_reason"] == finish, name
        assert out["usage"]["completion_tokens"] == len(ids), name
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + len(ids), name
        target = models["target"]
        prompt_ids = target.encode(target.apply_chat(body["messages"]) if chat else body["prompt"])
        assert out["prompt_token_ids"] == prompt_ids and out["usage"]["prompt_tokens"] == len(prompt_ids), name
        assert out["speculation"]["drafted_tokens"] >= out["speculation"]["accepted_tokens"] >= 0
        if body["stream"]:
            assert out["chunks"][0] and len(out["chunks"][0]) == 1, name  # the prefill's first token
            assert all(1 <= len(c) <= 5 for c in out["chunks"][:-1]), name  # one round: up to k + 1 tokens
            multi_token_chunk |= any(len(c) > 1 for c in out["chunks"])
    assert multi_token_chunk, "no streamed chunk carried a whole speculative round"


# ------------------------------------------------------------------------------ b) disconnects
def _wait_idle(url: str, aborted_before: float, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        if metric(m, "vllm:num_requests_running") == 0 and \
                metric(m, "vllm:request_success_total", finished_reason="abort") > aborted_before:
            return m
        time.sleep(0.1)
    pytest.fail(f"still running or not aborted after {timeout} s: {m}")


@pytest.mark.slow
def test_disconnect_cancels_and_frees_the_slot(servers, models):
    url = servers["main"].ready.url
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}

    async def leave_mid_stream():
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream("POST", url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        break  # leaving the block closes the connection mid-stream

    aborted = metric(scrape(url), "vllm:request_success_total", finished_reason="abort")
    asyncio.run(leave_mid_stream())
    m = _wait_idle(url, aborted)
    assert metric(m, "vllm:request_success_total", finished_reason="abort") == aborted + 1

    # a client that gives up on a whole (non-streamed) response is cancelled too
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=0.5)
    _wait_idle(url, aborted + 1)

    # and the next request is served, exactly
    new = {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    out = asyncio.run(_one(url + "/v1/completions", new))
    assert out["status"] == 200
    assert out["token_ids"] == reference(models, "default", 4, new)[1]


async def _one(url, body, headers=AUTH):
    async with httpx.AsyncClient(timeout=120) as client:
        return await post(client, url, body, headers)


# ------------------------------------------------------------------------------ c) overload
@pytest.mark.slow
def test_overload_gets_429_and_admitted_requests_complete(servers, models):
    url = servers["small"].ready.url
    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 32, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True, "stream": i % 2 == 1} for i in range(16)]
    before = scrape(url)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(post(client, url + "/v1/completions", b, {}) for b in bodies))

    outs = asyncio.run(run())
    refused = [o for o in outs if o["status"] == 429]
    served = [(b, o) for b, o in zip(bodies, outs) if o["status"] == 200]
    assert len(refused) + len(served) == len(outs), [o["status"] for o in outs]
    assert refused and len(served) >= 4, [o["status"] for o in outs]
    for o in refused:
        err = o["body"]["error"]
        assert err["message"] and err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    for b, o in served:
        assert o["token_ids"] == reference(models, "ngram", 3, b)[1]
        if b["stream"]:  # --stream-split-tokens: one token per chunk
            assert all(len(c) == 1 for c in o["chunks"])
        else:
            assert o["usage"]["completion_tokens"] == 32
    after = scrape(url)
    assert metric(after, "vllm:admission_rejections_total") - metric(before, "vllm:admission_rejections_total") \
        == len(refused)
    # the queue drains, then it takes requests again
    out = asyncio.run(_one(url + "/v1/completions", bodies[0], {}))
    assert out["status"] == 200


# ------------------------------------------------------------------------------ d) metrics
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:generation_tokens", "vllm:prompt_tokens",
            "vllm:request_success", "vllm:admission_rejections", "speclab:spec_decode_num_draft_tokens_per_pos",
            "speclab:verify_rounds", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "speclab:draft_length")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_queue_time_seconds")


def test_metric_names_types_and_counters_equal_the_engine(servers):
    url = servers["main"].ready.url
    types = {f.name: f.type for f in families(url)}
    m0 = scrape(url)
    for name in COUNTERS:
        assert types.get(name) == "counter", name
    for name in GAUGES:
        assert types.get(name) == "gauge", name
    for name in HISTOGRAMS:
        assert types.get(name) == "histogram", name
    assert types.get("speclab:spec_policy_info") == "gauge"  # an Info, in the text format
    info = next(dict(lab) for (n, lab) in scrape(url) if n == "speclab:spec_policy_info")
    assert info["method"] == "draft_model" and info["num_speculative_tokens"] == "4" and info["policy"] == "fixed"
    labels = {k for (n, lab) in m0 if n == "vllm:generation_tokens_total" for k, _ in lab}
    assert labels == {"model_name", "engine"}
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
            frozenset({"model_name": "target", "engine": "0", "position": "3"}.items())) in m0

    bodies = [{"prompt": p, "max_tokens": 24, "temperature": t, "seed": 7, "stream": s,
               "stream_options": {"include_usage": True}}
              for p, t, s in zip(PROMPTS[:6], (0, 0.9, 0, 0.7, 0, 1.0), (True, False, False, True, True, False))]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(post(client, url + "/v1/completions", b) for b in bodies))

    outs = asyncio.run(run())
    m1 = scrape(url)

    def delta(name, **labels):
        return metric(m1, name, **labels) - metric(m0, name, **labels)

    spec = [o["speculation"] for o in outs]
    use = [o["usage"] for o in outs]
    assert delta("vllm:spec_decode_num_drafts_total") == sum(s["num_drafts"] for s in spec)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(s["drafted_tokens"] for s in spec)
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(s["accepted_tokens"] for s in spec)
    for i in range(4):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) == \
            sum(s["accepted_tokens_per_pos"][i] for s in spec if len(s["accepted_tokens_per_pos"]) > i)
        assert delta("speclab:spec_decode_num_draft_tokens_per_pos_total", position=str(i)) == \
            sum(s["draft_tokens_per_pos"][i] for s in spec if len(s["draft_tokens_per_pos"]) > i)
    assert delta("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in use)
    assert delta("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in use)
    assert delta("vllm:prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in use)  # every prompt looked up
    assert 0 <= delta("vllm:prefix_cache_hits_total") <= delta("vllm:prefix_cache_queries_total")
    assert delta("vllm:time_to_first_token_seconds_count") == len(outs)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(outs)
    assert delta("vllm:inter_token_latency_seconds_count") == sum(s["rounds"] for s in spec)  # one per round
    assert delta("vllm:request_success_total") == len(outs)
    assert metric(m1, "vllm:num_requests_running") == 0
    assert 0 < metric(m1, "speclab:draft_length") <= 4
    for s in spec:  # the per-request ratios derive from the raw counts
        assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"])
        assert s["mean_acceptance_length"] == pytest.approx(s["accepted_tokens"] / s["rounds"] + 1)


def test_a_repeated_prompt_reuses_its_prefix(servers, models):
    """Prefix caching (on by default): the same prompt again is prefilled from its stored keys and values, all
    but its last token, and decodes to the same tokens."""
    url = servers["main"].ready.url
    body = {"prompt": "A prompt for the prefix cache: " + PROMPTS[2], "max_tokens": 16, "temperature": 0,
            "return_token_ids": True}
    outs, hits = [], []
    for _ in range(2):
        m0 = scrape(url)
        outs.append(asyncio.run(_one(url + "/v1/completions", dict(body, stream=False))))
        hits.append(metric(scrape(url), "vllm:prefix_cache_hits_total") - metric(m0, "vllm:prefix_cache_hits_total"))
    n = outs[0]["usage"]["prompt_tokens"]
    assert hits == [0, n - 1]
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == reference(models, "default", 4, body)[1]


# ------------------------------------------------------------------------------ e) bad input, auth
BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 1200}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": 500}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
]


def test_bad_input_is_a_400_and_the_server_keeps_serving(servers, models):
    url = servers["main"].ready.url
    with httpx.Client(timeout=30) as c:
        for path, body, param in BAD:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = c.post(url + path, headers={**AUTH, "Content-Type": "application/json"}, **kw)
            assert r.status_code == 400, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"], body
            assert set(err) == {"message", "type", "param", "code"} and isinstance(err["code"], str), err
            assert err["param"] == param, (body, err)
            assert "\n" not in err["message"]
            if param == "max_tokens" and body.get("max_tokens") in (0, -1):  # named as the client sent it
                assert err["message"].startswith("'max_tokens' must be between 1 and"), err
        # authentication: /v1 wants the key, /health and /metrics do not
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = c.post(url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["message"], headers
            assert c.get(url + "/v1/models", headers=headers).status_code == 401
        assert c.get(url + "/health").status_code == 200
        assert c.get(url + "/metrics").status_code == 200
        models_list = c.get(url + "/v1/models", headers=AUTH).json()
        assert [m["id"] for m in models_list["data"]] == ["target"]
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "return_token_ids": True, "model": "target"}
    out = asyncio.run(_one(url + "/v1/completions", body))
    assert out["status"] == 200 and out["token_ids"] == reference(models, "default", 4, body)[1]


# ------------------------------------------------------------------------------ servers in this process
class InProcess(InProcessServer):
    """speclab.serve.inprocess.InProcessServer, checking that the app's shutdown stopped the engine."""

    def __exit__(self, *exc):
        super().__exit__(*exc)
        assert not self.server.engine.alive


@pytest.mark.parametrize("process", [True, False], ids=["engine-process", "engine-thread"])
@pytest.mark.slow
def test_plain_decoding_server(models, process):
    """No drafter: plain decoding through the same loop, and no spec-decode metrics (as vLLM); the engine core in
    its own process (the default on a CPU) or on a thread (CUDA)."""
    from speclab.engine import Off
    from speclab.serve.app import Server

    body = {"prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0.7, "seed": 3, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    server = Server(models["target"], None, Off(), served_name="plain", engine_process=process,
                    prefix_caching=False)
    with InProcess(server) as srv:
        assert server.engine.process == process
        if process:  # the model's work happens in the child, not in this process
            assert server.engine.workers[0].pid != os.getpid()
        out = asyncio.run(_one(srv.url + "/v1/completions", body, {}))
        again = asyncio.run(_one(srv.url + "/v1/completions", body, {}))
        names = {f.name for f in families(srv.url)}
        m = scrape(srv.url)
    assert again["token_ids"] == out["token_ids"]
    # prefix caching off (--no-enable-prefix-caching): nothing looked up, nothing reused
    assert metric(m, "vllm:prefix_cache_queries_total") == metric(m, "vllm:prefix_cache_hits_total") == 0
    text, ids, finish = reference(models, None, 0, body)
    assert (out["text"], out["token_ids"], out["finish_reason"]) == (text, ids, finish)
    assert all(len(c) == 1 for c in out["chunks"])  # plain decoding: one token per round
    assert out["speculation"]["drafted_tokens"] == 0 and out["speculation"]["acceptance_rate"] is None
    assert "vllm:generation_tokens" in names and not any(n.startswith("vllm:spec_decode") for n in names)


@pytest.mark.slow
def test_adaptive_policy_starts_from_calibrated_step_costs(models, monkeypatch):
    """`speclab serve` with an adaptive policy calibrates the step costs at start-up and hands them to the engine
    core, whose scheduler then refines the same tables online (here on a thread, so the object is shared). The
    calibration reads a clock that counts forwards (a target forward 1, a draft forward 0.1), so the tables are the
    same on a busy machine as on an idle one: at those prices goodput drafts the request's 12 tokens."""
    from speclab.engine import make_policy
    from speclab.engine.costs import ROBUST_REPS, ROBUST_STAT, OnlineCosts
    from speclab.models.native_llama import StaticKVCache
    from speclab.serve.app import Server

    target, draft = models["target"], models["draft"]
    spent = [0.0]
    forward = StaticKVCache.forward

    def counted(cache, *args, **kwargs):
        spent[0] += 1.0 if cache.model is target.native else 0.1
        return forward(cache, *args, **kwargs)

    costs = OnlineCosts()
    with monkeypatch.context() as m:
        m.setattr(StaticKVCache, "forward", counted)
        costs.calibrate(target, draft.lm, rows=(1, 2), tokens=(1, 2, 3, 4, 5), reps=ROBUST_REPS, stat=ROBUST_STAT,
                        clock=lambda: spent[0])
    before = costs.snapshot()
    assert before["calibrated_target"]["1x5"] == before["calibrated_target"]["1x1"]  # one forward each
    assert before["calibrated_target"] and not before["target"]  # timed, nothing learnt yet
    server = Server(target, draft, make_policy("goodput", 4), served_name="calibrated", engine_process=False,
                    engine_cores=1, costs=costs)
    with InProcess(server) as srv:
        out = asyncio.run(_one(srv.url + "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 12}, {}))
    assert out["status"] == 200 and out["speculation"]["rounds"] > 0
    assert costs.snapshot()["target"]  # the engine's rounds were recorded into the tables it was given


@pytest.mark.slow
def test_an_engine_fault_fails_only_its_requests(models):
    """A drafter that raises inside the engine step whenever a row holds the POISON token: that request
    gets a 500 body; the one running before it and the one queued behind it complete exactly."""
    from speclab.drafters import PromptLookupDrafter
    from speclab.engine import make_policy
    from speclab.serve.app import Server

    POISON = 2047

    class FaultyLookup(PromptLookupDrafter):
        def propose(self, ctx, ks, params, uniform, want_probs, stop=None):
            if any(POISON in row for row in ctx.host):
                raise RuntimeError("injected fault")
            return super().propose(ctx, ks, params, uniform, want_probs, stop)

    ok = {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    ok2 = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    bad = {"prompt": [200, 300, POISON, 400], "max_tokens": 12, "temperature": 0}
    server = Server(models["target"], FaultyLookup(3, 1), make_policy(None, 3), served_name="faulty", max_num_seqs=1,
                    engine_cores=1)
    with InProcess(server) as srv:
        url = srv.url + "/v1/completions"

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                first = asyncio.ensure_future(post(client, url, ok, {}))
                await asyncio.sleep(0.05)  # it runs; the next two wait (one row at a time)
                second = asyncio.ensure_future(post(client, url, bad, {}))
                await asyncio.sleep(0.02)
                third = asyncio.ensure_future(post(client, url, {**ok2, "stream": True}, {}))
                return await asyncio.gather(first, second, third)

        a, b, c = asyncio.run(run())
        m = scrape(srv.url)
    assert b["status"] == 500 and "injected fault" in b["body"]["error"]["message"]
    assert a["status"] == 200 and a["token_ids"] == reference(models, "ngram", 3, ok)[1]
    assert c["status"] == 200 and c["token_ids"] == reference(models, "ngram", 3, ok2)[1]
    assert metric(m, "speclab:engine_errors_total") == 1
    assert metric(m, "vllm:request_success_total", finished_reason="error") == 1


@pytest.mark.slow
def test_data_parallel_cores_share_the_load_exactly(models):
    """Two engine cores (vLLM's data parallelism): concurrent staggered requests spread over both, each output equal
    to its solo run, the metrics the sum of both cores' counts; then the second core dies: its request fails, the
    first core's completes, and /health and new requests go on with the first core (200) while the second's
    replacement starts; once it is READY, requests are spread over both again."""
    from speclab.engine import make_policy
    from speclab.serve.app import Server

    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16 + i, "temperature": 0.0 if i % 2 else 0.8,
               "seed": 50 + i, "return_token_ids": True, "stream": i % 3 == 0,
               "stream_options": {"include_usage": True}} for i in range(8)]
    server = Server(models["target"], models["draft"], make_policy(None, 4), served_name="dp", engine_cores=2,
                    max_num_seqs=4)
    with InProcess(server) as srv:
        url = srv.url + "/v1/completions"
        assert [c.rows for c in server.engine.cores] == [2, 2]
        assert len({w.pid for w in server.engine.workers} | {os.getpid()}) == 3
        m0 = scrape(srv.url)

        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(i, b):
                    await asyncio.sleep(0.02 * i)
                    return await post(client, url, b, {})
                return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))

        outs = asyncio.run(run())
        m1 = scrape(srv.url)
        assert all(c.submitted >= 2 for c in server.engine.cores), [c.submitted for c in server.engine.cores]
        for b, o in zip(bodies, outs):
            text, ids, finish = reference(models, "draft", 4, b)
            assert (o["status"], o["token_ids"], o["text"], o["finish_reason"]) == (200, ids, text, finish)
        for name, key in (("vllm:spec_decode_num_draft_tokens_total", "drafted_tokens"),
                          ("vllm:spec_decode_num_accepted_tokens_total", "accepted_tokens")):
            assert metric(m1, name) - metric(m0, name) == sum(o["speculation"][key] for o in outs), name
        assert metric(m1, "vllm:generation_tokens_total") - metric(m0, "vllm:generation_tokens_total") == \
            sum(o["usage"]["completion_tokens"] for o in outs)

        long = {"prompt": PROMPTS[2], "max_tokens": 600, "ignore_eos": True, "temperature": 0, "stream": True}
        pids = []

        async def kill_the_second():
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.ensure_future(post(client, url, long, {}))
                await running_on(server, 0, first)
                second = asyncio.ensure_future(post(client, url, {**long, "max_tokens": 900}, {}))
                await running_on(server, 1, second)
                pids.append(server.engine.workers[1].pid)
                os.kill(pids[-1], signal.SIGKILL)
                return await asyncio.gather(first, second)

        first, second = asyncio.run(kill_the_second())
        assert "error" in second and second["finish_reason"] is None
        assert second["error"]["code"] == "engine_core_died", second
        assert "error" not in first and first["finish_reason"] == "length" and len(first["text"]) > 0
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # the first core serves
        after = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert after.status_code == 200, after.text
        wait_for(lambda: server.engine.cores[1].serving, 60, "the second core's replacement never became ready")
        assert server.engine.cores[1].starts == 2 and server.engine.workers[1].pid not in pids


@pytest.mark.slow
def test_rows_the_draft_never_took_in_leave_and_move_without_failing(models):
    """A server whose policy is off above 2 rows, past the 8 rows its caches start with: rows 8-11 never draft, so
    the draft model never takes them in, and rows finishing apart move them into freed slots. Every request
    completes, equal to plain greedy decoding (served at 32 streams, such servers failed up to 30 of 32 requests)."""
    from speclab.engine import make_policy
    from speclab.serve.app import Server

    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8 + 3 * i, "temperature": 0.0, "ignore_eos": True,
               "return_token_ids": True} for i in range(12)]
    server = Server(models["target"], models["draft"], make_policy("batch-table:1-2=4,3-=0", 4), served_name="late",
                    engine_cores=1, max_num_seqs=12)
    with InProcess(server) as srv:
        url = srv.url + "/v1/completions"

        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(post(client, url, b, {}) for b in bodies))

        outs = asyncio.run(run())
        assert [o["status"] for o in outs] == [200] * 12, [o.get("body") for o in outs]
        for b, o in zip(bodies, outs):
            text, ids, finish = reference(models, None, 0, b)
            assert (o["token_ids"], o["text"], o["finish_reason"]) == (ids, text, finish)
        assert sum(o["speculation"]["drafted_tokens"] for o in outs) > 0  # the last rows drafted
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


class Slowed:
    """The target LM with one method slowed by ``delay`` seconds (subclasses say which); the rest is the LM's."""

    def __init__(self, lm, delay: float):
        self._lm, self._delay = lm, delay

    def __getattr__(self, name):
        return getattr(self._lm, name)


class SlowEncoding(Slowed):
    """Encoding takes ``delay`` seconds: the HTTP side's work before the engine sees the request (parsing,
    tokenising) made long enough to measure."""

    def encode(self, text):
        time.sleep(self._delay)
        return self._lm.encode(text)


def test_ttft_clock_starts_at_arrival(models):
    """TTFT, queue time and E2E start when the app receives the request (vLLM's arrival time), not when the engine
    admits it: the tokenising before admission is counted."""
    from speclab.engine import Off
    from speclab.serve.app import Server

    delay = 0.3
    # the core on a thread: this test's HTTP client runs beside the server's start (a fork then can copy an OpenSSL
    # lock held, and the forked core deadlocks on it)
    server = Server(SlowEncoding(models["target"], delay), None, Off(), served_name="slow", engine_process=False)
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with InProcess(server) as srv:
        m0 = scrape(srv.url)
        t0 = time.perf_counter()
        out = asyncio.run(_one(srv.url + "/v1/completions", body, {}))
        client_e2e = time.perf_counter() - t0
        m1 = scrape(srv.url)
    assert out["status"] == 200 and out["text"]

    def delta(name):
        return metric(m1, name) - metric(m0, name)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    ttft = delta("vllm:time_to_first_token_seconds_sum")
    assert delay <= ttft <= client_e2e
    assert delta("vllm:request_queue_time_seconds_sum") >= delay  # arrival to the engine's prefill
    assert delay <= delta("vllm:e2e_request_latency_seconds_sum") <= client_e2e


class SlowDecoding(Slowed):
    """Decoding tokens to text takes ``delay`` seconds: the HTTP side's work between a token's arrival and its chunk
    going out made long enough to measure."""

    tokenizer = None  # (no shortcut to the Rust decoder: every decode comes here)

    def decode(self, ids):
        time.sleep(self._delay)
        return self._lm.decode(ids)


def test_ttft_ends_when_the_first_chunk_is_written(models):
    """A streamed request's TTFT ends when its first chunk with output has been handed to the connection, as a
    client sees it: the HTTP side's detokenising and formatting after the token came from the engine is counted."""
    from speclab.engine import Off
    from speclab.serve.app import Server

    delay = 0.2
    server = Server(SlowDecoding(models["target"], delay), None, Off(), served_name="slow")
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with InProcess(server) as srv:
        m0 = scrape(srv.url)
        out = asyncio.run(_one(srv.url + "/v1/completions", body, {}))
        m1 = scrape(srv.url)
    assert out["status"] == 200 and out["text"]
    def delta(name):
        return metric(m1, name) - metric(m0, name)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_sum") >= delay
    if sys.platform.startswith("linux"):  # the loop's read, kept apart: well under the TTFT
        assert delta("speclab:request_read_delay_seconds_count") == 1
        assert 0 <= delta("speclab:request_read_delay_seconds_sum") < delay


@contextlib.contextmanager
def uvicorn_thread(app, http: str, loop: str = "auto"):
    """A uvicorn server for ``app`` with speclab serve's stamping protocol, on a socket bound as speclab serve binds
    one (:func:`speclab.serve.cli.listen`), in a thread: yields (uvicorn server, port); stopped on exit."""
    import threading

    import uvicorn

    from speclab.serve.arrival import stamping_protocol
    from speclab.serve.cli import listen

    sock = listen("127.0.0.1", 0)
    uv = uvicorn.Server(uvicorn.Config(app, log_level="error", loop=loop, http=stamping_protocol(http),
                                       lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not uv.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield uv, sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(10)
        sock.close()


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_arrival_is_stamped_when_the_request_is_read(http):
    """speclab serve's HTTP protocol stamps a request when the loop reads its first bytes, before the app's task
    runs: with 10 requests written together to an app whose handler holds the loop 25 ms, some are read long
    before their handlers start; the app's own stamp (ArrivalClock, the fallback) would have missed that wait.
    The client connects first and the first handler holds the loop until all 10 are written: the server reads
    them in at most two groups (those read with the first, the rest once its handler is done), so one request
    waits behind at least 4 others' handlers, however the client's writes and the server's reads interleave."""
    import threading

    from speclab.serve.arrival import ARRIVAL, ArrivalClock

    if http == "httptools":
        pytest.importorskip("httptools")
    N = 10
    seen = []
    written = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen.append((scope.get(ARRIVAL), time.perf_counter()))
        if len(seen) == 1:
            written.wait(10)
        time.sleep(0.025)  # holds the event loop, as parsing and tokenising a burst of requests does
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def burst(uv, port):
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(N)]  # a connection each
        t_end = time.time() + 10
        while len(uv.server_state.connections) < N and time.time() < t_end:  # the server reads from all of them
            await asyncio.sleep(0.005)
        for _, w in conns:
            w.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        for _, w in conns:
            await w.drain()
        written.set()
        statuses = []
        for r, w in conns:
            statuses.append(int((await r.read()).split(b" ", 2)[1]))
            w.close()
        return statuses

    with uvicorn_thread(ArrivalClock(app), http) as (uv, port):
        try:
            assert asyncio.run(burst(uv, port)) == [200] * N
        finally:
            written.set()
    assert len(seen) == N and all(a is not None and a <= t for a, t in seen)
    assert max(t - a for a, t in seen) >= 0.08  # read, then waited behind >= 4 others' handlers (100 ms)


def test_health_says_503_until_the_engine_core_is_ready(models, monkeypatch):
    """The core's READY comes once it has built its scheduler (an adaptive policy calibrates there): until then
    /health says 503, so a start-up that waits for 200 waits for it, and a core stuck while starting never looks
    healthy. A request sent meanwhile waits in the channel and completes."""
    import threading

    from speclab.engine import Off
    from speclab.serve import app as serve_app
    from speclab.serve.app import Server

    gate, real = threading.Event(), serve_app.Scheduler

    def held(*args, **kw):
        assert gate.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(serve_app, "Scheduler", held)
    srv = InProcess(Server(models["target"], None, Off(), served_name="held", engine_process=False))
    srv.thread.start()
    try:
        codes, deadline = [], time.monotonic() + 30
        while len(codes) < 5 and time.monotonic() < deadline:
            try:
                codes.append(httpx.get(srv.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.05)
        assert codes == [503] * 5
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            time.sleep(0.3)
            assert not waiting.done()
            gate.set()
            deadline = time.monotonic() + 30
            while httpx.get(srv.url + "/health", timeout=30).status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            r = waiting.result(timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        gate.set()
        srv.stop()


def test_engine_process_death_fails_requests_in_flight(models):
    """The only engine core's process dies mid-stream: the stream ends with an error event, and while no core can
    serve, /health says 503 and new requests get a 503 (never a 500); a replacement core starts, and then both are
    200 again. The HTTP side stays up throughout."""
    from speclab.engine import Off
    from speclab.serve.app import Server

    server = Server(models["target"], None, Off(), served_name="mortal", engine_cores=1)
    body = {"prompt": PROMPTS[2], "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    with InProcess(server) as srv:
        assert server.engine.process
        url = srv.url + "/v1/completions"

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                streaming = asyncio.ensure_future(post(client, url, body, {}))
                await running_on(server, None, streaming)
                os.kill(server.engine.workers[0].pid, signal.SIGKILL)
                return await streaming

        # the client that probes while the replacement core is forked exists before the kill: a client built in
        # that window creates an SSL context, and a fork meanwhile copies OpenSSL's lock held into the new core
        probe = httpx.Client(timeout=30)
        out = asyncio.run(run())
        assert "error" in out and out["finish_reason"] is None and out["error"]["code"] == "engine_core_died"
        after = probe.post(url, json={"prompt": "hi", "max_tokens": 2})
        health = probe.get(srv.url + "/health", timeout=10).status_code
        probe.close()
        # the replacement may be ready already (a fork of a warm process); until it is, both say 503
        assert (after.status_code, health) in ((503, 503), (200, 200), (503, 200)), (after.text, health)
        if after.status_code == 503:
            assert after.json()["error"]["code"] in ("engine_unavailable", "engine_core_died"), after.text
        wait_for(lambda: server.engine.cores[0].serving, 60, "the replacement core never became ready")
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
        again = httpx.post(url, json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, timeout=30)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2
        m = scrape(srv.url)
        assert metric(m, "speclab:engine_core_deaths_total") == 1 and metric(m, "speclab:engine_cores_serving") == 1


# ------------------------------------------------------------------------------ f) graceful shutdown
@pytest.mark.slow
def test_sigterm_drains_the_stream_in_flight_then_exits_0(servers, models):
    """Last test of the "small" server: it ends it."""
    srv = servers["small"].ready
    url = srv.url + "/v1/completions"
    body = {"prompt": PROMPTS[2], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                lines, signalled, refused = [], False, None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    lines.append(line[6:])
                    if len(lines) == 3 and not signalled:
                        srv.proc.send_signal(signal.SIGTERM)
                        signalled = True
                        await asyncio.sleep(0.3)
                        try:  # a new request now is refused: 503 or no connection at all
                            refused = (await client.post(url, json={"prompt": "hi", "max_tokens": 2})).status_code
                        except httpx.TransportError:
                            refused = "connection refused"
                return lines, refused

    lines, refused = asyncio.run(run())
    assert lines[-1] == "[DONE]"
    assert refused in (503, "connection refused")
    chunks = [json.loads(x) for x in lines[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
    assert all(len(ch["token_ids"]) == 1 for c in chunks for ch in c["choices"])  # --stream-split-tokens
    assert ids == reference(models, "ngram", 3, body)[1]
    assert chunks[-1]["usage"]["completion_tokens"] == 120
    assert srv.proc.wait(60) == 0, srv.output()[-2000:]


# ------------------------------------------------------------------------------ pure pieces
def _byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_text_holds_back_incomplete_characters():
    from speclab.serve.detok import IncrementalText

    text = "héllo wörld: 3 € — ok ✓ 😀 done"
    ids = list(text.encode())
    for step in (1, 2, 3, 5):
        d = IncrementalText(_byte_decode)
        parts = [d.push(ids[i:i + step]) for i in range(0, len(ids), step)]
        assert all("\ufffd" not in p for p in parts)
        assert "".join(parts) + d.finish(ids, None) == text


@pytest.mark.parametrize("stops", [("wörld",), ("€ —", "zzz"), ("d",), ("ok ✓ 😀 done",), ("nothing here",)])
def test_incremental_text_never_sends_a_stop_string(stops):
    from speclab.engine.request import find_stop
    from speclab.serve.detok import IncrementalText, held_tail

    text = "héllo wörld: 3 € — ok ✓ 😀 done"
    ids = list(text.encode())
    stop_at = find_stop(text, stops)
    final = text if stop_at is None else text[:stop_at]
    for step in (1, 2, 4):
        d = IncrementalText(_byte_decode, stops)
        sent = ""
        for i in range(0, len(ids), step):
            sent += d.push(ids[i:i + step])
            assert final.startswith(sent)  # never past a stop string, never anything that could change
            assert not any(s in sent for s in stops)
        assert sent + d.finish(ids, stop_at) == final
    assert held_tail("abc wö", ("wörld",)) == 2 and held_tail("abc", ("x",)) == 0


def test_incremental_text_with_the_family_tokenizer(models):
    from speclab.serve.detok import IncrementalText

    lm = models["target"]
    text = "Zoë paid 5 € for a crème brûlée — naïve café ✓\nnext line"
    ids = lm.encode(text)
    d = IncrementalText(lm.decode, ("brûlée",))
    sent = "".join(d.push([t]) for t in ids)
    assert "\ufffd" not in sent and "brûlée" not in sent
    assert sent + d.finish(ids, lm.decode(ids).find("brûlée")) == lm.decode(ids)[:lm.decode(ids).find("brûlée")]


def test_speculative_config_parsing(tmp_path):
    from speclab.serve.config import parse_speculative_config

    s = parse_speculative_config('{"method": "draft_model", "model": "draft-s", "num_speculative_tokens": 3}')
    assert (s.method, s.model, s.k) == ("draft_model", "draft-s", 3)
    s = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (s.method, s.k, s.lookup_max, s.lookup_min) == ("ngram", 4, 3, 3)  # vLLM: min defaults to max
    assert parse_speculative_config('{"model": "ngram"}').method == "ngram"
    assert not parse_speculative_config("none").enabled
    assert not parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 0}').enabled
    for bad in ('{"method": "eagle"}', "{not json", '{"num_speculative_tokens": 99}', "[1]",
                '{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', '{"draft": "x"}'):
        with pytest.raises(SpeclabError):
            parse_speculative_config(bad)
    # vLLM's JSON back, parsed to the same config (what speclab bench serve hands to both servers)
    for text in ('{"model": "draft-s", "num_speculative_tokens": 3}', '{"method": "ngram", "prompt_lookup_max": 3}',
                 '{"method": "synthetic", "model": "0.8", "num_speculative_tokens": 2}'):
        s = parse_speculative_config(text)
        assert parse_speculative_config(json.dumps(s.to_json())) == s
    assert parse_speculative_config("none").to_json() is None
    # eagle3 names a speculators directory, as vLLM reads it; the parsed config carries its path to both servers
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    s = parse_speculative_config(json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}))
    assert (s.method, s.model, s.k) == ("eagle3", str(head), 3)
    assert parse_speculative_config(json.dumps(s.to_json())) == s
    with pytest.raises(SpeclabError, match="speculators directory"):
        parse_speculative_config(json.dumps({"method": "eagle3", "model": str(tmp_path / "none")}))


def test_bench_serve_checks_its_speculative_config_with_the_servers_parser(tmp_path):
    import argparse

    from speclab.analysis.bench_serve import _vllm_spec, speculative_config_for

    args = argparse.Namespace(speculative_config=None, draft="draft-s", k=3)
    assert speculative_config_for(args) == {"method": "draft_model", "model": "draft-s", "num_speculative_tokens": 3}
    args.draft = "ngram"
    assert speculative_config_for(args) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                  "prompt_lookup_min": 5}
    for bad in ('{"method": "eagle"}', "none", '{"num_speculative_tokens": 0}'):
        with pytest.raises(SpeclabError):
            speculative_config_for(argparse.Namespace(speculative_config=bad, draft=None, k=4))
    # an EAGLE-3 head in the speculators format: both servers get method eagle3 with the same directory
    (tmp_path / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    spec = speculative_config_for(argparse.Namespace(speculative_config=None, draft=str(tmp_path), k=3))
    assert spec == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 3}
    assert _vllm_spec(spec) == (spec, None)


@pytest.mark.slow
def test_cli_errors_are_one_line():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for args in (["--speculative-config", '{"method": "eagle"}'], ["--request-timeout", "0"],
                 ["--stream-stall-timeout", "-1"], ["--max-workload-tags", "-1"]):
        r = subprocess.run([sys.executable, "-m", "speclab", "serve", "--port", str(free_port()), *args], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("speclab: error:") and r.stderr.count("\n") == 1, (args, r.stderr)


def test_served_connections_send_small_chunks_at_once():
    """`speclab serve` binds its own listening socket; asyncio turns Nagle off (TCP_NODELAY) on accepted sockets
    only when the socket's protocol says TCP. With proto 0, a stream's small chunks waited for the client's
    delayed ACK: on a kept-alive connection the first chunk arrived ~40 ms after its token (measured)."""
    from speclab.serve.cli import listen

    async def main():
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                seen.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        sock = listen("127.0.0.1", 0)
        sock.listen()
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        finally:
            server.close()
        return nodelay

    assert asyncio.run(main()) != 0


def test_core_shares_and_cpu_plan():
    """--max-num-seqs split over the engine cores (the first take the remainder); auto binding binds one engine
    core and leaves several to the OS."""
    from speclab.serve.runner import auto_cores, core_share, plan_cpus

    assert [core_share(64, 2, i) for i in range(2)] == [32, 32]
    assert [core_share(5, 3, i) for i in range(3)] == [2, 2, 1] and sum(core_share(7, 4, i) for i in range(4)) == 7
    assert auto_cores(False) == 1 and auto_cores(True) == len(os.sched_getaffinity(0))
    assert plan_cpus("none", 1) is None and plan_cpus("auto", 2) is None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) >= 2:
        assert plan_cpus("auto", 1) == ({allowed[0]}, set(allowed[1:]))
    else:
        assert plan_cpus("auto", 1) is None


def test_fork_hazards_name_the_threads_a_fork_would_leave_behind(caplog):
    """The threads beside the caller (asyncio's idle executor workers aside) are named, and an engine that forks a
    core beside one logs a warning naming it; once that thread ends, nothing is named."""
    import threading

    from speclab.serve.runner import fork_hazards

    before = set(fork_hazards())
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="client-thread")
    t.start()
    try:
        assert set(fork_hazards()) - before == {"client-thread"}
        w = threading.Thread(target=stop.wait, name="asyncio_0")  # an executor worker's name: not a hazard
        w.start()
        assert "asyncio_0" not in fork_hazards()
        caplog.set_level(logging.WARNING, logger="speclab.serve")
        asyncio.run(_fork_one_core())
        assert any("client-thread" in r.getMessage() and "engine_process=False" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        stop.set()
        t.join()
        w.join()
    assert set(fork_hazards()) == before


async def _fork_one_core():
    """Fork one engine core that exits at once (before building a scheduler) and reap it; not replaced."""
    from speclab.serve.runner import Engine

    def make(hooks, core=0):
        os._exit(0)

    engine = Engine(make, process=True)
    await engine._launch(engine.cores[0])
    engine.stopping = True  # its exit is not a death to replace
    worker = engine.cores[0].worker
    await asyncio.to_thread(worker.join, 30)
    if worker.is_alive():
        worker.kill()
    if engine.cores[0].channel is not None:
        engine.cores[0].channel.close()


def test_kernel_stamp_converts_the_packets_wall_time_to_the_servers_clock():
    import struct

    from speclab.serve.arrival import MAX_LAG, SO_TIMESTAMPNS, kernel_stamp

    def anc(t):
        sec = int(t)
        return [(socket.SOL_SOCKET, SO_TIMESTAMPNS, struct.pack("qq", sec, round((t - sec) * 1e9)))]

    assert kernel_stamp(anc(100.0 - 0.0025), 7.0, 100.0) == pytest.approx(6.9975, abs=1e-6)  # the docstring's case
    assert kernel_stamp([], 7.0, 100.0) is None  # no stamp: the read's own time is used
    assert kernel_stamp(anc(100.0 - MAX_LAG - 1), 7.0, 100.0) is None  # the wall clock stepped forward
    assert kernel_stamp(anc(100.5), 7.0, 100.0) is None  # ... or back
    assert kernel_stamp(anc(100.0002), 7.0, 100.0) == 7.0  # two clocks read a hair apart


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kernel receive stamps are Linux's")
@pytest.mark.parametrize("loop,http", [("asyncio", "h11"), ("asyncio", "httptools"), ("uvloop", "httptools")])
def test_arrival_is_when_the_kernel_received_the_request_not_when_the_loop_woke(loop, http):
    """A request that arrives while the server's event loop is held (here by another request's handler, as engine
    cores holding every CPU hold it on a busy machine) is stamped when its bytes reached the kernel, so the server's
    TTFT counts the time its loop took to wake up and read them. Stamped at the read, it started 0.3 s late. Both on
    a connection open before (read by the loop's watcher) and on one opened during the wait (its request waits in
    the kernel before the connection is even accepted, and is read as the connection is made). On uvloop, where the
    protocol leaves the reading to uvicorn, the stamp is the read's."""
    import threading

    from speclab.serve.arrival import ARRIVAL, READ

    for mod in (http, loop):
        if mod not in ("h11", "asyncio"):
            pytest.importorskip(mod)
    hold = 0.3
    seen = {}
    holding = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        seen[scope["path"]] = (scope.get(ARRIVAL), time.perf_counter(), scope.get(READ))
        if scope["path"] == "/hold":
            holding.set()
            time.sleep(hold)  # the loop is held: nothing is read until this returns
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def get(conn, path):
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())

    with uvicorn_thread(app, http, loop) as (uv, port):
        late = socket.create_connection(("127.0.0.1", port))  # connected (and accepted) before the loop is held
        t_end = time.time() + 10
        while len(uv.server_state.connections) < 1 and time.time() < t_end:
            time.sleep(0.005)
        first = socket.create_connection(("127.0.0.1", port))
        get(first, "/hold")
        assert holding.wait(10)
        sent = time.perf_counter()
        get(late, "/late")
        fresh = socket.create_connection(("127.0.0.1", port))  # the kernel completes the handshake meanwhile
        get(fresh, "/fresh")
        for c in (first, late, fresh):
            assert c.recv(100).startswith(b"HTTP/1.1 200")
            c.close()
    for path in ("/late", "/fresh"):
        arrival, handled, read = seen[path]
        assert handled - sent >= hold * 0.8, path  # the loop read it only once the handler let go
        if loop == "uvloop":  # no kernel reads on uvloop (speclab serve runs asyncio's loop): stamped at the read
            assert arrival - sent >= hold * 0.8 and read is None, path
            continue
        assert arrival - sent < hold * 0.3, path  # ... and its clock started when it came in
        assert read - arrival >= hold * 0.5, path  # the read's own time kept beside it (speclab:request_read_delay)


@pytest.mark.parametrize("loop,http", [("asyncio", "h11"), ("asyncio", "httptools"), ("uvloop", "httptools")])
@pytest.mark.slow
def test_kernel_reads_keep_http_whole(loop, http):
    """The connection read by the kernel-stamping reader (speclab serve's default) still does all of HTTP/1.1 that
    uvicorn's own reading does: a 5 MB body (uvicorn pauses and resumes reading as its buffer fills), three requests
    pipelined in one write, clients that reset their connection mid-request (before and after the handler started:
    every handler ends), and keep-alive, with no descriptor left behind. On uvloop the protocol reads as uvicorn's
    (a reader of its own there never heard of a reset: libuv drops a poll handle on an error)."""
    import struct

    for mod in (http, loop):
        if mod not in ("h11", "asyncio"):
            pytest.importorskip(mod)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        n = 0
        while True:
            m = await receive()
            if m["type"] != "http.request":
                return
            n += len(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(n).encode()})

    with uvicorn_thread(app, http, loop) as (uv, port):
        url = f"http://127.0.0.1:{port}/"
        fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
        big = b"x" * (5 << 20)
        assert httpx.post(url, content=big, timeout=30).text == str(len(big))
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc" * 3)
        got, t_end = b"", time.time() + 10
        while got.count(b"HTTP/1.1 200") < 3 and time.time() < t_end:
            got += c.recv(65536)
        c.close()
        assert got.count(b"HTTP/1.1 200") == 3, got
        for i in range(16):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nabc")
            if i % 4:
                time.sleep(0.05)  # the handler has started and waits for the body (the reset then comes as an error)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()  # a reset, the rest of the body never sent
        with httpx.Client() as client:
            assert [client.post(url, content=b"hi").text for _ in range(50)] == ["2"] * 50
        t_end = time.time() + 10
        while uv.server_state.connections and time.time() < t_end:
            time.sleep(0.02)
        assert not uv.server_state.connections
        if fds is not None:
            assert len(os.listdir("/proc/self/fd")) <= fds  # every duplicate descriptor closed
