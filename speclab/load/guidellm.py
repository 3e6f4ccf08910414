"""GuideLLM (``pip install guidellm``; the ``outside`` extra) against ``speclab serve``: the command, its JSON report
read back, and its figures set beside the server's own histograms over the same window.

The command (GuideLLM 0.8's ``run``; a local tokenizer directory, so nothing is downloaded)::

    guidellm run --backend kind=openai_http,target=http://127.0.0.1:8000 \\
        --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=16 \\
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \\
        --tokenizer kind=hf_auto,model=speclab/family/models/target \\
        --output kind=json,path=guidellm.json --disable-progress

GuideLLM sends chat completions with ``stream_options.continuous_usage_stats`` (vLLM's: a running ``usage`` in
every chunk, which speclab serve sends too) and ``ignore_eos``, so every request gives exactly ``output_tokens``.

Definitions, so that like is compared with like: GuideLLM's TTFT is from sending the request to its first token
(the server's ``vllm:time_to_first_token_seconds`` from the request reaching the machine to its first chunk
written); its ITL is per token, (latency - TTFT) / (output tokens - 1), which is the server's
``vllm:request_time_per_output_token_seconds`` (TPOT), not its per-round ``inter_token_latency`` histogram; its
request latency is the server's E2E.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def executable() -> str | None:
    """The ``guidellm`` command beside this interpreter, else on PATH; None when it is not installed."""
    here = Path(sys.executable).with_name("guidellm")
    return str(here) if here.exists() else shutil.which("guidellm")


def command(url: str, *, streams: int, requests: int, prompt_tokens: int, output_tokens: int, tokenizer: str,
            out: str, exe: str | None = None) -> list[str]:
    """The ``guidellm run`` command line for a closed-loop run of ``requests`` at ``streams`` concurrent streams."""
    return [exe or executable() or "guidellm", "run",
            "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer", f"kind=hf_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-progress"]


def _mean(metrics: dict, key: str) -> float | None:
    s = (metrics.get(key) or {}).get("successful") or {}
    return s.get("mean")


def summary(path: str | Path) -> dict:
    """The first benchmark of a GuideLLM JSON report: request counts, token totals and mean latencies (ms)."""
    data = json.loads(Path(path).read_text())
    m = data["benchmarks"][0]["metrics"]
    totals = m["request_totals"]
    out_tok = (m.get("output_token_count") or {}).get("successful") or {}
    e2e = _mean(m, "request_latency")
    return {"completed": totals["successful"], "errored": totals["errored"], "incomplete": totals["incomplete"],
            "output_tokens": out_tok.get("total_sum"),
            "ttft_ms": _mean(m, "time_to_first_token_ms"), "itl_ms": _mean(m, "inter_token_latency_ms"),
            "tpot_ms": _mean(m, "time_per_output_token_ms"), "e2e_ms": None if e2e is None else e2e * 1000.0,
            "output_tok_s": _mean(m, "output_tokens_per_second"),
            "tokens_per_iteration": _mean(m, "output_tokens_per_iteration")}


def agreement(gl: dict, server: dict) -> dict:
    """GuideLLM's means beside the server's histogram means over the same window (``speclab.load.scrape.window``):
    {metric: {guidellm_ms, server_ms, ratio}}, GuideLLM's per-token ITL set beside the server's TPOT."""
    lat = server.get("server_latency_ms") or {}
    out = {}
    for key, ours, theirs in (("ttft", "ttft_ms", "ttft"), ("itl", "itl_ms", "tpot"), ("e2e", "e2e_ms", "e2e")):
        g, s = gl.get(ours), (lat.get(theirs) or {}).get("mean")
        if g is not None and s:
            out[key] = {"guidellm_ms": g, "server_ms": s, "ratio": g / s}
    return out
