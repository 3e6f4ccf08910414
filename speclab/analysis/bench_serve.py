"""``speclab bench serve``: the serving benchmark. It starts ``speclab serve`` twice (plain decoding and
speculative: the family's default draft at k = 4 unless flags say otherwise), runs the load tool
(:mod:`speclab.load`, the one load generator) at concurrency 1, 2, 4, ... per workload, plain and
speculative interleaved level by level (both servers up at once, so machine noise hits both alike),
until plain decoding saturates (throughput grows < 10% when concurrency doubles) or at the levels
given, and reports throughput, TTFT, TPOT and p95 E2E side by side, the concurrency at which
speculation stops paying (output tokens/s below plain's), and a greedy-output identity check: every
server output equals the solo ``speclab generate -k 0`` output of the same prompt (and vLLM's, with
``--peer vllm``).

``--peer vllm --vllm-venv PATH`` runs the same load against vLLM's CPU build started from that venv
(plain, then with the same draft), one server at a time; without the venv it is skipped with a message.

Before each run the benchmark waits until no server it started is still busy (:mod:`speclab.load.quiet`:
vLLM's engine keeps a CPU busy for about a second after its last request, which the server measured next would
pay for). ``--aa`` adds a second plain speclab server, identical to the first, to the rotation: the ratio of
the twins, repetition by repetition, is the spread that noise alone gives a pair of servers, printed beside
speclab's ratio to vLLM's plain server.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from pathlib import Path

from ..errors import SpeclabError
from ..load.quiet import QUIET_BELOW
from ..tables import num

TWIN = "speclab plain twin"  # --aa: a second plain server, identical to "speclab plain" (the A/A control)
SATURATION_GAIN = 1.10  # doubling concurrency must raise plain tokens/s by 10% to count as not saturated


def levels_to_run(spec: str | None, max_c: int) -> list[int] | None:
    """The fixed list from --concurrency, or None for the doubling that stops at saturation."""
    if spec is None:
        return None
    from ..load.shapes import concurrency_levels

    return [int(lv.value) for lv in concurrency_levels(spec)]


def doubling(max_c: int) -> list[int]:
    out, c = [], 1
    while c <= max_c:
        out.append(c)
        c *= 2
    return out


def saturated(prev_tok_s: float | None, tok_s: float | None) -> bool:
    """Plain decoding has saturated when doubling concurrency raised its tokens/s by less than 10%."""
    return prev_tok_s is not None and tok_s is not None and tok_s < SATURATION_GAIN * prev_tok_s


def crossover(rows: list[dict], a: str = "speclab plain", b: str = "speclab speculative") -> dict:
    """Per workload: the lowest concurrency from which ``b``'s output tokens/s stays below ``a``'s at every
    level measured (speculation stops paying, and a noisy dip that recovers at the next level does not
    count), or None when speculation pays at the highest level measured."""
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        by_c: dict[int, dict] = {}
        for r in rows:
            if r["workload"] == wl:
                by_c.setdefault(r["concurrency"], {})[r["server"]] = r
        both = sorted(c for c, d in by_c.items() if a in d and b in d and d[a]["tok_s"] and d[b]["tok_s"] is not None)
        at = None
        for c in reversed(both):  # walk down from the top while speculation loses
            if by_c[c][b]["tok_s"] >= by_c[c][a]["tok_s"]:
                break
            at = c
        out[wl] = {"stops_paying_at": at, "highest_measured": both[-1] if both else None,
                   "speedup": {c: by_c[c][b]["tok_s"] / by_c[c][a]["tok_s"] for c in both}}
    return out


def identity(outputs: dict[str, dict[str, set]], solo: dict[str, str]) -> dict:
    """Greedy outputs per server ({server: {prompt id: {texts seen}}}) against the solo generation of each
    prompt: identical means one text per prompt per server, equal to the solo one."""
    out = {"prompts": len(solo), "servers": {}}
    for server, per in outputs.items():
        bad = []
        for pid, texts in per.items():
            if pid in solo and texts != {solo[pid]}:
                bad.append({"prompt": pid, "solo": solo[pid][:80], "server": sorted(t[:80] for t in texts)})
        checked = sum(1 for pid in per if pid in solo)
        out["servers"][server] = {"prompts_checked": checked, "identical": checked - len(bad), "mismatches": bad[:5]}
    return out


def _row(server: str, workload: str, c: int, level: dict) -> dict:
    s = level["summary"]

    def get(key, stat):
        return (s.get(key) or {}).get(stat)

    return {"server": server, "workload": workload, "concurrency": c, "completed": s["completed"],
            "failed": s["failed"], "tok_s": s["output_throughput"], "req_s": s["request_throughput"],
            "ttft_p50_ms": get("ttft_ms", "p50"), "ttft_mean_ms": get("ttft_ms", "mean"),
            "tpot_mean_ms": get("tpot_ms", "mean"), "tpot_p95_ms": get("tpot_ms", "p95"),
            "e2e_p95_ms": get("e2e_ms", "p95"), "pacing": level["fingerprint"]["call"],
            "tokens_per_burst": level["fingerprint"]["mean_tokens_per_burst"],
            "server_acceptance_length": ((level.get("server") or {}).get("spec_decode") or {}).get(
                "mean_acceptance_length"),
            "prefix_hit_rate": ((level.get("server") or {}).get("prefix_cache") or {}).get("hit_rate")}


def paired_ratios(rows: list[dict], a: str, b: str) -> dict:
    """{workload: {concurrency: [a's tokens/s over b's, one per repetition]}}: each ratio pairs the two servers'
    runs of the same repetition (measured back to back in one rotation, so a slow minute hits both)."""
    reps: dict = {}
    for r in rows:
        if r["server"] in (a, b):
            reps.setdefault((r["workload"], r["concurrency"]), {})[r["server"]] = r.get("tok_s_reps") or [r["tok_s"]]
    out: dict = {}
    for (wl, c), by in reps.items():
        if a in by and b in by:
            out.setdefault(wl, {})[c] = [x / y if x and y else None for x, y in zip(by[a], by[b])]
    return out


def lower_median(ordered: list):
    """The middle item of ``ordered`` (sorted, not empty): the lower of the two middle ones for an even count."""
    return ordered[(len(ordered) - 1) // 2]


def settle_summary(settles: list[float]) -> dict:
    ok = sorted(settles)
    return {"runs": len(ok), "median": lower_median(ok) if ok else None, "max": ok[-1] if ok else None}


def print_paired(paired: dict, aa: bool) -> None:
    """One line per pair and cell: the per-repetition ratios, their median and range."""
    if aa:
        print(f"A/A control: {TWIN} is a second, identical plain server; its ratio to speclab plain is the spread "
              f"that noise alone gives a pair of servers here")
    for pair, by_wl in paired.items():
        for wl, by_c in by_wl.items():
            for c, ratios in by_c.items():
                ok = sorted(x for x in ratios if x is not None)
                if not ok:
                    continue
                print(f"paired, {pair}, {wl} c={c}: {', '.join(f'{x:.2f}' for x in ratios if x is not None)} per "
                      f"repetition (median {lower_median(ok):.2f}x, range {ok[0]:.2f}-{ok[-1]:.2f})")


def median_rep(measured: list, tok_s=lambda m: m[0]["tok_s"]):
    """Of one cell's repetitions (by default ``(row, summary)`` pairs; ``tok_s`` reads a repetition's tokens/s),
    the one whose tokens/s is the median (the lower of the two middle ones for an even count; a failed level's
    None counts as 0)."""
    return lower_median(sorted(measured, key=lambda m: tok_s(m) or 0.0))


def format_table(rows: list[dict], servers: list[str]) -> str:
    lines = []
    for wl in dict.fromkeys(r["workload"] for r in rows):
        lines.append(f"workload {wl}   (tok/s = output tokens/s; TTFT p50, TPOT mean, E2E p95 in ms; hit = share of "
                     f"prompt tokens found in the server's prefix cache)")
        head = f"{'conc':>5}"
        for s in servers:
            head += f" | {s[:22]:<22}{'tok/s':>7}{'TTFT':>7}{'TPOT':>7}{'E2E95':>8}{'hit':>6}"
        lines.append(head)
        by_c: dict[int, dict] = {}
        for r in rows:
            if r["workload"] == wl:
                by_c.setdefault(r["concurrency"], {})[r["server"]] = r
        for c in sorted(by_c):
            line = f"{c:>5}"
            for s in servers:
                r = by_c[c].get(s)
                if r is None:
                    line += f" | {'':<22}{'-':>7}{'-':>7}{'-':>7}{'-':>8}{'-':>6}"
                    continue
                fail = f" {r['failed']} failed" if r["failed"] else ""
                line += (f" | {(r['pacing'] + fail)[:22]:<22}{num(r['tok_s']):>7}{num(r['ttft_p50_ms']):>7}"
                         f"{num(r['tpot_mean_ms'], '.2f'):>7}{num(r['e2e_p95_ms'], '.0f'):>8}"
                         f"{_pct(r.get('prefix_hit_rate')):>6}")
            lines.append(line)
    return "\n".join(lines)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{100.0 * rate:.0f}%"


def speculative_config_for(args) -> dict:
    """The speculative server's config (vLLM's JSON, checked by the server's own parser): the flag's, or the
    default draft at ``--k``."""
    from ..defaults import default_draft
    from ..drafters.speculators import speculators_dir
    from ..serve.config import parse_speculative_config

    text = args.speculative_config
    if not text:
        draft = args.draft or default_draft()
        method = "ngram" if draft == "ngram" else "eagle3" if speculators_dir(draft) else "draft_model"
        text = json.dumps({"method": "ngram", "num_speculative_tokens": args.k} if method == "ngram" else
                          {"method": method, "model": draft, "num_speculative_tokens": args.k})
    spec = parse_speculative_config(text).to_json()
    if spec is None:
        raise SpeclabError("speclab bench serve compares plain and speculative decoding: give a speculative "
                           "config with num_speculative_tokens >= 1")
    return spec


def request_tokens(args) -> int:
    """max_tokens per request: ``--max-new-tokens`` when given, else 32 (64 with ``--full``)."""
    return args.max_new_tokens or (64 if args.full else 32)


def _vllm_spec(spec: dict) -> tuple[dict | None, str | None]:
    """speclab's speculative config (as :func:`speculative_config_for` gives it: every key present) in vLLM's
    terms, draft models as directories; or (None, why not)."""
    from ..family import resolve

    if spec["method"] == "ngram":
        return dict(spec), None
    if spec["method"] == "draft_model":
        path = resolve(spec["model"]) or spec["model"]
        if not Path(path).is_dir():
            return None, f"draft {spec['model']!r} is not a local directory vLLM can load"
        return {**spec, "model": str(path)}, None
    if spec["method"] == "eagle3":  # the parser gave the speculators directory, which vLLM reads as it is
        return dict(spec), None
    return None, f"vLLM has no equivalent of method {spec['method']!r}"


class SoloDecoder:
    """Greedy solo generation (what ``speclab generate -k 0`` does) in this process: the identity oracle and the
    baseline the server's overhead is measured against."""

    def __init__(self, target_name: str, threads: int | None):
        from ..defaults import setup_threads
        from ..engine import SpeculativeDecoder
        from ..models import load_model

        target = load_model(target_name, device="cpu", role="target")
        setup_threads(threads, target)
        self.dec = SpeculativeDecoder(target, None)
        self.dec.generate(["warm up"], k=0, max_new_tokens=4, record=False)

    def run(self, texts: list[str], max_tokens: int) -> tuple[list[str], dict]:
        """Each text alone, one after another: (outputs, {"tokens", "wall_s", "tok_s"})."""
        runs = [self.one(text, max_tokens) for text in texts]
        wall, tokens = sum(r[0] for r in runs), sum(r[1] for r in runs)
        return [r[2] for r in runs], {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall if wall else None}

    def one(self, text: str, max_tokens: int) -> tuple[float, int, str]:
        """One text: (seconds, output tokens, output text)."""
        t0 = time.perf_counter()
        res = self.dec.generate([text], k=0, max_new_tokens=max_tokens, temperature=0.0)
        wall = time.perf_counter() - t0
        n = res.output_tokens[0] if isinstance(res.output_tokens[0], int) else len(res.output_tokens[0])
        return wall, n, res.texts[0]


def prefix_hit_rates(results: dict) -> dict:
    """Per server: prompt tokens looked up in its prefix cache over all its levels, and the share found there
    (from each level's /metrics window), or None for a server that does not export the counters."""
    out = {}
    for server, by_wl in results.items():
        q = h = 0.0
        seen = False
        for by_c in by_wl.values():
            for level in by_c.values():
                pc = (level.get("server") or {}).get("prefix_cache")
                if pc:
                    seen = True
                    q += pc["queries"]
                    h += pc["hits"]
        out[server] = {"queries": q, "hits": h, "hit_rate": h / q if q else None} if seen else None
    return out


def run_serve_bench(args) -> int:
    from ..defaults import default_target
    from ..load import Endpoint, LoadSpec, concurrency_levels, run
    from ..load.prompts import load_prompts, request_order
    from ..load.quiet import wait_quiet
    from ..load.servers import speclab_serve, vllm_serve, vllm_venv
    from ..workloads import workload_names

    full = bool(args.full)
    target = args.target or default_target()
    workloads = workload_names(args.workload) if args.workload is not None or full else ["json", "code"]
    max_c = args.max_concurrency or (64 if full else 16)
    fixed = levels_to_run(args.concurrency, max_c)
    max_tokens = request_tokens(args)
    spec = speculative_config_for(args)
    quiet = args.quiet
    log = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    reps = max(1, args.reps or 1)

    def n_requests(c):
        if args.requests:
            return args.requests
        return max(8, 4 * c) if full else max(4, 2 * c)

    peer = None
    if args.peer == "vllm":
        venv = vllm_venv(args.vllm_venv)
        if venv is None:
            print(f"speclab bench serve: vLLM peer skipped: no venv at {args.vllm_venv or 'the default'} "
                  f"(set it up with scripts/setup_vllm)")
        else:
            peer = venv

    prompts_by_wl = {wl: load_prompts(wl) for wl in workloads}
    rows: list[dict] = []
    results: dict = {}
    outputs: dict[str, dict[str, set]] = {}
    texts_of: dict[str, str] = {}
    levels_by_wl: dict[str, list[int]] = {}
    overhead_texts: dict[str, list[str]] = {}  # per workload: the prompts its concurrency-1 level sent
    settles: list[float] = []  # seconds waited before each run for the servers to go quiet (speclab.load.quiet)
    interleaved = None

    @functools.cache
    def solo_decoder() -> SoloDecoder:  # loaded once, when first needed
        return SoloDecoder(target, args.threads)

    def measure(server_name, url, wl, c, warm, model=None, rep=0):
        """One load level on one server: (row, level summary without the per-request records). Fresh prompts: the
        same for every server in a cell (each server's cache is its own), new for each cell and repetition."""
        ep = Endpoint(url, model=model, max_tokens=max_tokens, temperature=0.0, timeout=300.0)
        ls = LoadSpec(levels=concurrency_levels(str(c)), prompts=prompts_by_wl[wl], num_requests=n_requests(c),
                      seed=args.seed, warmup=1 if warm else 0, quiet=True, tokenizer=target,
                      fresh=f"{run_salt}/{wl}/r{rep}" if prompt_mode == "fresh" else None)
        settles.append(wait_quiet(srv.proc.pid for _, srv, _ in up))  # no server still busy from its last turn
        res = run(ep, ls)
        level = res["levels"][0]
        texts_of.update(level.get("fresh_prompts", {}))
        for r in level["requests"]:
            if r["ok"]:
                outputs.setdefault(server_name, {}).setdefault(r["prompt_id"], set()).add(r["text"])
        for p in prompts_by_wl[wl]:
            texts_of[p.id] = p.prompt
        return _row(server_name, wl, c, level), {k: v for k, v in level.items() if k != "requests"}

    def keep(server_name, wl, c, measured):
        """The repetition with the median tokens/s stands for the cell (all of them listed in its row)."""
        row, summary = median_rep(measured)
        row["tok_s_reps"] = [m[0]["tok_s"] for m in measured]
        rows.append(row)
        results.setdefault(server_name, {}).setdefault(wl, {})[c] = summary
        reps_note = f"  (reps {', '.join(num(t) for t in row['tok_s_reps'])})" if len(measured) > 1 else ""
        log(f"  {server_name:<26} {wl:<10} c={c:<3} {num(row['tok_s']):>7} tok/s  "
            f"TPOT {num(row['tpot_mean_ms'], '.2f')}"
            f" ms  {row['pacing']}{'  ' + str(row['failed']) + ' failed' if row['failed'] else ''}{reps_note}")
        return row

    prefix_caching = getattr(args, "prefix_caching", "on")
    prompt_mode = getattr(args, "prompt_mode", None) or ("fresh" if peer is not None else "repeat")
    run_salt = uuid.uuid4().hex
    t_start = time.perf_counter()
    log(f"speclab bench serve: target {target}, speculative {json.dumps(spec)}, workloads {','.join(workloads)}, "
        f"max_tokens {max_tokens}, concurrency {fixed or f'1,2,4,... up to {max_c} until plain saturates'}, "
        f"{reps} interleaved repetition(s), speclab prefix caching {prefix_caching}, {prompt_mode} prompts")
    vllm_notes = []
    up: list[tuple[str, object, str | None]] = []  # (name, server, model name to send)
    try:
        # every server is up before the first request, and each level runs on each in turn (the order rotating),
        # so that the machine's drifts over minutes hit all of them alike
        pc = [] if prefix_caching == "on" else ["--no-enable-prefix-caching"]
        up.append(("speclab plain", speclab_serve(target, "none", threads=args.threads or 1, extra=pc), None))
        if getattr(args, "aa", False):
            up.append((TWIN, speclab_serve(target, "none", threads=args.threads or 1, extra=pc), None))
        up.append(("speclab speculative", speclab_serve(target, spec, policy=args.spec_policy,
                                                        threads=args.threads or 1, extra=pc), None))
        log(f"speclab servers up ({', '.join(f'{name} {srv.started_s:.0f} s' for name, srv, _ in up)})")
        if peer is not None:
            from ..family import resolve

            model_dir = str(resolve(target) or target)
            vspec, why = _vllm_spec(spec)
            for name, sc in (("vllm plain", None), ("vllm speculative", vspec)):
                if name == "vllm speculative" and vspec is None:
                    vllm_notes.append(f"vllm speculative skipped: {why}")
                    continue
                log(f"starting {name} from {peer} (about 1-3 minutes) ...")
                try:
                    srv = vllm_serve(peer, model_dir, sc)
                except SpeclabError as e:
                    vllm_notes.append(f"{name} failed: {e}")
                    print(f"speclab bench serve: {name} failed: {e}")
                    continue
                up.append((name, srv, model_dir))
                log(f"{name} up after {srv.started_s:.0f} s")
        for wl in workloads:
            prev = None
            done = []
            for i, c in enumerate(fixed or doubling(max_c)):
                measured: dict[str, list] = {name: [] for name, _, _ in up}
                if c == 1:  # the prompts the level sends, in order: the solo baseline of the server's overhead
                    order = request_order(prompts_by_wl[wl], args.seed)
                    texts = [order[j % len(order)].prompt for j in range(n_requests(1))]
                    overhead_texts[wl] = texts
                for rep in range(reps):
                    shift = (i + rep) % len(up)
                    for name, srv, model in up[shift:] + up[:shift]:
                        measured[name].append(measure(name, srv.url, wl, c, warm=i == 0 and rep == 0, model=model,
                                                      rep=rep))
                kept = {name: keep(name, wl, c, m) for name, m in measured.items()}
                done.append(c)
                p = kept["speclab plain"]
                if fixed is None and saturated(prev, p["tok_s"]):
                    log(f"  plain decoding saturated on {wl} at concurrency {c}")
                    break
                prev = p["tok_s"]
            levels_by_wl[wl] = done
        if overhead_texts:  # request by request, the servers otherwise idle (see .serve_overhead)
            from .serve_overhead import interleaved_overhead

            log("server overhead: each concurrency-1 prompt served by a plain speclab serve without prefix caching "
                "(it would skip the prefill of the prompts it has seen) and generated solo, back to back ...")
            solo = solo_decoder()
            texts_all = [t for _ in range(reps) for ts in overhead_texts.values() for t in ts]
            with speclab_serve(target, "none", threads=args.threads or 1,
                               extra=["--no-enable-prefix-caching"]) as bare:
                interleaved = interleaved_overhead(bare.url, texts_all, max_tokens,
                                                   functools.partial(solo.one, max_tokens=max_tokens))
    finally:
        for _, srv, _ in up:
            srv.stop()
    servers = [name for name, _, _ in up]
    log("solo greedy generation of every prompt sent (the identity oracle) ...")
    solo_ids = list(dict.fromkeys(pid for srv in outputs.values() for pid in srv))
    solo_texts, solo_speed = solo_decoder().run([texts_of[pid] for pid in solo_ids], max_tokens)
    solo = dict(zip(solo_ids, solo_texts))
    ident = identity(outputs, solo)
    cross = crossover(rows)
    result = {"target": target, "speculative_config": spec, "spec_policy": args.spec_policy, "workloads": workloads,
              "max_tokens": max_tokens, "reps": reps, "prompt_mode": prompt_mode,
              "requests_per_level": {c: n_requests(c) for cs in levels_by_wl.values() for c in cs},
              "levels": levels_by_wl, "rows": rows, "crossover": cross,
              "identity": ident, "solo_generate": solo_speed,
              "server_overhead": {"interleaved": interleaved}, "prefix_cache": prefix_hit_rates(results),
              "vllm_notes": vllm_notes, "settle_s": settle_summary(settles),
              "wall_s": time.perf_counter() - t_start, "load_results": results}
    if "vllm plain" in servers:
        result["crossover_vllm"] = crossover(rows, "vllm plain", "vllm speculative")
    pairs = [(TWIN, "speclab plain"), ("speclab plain", "vllm plain")]
    result["paired_ratios"] = {f"{a} / {b}": paired_ratios(rows, a, b) for a, b in pairs
                               if a in servers and b in servers}
    print(format_table(rows, servers))
    for who, cx_all in (("speclab", cross), ("vllm", result.get("crossover_vllm") or {})):
        for wl, cx in cx_all.items():
            at = cx["stops_paying_at"]
            sp = ", ".join(f"c{c}: {v:.2f}x" for c, v in cx["speedup"].items())
            print(f"{who} {wl}: " + (f"speculation stops paying at concurrency {at}" if at is not None else
                                     f"speculation pays at every level measured (up to concurrency "
                                     f"{cx['highest_measured']})") + f"   (speculative / plain tokens/s: {sp})")
    ov = result["server_overhead"]
    iv = ov["interleaved"]
    if iv is not None and iv["ratio"] is not None:
        print(f"server overhead: plain at concurrency 1 over solo generate -k 0, request by request "
              f"({len(iv['pairs'])} prompts, each served and generated solo back to back): {iv['ratio']:.2f}x tokens/s "
              f"({num(iv['served_tok_s'])} / {num(iv['solo_tok_s'])}; median pair {iv['median_pair']:.2f}x; "
              f"{iv['identical']} of {len(iv['pairs'])} outputs identical)")
    for server, pc in result["prefix_cache"].items():
        if pc is not None and pc["hit_rate"] is not None:
            print(f"prefix cache, {server}: {pc['hit_rate']:.1%} of {pc['queries']:.0f} prompt tokens found in it "
                  f"({'every prompt unique' if prompt_mode == 'fresh' else 'the load repeats prompts'})")
    for server, d in ident["servers"].items():
        print(f"greedy identity, {server}: {d['identical']} of {d['prompts_checked']} prompts identical to solo "
              f"generation" + (f"; first mismatch {d['mismatches'][0]}" if d["mismatches"] else ""))
    print_paired(result["paired_ratios"], aa=TWIN in servers)
    st = result["settle_s"]
    if st["runs"]:
        print(f"before each of {st['runs']} runs, waited for every server to go quiet (under {QUIET_BELOW:g} CPU): "
              f"median {st['median']:.1f} s, longest {st['max']:.1f} s")
    for n in vllm_notes:
        print(f"note: {n}")
    print(f"({result['wall_s']:.0f} s)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=list))
        print(f"wrote {args.json}")
    if args.charts:
        from ..load.charts import load_chart

        out = Path(args.charts)
        out.mkdir(parents=True, exist_ok=True)
        for wl in workloads:
            sub = [dict(r, value=r["concurrency"]) for r in rows if r["workload"] == wl]
            path = out / f"serve_{wl}.html"
            load_chart(sub, series="server", title=f"workload {wl}").save(path)
            print(f"wrote {path}")
    return 0
