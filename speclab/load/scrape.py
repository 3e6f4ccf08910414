"""Server-side acceptance and latency from ``/metrics``, over a run's window (scrape before, scrape after).

vLLM exports raw spec-decode counters (``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``,
``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos{position=i}``; ``_total`` on the wire),
and rates are derived here from the differences over the window, as vLLM's own dashboards do:

* acceptance rate = accepted tokens / draft tokens;
* mean acceptance length = 1 + accepted tokens / drafts (tokens per verification round, bonus included);
* per-position acceptance = accepted at position i / drafts.

SGLang exports gauges instead (``sglang:spec_accept_length``, ``sglang:spec_accept_rate``): current
values, not counters, so a window cannot be formed; the value after the run is reported as such.

speclab serve also exports the same counters per workload tag (``speclab:workload_spec_decode_*{workload=...}``,
each request tagged by its ``X-Workload`` header, which ``speclab load`` sets to the prompt's workload): the same
rates per workload over the window (``spec_decode_by_workload``).

Latency histograms with vLLM's names (``vllm:time_to_first_token_seconds``, ``..inter_token_latency..``,
``..e2e_request_latency..``, ``..request_time_per_output_token..``) give the server's own means over the
window (sum and count differences), to set beside the client's. Samples with several label sets (model,
engine) are summed.
"""

from __future__ import annotations

import httpx

from .fingerprint import ESTIMATE_CHUNKS

SPEC = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
        "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"
PREFIX = {"queries": "vllm:prefix_cache_queries", "hits": "vllm:prefix_cache_hits"}  # in prompt tokens
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds", "tpot": "vllm:request_time_per_output_token_seconds",
              "read_delay": "speclab:request_read_delay_seconds"}  # (speclab serve's only: its loop's wait for a CPU)
BY_WORKLOAD = {"drafts": "speclab:workload_spec_decode_num_drafts",
               "draft_tokens": "speclab:workload_spec_decode_num_draft_tokens",
               "accepted_tokens": "speclab:workload_spec_decode_num_accepted_tokens",
               "accepted_per_pos": "speclab:workload_spec_decode_num_accepted_tokens_per_pos",
               "requests": "speclab:workload_requests"}
SGLANG = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate"}


def parse(text: str) -> dict:
    """Prometheus text -> {sample name without ``_total``: {frozenset(labels minus model/engine...): value}}.
    ``_created`` samples are dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name
            if name.endswith("_created"):
                continue
            if name.endswith("_total"):
                name = name[: -len("_total")]
            key = frozenset((k, v) for k, v in s.labels.items() if k in ("position", "le", "workload"))
            d = out.setdefault(name, {})
            d[key] = d.get(key, 0.0) + float(s.value)
    return out


def _value(samples: dict, name: str) -> float | None:
    d = samples.get(name)
    return None if not d else sum(d.values())


def _per_position(samples: dict) -> dict[int, float]:
    out = {}
    for key, v in (samples.get(PER_POS) or {}).items():
        pos = dict(key).get("position")
        if pos is not None:
            out[int(pos)] = out.get(int(pos), 0.0) + v
    return out


def _labelled(samples: dict, name: str, label: str) -> dict[str, float]:
    """{value of ``label``: the samples' sum} for ``name``."""
    out: dict[str, float] = {}
    for key, v in (samples.get(name) or {}).items():
        lab = dict(key).get(label)
        if lab is not None:
            out[lab] = out.get(lab, 0.0) + v
    return out


def _rates(drafts: float, draft_tokens: float, accepted: float, per_pos: list[float]) -> dict:
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "accepted_per_position": per_pos, "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "per_position_acceptance": [a / drafts for a in per_pos] if drafts else None}


def by_workload(before: dict, after: dict) -> dict | None:
    """Spec-decode counters and rates per workload tag over the window (speclab serve's ``speclab:workload_*``);
    None when the server exports none. Tags with no draft in the window are left out."""
    if BY_WORKLOAD["drafts"] not in after:
        return None

    def delta(name: str) -> dict[str, float]:
        a, b = _labelled(after, name, "workload"), _labelled(before, name, "workload")
        return {w: v - b.get(w, 0.0) for w, v in a.items()}

    drafts, dt, acc = (delta(BY_WORKLOAD[k]) for k in ("drafts", "draft_tokens", "accepted_tokens"))
    out = {}
    for w in sorted(drafts):
        if not drafts[w]:
            continue
        pos_a = {}
        for key, v in (after.get(BY_WORKLOAD["accepted_per_pos"]) or {}).items():
            d = dict(key)
            if d.get("workload") == w:
                p = int(d["position"])
                pos_a[p] = pos_a.get(p, 0.0) + v - (before.get(BY_WORKLOAD["accepted_per_pos"]) or {}).get(key, 0.0)
        per_pos = [pos_a.get(i, 0.0) for i in range(max(pos_a) + 1)] if pos_a else []
        out[w] = _rates(drafts[w], dt.get(w, 0.0), acc.get(w, 0.0), per_pos)
    return out


def window(before: dict | None, after: dict) -> dict:
    """What the server reports for the window between two parsed scrapes (``before`` None: since start).

    Returns {"spec_decode": counters and derived rates or None, "spec_decode_by_workload": {tag: the same} or
    None (with spec_decode only), "sglang": gauges or None,
    "generation_tokens", "prefix_cache": {queries, hits, hit_rate} in prompt tokens or None,
    "server_latency_ms": {ttft, itl, e2e, tpot, read_delay (where exported): window means} }."""
    before = before or {}

    def delta(name):
        a = _value(after, name)
        return None if a is None else a - (_value(before, name) or 0.0)

    out: dict = {"spec_decode": None, "spec_decode_by_workload": None, "sglang": None,
                 "generation_tokens": delta(GENERATION_TOKENS), "prefix_cache": None, "server_latency_ms": {}}
    pq, ph = delta(PREFIX["queries"]), delta(PREFIX["hits"])
    if pq is not None and ph is not None:
        out["prefix_cache"] = {"queries": pq, "hits": ph, "hit_rate": ph / pq if pq else None}
    counts = {k: delta(v) for k, v in SPEC.items()}
    if all(v is not None for v in counts.values()):
        pa, pb = _per_position(after), _per_position(before)
        per_pos = [pa[i] - pb.get(i, 0.0) for i in sorted(pa)]
        out["spec_decode"] = _rates(counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"], per_pos)
        out["spec_decode_by_workload"] = by_workload(before, after)
    sg = {k: _value(after, v) for k, v in SGLANG.items()}
    if any(v is not None for v in sg.values()):
        out["sglang"] = dict(sg, note="gauges: the server's current value after the run, not a window")
    for key, name in HISTOGRAMS.items():
        s, c = delta(name + "_sum"), delta(name + "_count")
        if s is not None and c:
            out["server_latency_ms"][key] = {"mean": s / c * 1000.0, "n": c}
    return out


async def fetch(client: httpx.AsyncClient, base_url: str,
                headers: dict | None = None) -> tuple[dict | None, str | None]:
    """(parsed /metrics, None) or (None, why not): a server without /metrics is not an error."""
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers or {}, timeout=10.0)
    except httpx.HTTPError as e:
        return None, f"/metrics unreachable: {type(e).__name__}"
    if r.status_code != 200:
        return None, f"/metrics answered HTTP {r.status_code}"
    try:
        return parse(r.text), None
    except ValueError as e:
        return None, f"/metrics is not Prometheus text: {str(e)[:100]}"


def one_token_chunks(fp: dict) -> bool:
    """Does every chunk that carries output carry one token (a server splitting its rounds into one-token chunks)?
    From the fingerprint's tokens-per-chunk histogram: a chunk without a token of its own (speclab serve's last chunk
    of a request can carry only its finish reason and the text the detokeniser held back) is no multi-token chunk,
    though it pulls the mean below 1.0 (measured: 241 one-token chunks and one such chunk on prose at one stream, a
    mean of 0.996, so three split cells were compared per chunk, at 0.50-0.89x the server's per-round ITL, where
    their bursts read 1.00-1.01x). e.g. {"0": 1, "1": 241}: True;
    {"1": 40, "2": 3}: False; no histogram: the mean is exactly 1.0."""
    hist = fp.get("tokens_per_chunk_hist")
    if hist:
        sizes = {int(k) for k, v in hist.items() if v}
        return 1 in sizes and sizes <= {0, 1}
    return fp.get("mean_tokens_per_chunk") == 1.0


def latency_agreement(summary: dict, server: dict, fingerprint: dict | None = None) -> dict:
    """Client means (ms) beside the server's histogram means over the same window, with client / server.
    Caveats: a server's TTFT may start later than the client's (vLLM's when its API server reads the request;
    speclab serve's when the request reached the machine), and a server's ITL histogram is per engine step, which
    equals the client's ``itl`` (per chunk) only when each chunk carries one step. When every chunk carries one
    token (:func:`one_token_chunks`) and they come in bursts (a server splitting each round into one-token chunks),
    the client's figure set beside the server's ITL is the mean wait before a burst (``fingerprint["burst_gap_ms"]``),
    one round each, marked ``"client_from": "bursts"``; the per-chunk ITL stays in the summary."""
    out = {}
    fp = fingerprint or {}
    by_bursts = (one_token_chunks(fp) and (fp.get("mean_tokens_per_burst") or 0.0) > ESTIMATE_CHUNKS
                 and fp.get("burst_gap_ms"))
    for key, (ours, theirs) in {"ttft": ("ttft_ms", "ttft"), "itl": ("itl_ms", "itl"), "tpot": ("tpot_ms", "tpot"),
                                "e2e": ("e2e_ms", "e2e")}.items():
        c = (summary.get(ours) or {}).get("mean")
        s = (server.get("server_latency_ms") or {}).get(theirs, {}).get("mean")
        extra = {}
        if key == "itl" and by_bursts:
            c, extra = fp["burst_gap_ms"], {"client_from": "bursts"}
        if c is not None and s:
            out[key] = {"client_ms": c, "server_ms": s, "ratio": c / s, **extra}
    return out


def compare(server: dict, outside: float | None) -> dict | None:
    """The server's mean acceptance length beside the client's outside estimate (fingerprint's
    ``accepted_length_estimate``).
    They measure the same thing only when every round drafts: vLLM's counters (and speclab's) count
    ``drafts`` = rounds that proposed at least one token, while the outside estimate averages over every
    round, so rounds without a draft (n-gram lookup finding no match, a policy choosing k = 0) pull the
    outside figure towards 1."""
    spec = server.get("spec_decode") or {}
    inside = spec.get("mean_acceptance_length")
    if inside is None and server.get("sglang"):
        inside = server["sglang"].get("accept_length")
    if inside is None or outside is None:
        return None
    return {"server_mean_acceptance_length": inside, "outside_estimate": outside,
            "ratio": outside / inside if inside else None}
