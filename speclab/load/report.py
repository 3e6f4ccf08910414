"""A load run's result as text: one table row per load level, the verdict with its evidence, and the
server's acceptance beside the outside estimate."""

from __future__ import annotations

from ..tables import num


def _d(dist: dict | None, key: str, spec=".1f") -> str:
    return "-" if not dist else num(dist.get(key), spec)


def level_rows(result: dict) -> list[dict]:
    """One flat dict per level (also what the charts and the benchmark tabulate)."""
    rows = []
    for lv in result["levels"]:
        s, fp = lv["summary"], lv["fingerprint"]
        spec = (lv.get("server") or {}).get("spec_decode") or {}
        rows.append({
            "load": lv["level"]["label"], "kind": lv["level"]["kind"], "value": lv["level"]["value"],
            "completed": s["completed"], "failed": s["failed"],
            "req_s": s["request_throughput"], "tok_s": s["output_throughput"],
            "ttft_p50_ms": (s["ttft_ms"] or {}).get("p50"), "ttft_p95_ms": (s["ttft_ms"] or {}).get("p95"),
            "tpot_mean_ms": (s["tpot_ms"] or {}).get("mean"), "tpot_p95_ms": (s["tpot_ms"] or {}).get("p95"),
            "itl_mean_ms": (s["itl_ms"] or {}).get("mean"), "e2e_p95_ms": (s["e2e_ms"] or {}).get("p95"),
            "goodput": (s.get("goodput") or {}).get("request_goodput"),
            "tokens_per_burst": fp["mean_tokens_per_burst"], "near_zero_share": fp["near_zero_share"],
            "call": fp["call"], "server_mean_acceptance_length": spec.get("mean_acceptance_length"),
            "server_acceptance_rate": spec.get("acceptance_rate"),
        })
    return rows


def format_result(result: dict) -> str:
    head = (f"{'load':<18}{'ok':>5}{'fail':>5}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'p95':>8}"
            f"{'TPOT mean':>11}{'p95':>8}{'ITL mean':>10}{'E2E p95':>10}{'tok/burst':>11}{'pacing':>8}")
    path = "chat/completions" if result["endpoint"] == "chat" else "completions"
    budget = result.get("max_tokens_label", result["max_tokens"])
    lines = [f"{result['url']}  model {result['model']}  /v1/{path}  max_tokens {budget}"
             f"  T={result['temperature']:g}   (times in ms; ITL = gap between chunks, as vLLM)", head]
    for r in level_rows(result):
        lines.append(f"{r['load']:<18}{r['completed']:>5}{r['failed']:>5}{num(r['req_s'], '.2f'):>8}"
                     f"{num(r['tok_s']):>8}{num(r['ttft_p50_ms']):>10}{num(r['ttft_p95_ms']):>8}"
                     f"{num(r['tpot_mean_ms'], '.2f'):>11}{num(r['tpot_p95_ms'], '.2f'):>8}"
                     f"{num(r['itl_mean_ms'], '.2f'):>10}{num(r['e2e_p95_ms']):>10}"
                     f"{num(r['tokens_per_burst'], '.2f'):>11}{r['call']:>8}")
    for lv in result["levels"]:
        s = lv["summary"]
        if s["failed"]:
            kinds = ", ".join(f"{k} {v}" for k, v in s["failures"].items())
            lines.append(f"{lv['level']['label']}: {s['failed']} failed ({kinds}); e.g. {s['failure_examples'][0]}")
        if s.get("goodput"):
            g = s["goodput"]
            slo = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
            lines.append(f"{lv['level']['label']}: goodput {g['request_goodput']:.2f} req/s "
                         f"({g['good_requests']} of {s['completed']} met {slo})")
    v = result["verdict"]
    lines.append(f"verdict: {v['verdict'].upper()}")
    lines += [f"  {e}" for e in v["evidence"]]
    for lv in result["levels"]:
        server = lv.get("server") or {}
        spec, cmp_ = server.get("spec_decode"), lv.get("acceptance_vs_outside")
        if spec and spec.get("drafts"):
            ppa = ", ".join(f"{x:.2f}" for x in spec["per_position_acceptance"] or [])
            lines.append(f"{lv['level']['label']}: server acceptance rate {num(spec['acceptance_rate'], '.3f')}, "
                         f"mean acceptance length {num(spec['mean_acceptance_length'], '.2f')} "
                         f"(outside estimate {num((cmp_ or {}).get('outside_estimate'), '.2f')}), per position [{ppa}]")
            for w, ws in (server.get("spec_decode_by_workload") or {}).items():
                ppa = ", ".join(f"{x:.2f}" for x in ws["per_position_acceptance"] or [])
                lines.append(f"  {w:<16} acceptance rate {num(ws['acceptance_rate'], '.3f')}, mean acceptance "
                             f"length {num(ws['mean_acceptance_length'], '.2f')}, {ws['drafts']:.0f} drafts, "
                             f"per position [{ppa}]")
        elif server.get("sglang"):
            sg = server["sglang"]
            lines.append(f"{lv['level']['label']}: SGLang accept length {num(sg.get('accept_length'), '.2f')}, "
                         f"accept rate {num(sg.get('accept_rate'), '.3f')} (gauges after the run)")
        pc = server.get("prefix_cache")
        if pc and pc.get("hits"):
            lines.append(f"{lv['level']['label']}: server prefix cache: {pc['hit_rate']:.1%} of {pc['queries']:.0f} "
                         f"prompt tokens reused (TTFT and throughput are not comparable with a run that repeats "
                         f"no prompts)")
        agree = lv.get("latency_vs_server") or {}
        if agree:
            pairs = [f"{k.upper()} {a['client_ms']:.1f}/{a['server_ms']:.1f} ms ({a['ratio']:.2f}x)"
                     for k, a in agree.items()]
            lines.append(f"{lv['level']['label']}: client/server mean " + ", ".join(pairs))
        rd = (server.get("server_latency_ms") or {}).get("read_delay")
        if rd:
            lines.append(f"{lv['level']['label']}: the server's event loop read each request {rd['mean']:.2f} ms "
                         f"(mean) after it reached the machine (its TTFT counts that wait)")
        if "unavailable" in server:
            lines.append(f"{lv['level']['label']}: no server metrics ({server['unavailable']})")
    for lv in result["levels"]:
        lag = lv["fingerprint"].get("client_loop_lag_ms")
        itl = lv["summary"].get("itl_token_ms") or lv["summary"].get("itl_ms")
        if lag and itl and lag["p99"] > 0.5 * itl["mean"]:
            lines.append(f"{lv['level']['label']}: this client's event loop woke up to {lag['p99']:.1f} ms late (p99; "
                         f"mean token gap {itl['mean']:.1f} ms): the machine is busy and the client may bunch chunks")
        wait, ttft = lv["summary"].get("send_wait_ms"), lv["summary"].get("ttft_ms")
        if wait and ttft and wait["mean"] > 0.1 * ttft["mean"]:
            lines.append(f"{lv['level']['label']}: this client took {wait['mean']:.1f} ms (mean) to put each request "
                         f"on the wire (building it, its event loop, a connection); TTFT and E2E start after that "
                         f"({ttft['mean']:.1f} ms TTFT)")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)
