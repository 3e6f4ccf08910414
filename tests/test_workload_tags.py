"""Acceptance per workload tag: a request tagged with OpenAI's ``metadata.workload`` or the ``X-Workload`` header is
counted in ``speclab:workload_*`` on /metrics; each tag's spec-decode counters equal the sums of its requests' own
``speculation`` figures; tags beyond the bound share ``_other``; an untagged request adds to no tag; a bad tag is a
400. A server in this process with the family's draft."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import pytest

SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in SERVE_DEPS),
                                reason="needs fastapi, uvicorn and prometheus_client")
PROMPTS = ["def fibonacci(n):\n", '{"name": "', "import numpy as np\n", "The quick brown fox"]


def by_workload(url: str) -> dict:
    """{(sample name, workload, position or None): value} for the speclab:workload_* samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name.startswith("speclab:workload_") and not s.name.endswith("_created"):
                key = (s.name, s.labels["workload"], s.labels.get("position"), s.labels.get("finished_reason"))
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_spec_decode_counters_per_workload_tag():
    from speclab.drafters import make_drafter
    from speclab.engine import make_policy
    from speclab.models import load_model
    from speclab.serve.app import Server
    from speclab.serve.inprocess import InProcessServer

    target = load_model("target", device="cpu", role="target")
    server = Server(target, make_drafter("draft-xs-distill", target), make_policy(None, 4), served_name="tags",
                    engine_cores=1, max_workload_tags=2)
    tags = ["code", "json", "code", None, "prose", "json"]  # "prose" is the third tag: over the bound of 2
    with InProcessServer(server) as srv:
        url = srv.url + "/v1/completions"

        async def one(client, i, tag):
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            headers = {}
            if tag is not None and i % 2:
                headers["X-Workload"] = tag
            elif tag is not None:
                body["metadata"] = {"workload": tag}
            r = await client.post(url, json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r.json()["speculation"]

        async def run():
            # "code" and "json" arrive first, on their own, so they are the two tags with series of their own
            # however the machine schedules the concurrent rest
            async with httpx.AsyncClient(timeout=120) as client:
                first = [await one(client, i, tags[i]) for i in (0, 1)]
                rest = await asyncio.gather(*(one(client, i, t) for i, t in enumerate(tags) if i > 1))
                return first + list(rest)

        specs = asyncio.run(run())
        m = by_workload(srv.url)
        bad = [httpx.post(url, json={"prompt": "hi", "metadata": {"workload": "a b"}}, timeout=30),
               httpx.post(url, json={"prompt": "hi"}, headers={"X-Workload": "x" * 65}, timeout=30),
               httpx.post(url, json={"prompt": "hi", "metadata": "code"}, timeout=30)]
    assert {k[1] for k in m} == {"code", "json", "_other"}
    for label, members in (("code", [0, 2]), ("json", [1, 5]), ("_other", [4])):
        def total(key, members=members):
            return sum(specs[i][key] for i in members)

        assert m[("speclab:workload_requests_total", label, None, "length")] == len(members)
        assert m[("speclab:workload_generation_tokens_total", label, None, None)] == 24 * len(members)
        assert m[("speclab:workload_spec_decode_num_drafts_total", label, None, None)] == total("num_drafts")
        assert m[("speclab:workload_spec_decode_num_draft_tokens_total", label, None, None)] == total("drafted_tokens")
        assert m[("speclab:workload_spec_decode_num_accepted_tokens_total", label, None, None)] == \
            total("accepted_tokens")
        for pos in range(4):
            acc = sum(specs[i]["accepted_tokens_per_pos"][pos] for i in members)
            got = m.get(("speclab:workload_spec_decode_num_accepted_tokens_per_pos_total", label, str(pos), None), 0)
            assert got == acc, (label, pos)
    assert sum(s["drafted_tokens"] for s in specs) > sum(s["drafted_tokens"] for i, s in enumerate(specs)
                                                         if tags[i] is not None)  # the untagged one drafted too
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in bad] == ["metadata", "x-workload", "metadata"]
