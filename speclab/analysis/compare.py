"""``speclab bench compare``: speclab against Hugging Face side by side, and against its own limit.

Same target/draft pair, same prompts per workload, greedy, same max_new_tokens, batch 1; runs
interleaved (A B C ... A B C ...) after a warm-up; medians reported. Methods:

  (a) hf-plain       Hugging Face ``generate``
  (b) hf-assisted    HF assisted generation with the same draft (constant schedule of k tokens,
                     confidence threshold 0: a fixed-k comparison)
  (c) hf-pld         HF prompt lookup decoding (k tokens)
  (d) speclab-plain  speclab, k = 0
  (e) speclab-draft  speclab with the draft model
  (f) speclab-ngram  speclab prompt lookup
  (e+) speclab-draft with events on (a recorder subscribed): the cost of instrumentation

Every output is checked token-identical to (a). Also: the zero-overhead limit from measured step
costs, Leviathan et al.'s formula, a batch sweep with the crossover batch, and events on vs off.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import torch

from ..engine import SpeculativeDecoder, sync
from ..limits import parse_numbers
from ..tables import num
from .costmodel import step_costs

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PeakRSS:
    """Peak resident memory (MB) above the level at start, sampled every millisecond. On CUDA the
    allocator's own peak is used instead."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0.0

    @staticmethod
    def rss() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        self.base = self.rss()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, self.rss() - self.base)
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = max(self.peak, (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20)
        else:
            self._stop = True
            self._t.join()


class Methods:
    """Each method: prompt token ids -> (generated ids, acceptance or None)."""

    def __init__(self, target, draft_lm, max_new: int):
        from ..drafters import ModelDrafter, PromptLookupDrafter

        self.t, self.d, self.n = target, draft_lm, max_new
        self.eos = target.eos_token_id
        self.plain = SpeculativeDecoder(target, None)
        self.draft = SpeculativeDecoder(target, ModelDrafter(draft_lm, target.vocab_size))
        self.ngram = SpeculativeDecoder(target, PromptLookupDrafter())

    def _hf(self, ids, **kw):
        x = torch.tensor([ids], device=self.t.device)
        out = self.t.hf_model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                       max_new_tokens=self.n, eos_token_id=self.eos, pad_token_id=self.eos, **kw)
        return out[0, len(ids):].tolist(), None

    def hf_plain(self, ids, k):
        return self._hf(ids)

    def hf_assisted(self, ids, k):
        gc = self.d.hf_model.generation_config
        gc.num_assistant_tokens = k
        gc.num_assistant_tokens_schedule = "constant"
        gc.assistant_confidence_threshold = 0.0
        return self._hf(ids, assistant_model=self.d.hf_model)

    def hf_pld(self, ids, k):
        return self._hf(ids, prompt_lookup_num_tokens=k)

    def _sl(self, dec, ids, k, record):
        r = dec.generate([ids], k=k, max_new_tokens=self.n, record=record)
        return r.output_tokens[0], (r.metrics.get("acceptance_rate"), r.metrics.get("mean_accepted_length")) \
            if record else None

    def sl_prefill(self, ids, k):
        """Prefill and the first token only: subtracted from every run to get decode-phase speed."""
        r = self.plain.generate([ids], k=0, max_new_tokens=1, record=False)
        return r.output_tokens[0], None

    def sl_plain(self, ids, k):
        return self._sl(self.plain, ids, 0, False)

    def sl_draft(self, ids, k):
        return self._sl(self.draft, ids, k, False)

    def sl_draft_events(self, ids, k):
        return self._sl(self.draft, ids, k, True)

    def sl_ngram(self, ids, k):
        return self._sl(self.ngram, ids, k, False)

    def sl_ngram_events(self, ids, k):
        return self._sl(self.ngram, ids, k, True)


def leviathan(a: float, k: int, c: float) -> float:
    """Expected speedup of Leviathan et al. (2023): (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    from .costmodel import expected_speedup

    return expected_speedup(min(max(a, 0.0), 1.0), k, c)


COMPACT = dict(workload="json,code", prompts_per_workload=3, ks="2,4", batches="1,4,16", reps=2)
FULL = dict(workload="all", prompts_per_workload=4, ks="2,4,6", batches="1,2,4,8,16,32,64,128", reps=3)


def resolve_grid(args) -> None:
    """Fill the settings the user did not give from the compact default grid (~3 minutes) or --full."""
    grid = FULL if getattr(args, "full", False) else COMPACT
    for key, value in grid.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def run_compare(args) -> int:
    from ..defaults import default_draft, setup_threads
    from ..models import load_model
    from ..workloads import load_workload, workload_names

    resolve_grid(args)
    torch.manual_seed(0)
    target = load_model(args.target, device=args.device, role="target")
    setup_threads(args.threads or 1, target)
    draft_name = args.draft or default_draft()
    draft = load_model(draft_name, device=target.device, dtype=target.dtype, role="draft")
    from ..models import check_same_tokenizer

    check_same_tokenizer(target, draft)
    dev = target.device
    ks = parse_numbers(args.ks, "--k", integer=True, hi=32)
    batches = parse_numbers(args.batches, "--batches", integer=True, hi=16384)
    wl_names = workload_names(args.workload)
    n_prompts = args.prompts_per_workload
    M = Methods(target, draft, args.max_new_tokens)
    plan = [("hf-plain", M.hf_plain, 0), ("speclab-plain", M.sl_plain, 0), ("prefill", M.sl_prefill, 0)]
    for k in ks:
        plan += [("hf-assisted", M.hf_assisted, k), ("hf-pld", M.hf_pld, k), ("speclab-draft", M.sl_draft, k),
                 ("speclab-ngram", M.sl_ngram, k), ("speclab-draft+events", M.sl_draft_events, k),
                 ("speclab-ngram+events", M.sl_ngram_events, k)]
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    rows = []
    costs_by_wl = {}
    ntok = {}  # workload -> prompt -> tokens generated (the same for every method: outputs are identical)
    results = {}  # (method, workload, k) -> dict(tps=[...], identical=bool, acc=[...], mem)
    for w in wl_names:
        prompts = [target.encode(p.prompt) for p in load_workload(w)[:n_prompts]]
        # warm-up: every method once
        for name, fn, k in plan:
            fn(prompts[0], k)
        ref = {i: M.hf_plain(ids, 0)[0] for i, ids in enumerate(prompts)}
        ntok[w] = {i: len(out) for i, out in ref.items()}
        for name, fn, k in plan:
            results[(name, w, k)] = dict(tps=[], identical=True, acc=[], tpr=[], mem=0.0,
                                         times={i: [] for i in range(len(prompts))})
        for rep in range(args.reps):
            for i, ids in enumerate(prompts):
                for name, fn, k in plan:  # interleaved: A B C ... for every prompt and repetition
                    r = results[(name, w, k)]
                    with PeakRSS(dev) as mem:
                        sync(dev)
                        t0 = time.perf_counter()
                        out, acc = fn(ids, k)
                        sync(dev)
                        dt = time.perf_counter() - t0
                    r["mem"] = max(r["mem"], mem.peak)
                    r["times"][i].append(dt)
                    if name == "prefill":
                        continue
                    r["tps"].append(len(out) / dt)
                    r["identical"] &= out == ref[i]
                    if acc is not None:
                        if acc[0] is not None:
                            r["acc"].append(acc[0])
                        r["tpr"].append(acc[1])
        # step costs under the same conditions, at this workload's typical context length
        ctx = int(statistics.median(len(ids) for ids in prompts)) + args.max_new_tokens // 2
        costs_by_wl[w] = step_costs(target, draft, ks, context=ctx)
        log(f"[compare] {w}: done")
    # acceptance of the events-off runs is that of the same runs with events on (greedy: same tokens)
    for (name, w, k), r in results.items():
        if name == "prefill":
            continue
        twin = results.get((name + "+events", w, k))
        if twin is not None:
            r["acc"], r["tpr"] = twin["acc"], twin["tpr"]
        base = statistics.median(results[("hf-plain", w, 0)]["tps"])
        med = statistics.median(r["tps"])
        rows.append(dict(method=name, workload=w, k=k, batch=1, tokens_per_s=med, ratio_vs_hf_plain=med / base,
                         acceptance_rate=statistics.mean(r["acc"]) if r["acc"] else None,
                         tokens_per_round=statistics.mean(r["tpr"]) if r["tpr"] else None,
                         identical=r["identical"], peak_mem_mb=r["mem"]))

    # ---- the limit: zero-overhead prediction from measured step costs and measured acceptance.
    # The formula is about decoding, so the measured speedup is too: per prompt, the median time of
    # a run minus the median time of prefill + first token (same for both), plain over speculative.
    eff = []
    for w in wl_names:
        costs = costs_by_wl[w]
        pre = results[("prefill", w, 0)]["times"]
        plain_t = results[("speclab-plain", w, 0)]["times"]
        for k in ks:
            sd = _row(rows, "speclab-draft", w, k)
            if sd["tokens_per_round"] is None:
                continue
            tpr = sd["tokens_per_round"]
            predicted = tpr * costs["target_step_s"] / (k * costs["draft_step_s"] + costs["verify_s"][k])
            spec_t = results[("speclab-draft", w, k)]["times"]
            dec_plain = {i: statistics.median(plain_t[i]) - statistics.median(pre[i]) for i in plain_t}
            dec_spec = {i: statistics.median(spec_t[i]) - statistics.median(pre[i]) for i in plain_t}
            measured = statistics.median(dec_plain[i] / dec_spec[i] for i in plain_t)
            # share of each decode phase that the forwards alone explain (tokens after the first):
            # efficiency = spec share / plain share, so it exceeds 1 when plain decoding loses more to
            # per-token host work (argmax, bookkeeping) than speculation loses per round
            n = {i: max(ntok[w][i] - 1, 1) for i in plain_t}
            share_plain = statistics.median(n[i] * costs["target_step_s"] / dec_plain[i] for i in plain_t)
            share_spec = statistics.median(n[i] / tpr * (k * costs["draft_step_s"] + costs["verify_s"][k]) /
                                           dec_spec[i] for i in plain_t)
            a = sd["acceptance_rate"] or 0.0
            eff.append(dict(workload=w, k=k, acceptance_rate=a, tokens_per_round=tpr, measured_speedup=measured,
                             predicted_speedup=predicted, efficiency=measured / predicted,
                             forward_share_plain=share_plain, forward_share_spec=share_spec,
                             leviathan_speedup=leviathan(a, k, costs["draft_step_s"] / costs["target_step_s"])))

    # ---- batch sweep: plain vs speculative on the workload where speculation pays most at batch 1,
    # at its best k: where does it stop paying as the batch grows?
    gain = {(w, k): _row(rows, "speclab-draft", w, k)["tokens_per_s"] /
            _row(rows, "speclab-plain", w, 0)["tokens_per_s"] for w in wl_names for k in ks}
    batch_wl, best_k = max(gain, key=gain.get)
    mix = [p.prompt for p in load_workload(batch_wl)]
    batch_rows = []
    for B in batches:
        group = [mix[i % len(mix)] for i in range(B)]
        tp = {"plain": [], "spec": []}
        for rep in range(max(2, args.reps)):
            for name, dec, k in (("plain", M.plain, 0), ("spec", M.draft, best_k)):
                sync(dev)
                t0 = time.perf_counter()
                r = dec.generate(group, k=k, max_new_tokens=args.max_new_tokens, record=False)
                sync(dev)
                tp[name].append(sum(len(o) for o in r.output_tokens) / (time.perf_counter() - t0))
        p, s = statistics.median(tp["plain"]), statistics.median(tp["spec"])
        batch_rows.append(dict(batch=B, k=best_k, workload=batch_wl, plain_tokens_per_s=p, spec_tokens_per_s=s,
                               speedup=s / p))
        log(f"[compare] batch {B}: speedup {s / p:.2f}")
    crossover = next((b["batch"] for b in batch_rows if b["speedup"] < 1.0), None)

    report = dict(
        command="speclab bench " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "speclab bench compare",
        target=target.name, draft=draft.name, device=str(dev), threads=torch.get_num_threads(),
        max_new_tokens=args.max_new_tokens, prompts_per_workload=n_prompts, reps=args.reps,
        rows=rows, efficiency=dict(step_costs=costs_by_wl, per_workload=eff,
                                   median=statistics.median([e["efficiency"] for e in eff]) if eff else None),
        batch=batch_rows, crossover_batch=crossover,
    )
    report["targets"] = _targets(report, ks, wl_names)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


def _row(rows, method, w, k):
    return next(r for r in rows if r["method"] == method and r["workload"] == w and r["k"] == k)


def _best_k(rows, method, ks):
    """The k with the best median (over workloads) tokens/s."""
    by_k = {k: statistics.median([r["tokens_per_s"] for r in rows if r["method"] == method and r["k"] == k])
            for k in ks}
    return max(by_k, key=by_k.get)


def _targets(rep, ks, wls) -> dict:
    rows = rep["rows"]

    def med_ratio(num, den, wl=None):
        vals = []
        for w in (wl or wls):
            a = [r for r in rows if r["method"] == num[0] and r["workload"] == w and r["k"] == num[1]][0]
            b = [r for r in rows if r["method"] == den[0] and r["workload"] == w and r["k"] == den[1]][0]
            vals.append(a["tokens_per_s"] / b["tokens_per_s"])
        return statistics.median(vals)

    kd, kh = _best_k(rows, "speclab-draft", ks), _best_k(rows, "hf-assisted", ks)
    t = {
        "plain_vs_hf_plain": dict(value=med_ratio(("speclab-plain", 0), ("hf-plain", 0)), goal=1.1),
        "draft_vs_hf_assisted": dict(value=med_ratio(("speclab-draft", kd), ("hf-assisted", kh)), goal=1.5,
                                     speclab_k=kd, hf_k=kh),
        "events_on_slowdown": dict(value=1 - 1 / med_ratio(("speclab-draft", kd), ("speclab-draft+events", kd)),
                                   goal=0.05, lower_is_better=True),
    }
    for w in ("json", "code"):
        if w in wls:  # the best speculative method (model draft or prompt lookup) at its own best k here
            best = {}
            for m in ("speclab-draft", "speclab-ngram"):
                by_k = {k: med_ratio((m, k), ("speclab-plain", 0), [w]) for k in ks}
                kw = max(by_k, key=by_k.get)
                best[m] = dict(value=by_k[kw], k=kw)
            m = max(best, key=lambda x: best[x]["value"])
            t[f"spec_vs_plain_{w}"] = dict(value=best[m]["value"], goal=1.5, method=m, k=best[m]["k"],
                                           by_method=best)
    eff = [e["efficiency"] for e in rep["efficiency"]["per_workload"] if e["k"] == kd]
    if eff:
        t["efficiency"] = dict(value=statistics.median(eff), goal=0.85, k=kd)
    t["all_identical"] = dict(value=all(r["identical"] for r in rows), goal=True)
    for v in t.values():
        if isinstance(v["goal"], bool):
            v["met"] = v["value"] == v["goal"]
        elif v.get("lower_is_better"):
            v["met"] = v["value"] <= v["goal"]
        else:
            v["met"] = v["value"] >= v["goal"]
    return t


def format_report(rep) -> str:
    L = []
    L.append(f"target {rep['target']}  draft {rep['draft']}  device {rep['device']}  threads {rep['threads']}  "
             f"max_new_tokens {rep['max_new_tokens']}  prompts/workload {rep['prompts_per_workload']}  "
             f"reps {rep['reps']}  (medians, batch 1, greedy)")
    L.append("")
    L.append(f"{'method':<22}{'workload':<12}{'k':>3}{'tok/s':>9}{'vs hf':>7}{'accept':>8}{'tok/rnd':>8}"
             f"{'ident':>7}{'peak MB':>9}")
    for r in rep["rows"]:
        acc, tpr = num(r["acceptance_rate"], ".2f", ""), num(r["tokens_per_round"], ".2f", "")
        L.append(f"{r['method']:<22}{r['workload']:<12}{r['k']:>3}{r['tokens_per_s']:>9.1f}"
                 f"{r['ratio_vs_hf_plain']:>7.2f}{acc:>8}{tpr:>8}{('yes' if r['identical'] else 'NO'):>7}"
                 f"{r['peak_mem_mb']:>9.1f}")
    L.append("")
    for w, c in rep["efficiency"]["step_costs"].items():
        L.append(f"step costs ({w}): target {c['target_step_s'] * 1e3:.3f} ms, draft {c['draft_step_s'] * 1e3:.3f} "
                 f"ms (c = {c['draft_step_s'] / c['target_step_s']:.3f}), verify(k+1): " +
                 ", ".join(f"k={k} {v * 1e3:.3f} ms" for k, v in c["verify_s"].items()))
    L.append("decode-phase speedup of speclab-draft over speclab-plain (prefill subtracted) against the "
             "zero-overhead limit")
    L.append(f"{'workload':<12}{'k':>3}{'accept':>8}{'tok/rnd':>8}{'measured':>10}{'limit':>8}{'effic.':>8}"
             f"{'Leviathan':>10}{'fwd share plain':>17}{'fwd share spec':>16}")
    for e in rep["efficiency"]["per_workload"]:
        L.append(f"{e['workload']:<12}{e['k']:>3}{e['acceptance_rate']:>8.2f}{e['tokens_per_round']:>8.2f}"
                 f"{e['measured_speedup']:>10.2f}{e['predicted_speedup']:>8.2f}{e['efficiency']:>8.2f}"
                 f"{e['leviathan_speedup']:>10.2f}{e.get('forward_share_plain', float('nan')):>17.2f}"
                 f"{e.get('forward_share_spec', float('nan')):>16.2f}")
    L.append("")
    if rep["batch"]:
        L.append(f"batch sweep on workload {rep['batch'][0].get('workload')}")
    L.append(f"{'batch':>6}{'k':>3}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}")
    for b in rep["batch"]:
        L.append(f"{b['batch']:>6}{b['k']:>3}{b['plain_tokens_per_s']:>13.1f}{b['spec_tokens_per_s']:>12.1f}"
                 f"{b['speedup']:>9.2f}")
    L.append(f"crossover batch (speculation stops paying): {rep['crossover_batch']}")
    L.append("")
    for name, t in rep["targets"].items():
        v = t["value"]
        vs = f"{v:.3f}" if isinstance(v, float) else str(v)
        how = ""
        if "by_method" in t:
            how = "  (" + ", ".join(f"{m} {b['value']:.2f} at k={b['k']}" for m, b in t["by_method"].items()) + ")"
        L.append(f"target {name:<24} {vs:>8}  goal {'<=' if t.get('lower_is_better') else '>='} {t['goal']}  "
                 f"{'MET' if t['met'] else 'NOT MET'}{how}")
    return "\n".join(L)
