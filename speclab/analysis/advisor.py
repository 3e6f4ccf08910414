"""The advisor: should this deployment speculate? ``speclab advise`` and :func:`advise`.

Apply the speculation rubric (decode-bound share, acceptance per workload, crossover concurrency vs the
expected one, tokenizer match) to lab results, a load run or typed figures, with step costs measured (from the
result, or timed here) or modelled for a named deployment (``speclab advise what-if``).

The rubric (speculation is a candidate when the path is decode-bound, acceptance is high, concurrency
is low to moderate and draft and target share a tokenizer) applied row by row to numbers, each with
its source: **measured** (a lab run), **scraped** (a server's /metrics or a load run), **assumed**
(typed in, or a default) or **model** (predicted by the cost model). The cost model
(:mod:`.costmodel` over :mod:`.roofline` presets or measured step costs) turns acceptance into a
predicted speedup at every concurrency, so each workload gets a verdict:

* **enable**, with k (or the ``goodput`` policy when traffic may cross the crossover) and the
  concurrency up to which it pays, the predicted TPOT and throughput change, and the matching
  ``speclab serve``, vLLM and SGLang flags; or
* **do not enable**, with the reason: tokenizer mismatch, prefill-bound, low acceptance, saturated.

It also says what the rubric does not cover: prefill-bound requests (speculation does nothing for
TTFT) and queueing under saturation (the fix is capacity or admission, not speculation).

Inputs, readable by :func:`read_inputs` (see docs/advisor.md for the fields each reader uses):
``speclab bench acceptance|compare|serve|policies|heads``, a sweep (CSV or JSON), a ``speclab load --json``
result, ``python benchmarks/cpucheck.py``; or typed figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ..errors import SpeclabError
from .costmodel import (
    MeasuredCosts,
    alpha_from_mean_length,
    batch_table,
    best_k_for_batch,
    predict,
    predicted_crossover,
)

# Thresholds of the rubric (docs/advisor.md explains each).
MIN_DECODE_SHARE = 0.5  # decode must be at least half of a request's time, else it is prefill-bound
MIN_GAIN = 1.10  # a predicted speedup below 1.1x is within the model's error: not worth enabling
GOODPUT_MARGIN = 4  # crossover within 4x the expected concurrency: a load swing can cross it
DEFAULT_OUTPUT_TOKENS = 256
DEFAULT_PROMPT_TOKENS = 512
MAX_TABLE_BATCH = 256

NOT_COVERED = (
    "Prefill-bound requests: speculation only shortens the decode phase; it does nothing for time to first token. "
    "When TTFT dominates, look at prefix caching, chunked prefill, shorter prompts or a faster prefill instead.",
    "Queueing under saturation: when requests wait for a slot, TTFT and end-to-end latency grow with the queue. "
    "Speculation only changes the cost of the rows already running (and past the crossover makes each step "
    "dearer). The fix is capacity (more replicas, a larger batch budget) or admission control (max-num-seqs, "
    "rate limits), not speculation.",
)


# ---------------------------------------------------------------------------------------------- data


@dataclass
class Workload:
    """Acceptance of one workload: a per-token rate ``alpha``, per-position acceptance (r_1, r_2, ...:
    the survival curve the engine and vLLM report), or a mean accepted length measured at ``k``."""

    name: str
    alpha: float | None = None
    per_position: list[float] | None = None
    mean_length: float | None = None
    k: int | None = None  # the k the mean length / rate was measured at
    source: str = "assumed"
    measured_crossover: int | None = None  # batch where a measured sweep stopped paying
    crossover_measured: bool = False  # whether measured_crossover was measured (None then = never stopped)

    def acceptance(self):
        """What the cost model reads: the per-position curve, else alpha (from the mean length if need be)."""
        if self.per_position:
            return list(self.per_position)
        if self.alpha is not None:
            return self.alpha
        if self.mean_length is not None and self.k:
            return alpha_from_mean_length(min(max(self.mean_length, 1.0), self.k + 1), self.k)
        raise SpeclabError(f"workload '{self.name}' has no acceptance figure")

    def rate(self) -> float:
        """The per-token rate shown in the rubric (for a curve: the first position)."""
        acc = self.acceptance()
        return acc[0] if isinstance(acc, list) else acc


@dataclass
class Inputs:
    """Everything advise() reads about the traffic, each figure with its source."""

    workloads: list[Workload] = field(default_factory=list)
    ttft_ms: float | None = None
    ttft_source: str = "assumed"
    tpot_ms: float | None = None  # plain decoding's TPOT (None: predicted by the model)
    tpot_source: str = "assumed"
    tpot_is_plain: bool = True  # False when it was measured with speculation on (then not used to calibrate)
    output_tokens: float | None = None
    output_source: str = "assumed"
    prompt_tokens: float | None = None
    concurrency: int | None = None
    concurrency_source: str = "assumed"
    tokenizer_match: bool | None = None
    tokenizer_source: str = "assumed"
    queueing: str | None = None  # evidence of queueing under load (a load run's TTFT growth)
    costs: MeasuredCosts | None = None  # step costs measured by a lab run
    draft: str | None = None  # the draft the figures were measured with
    target: str | None = None  # the target they were measured on
    notes: list[str] = field(default_factory=list)


@dataclass
class Deployment:
    """Where the advice applies: step costs (a roofline or measured) and how to name the draft."""

    costs: object  # RooflineCosts or MeasuredCosts: target_time(rows, tokens), draft_time(rows)
    description: str
    source: str  # "model" (roofline of a preset) or "measured"
    k_max: int = 8
    target_name: str = "TARGET"
    draft_name: str = "DRAFT"
    method: str = "draft_model"  # draft_model | ngram | eagle | eagle3 (for the engine flags)


@dataclass
class RubricRow:
    criterion: str
    workload: str  # a workload name, or "all"
    value: str
    number: float | None
    threshold: str
    ok: bool | None  # None: informational
    source: str


@dataclass
class Verdict:
    workload: str
    enable: bool
    reason: str  # why not ("" when enabled)
    k: int
    policy: str  # "fixed" | "goodput" | "off"
    pays_up_to: int | None  # the largest concurrency at which it still pays (None: beyond the range checked)
    crossover: int | None  # predicted batch where it stops paying (None: not within the range checked)
    speedup_at_1: float
    speedup: float  # predicted at the expected concurrency (with the best k there, or k=best at 1 if none)
    plain_tpot_ms: float
    tpot_ms: float  # predicted with speculation (the k above; = plain when not enabled)
    throughput_change: float  # tokens/s with / without - 1 at the expected concurrency
    flags: dict[str, str] = field(default_factory=dict)
    explanation: str = ""


@dataclass
class Advice:
    rubric: list[RubricRow]
    verdicts: list[Verdict]
    notes: list[str]
    not_covered: list[str]
    deployment: dict
    concurrency: int
    curves: dict[str, list[dict]] = field(default_factory=dict)  # workload -> speedup vs batch rows

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        return format_advice(self)


# ---------------------------------------------------------------------------------------------- the rubric


def _ok(b: bool) -> str:
    return "pass" if b else "FAIL"


def break_even_alpha(costs, rows: int, k_max: int, gain: float = MIN_GAIN) -> float | None:
    """The smallest i.i.d. acceptance rate at which the best k gives ``gain`` at ``rows`` rows (None:
    not even a perfect draft does)."""
    if best_k_for_batch(costs, 1.0, rows, k_max)[1] < gain:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if best_k_for_batch(costs, mid, rows, k_max)[1] >= gain:
            hi = mid
        else:
            lo = mid
    return hi


def _bound_row(dep: Deployment, C: int, k: int) -> RubricRow | None:
    """How far the verify forward's matmuls at concurrency C are from compute-bound (roofline only)."""
    from .roofline import RooflineCosts, forward_terms

    if not isinstance(dep.costs, RooflineCosts) or k == 0:
        return None
    c = dep.costs
    t = forward_terms(c.hw, c.target, C, k + 1, c.context, overhead_s=0.0)
    ratio = t["compute_over_memory"]
    return RubricRow("decode path memory-bound (verify of k+1 tokens at the expected concurrency)", "all",
                     f"weight matmuls {t['weights_bound']}-bound: arithmetic {ratio:.0%} of the weight-read time "
                     f"({C} rows x {k + 1} tokens); attention {t['attention_bound']}-bound", ratio,
                     "arithmetic < weight reads", ratio < 1.0, "model")


def _flags(dep: Deployment, k: int, policy: str, table: list[tuple[int, int, int]]) -> dict[str, str]:
    """The equivalent settings of speclab serve, vLLM and SGLang for a verdict."""
    if k == 0:
        return {"speclab": f"speclab serve --model {dep.target_name} --speculative-config none",
                "vllm": f"vllm serve {dep.target_name}  # no --speculative-config",
                "sglang": f"python -m sglang.launch_server --model-path {dep.target_name}  # no speculative flags"}
    method = dep.method
    spec = {"method": method, "num_speculative_tokens": k}
    if method != "ngram":
        spec = {"method": method, "model": dep.draft_name, "num_speculative_tokens": k}
    speclab_policy = "goodput" if policy == "goodput" else "fixed"
    speclab = (f"speclab serve --model {dep.target_name} --speculative-config '{json.dumps(spec)}' "
               f"--spec-policy {speclab_policy}")
    vspec = dict(spec)
    k_top = max(kk for _, _, kk in table) if table else k
    vspec["num_speculative_tokens"] = max(k_top, 1)
    if table and any(kk != k for _, _, kk in table):
        vspec["num_speculative_tokens_per_batch_size"] = [list(r) for r in table]
    vllm = f"vllm serve {dep.target_name} --speculative-config '{json.dumps(vspec)}'"
    algo = {"draft_model": "STANDALONE", "ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3"}[method]
    sg = f"python -m sglang.launch_server --model-path {dep.target_name} --speculative-algorithm {algo}"
    if method != "ngram":
        sg += f" --speculative-draft-model-path {dep.draft_name}"
    sg += f" --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    return {"speclab": speclab, "vllm": vllm, "sglang": sg + "  # no per-batch-size table: speculates at every load"}


def advise(inputs: Inputs, dep: Deployment, concurrency: int | None = None) -> Advice:
    """Apply the rubric to ``inputs`` on deployment ``dep`` at the expected ``concurrency`` (default:
    the inputs' own, else 1). Pure: no models are run."""
    if not inputs.workloads:
        raise SpeclabError("no workload acceptance to judge: give --acceptance NAME:RATE or a lab/load result file")
    C = int(concurrency or inputs.concurrency or 1)
    if C < 1:
        raise SpeclabError(f"the expected concurrency must be at least 1, got {C}")
    c_src = "assumed" if concurrency else (inputs.concurrency_source if inputs.concurrency else "assumed")
    costs, kmax = dep.costs, dep.k_max
    rubric: list[RubricRow] = []
    notes = list(inputs.notes)

    # --- decode share of request time (TTFT vs decode)
    plain_step_C = predict(costs, 0.0, 0, C)["plain_tpot_s"] * 1e3
    tpot, tpot_src = (inputs.tpot_ms, inputs.tpot_source) if inputs.tpot_ms is not None else (plain_step_C, "model")
    n_out, out_src = ((inputs.output_tokens, inputs.output_source) if inputs.output_tokens is not None
                      else (DEFAULT_OUTPUT_TOKENS, "assumed"))
    if inputs.ttft_ms is not None:
        ttft, ttft_src = inputs.ttft_ms, inputs.ttft_source
    else:
        n_in = inputs.prompt_tokens or DEFAULT_PROMPT_TOKENS
        ttft = _prefill_ms(costs, n_in)
        ttft_src = "model"
    decode_ms = max(n_out - 1, 0) * tpot
    share = decode_ms / (ttft + decode_ms) if ttft + decode_ms > 0 else 0.0
    prefill_bound = share < MIN_DECODE_SHARE
    rubric.append(RubricRow("decode-bound share of request time", "all",
                            f"{share:.0%} decode: TTFT {ttft:.1f} ms ({ttft_src}) vs {n_out:.0f} tokens ({out_src}) x "
                            f"TPOT {tpot:.2f} ms ({tpot_src})", share, f">= {MIN_DECODE_SHARE:.0%}",
                            not prefill_bound, _weakest(ttft_src, tpot_src, out_src)))

    # --- tokenizer
    tok = inputs.tokenizer_match
    rubric.append(RubricRow("draft and target share a tokenizer", "all",
                            {True: "yes", False: "no", None: "not checked (assumed yes)"}[tok],
                            None, "same token ids", tok is not False, inputs.tokenizer_source))

    # --- how the verify forward stands at the expected concurrency (roofline deployments)
    first = inputs.workloads[0].acceptance()
    row = _bound_row(dep, C, best_k_for_batch(costs, first, C, kmax)[0] or best_k_for_batch(costs, first, 1, kmax)[0])
    if row is not None:
        rubric.append(row)
    cap = costs.max_batch(kmax) if hasattr(costs, "max_batch") else None
    measured_rows = costs.max_rows if isinstance(costs, MeasuredCosts) else None
    search = min(4096, cap) if cap else (max(measured_rows, C) if measured_rows else 4096)
    if cap is not None and C > cap:
        notes.append(f"concurrency {C} does not fit: the KV caches of {cap} rows at this context fill the device "
                     f"memory (less in practice: activations and reserves)")
    if measured_rows is not None and C > measured_rows:
        notes.append(f"step costs were measured up to {measured_rows} rows; concurrency {C} is extrapolated from them "
                     f"(a sweep over more batches, or benchmarks/cpucheck.py --batches, measures further)")

    be = break_even_alpha(costs, 1, kmax)  # the same costs for every workload
    verdicts, curves = [], {}
    for w in inputs.workloads:
        acc = w.acceptance()
        k1, s1 = best_k_for_batch(costs, acc, 1, kmax)
        kC, sC = best_k_for_batch(costs, acc, C, kmax)
        cross = predicted_crossover(costs, acc, kmax, max_batch=max(search, 1))
        mean_len = (w.mean_length if w.mean_length is not None and w.k is not None
                    else None)
        acc_txt = f"{w.rate():.2f} per token" + (f", mean accepted length {mean_len:.2f} at k={w.k}" if mean_len
                                                  else "")
        if w.per_position:
            acc_txt += " (per position: " + ", ".join(f"{x:.2f}" for x in w.per_position[:8]) + ")"
        rubric.append(RubricRow("acceptance", w.name, acc_txt + f"; best k={k1} gives {s1:.2f}x at concurrency 1",
                                w.rate(), f">= {be:.2f} for {MIN_GAIN:.2f}x at concurrency 1" if be is not None
                                else "no acceptance pays on these costs", s1 >= MIN_GAIN, w.source))
        cross_txt = f"{cross}" if cross is not None else (
            f"never up to the memory limit ({cap} rows)" if cap else
            f"never up to {search} rows (the largest measured)" if measured_rows else "never within 4096 rows")
        if w.crossover_measured:
            cross_txt += (f"; measured: {w.measured_crossover}" if w.measured_crossover is not None
                          else "; measured: pays at every batch size run")
        rubric.append(RubricRow("crossover concurrency vs expected", w.name,
                                f"speculation stops paying at {cross_txt}; expected concurrency {C} ({c_src})",
                                float(cross) if cross is not None else None, f"expected {C} < crossover",
                                cross is None or C < cross, "model" if not w.crossover_measured else "measured"))

        # --- the verdict
        k_use = kC if kC > 0 else k1
        pC = predict(costs, acc, k_use, C) if k_use else predict(costs, acc, 0, C)
        ratio = pC["speedup"]
        if tok is False:
            reason, why = "tokenizer mismatch", ("draft and target do not share token ids: the target would reject "
                                                 "what it cannot read; pick a draft with the target's tokenizer")
        elif prefill_bound:
            amdahl = 1 / ((1 - share) + share / max(s1, 1e-9))
            reason, why = "prefill-bound", (f"decode is {share:.0%} of a request: even the best-case {s1:.2f}x on "
                                            f"decode shortens a request by {1 - 1 / amdahl:.0%} at most")
        elif s1 < MIN_GAIN:
            reason, why = "low acceptance", (f"acceptance {w.rate():.2f} gives at most {s1:.2f}x even at concurrency "
                                             f"1" + (f"; it needs about {be:.2f} per token" if be is not None else ""))
        elif kC == 0 or sC < MIN_GAIN:
            reason, why = "saturated", (f"at concurrency {C} the verify forward is no longer nearly free: the best "
                                        f"is {sC:.2f}x (under {MIN_GAIN:.2f}x); speculation stops paying at "
                                        f"{cross_txt}")
        else:
            reason, why = "", ""
        enable = reason == ""
        # beyond the last range vLLM carries its k forward; measured costs are not extrapolated for it
        table = batch_table(costs, acc, kmax, max_batch=search if measured_rows else max(MAX_TABLE_BATCH, 2 * C))
        if enable:
            policy = "goodput" if cross is not None and cross <= GOODPUT_MARGIN * C else "fixed"
            upto = cross - 1 if cross is not None else ("the memory limit" if cap else
                                                        f"{search} rows at least" if measured_rows else
                                                        "every concurrency checked")
            why = f"predicted {sC:.2f}x at concurrency {C} with k={kC}; pays up to {upto}"
            if policy == "goodput":
                why += f" (traffic may cross the crossover at {cross}: a policy that switches itself off)"
        else:
            policy = "off"
        k_out = kC if enable else 0
        plain_tpot = tpot if inputs.tpot_ms is not None and inputs.tpot_is_plain else pC["plain_tpot_s"] * 1e3
        spec_ratio = ratio if enable else 1.0
        verdicts.append(Verdict(
            w.name, enable, reason, k_out, policy, (cross - 1) if cross is not None else None, cross, s1,
            ratio, plain_tpot, plain_tpot / spec_ratio, spec_ratio - 1,
            _flags(dep, k_out, policy, table if enable else []), why))
        grid = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, C})
        curves[w.name] = [{"batch": b, "best_k": kb, "speedup": sb}
                          for b in grid for kb, sb in [best_k_for_batch(costs, acc, b, kmax)]]

    if inputs.queueing:
        notes.append(f"queueing: {inputs.queueing}. That is the second case below: capacity or admission.")
    notes.append("low-entropy output (structured data, code, summaries) shows up as acceptance: the acceptance "
                 "rows carry that criterion")
    return Advice(rubric, verdicts, notes, list(NOT_COVERED), {"description": dep.description, "source": dep.source,
                                                               "k_max": kmax, "method": dep.method}, C, curves)


_RANK = {"measured": 0, "scraped": 1, "model": 2, "assumed": 3}


def _weakest(*sources: str) -> str:
    return max(sources, key=lambda s: _RANK.get(s, 3))


def _prefill_ms(costs, prompt_tokens: float) -> float:
    """Predicted TTFT: one forward over the prompt (batch 1)."""
    return costs.target_time(1, max(1, int(prompt_tokens))) * 1e3


# ---------------------------------------------------------------------------------------------- text


def format_advice(a: Advice) -> str:
    L = [f"deployment: {a.deployment['description']}  (step costs: {a.deployment['source']}); expected concurrency "
         f"{a.concurrency}", "", "rubric:"]
    for r in a.rubric:
        mark = "info" if r.ok is None else _ok(r.ok)
        L.append(f"  [{mark:<4}] {r.criterion} ({r.workload}): {r.value}  [threshold {r.threshold}; {r.source}]")
    L.append("")
    L.append("verdicts:")
    for v in a.verdicts:
        if v.enable:
            L.append(f"  {v.workload}: ENABLE, k={v.k}" + (", policy goodput" if v.policy == "goodput" else "") +
                     f": TPOT {v.plain_tpot_ms:.2f} -> {v.tpot_ms:.2f} ms, throughput {v.throughput_change:+.0%} at "
                     f"concurrency {a.concurrency}. {v.explanation}")
        else:
            L.append(f"  {v.workload}: DO NOT ENABLE ({v.reason}): {v.explanation} (TPOT stays {v.plain_tpot_ms:.2f} "
                     f"ms; with speculation the model predicts {v.speedup:.2f}x)")
        for eng, flag in v.flags.items():
            L.append(f"      {eng:<8} {flag}")
    L.append("")
    L += [f"note: {n}" for n in a.notes]
    L.append("not covered by the rubric:")
    L += [f"  - {n}" for n in a.not_covered]
    return "\n".join(L)


# ---------------------------------------------------------------------------------------------- deployment


def make_deployment(hardware_name: str | None = None, *, inputs: Inputs | None = None, target_model=None,
                    target_params: float | None = None, bytes_per_param: float = 2.0, layers: int = 0, hidden: int = 0,
                    kv_heads: int = 0, head_dim: int = 0, draft_model=None, draft_params: float | None = None,
                    draft_layers: int = 0, draft_hidden: int = 0, draft_kv_heads: int = 0, draft_head_dim: int = 0,
                    draft_cost: float | None = None, context: int = 1024, overhead_ms: float | None = None,
                    draft_overhead_ms: float | None = None, k_max: int = 8, target_name: str | None = None,
                    draft_name: str | None = None, method: str | None = None,
                    concurrency: int | None = None) -> Deployment:
    """A deployment for :func:`advise`: a hardware preset with model shapes (named, or parameter counts
    and layer sizes), or, with ``hardware_name=None``, the step costs measured in ``inputs``. With a
    plain TPOT in ``inputs`` and no ``overhead_ms``, the per-forward overhead is fitted to it."""
    from .roofline import ModelShape, RooflineCosts, fit_overhead, hardware, shape

    inp = inputs or Inputs()
    draft_name = draft_name or inp.draft or "DRAFT"
    method = method or ("ngram" if draft_name == "ngram" else "draft_model")
    target_name = target_name or inp.target or "TARGET"
    if hardware_name is None:
        if inp.costs is None:
            raise SpeclabError("give --hardware (a preset) or a lab result with measured step costs (--from)")
        return Deployment(inp.costs, f"{inp.costs.source}: {target_name} with draft {draft_name}", "measured",
                          k_max, target_name, draft_name, method)
    if target_model:
        tshape = shape(target_model)
    elif target_params:
        tshape = ModelShape(target_name, target_params, bytes_per_param, layers, hidden, kv_heads, head_dim)
    else:
        raise SpeclabError("give the target: --target-model NAME or --target-params N (with --layers, --hidden, "
                           "--kv-heads, --head-dim for the KV cache)")
    dshape, dcost = None, 0.0
    if draft_model:
        dshape = shape(draft_model)
    elif draft_params:
        dshape = ModelShape(draft_name, draft_params, bytes_per_param, draft_layers, draft_hidden or hidden,
                            draft_kv_heads or kv_heads, draft_head_dim or head_dim)
    elif draft_cost is not None:
        if not (draft_cost >= 0 and math.isfinite(draft_cost)):
            raise SpeclabError(f"--draft-cost must be >= 0, got {draft_cost!r}")
        dcost = draft_cost
    else:
        raise SpeclabError("give the draft: --draft-model NAME, --draft-params N, or --draft-cost C (its step as a "
                           "fraction of the target's; 0 for prompt lookup)")
    over = overhead_ms / 1e3 if overhead_ms is not None else None
    hw = hardware(hardware_name, overhead_s=over)
    note = "vendor peaks, no per-step overhead (an ideal engine: an upper bound on the speedup)"
    C = concurrency or inp.concurrency or 1
    if over is None and inp.tpot_ms is not None and inp.tpot_is_plain:
        fitted = fit_overhead(hw, tshape, inp.tpot_ms / 1e3, rows=C, context=context)
        hw = hardware(hw, overhead_s=fitted)
        note = (f"per-forward overhead {fitted * 1e3:.2f} ms fitted to the plain TPOT {inp.tpot_ms:.2f} ms "
                f"({inp.tpot_source}), paid by draft steps too (conservative)")
    elif over is not None:
        note = f"per-forward overhead {over * 1e3:.2f} ms (given)"
    d_over = draft_overhead_ms / 1e3 if draft_overhead_ms is not None else None
    if d_over is not None and not (d_over >= 0 and math.isfinite(d_over)):
        raise SpeclabError(f"--draft-overhead-ms must be >= 0, got {draft_overhead_ms!r}")
    costs = RooflineCosts(hw, tshape, dshape, draft_cost=dcost, context=context, draft_overhead_s=d_over)
    dname = dshape.name if dshape is not None else f"draft at {dcost:g}x the target step"
    desc = f"{hw.name}: {tshape.name} with {dname}, context {context}; {note}"
    return Deployment(costs, desc, "model", k_max, target_name, draft_name, method)

