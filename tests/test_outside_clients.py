"""Outside load generators against ``speclab serve``: GuideLLM (the ``outside`` extra) completes a run and its
token counts equal the server's; ``vllm bench serve`` (from the vLLM venv ``scripts/setup_vllm`` builds) does the
same; and the vLLM request extension GuideLLM relies on, ``stream_options.continuous_usage_stats``, gives a running
``usage`` in every chunk. The latency figures are printed beside the server's histograms (docs: how close they
are); the tests assert what does not depend on the machine's speed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in SERVE_DEPS),
                                reason="needs fastapi, uvicorn and prometheus_client")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def target():
    from speclab.models import load_model

    return load_model("target", device="cpu", role="target")


def test_continuous_usage_stats_give_a_running_usage_in_every_chunk(target):
    from speclab.drafters import make_drafter
    from speclab.engine import make_policy
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    server = Server(target, make_drafter("draft-xs-distill", target), make_policy(None, 4), served_name="target",
                    engine_cores=1)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Write a JSON object"}]}],
            "max_completion_tokens": 24, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with InProcessServer(server) as srv:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            plain = c.post(srv.url + "/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}},
                           timeout=60)
    assert plain.status_code == 200
    with_tokens = [ch for ch in chunks if ch["choices"] and ch["choices"][0].get("token_ids")]
    sent = 0
    for ch in with_tokens:
        sent += len(ch["choices"][0]["token_ids"])
        assert ch["usage"]["completion_tokens"] == sent, ch
        assert ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + sent
    assert sent == 24 and chunks[-1]["usage"]["completion_tokens"] == 24  # the final usage chunk agrees


def _run_against_a_server(tmp_path: Path, make_command) -> dict:
    """A fresh ``speclab serve`` (its defaults), ``make_command(url)`` run against it, and what the server counted
    meanwhile (the window of its /metrics between before and after)."""
    from serve_process import ServeProcess

    from speclab.load import scrape

    srv = ServeProcess([], tmp_path / "serve.log")
    try:
        srv.wait_healthy()
        before = scrape.parse(httpx.get(srv.url + "/metrics", timeout=30).text)
        run = subprocess.run(make_command(srv.url), cwd=tmp_path, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        after = scrape.parse(httpx.get(srv.url + "/metrics", timeout=30).text)
    finally:
        srv.close()
    return scrape.window(before, after)


@pytest.mark.slow
def test_guidellm_completes_a_run_and_counts_what_the_server_counted(tmp_path):
    from speclab.family import DEFAULT_TARGET, resolve
    from speclab.load import guidellm

    exe = guidellm.executable()
    if exe is None:
        pytest.skip("guidellm is not installed (pip install 'speclab[outside]')")
    out = tmp_path / "guidellm.json"
    server = _run_against_a_server(tmp_path, lambda url: guidellm.command(
        url, streams=4, requests=16, prompt_tokens=64, output_tokens=32, tokenizer=str(resolve(DEFAULT_TARGET)),
        out=str(out), exe=exe))
    gl = guidellm.summary(out)
    # a GuideLLM run has ended one request short of its max_requests (15 of 16 completed, none errored or
    # incomplete) with concurrent streams; whatever it completed must be exactly what the server served
    assert gl["errored"] == gl["incomplete"] == 0 and 16 - 4 < gl["completed"] <= 16, gl
    assert gl["output_tokens"] == server["generation_tokens"] == gl["completed"] * 32
    assert server["server_latency_ms"]["ttft"]["n"] == gl["completed"]
    agree = guidellm.agreement(gl, server)
    assert set(agree) == {"ttft", "itl", "e2e"}
    print("guidellm / server means:", {k: f"{v['guidellm_ms']:.1f}/{v['server_ms']:.1f} ms ({v['ratio']:.2f}x)"
                                       for k, v in agree.items()})


@pytest.mark.slow
def test_vllm_bench_serve_completes_a_run_against_speclab_serve(tmp_path):
    from speclab.family import DEFAULT_TARGET, resolve
    from speclab.load import vllm_bench
    from speclab.load.servers import vllm_venv

    venv = vllm_venv(None)
    if venv is None or subprocess.run([str(Path(venv) / "bin" / "python"), "-c", "import vllm.benchmarks.serve"],
                                      capture_output=True, timeout=300).returncode:
        pytest.skip("no vLLM venv with vllm installed (scripts/setup_vllm)")
    server = _run_against_a_server(tmp_path, lambda url: vllm_bench.command(
        venv, url, model="target", tokenizer=str(resolve(DEFAULT_TARGET)), prompts=16, concurrency=4, input_len=64,
        output_len=32, result_dir=str(tmp_path), result_file="vllm.json"))
    res = json.loads((tmp_path / "vllm.json").read_text())
    assert res["completed"] == 16 and res["total_output_tokens"] == server["generation_tokens"] == 16 * 32
    lat = server["server_latency_ms"]
    print("vllm bench serve / server means: TTFT "
          f"{res['mean_ttft_ms']:.1f}/{lat['ttft']['mean']:.1f} ms, TPOT {res['mean_tpot_ms']:.1f}/"
          f"{lat['tpot']['mean']:.1f} ms")
