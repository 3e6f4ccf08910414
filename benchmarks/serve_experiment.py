"""The serving experiment, end to end: ``python benchmarks/serve_experiment.py``.

Servers (each started fresh, one torch thread each):

* ``speclab serve`` with speculation off (``--speculative-config none``), fixed k (the draft at k, by
  default draft-xs-distill at k = 4), and the adaptive draft-length policies (``--spec-policy``; default
  every adaptive one in :data:`speclab.engine.policies.POLICIES`: batch-table with a table for this CPU,
  heuristic, ema, goodput, confidence; K = k);
* the same speculative servers with ``--stream-split-tokens`` (one token per chunk), measured at the
  lowest and the highest load (every load with ``--full``): the gaps alone must carry the evidence;
* vLLM's CPU build from its venv (docs/vllm.md), when present: plain, ``draft_model`` at k, ``ngram``
  at k, and its own adaptive form, the batch-size table (``num_speculative_tokens_per_batch_size``, the
  same table as speclab's batch-table), one server at a time.

Load: ``speclab load`` (:mod:`speclab.load`, the one load generator) at rising concurrency (1, 2, 4,
8, 16, 32) on the json, code and tech_prose workloads. The speclab servers are all up at once and every
(workload, level) visits each in turn (the order rotating per level), so machine noise hits them
alike; with ``--reps`` a cell's throughput is pooled over its repetitions (:func:`median_cell`), and
``--control`` adds a second plain server to the rotation, the A/A control. Per cell: throughput, latency
percentiles, the pacing fingerprint and its call, the ``/metrics`` window, and what the server did
(:mod:`.serve_judge`). Per server and workload: the verdict over the levels. Then the checks
(:mod:`.serve_judge`), the crossover (``bench_serve.crossover``: the load from which fixed-k speculation stops
paying against plain), the text report and the charts (:mod:`.serve_report`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python benchmarks/NAME.py`: the root on the path, siblings as benchmarks.NAME
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import json
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import serve_judge as judge
from speclab.errors import SpeclabError
from speclab.load.shapes import Budgets

LEVELS = (1, 2, 4, 8, 16, 32)
FULL_LEVELS = (1, 2, 4, 8, 16, 32, 64)
WORKLOADS = ("json", "code", "tech_prose")
ADAPTIVE = ("batch-table", "heuristic", "ema", "goodput", "confidence")
# speclab's batch-table and vLLM's num_speculative_tokens_per_batch_size on this CPU (2 shared cores, the
# family target, draft-xs-distill): fixed k = 4 pays 1.4-1.75x at one or two running requests on json, is
# about even at four to eight and loses beyond on the machine's busy runs, and barely pays or loses on code
# and tech_prose from the start (docs/serving_experiment.md): so k = 4 up to two rows, 2 up to four, then off.
CPU_TABLE = "1-2=4,3-4=2,5-=0"
VLLM_LOG_INTERVAL = 2.0  # seconds between vLLM's engine log lines (VLLM_LOG_STATS_INTERVAL) in the experiment
VLLM_KINDS = ("plain", "fixed", "ngram", "batch-table")


@dataclass(frozen=True)
class ServerConfig:
    """One server to start: ``engine`` "speclab" or "vllm"; ``role`` "plain", "fixed", "lookup" (n-gram)
    or "adaptive"; ``spec`` the speculative config (None: plain); ``policy`` speclab's --spec-policy;
    ``control``: a second plain server, the A/A control (:func:`~.serve_judge.control_rows`)."""

    name: str
    engine: str
    role: str
    spec: dict | None = None
    policy: str | None = None
    split: bool = False
    control: bool = False


CONTROL = "speclab plain (control)"


@dataclass
class ExperimentSpec:
    target: str = "target"
    draft: str = "draft-xs-distill"
    k: int = 4
    policies: list[str] = field(default_factory=lambda: list(ADAPTIVE))  # adaptive, besides plain and fixed k
    table: str = CPU_TABLE
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    levels: list[int] = field(default_factory=lambda: list(LEVELS))
    split_levels: list[int] | None = None  # None: the lowest and the highest level
    split: bool = True
    requests: int | None = None  # per level; None: max(min_requests, per_client x concurrency)
    min_requests: int = 8
    per_client: int = 1
    max_tokens: int = 32
    length_spread: float = 0.5  # each request's max_tokens drawn from max_tokens x [1 - s, 1 + s] (load.shapes.Budgets)
    reps: int = 1  # repetitions of each cell (every server in turn; see median_cell)
    control: bool = False  # a second plain speclab server in the rotation: how far two identical servers read apart
    seed: int = 0
    threads: int = 1
    speclab: bool = True
    vllm: bool = True
    vllm_venv: str | None = None
    vllm_kinds: list[str] = field(default_factory=lambda: list(VLLM_KINDS))
    vllm_eager: bool = False  # --enforce-eager: vLLM starts ~25 s sooner per server and runs slower (checks only)
    timeout: float = 300.0

    def n_requests(self, c: int) -> int:
        return self.requests or max(self.min_requests, self.per_client * c)


def speclab_configs(spec: ExperimentSpec) -> list[ServerConfig]:
    """Plain, fixed k and each adaptive policy, in that order (names as the tables show them)."""
    from speclab.engine.policies import POLICIES

    draft = {"method": "draft_model", "model": spec.draft, "num_speculative_tokens": spec.k}
    out = [ServerConfig("speclab plain", "speclab", "plain")]
    if spec.control:
        out.append(ServerConfig(CONTROL, "speclab", "plain", control=True))
    out.append(ServerConfig(f"speclab fixed k={spec.k}", "speclab", "fixed", draft))
    for p in spec.policies:
        name = p.strip().lower().replace("_", "-")
        if name in ("off", "fixed"):
            continue  # plain and fixed k are always there
        if name.partition(":")[0] not in POLICIES:
            raise SpeclabError(f"unknown policy '{p}' (known: {', '.join(POLICIES)})")
        policy = f"batch-table:{spec.table}" if name == "batch-table" else name
        out.append(ServerConfig(f"speclab {name.partition(':')[0]}", "speclab", "adaptive", draft, policy))
    return out


def split_configs(configs: list[ServerConfig]) -> list[ServerConfig]:
    return [ServerConfig(c.name + " split", c.engine, c.role, c.spec, c.policy, split=True)
            for c in configs if c.spec is not None]


def vllm_table(table: str) -> list[list[int]]:
    """speclab's '1-2=4,3-4=2,5-=0' -> vLLM's [[1, 2, 4], [3, 4, 2], [5, 1000000, 0]] (inclusive ranges)."""
    from speclab.engine.policies import parse_table

    return [[lo, hi if hi is not None else 1_000_000, k] for lo, hi, k in parse_table(table)]


def vllm_configs(spec: ExperimentSpec) -> list[ServerConfig]:
    from speclab.family import resolve

    draft = resolve(spec.draft) or Path(spec.draft)
    if not Path(draft).is_dir():
        raise SpeclabError(f"draft {spec.draft!r} is not a local model directory vLLM can load")
    model = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": spec.k}
    all_ = {"plain": ServerConfig("vllm plain", "vllm", "plain"),
            "fixed": ServerConfig(f"vllm fixed k={spec.k}", "vllm", "fixed", model),
            "ngram": ServerConfig(f"vllm ngram k={spec.k}", "vllm", "lookup",
                                  {"method": "ngram", "num_speculative_tokens": spec.k, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 1}),
            "batch-table": ServerConfig("vllm batch-table", "vllm", "adaptive",
                                        dict(model, num_speculative_tokens=max(k for *_, k in vllm_table(spec.table)),
                                             num_speculative_tokens_per_batch_size=vllm_table(spec.table)))}
    unknown = [k for k in spec.vllm_kinds if k not in all_]
    if unknown:
        raise SpeclabError(f"unknown vLLM configuration {unknown[0]!r} (known: {', '.join(all_)})")
    return [all_[k] for k in spec.vllm_kinds]


# ------------------------------------------------------------------------------------------ measuring


def measure(url: str, cfg: ServerConfig, workload: str, c: int, spec: ExperimentSpec, prompts: list, *,
            warmup: int = 0, model: str | None = None, tokenizer: str | None = None, rep: int = 0) -> dict:
    """One cell: ``speclab load`` at concurrency ``c`` against ``url``; JSON-ready. Repetition ``rep`` takes its
    prompts in the order of seed ``spec.seed + rep``: every server and level of a repetition sends the same
    requests, and repetitions cover more of the workload than one order repeated."""
    from speclab.load import Endpoint, LoadSpec, concurrency_levels, run
    from speclab.load.report import level_rows

    extra = {"return_token_ids": True} if cfg.engine == "vllm" else {}
    ep = Endpoint(url, model=model, max_tokens=spec.max_tokens, temperature=0.0, timeout=spec.timeout, extra=extra)
    ls = LoadSpec(levels=concurrency_levels(str(c)), prompts=prompts, num_requests=spec.n_requests(c),
                  seed=spec.seed + rep, warmup=warmup, quiet=True, tokenizer=tokenizer,
                  length_spread=spec.length_spread)
    level = run(ep, ls)["levels"][0]
    row = level_rows({"levels": [level]})[0]
    completed = level["summary"]["completed"]
    if cfg.engine == "speclab":
        eng = judge.inside_speclab(level["requests"])
        inside = eng
        sd = (level["server"] or {}).get("spec_decode")
        if inside is not None and sd is not None and inside["rounds"]:
            inside = dict(inside, spec_on_share=sd["drafts"] / inside["rounds"])
    else:
        eng = None
        inside = judge.inside_metrics(level.get("server"), completed)
    fp = level["fingerprint"]
    return {"server": cfg.name, "engine": cfg.engine, "role": cfg.role, "policy": cfg.policy, "split": cfg.split,
            "control": cfg.control,
            "workload": workload, "concurrency": c, **{k: v for k, v in row.items() if k not in ("load", "kind")},
            "call": fp["call"], "accepted_length_estimate": fp["accepted_length_estimate"],
            "estimate_from": fp["estimate_from"], "mean_tokens_per_chunk": fp["mean_tokens_per_chunk"],
            "inside": inside, "engine_counters": eng, "summary": level["summary"], "fingerprint": fp,
            "server_metrics": level["server"], "acceptance_vs_outside": level["acceptance_vs_outside"],
            "latency_vs_server": level["latency_vs_server"], "client_stalls": level["client_stalls"],
            "requests": level["requests"]}


def _start_all(starters: dict) -> dict:
    """Start servers in parallel ({name: zero-argument callable}); on any failure, or an interrupt while they
    start, stop the ones that came up (each runs in its own process group: nothing else would end them)."""
    pool = ThreadPoolExecutor(max(1, len(starters)))
    futures = {name: pool.submit(f) for name, f in starters.items()}
    try:
        pool.shutdown(wait=True)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_all(f.result() for f in futures.values() if f.done() and not f.cancelled() and f.exception() is None)
        raise
    up, errors = {}, []
    for name, f in futures.items():
        if f.exception() is None:
            up[name] = f.result()
        else:
            errors.append(f"{name}: {f.exception()}")
    if errors:
        _stop_all(up.values())
        raise SpeclabError("server failed to start: " + "; ".join(errors))
    return up


def _stop_all(servers) -> None:
    servers = list(servers)
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


def _speclab_starter(cfg: ServerConfig, spec: ExperimentSpec):
    from speclab.load.servers import speclab_serve

    return lambda: speclab_serve(spec.target, cfg.spec if cfg.spec is not None else "none", policy=cfg.policy,
                                 threads=spec.threads, split_tokens=cfg.split)


def _run_speclab(configs: list[ServerConfig], levels: list[int], spec: ExperimentSpec, prompts: dict, log,
                 cells: list, started: dict) -> None:
    """Every config up at once; per workload and level each config in turn (the order rotating), ``spec.reps``
    times, each cell kept as its median repetition (:func:`median_cell`)."""
    t0 = time.perf_counter()
    servers = _start_all({c.name: _speclab_starter(c, spec) for c in configs})
    try:
        started.update({name: round(s.started_s, 1) for name, s in servers.items()})
        log(f"{len(servers)} speclab servers up in {time.perf_counter() - t0:.0f} s")
        warm = set()
        turn = 0
        for wl in spec.workloads:
            for c in levels:
                reps: dict[str, list] = {}
                for r in range(spec.reps):
                    order = configs[turn % len(configs):] + configs[:turn % len(configs)]
                    turn += 1
                    for cfg in order:
                        w = 0 if cfg.name in warm else 1  # a fresh process pays for lazy initialisation once
                        warm.add(cfg.name)
                        reps.setdefault(cfg.name, []).append(
                            measure(servers[cfg.name].url, cfg, wl, c, spec, prompts[wl], warmup=w,
                                    tokenizer=spec.target, rep=r))
                for cfg in configs:
                    cell = median_cell(reps[cfg.name])
                    cells.append(cell)
                    log(_progress(cell))
    finally:
        _stop_all(servers.values())


def median_cell(measured: list[dict]) -> dict:
    """One cell from its repetitions: the one :func:`~.bench_serve.median_rep` keeps (the median tokens/s) for
    latencies, pacing and counters, with ``tok_s`` the throughput over all of them (:func:`pooled_tok_s`: every
    output token over every repetition's duration, as one run interleaved with the other servers would read),
    ``tok_s_median_rep`` the kept one's and ``tok_s_reps`` each repetition's, in order (repetition r of every
    server ran in the same turn, close in time); ``failed_reps`` each repetition's failed requests, with
    ``failures`` (by kind) and ``failure_examples`` over all of them, from each repetition's load summary
    (:func:`speclab.load.stats.summarize`), so that a failure in any repetition shows."""
    from speclab.analysis.bench_serve import median_rep

    kept = median_rep(measured, tok_s=lambda m: m["tok_s"])
    pooled = pooled_tok_s(measured)
    sums = [m.get("summary") or {} for m in measured]
    return dict(kept, tok_s=kept["tok_s"] if pooled is None else pooled, tok_s_median_rep=kept["tok_s"],
                tok_s_reps=[m["tok_s"] for m in measured], failed_reps=[m.get("failed", 0) for m in measured],
                failures=dict(sum((Counter(s.get("failures") or {}) for s in sums), Counter())),
                failure_examples=list(dict.fromkeys(e for s in sums for e in s.get("failure_examples") or []))[:5])


def pooled_tok_s(measured: list[dict]) -> float | None:
    """Output tokens over seconds, summed over a cell's repetitions; None when a repetition lacks either.
    e.g. 300 tokens in 3 s and 100 in 2 s -> 80 tok/s (the mean of 100 and 50 would say 75)."""
    tokens = [(m.get("summary") or {}).get("output_tokens") for m in measured]
    secs = [(m.get("summary") or {}).get("duration_s") for m in measured]
    if not measured or None in tokens or None in secs or sum(secs) <= 0:
        return None
    return sum(tokens) / sum(secs)


def _progress(cell: dict) -> str:
    ins = (cell.get("inside") or {}).get("accepted_per_round")
    fail = f"  {cell['failed']} failed" if cell["failed"] else ""
    tok = "-" if cell["tok_s"] is None else f"{cell['tok_s']:.1f}"
    tpot = "-" if cell["tpot_p95_ms"] is None else f"{cell['tpot_p95_ms']:.1f}"
    reps = cell.get("tok_s_reps") or []
    reps = f"  (reps {', '.join('-' if t is None else f'{t:.0f}' for t in reps)})" if len(reps) > 1 else ""
    return (f"  {cell['server']:<28} {cell['workload']:<10} c={cell['concurrency']:<3} {tok:>7} tok/s  "
            f"p95 TPOT {tpot:>6} ms  {cell['call']:<7} accepted/round {'-' if ins is None else f'{ins:.2f}'}{fail}"
            f"{reps}")


def _run_vllm(configs: list[ServerConfig], spec: ExperimentSpec, prompts: dict, log, cells: list,
              started: dict, acceptance: list, notes: list) -> None:
    """One vLLM server at a time: every workload and level (``spec.reps`` times in a row, the median kept), then its
    counters against its engine log."""
    import httpx

    from speclab.family import resolve
    from speclab.load import scrape
    from speclab.load.servers import vllm_serve, vllm_venv

    venv = vllm_venv(spec.vllm_venv)
    if venv is None:
        msg = (f"vLLM skipped: no venv at {spec.vllm_venv or os.environ.get('SPECLAB_VLLM_VENV') or '/work/vllm-venv'}"
               " (set it up with scripts/setup_vllm)")
        notes.append(msg)
        log(msg)
        return
    model_dir = str(resolve(spec.target) or spec.target)
    if not Path(model_dir).is_dir():
        notes.append(f"vLLM skipped: target {spec.target!r} is not a local model directory")
        return
    env = {"VLLM_LOG_STATS_INTERVAL": str(VLLM_LOG_INTERVAL)}
    for cfg in configs:
        log(f"starting {cfg.name} from {venv} (about 1-2 minutes) ...")
        srv = None
        try:
            srv = vllm_serve(venv, model_dir, cfg.spec, env=env, eager=spec.vllm_eager)
            started[cfg.name] = round(srv.started_s, 1)
            log(f"{cfg.name} up after {srv.started_s:.0f} s")
            for wl in spec.workloads:
                for i, c in enumerate(spec.levels):
                    cell = median_cell([measure(srv.url, cfg, wl, c, spec, prompts[wl],
                                                warmup=1 if wl == spec.workloads[0] and i == 0 and r == 0 else 0,
                                                model=model_dir, tokenizer=model_dir, rep=r)
                                        for r in range(spec.reps)])
                    cells.append(cell)
                    log(_progress(cell))
            time.sleep(2 * VLLM_LOG_INTERVAL + 1.0)  # the engine logs what it counted since its last line
            since_start = scrape.window(None, scrape.parse(httpx.get(f"{srv.url}/metrics", timeout=10).text))
            log_sums = judge.parse_engine_log(srv.log_path.read_text(errors="replace"))
            acceptance.append(judge.vllm_acceptance_check(cfg.name, since_start, log_sums))
        except (SpeclabError, httpx.HTTPError, OSError) as e:
            notes.append(f"{cfg.name} failed: {e}")
            log(f"{cfg.name} failed: {e}")
        finally:
            if srv is not None:
                srv.stop()


def run_experiment(spec: ExperimentSpec, log=print) -> dict:
    """Run the whole experiment; returns the JSON-ready result (see :func:`judge_result`)."""
    from speclab.load.prompts import load_prompts

    t_start = time.perf_counter()
    prompts = {wl: load_prompts(wl) for wl in spec.workloads}
    levels = sorted(set(spec.levels))
    split_levels = sorted(set(spec.split_levels)) if spec.split_levels else sorted({levels[0], levels[-1]})
    cells: list[dict] = []
    started: dict = {}
    vllm_acceptance: list = []
    notes: list[str] = []
    configs = speclab_configs(spec) if spec.speclab else []
    splits = split_configs(configs) if spec.split else []
    vconfigs = vllm_configs(spec) if spec.vllm else []
    if not configs and not vconfigs:
        raise SpeclabError("nothing to run: neither speclab nor vLLM servers selected")
    log(f"serve experiment: target {spec.target}, draft {spec.draft} k={spec.k}, workloads {','.join(spec.workloads)}"
        f", concurrency {','.join(map(str, levels))}, max_tokens {Budgets(spec.max_tokens, spec.length_spread).label}"
        ", servers: "
        + ", ".join(c.name for c in configs + splits + vconfigs))
    if configs:
        _run_speclab(configs, levels, spec, prompts, log, cells, started)
    if splits:
        sub = ExperimentSpec(**{**asdict(spec), "levels": split_levels})
        _run_speclab(splits, split_levels, sub, prompts, log, cells, started)
    if vconfigs:
        _run_vllm(vconfigs, spec, prompts, log, cells, started, vllm_acceptance, notes)
    result = judge_result(cells, spec, vllm_acceptance)
    result.update(servers_started_s=started, notes=notes, wall_s=time.perf_counter() - t_start)
    return result


def compare_servers(cells: list[dict]) -> tuple[list[dict], dict, list[dict]]:
    """Per engine, plain against fixed k: the throughput check rows and the crossover by workload; and the control
    rows (speclab's second plain server over its plain one), whose ratio speclab's throughput rows carry (vLLM's
    servers run one at a time, later, outside that rotation)."""
    from speclab.analysis.bench_serve import crossover

    throughput, cross, control = [], {}, []
    for engine in ("speclab", "vllm"):
        names = {c["role"]: c["server"] for c in cells if c["engine"] == engine and not c["split"]
                 and c["role"] in ("plain", "fixed") and not c.get("control")}
        rows_here: list[dict] = []
        if "plain" in names and "fixed" in names:
            rows_here = judge.throughput_checks([c for c in cells if c["engine"] == engine], names["plain"],
                                                names["fixed"])
            throughput += rows_here
            rows = [{"workload": c["workload"], "concurrency": c["concurrency"], "server": c["server"],
                     "tok_s": c["tok_s"]} for c in cells if c["engine"] == engine and not c["split"]]
            cross[engine] = {"plain": names["plain"], "fixed": names["fixed"],
                             "by_workload": crossover(rows, names["plain"], names["fixed"])}
        if "plain" in names and engine == "speclab":  # the control runs in speclab's rotation: its rows only
            control = judge.control_rows(cells, names["plain"], CONTROL)
            judge.attach_control(rows_here, control)
    return throughput, cross, control


def judge_result(cells: list[dict], spec: ExperimentSpec, vllm_acceptance: list | None = None) -> dict:
    """Verdicts per server and workload, the checks and the crossovers, from the cells."""
    from speclab.load.fingerprint import verdict

    groups: dict[tuple, list] = {}
    for c in cells:
        groups.setdefault((c["server"], c["workload"]), []).append(c)
    verdicts, vchecks = [], []
    for (server, wl), cs in groups.items():
        cs = sorted(cs, key=lambda c: c["concurrency"])
        v = verdict([(f"concurrency {c['concurrency']}", c["concurrency"], c["fingerprint"]) for c in cs])
        verdicts.append({"server": server, "workload": wl, "split": cs[0]["split"], **v})
        vchecks.append(judge.verdict_check(cs[0]["role"], cs, v["verdict"]))
    throughput, cross, control = compare_servers(cells)
    acceptance = [a for a in (judge.speclab_acceptance_check(c) for c in cells if c["role"] != "plain") if a]
    acceptance += vllm_acceptance or []
    checks = {"requests": [judge.requests_check(c) for c in cells], "pacing": [judge.pacing_check(c) for c in cells],
              "verdict": vchecks, "throughput": throughput, "acceptance": acceptance}
    return {"settings": asdict(spec), "thresholds": {"spec_on": judge.SPEC_ON, "spec_off": judge.SPEC_OFF,
                                                     "throughput_target": judge.THROUGHPUT_TARGET},
            "cells": cells, "verdicts": verdicts, "checks": checks, "check_summary": judge.summarize_checks(checks),
            "control": control, "crossover": cross}


# ------------------------------------------------------------------------------------------ the command


def build_parser():
    from benchmarks._cli import add_flags, parser

    p = parser("serve_experiment", "The serving experiment: speclab serve plain, fixed k and the adaptive policies "
               "(and vLLM when its venv is present) under speclab load at rising concurrency on json, code and "
               "tech_prose; pacing verdicts, crossover and checks (about 10 minutes; --full: more).")
    add_flags(p, "target", "draft", "k", "workload", "max_new_tokens", "reps", "full", "seed", "threads", "out",
              "quiet", draft=dict(help="the draft of the speculative servers (default draft-xs-distill)"),
              reps=dict(help="interleaved repetitions per cell, every speclab server in turn (default 1)"))
    p.add_argument("--concurrency", default=None, help=f"concurrency levels (default {','.join(map(str, LEVELS))})")
    p.add_argument("--requests", type=int, default=None, help="requests per cell")
    p.add_argument("--policy", dest="policy_list", default=None, metavar="NAME,...",
                   help="the adaptive policies besides plain and fixed k (default every one; 'none' for neither)")
    p.add_argument("--length-spread", type=float, default=0.5, help="each request's token budget drawn uniformly "
                   "from max-new-tokens x [1 - s, 1 + s] (default 0.5; the same draws for every server)")
    p.add_argument("--batch-table", default=None, metavar="TABLE",
                   help=f"the batch-table policy's table, also vLLM's num_speculative_tokens_per_batch_size "
                        f"(default {CPU_TABLE})")
    p.add_argument("--control", action="store_true", help="add a second plain speclab server to the rotation (the "
                   "A/A control): how far two identical servers read apart in each cell")
    p.add_argument("--no-speclab", action="store_true", help="only vLLM")
    p.add_argument("--no-split", action="store_true", help="no --stream-split-tokens servers")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out")
    p.add_argument("--vllm-venv", default=None, metavar="PATH", help="vLLM's venv (default $SPECLAB_VLLM_VENV or "
                   "/work/vllm-venv)")
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (no torch.compile "
                   "warm-up: quicker to start, slower to run; for checking verdicts and counters, not throughput)")
    p.add_argument("--vllm-configs", default=None, help=f"vLLM servers to run (default {','.join(VLLM_KINDS)})")
    return p


def spec_from_args(args) -> ExperimentSpec:
    from speclab.defaults import default_target
    from speclab.load.shapes import check_spread, concurrency_levels
    from speclab.workloads import workload_names

    full = bool(args.full)
    levels = ([int(lv.value) for lv in concurrency_levels(args.concurrency)] if args.concurrency
              else list(FULL_LEVELS if full else LEVELS))
    policies = list(ADAPTIVE)
    if args.policy_list:  # "none": plain and fixed k only
        policies = [p.strip() for p in args.policy_list.split(",") if p.strip() and p.strip() != "none"]
    max_tokens = args.max_new_tokens if args.max_new_tokens != 64 or full else 32
    return ExperimentSpec(
        target=args.target or default_target(), draft=args.draft or "draft-xs-distill", k=args.k,
        policies=policies, table=args.batch_table or CPU_TABLE,
        workloads=workload_names(args.workload) if args.workload else list(WORKLOADS), levels=levels,
        split_levels=levels if full else None, split=not args.no_split,
        requests=args.requests, min_requests=16 if full else 8, per_client=2 if full else 1, max_tokens=max_tokens,
        length_spread=check_spread(getattr(args, "length_spread", 0.5)),
        reps=max(1, args.reps or 1), control=args.control,
        seed=args.seed, threads=args.threads or 1, speclab=not args.no_speclab, vllm=not args.no_vllm,
        vllm_venv=args.vllm_venv, vllm_eager=args.vllm_eager,
        vllm_kinds=[k.strip() for k in args.vllm_configs.split(",")] if args.vllm_configs else list(VLLM_KINDS))


def run_from_args(args) -> int:
    from benchmarks.serve_report import format_report, save_charts

    spec = spec_from_args(args)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    result = run_experiment(spec, log)
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=list))
        print(f"wrote {args.json}")
    for p in save_charts(result, str(Path(args.json).parent / "serve_experiment_charts")):
        print(f"wrote {p}")
    return 0 if result["cells"] else 1


def main(argv: list[str] | None = None) -> int:
    from benchmarks._cli import run

    return run(build_parser(), run_from_args, argv, "serve_experiment")


if __name__ == "__main__":
    sys.exit(main())
