"""Judging the serving experiment (``python benchmarks/serve_experiment.py``): what each server really did, what
its pacing should therefore read, and the experiment's checks (pure functions over the experiment's cells).

A *cell* is one server configuration x workload x load level, as :mod:`.serve_experiment` builds it:
``server`` (a name), ``role`` ("plain", "fixed", "lookup" or "adaptive"), ``split``, ``workload``,
``concurrency``, ``tok_s``, ``call`` (the fingerprint's call for the level), ``inside`` (below) and the
level's ``server_metrics`` (the ``/metrics`` window) and ``engine_counters``.

**What the server did** (``inside``): accepted drafts per row-round, the extra tokens a verification
round brings beyond the one every round brings. That, and nothing else, is what the pacing can see: a
round that drafted and accepted nothing delivers one token, as plain decoding does. speclab's responses
carry each request's own counters (rounds, drafted, accepted: every round counts, k = 0 included), so
there it is exact. vLLM reports only ``/metrics`` counters, where ``drafts`` counts the rounds that
drafted; rounds that did not draft (a batch-size table choosing k = 0, n-gram lookup finding no match)
emit one token each, so they number about generation tokens - requests (the prefill tokens) - drafts -
accepted (an estimate: accepted drafts past max_tokens are counted but not emitted).

**The expected call** of a level: bursty when the server accepted at least ``SPEC_ON`` (0.25) drafts per
row-round (20% of the token gaps near zero), smooth below ``SPEC_OFF`` (0.03; 3%), either in between
(the fingerprint's line is at 8%, about 0.09 per round). Plain servers must read smooth and fixed-k
servers bursty at every level whatever they accepted; adaptive and n-gram servers as they behaved.

**The checks** (each a list of rows with ``ok``):

* ``requests``: every request of every cell completed, in every repetition (a failed request is listed with
  its reason: an engine that failed under some load shows here, not only as a low throughput);
* ``pacing``: every cell's call is the expected one ("late" counts as smooth; "unknown" fails);
* ``verdict``: per server and workload, the verdict over the levels (``speclab.load.fingerprint``) is
  the one the expected calls give: plain -> plain, fixed k -> speculative, adaptive -> whatever its
  levels say (adaptive when it switched off as load rose; a level in the ambiguous band may go either
  way, so any verdict those choices allow is accepted);
* ``throughput``: each adaptive server's output tokens/s at each level >= ``THROUGHPUT_TARGET`` (0.95)
  x the better of plain and fixed k on the same engine and workload (the target); with the A/A
  control (a second plain server in the rotation, :func:`control_rows`), each row also carries how far two
  identical servers read apart in that cell;
* ``acceptance``: the scraped ``/metrics`` window equals the engine's own counters: for speclab the sums
  of the per-request figures in the responses (accepted and drafted tokens, exact); for vLLM the sums of
  its engine log lines (``SpecDecoding metrics: ... Accepted: N tokens, Drafted: M tokens``) against the
  counters since start, and per-position accepted tokens adding up to the accepted total.
"""

from __future__ import annotations

import itertools
import re
import statistics

from speclab.load.fingerprint import verdict_of_calls

SPEC_ON = 0.25
SPEC_OFF = 0.03
THROUGHPUT_TARGET = 0.95
NOMINAL = {"plain": "smooth", "fixed": "bursty"}  # roles whose every level has a fixed expectation
VERDICT_OF_ROLE = {"plain": "plain", "fixed": "speculative"}


def inside_speclab(requests: list[dict]) -> dict | None:
    """What a speclab server did over a level, from the per-request ``speculation`` objects of its
    successful responses: rounds, drafted and accepted tokens, accepted per round. None without them."""
    spec = [r["speculation"] for r in requests if r.get("ok") and r.get("speculation")]
    if not spec:
        return None
    rounds = sum(s["rounds"] for s in spec)
    drafted = sum(s["drafted_tokens"] for s in spec)
    accepted = sum(s["accepted_tokens"] for s in spec)
    return {"rounds": rounds, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "accepted_per_round": accepted / rounds if rounds else None,
            "draft_tokens_per_round": drafted / rounds if rounds else None,
            "source": "per-request counters"}


def inside_metrics(server: dict | None, completed: int) -> dict | None:
    """What a vLLM-style server did over a level, estimated from its ``/metrics`` window: row-rounds =
    drafts + the rounds that drafted nothing (each emitted one token: generation tokens - requests -
    drafts - accepted, at least 0). A server without spec-decode counters did not speculate."""
    if not server or server.get("generation_tokens") is None:
        return None
    gen = server["generation_tokens"]
    sd = server.get("spec_decode")
    if sd is None:
        rounds = max(0.0, gen - completed)
        return {"rounds": rounds, "drafted_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_round": 0.0,
                "draft_tokens_per_round": 0.0, "spec_on_share": 0.0, "source": "/metrics (no spec-decode counters)"}
    drafts, acc = sd["drafts"], sd["accepted_tokens"]
    rounds = drafts + max(0.0, gen - completed - drafts - acc)
    return {"rounds": rounds, "drafted_tokens": sd["draft_tokens"], "accepted_tokens": acc,
            "accepted_per_round": acc / rounds if rounds else None,
            "draft_tokens_per_round": sd["draft_tokens"] / rounds if rounds else None,
            "spec_on_share": drafts / rounds if rounds else None, "source": "/metrics estimate"}


def expected_from_inside(accepted_per_round: float | None) -> str | None:
    """The call a level's pacing should get from what the server did: "bursty", "smooth", or None (the
    ambiguous band, or nothing known)."""
    if accepted_per_round is None:
        return None
    if accepted_per_round >= SPEC_ON:
        return "bursty"
    if accepted_per_round < SPEC_OFF:
        return "smooth"
    return None


def did_letter(accepted_per_round: float | None) -> str:
    """B (speculated visibly), S (did not), ~ (in between), ? (unknown): for the tables."""
    e = expected_from_inside(accepted_per_round)
    if accepted_per_round is None:
        return "?"
    return {"bursty": "B", "smooth": "S"}.get(e, "~")


def normal_call(call: str) -> str:
    return "smooth" if call == "late" else call


def expected_call(cell: dict) -> str | None:
    """The call a cell must get: nominal for plain and fixed-k servers, what the server did otherwise."""
    if cell["role"] in NOMINAL:
        return NOMINAL[cell["role"]]
    return expected_from_inside((cell.get("inside") or {}).get("accepted_per_round"))


def requests_check(cell: dict) -> dict:
    """Every request of the cell completed, in every repetition (``failed_reps``; the kept one's ``failed`` in a
    cell without repetitions), with the failures by kind and examples of their reasons as the load summaries give
    them (:func:`~.serve_experiment.median_cell`)."""
    failed = sum(cell.get("failed_reps") or [cell.get("failed") or 0])
    return {"server": cell["server"], "workload": cell["workload"], "concurrency": cell["concurrency"],
            "failed": failed, "failures": cell.get("failures") or {},
            "failure_examples": cell.get("failure_examples") or [], "ok": failed == 0}


def pacing_check(cell: dict) -> dict:
    exp = expected_call(cell)
    call = normal_call(cell["call"])
    ok = call in ("bursty", "smooth") and (exp is None or call == exp)
    return {"server": cell["server"], "workload": cell["workload"], "concurrency": cell["concurrency"],
            "call": cell["call"], "expected": exp or "bursty or smooth", "ok": ok}


def allowed_verdicts(role: str, expected_calls: list[str | None]) -> set[str]:
    """Verdicts consistent with a server's role and its levels' expected calls (by rising load): fixed
    for plain and fixed-k servers; for the others every verdict that some choice of the ambiguous levels
    (None) gives. e.g. [bursty, None, smooth] -> {adaptive}; [bursty, None] -> {speculative, adaptive}."""
    if role in VERDICT_OF_ROLE:
        return {VERDICT_OF_ROLE[role]}
    free = [i for i, c in enumerate(expected_calls) if c is None]
    out = set()
    for combo in itertools.product(("bursty", "smooth"), repeat=len(free)):
        calls = list(expected_calls)
        for i, c in zip(free, combo):
            calls[i] = c
        out.add(verdict_of_calls(calls))
    return out


def verdict_check(role: str, cells: list[dict], verdict: str) -> dict:
    """One server on one workload: its verdict against the allowed ones (cells in any order)."""
    cells = sorted(cells, key=lambda c: c["concurrency"])
    exp = [expected_call(c) for c in cells]
    allowed = allowed_verdicts(role, exp)
    did = "".join(did_letter((c.get("inside") or {}).get("accepted_per_round")) for c in cells)
    return {"server": cells[0]["server"], "workload": cells[0]["workload"], "split": cells[0].get("split", False),
            "levels": [c["concurrency"] for c in cells], "calls": [c["call"] for c in cells], "did": did,
            "verdict": verdict, "allowed": sorted(allowed), "ok": verdict in allowed}


def throughput_checks(cells: list[dict], plain: str, fixed: str, target: float = THROUGHPUT_TARGET) -> list[dict]:
    """Each adaptive server's tokens/s against the better of ``plain`` and ``fixed`` (server names) at the
    same workload and level (split-token runs are not timed against anything). A cell's ``tok_s`` is its
    throughput over every repetition; with repetitions, ``rep_ratios`` adds the same ratio repetition by
    repetition (each repetition ran every server in one turn) and ``rep_ratio_median`` their median, as
    evidence of how far the machine's drift moves the pooled ratio."""
    by = {(c["server"], c["workload"], c["concurrency"]): c for c in cells if not c.get("split")}
    out = []
    for c in cells:
        if c["role"] != "adaptive" or c.get("split"):
            continue
        p, f = by.get((plain, c["workload"], c["concurrency"])), by.get((fixed, c["workload"], c["concurrency"]))
        refs = [x["tok_s"] for x in (p, f) if x and x.get("tok_s")]
        if not refs or c.get("tok_s") is None:
            continue
        best = max(refs)
        ratio = c["tok_s"] / best
        paired = rep_ratios(c.get("tok_s_reps"), [x.get("tok_s_reps") for x in (p, f) if x])
        out.append({"server": c["server"], "workload": c["workload"], "concurrency": c["concurrency"],
                    "tok_s": c["tok_s"], "plain_tok_s": p and p.get("tok_s"), "fixed_tok_s": f and f.get("tok_s"),
                    "ratio_to_best": ratio, "ok": ratio >= target, "rep_ratios": paired,
                    "rep_ratio_median": statistics.median_low(paired) if paired else None})
    return out


def rep_ratios(own: list | None, refs: list) -> list[float]:
    """Repetition by repetition, ``own`` tokens/s over the best of the references' in the same repetition
    (repetitions missing a number are left out; fewer than two repetitions: []).
    e.g. own [90, 110], refs [[100, 100], [80, 120]] -> [0.9, 0.9167]."""
    if not own or len(own) < 2:
        return []
    out = []
    for i, t in enumerate(own):
        best = max((r[i] for r in refs if r and i < len(r) and r[i]), default=None)
        if t is not None and best:
            out.append(t / best)
    return out


def control_rows(cells: list[dict], plain: str, control: str) -> list[dict]:
    """The A/A control: per workload and level, a second plain server (``control``, the same configuration as
    ``plain``, in the same rotation) over ``plain``: pooled and repetition by repetition. Identical servers read
    1.0 on a quiet machine; how far they read apart is how finely the throughput check can tell servers apart
    in this run. [] without control cells."""
    by = {(c["server"], c["workload"], c["concurrency"]): c for c in cells if not c.get("split")}
    out = []
    for (server, wl, conc), c in by.items():
        p = by.get((plain, wl, conc))
        if server != control or p is None or not p.get("tok_s") or c.get("tok_s") is None:
            continue
        paired = rep_ratios(c.get("tok_s_reps"), [p.get("tok_s_reps")])
        out.append({"workload": wl, "concurrency": conc, "ratio": c["tok_s"] / p["tok_s"], "rep_ratios": paired,
                    "rep_ratio_median": statistics.median_low(paired) if paired else None})
    return out


def attach_control(throughput: list[dict], control: list[dict]) -> None:
    """Give each throughput check row its cell's control ratio (``control_ratio``: the A/A control's plain
    over plain at the same workload and level; None without one)."""
    by = {(r["workload"], r["concurrency"]): r["ratio"] for r in control}
    for r in throughput:
        r["control_ratio"] = by.get((r["workload"], r["concurrency"]))


def speclab_acceptance_check(cell: dict) -> dict | None:
    """The ``/metrics`` window against the sums of the per-request counters (speclab): equal exactly."""
    sd = (cell.get("server_metrics") or {}).get("spec_decode")
    eng = cell.get("engine_counters")
    if eng is None:
        return None
    base = {"server": cell["server"], "workload": cell["workload"], "concurrency": cell["concurrency"],
            "engine_accepted": eng["accepted_tokens"], "engine_drafted": eng["drafted_tokens"]}
    if sd is None:  # no spec-decode counters: the engine must not have drafted either
        return dict(base, scraped_accepted=None, scraped_drafted=None, ok=eng["drafted_tokens"] == 0)
    ok = (sd["accepted_tokens"] == eng["accepted_tokens"] and sd["draft_tokens"] == eng["drafted_tokens"]
          and sum(sd["accepted_per_position"]) == sd["accepted_tokens"])
    rate = eng["accepted_tokens"] / eng["drafted_tokens"] if eng["drafted_tokens"] else None
    return dict(base, scraped_accepted=sd["accepted_tokens"], scraped_drafted=sd["draft_tokens"],
                scraped_rate=sd["acceptance_rate"], engine_rate=rate, ok=ok)


LOG_LINE = re.compile(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+), .*?Accepted: (\d+) tokens, "
                      r"Drafted: (\d+) tokens, Per-position acceptance rate: ([\d., ]+?), Avg")


def parse_engine_log(text: str) -> dict:
    """Sum vLLM's periodic spec-decode log lines (the engine's own aggregation, logged every
    VLLM_LOG_STATS_INTERVAL seconds and reset): accepted and drafted tokens, and the lines' count."""
    acc = dr = n = 0
    for m in LOG_LINE.finditer(text):
        acc += int(m.group(2))
        dr += int(m.group(3))
        n += 1
    return {"lines": n, "accepted_tokens": acc, "draft_tokens": dr}


def vllm_acceptance_check(server: str, since_start: dict, log: dict) -> dict:
    """vLLM's counters since start (a ``/metrics`` window from nothing) against its engine log's sums."""
    sd = since_start.get("spec_decode")
    if sd is None:
        return {"server": server, "scraped_accepted": None, "scraped_drafted": None,
                "engine_log_accepted": log["accepted_tokens"], "engine_log_drafted": log["draft_tokens"],
                "log_lines": log["lines"], "ok": log["draft_tokens"] == 0}
    ok = (sd["accepted_tokens"] == log["accepted_tokens"] and sd["draft_tokens"] == log["draft_tokens"]
          and sum(sd["accepted_per_position"]) == sd["accepted_tokens"] and log["lines"] > 0)
    return {"server": server, "scraped_accepted": sd["accepted_tokens"], "scraped_drafted": sd["draft_tokens"],
            "engine_log_accepted": log["accepted_tokens"], "engine_log_drafted": log["draft_tokens"],
            "log_lines": log["lines"], "scraped_rate": sd["acceptance_rate"],
            "scraped_mean_acceptance_length": sd["mean_acceptance_length"], "ok": ok}


def summarize_checks(checks: dict) -> dict:
    """{check name: {"passed", "total", "ok"}} over every row of each check."""
    out = {}
    for name, rows in checks.items():
        passed = sum(1 for r in rows if r["ok"])
        out[name] = {"passed": passed, "total": len(rows), "ok": passed == len(rows)}
    return out
