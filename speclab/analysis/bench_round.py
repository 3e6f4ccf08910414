"""``speclab bench round``: one speculative round taken apart, each phase beside the floor this machine allows.

A round's wall time is split as the decoder's events report it: the draft steps, the verify forward over the
newest token and the k drafts, acceptance (and sampling), bookkeeping (writing the tokens, the rollback, the
drafter's catch-up and the events themselves) and everything else between rounds (the policy's choice). Each
phase stands beside a floor measured on the spot, in the same process and between the same runs:

* verify: the slower of the target's weight matmuls at k + 1 rows (torch's kernels, nothing else) and one
  read of its weights and the rows' KV cache (a sum over every byte);
* draft: the same for one draft step, times the steps a round runs (the draft model's weights, or an
  EAGLE head's and the target's LM head it reads; 0 for prompt lookup, which reads no weights);
* accept: the argmax over the k + 1 positions' logits (what greedy acceptance must read);
* bookkeeping and other: 0 (no arithmetic the hardware needs).

A plain step (k = 0) is measured the same way in the same rotation, twice (an A/A control: the gap between
the two is this machine's noise). Batch 1, greedy. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

from .flags import out_path, write_json

PHASES = ("draft", "verify", "accept", "bookkeeping", "other")


@dataclass
class Floors:
    """Seconds the hardware needs, measured here: matmuls and reads at the round's shapes."""

    verify_matmul: float
    verify_read: float
    plain_matmul: float
    plain_read: float
    draft_step_matmul: float
    draft_step_read: float
    accept: float
    plain_accept: float

    def phase(self, name: str, steps: int) -> float:
        if name == "verify":
            return max(self.verify_matmul, self.verify_read)
        if name == "draft":
            return steps * max(self.draft_step_matmul, self.draft_step_read)
        if name == "accept":
            return self.accept
        return 0.0

    def plain_phase(self, name: str) -> float:
        if name == "verify":
            return max(self.plain_matmul, self.plain_read)
        return self.plain_accept if name == "accept" else 0.0


@dataclass
class RoundReport:
    target: str
    draft: str
    k: int
    workload: str
    prompts: int
    reps: int
    context_tokens: float
    threads: int
    spec_ms: dict[str, float] = field(default_factory=dict)  # median per phase, a round at k
    plain_ms: dict[str, float] = field(default_factory=dict)  # median per phase, a plain step
    plain_again_ms: dict[str, float] = field(default_factory=dict)  # the A/A control
    floors_ms: dict[str, float] = field(default_factory=dict)
    draft_steps: int = 0
    acceptance: float = 0.0
    ratios: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ the floors


def matmul_weights(lm) -> list:
    """The target's matmul weights as its forward holds them: (in, out) tensors."""
    import torch

    from ..models.native_llama import Weight

    nat = getattr(lm, "native", None)
    if nat is not None:
        ws = [nat.lm_head] + [w for layer in nat.layers for w in (layer[1], layer[2], layer[4], layer[5])]
        return [w.t if isinstance(w, Weight) else w.t() for w in ws]

    return [m.weight.t() for m in lm.hf_model.modules() if isinstance(m, torch.nn.Linear)]


def draft_weights(drafter, target) -> list:
    """What one draft step reads: a draft model's weights; a head's weights and the target's LM head; nothing
    for a drafter without weights (prompt lookup)."""
    import torch

    if drafter is None:
        return []
    lm = getattr(drafter, "lm", None)
    if lm is not None:
        return matmul_weights(lm)
    module = getattr(drafter, "head", None) or getattr(drafter, "heads", None)
    if module is not None and not isinstance(module, torch.nn.Module):  # a drafter wrapping a head drafter
        return draft_weights(module, target)
    if isinstance(module, torch.nn.Module):
        ws = [p.t() for p in module.parameters() if p.dim() == 2]
        return ws + matmul_weights(target)[:1]  # the LM head
    return []


def _median_time(fn, reps: int = 7, inner: int = 3) -> float:
    fn()  # warm: the first call allocates
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def time_matmuls(weights: list, rows: int) -> float:
    """Seconds for x (rows, in) @ W (in, out) over every weight: the matmuls alone, with the faster of torch's
    kernel and the few-row kernel (kernels/few_rows.c) where that one runs."""
    import torch

    from ..kernels import few_rows

    if not weights:
        return 0.0
    xs = [torch.randn(rows, w.shape[0], dtype=w.dtype) for w in weights]

    def run():
        for x, w in zip(xs, weights):
            x @ w

    best = _median_time(run)
    if few_rows.load() is not None and rows <= few_rows.MAX_ROWS and all(few_rows.packable(w.t()) for w in weights):
        panels = [few_rows.pack(w.t()) for w in weights]

        def run_few():
            for x, p in zip(xs, panels):
                few_rows.matmul(x, p)

        best = min(best, _median_time(run_few))
    return best


def time_read(tensors: list) -> float:
    """Seconds to read every byte of ``tensors`` once (a sum is a pure streaming read)."""
    if not tensors:
        return 0.0

    def run():
        for t in tensors:
            t.sum()

    return _median_time(run)


def measure_floors(target, drafter, k: int, context: int) -> Floors:
    import torch

    weights = matmul_weights(target)
    c = target.config
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = [torch.randn(2, kv_heads, context, head_dim, dtype=target.dtype) for _ in range(target.n_layers)]
    dweights = draft_weights(drafter, target)
    logits = torch.randn(k + 1, target.vocab_size)
    plain_logits = torch.randn(1, target.vocab_size)
    return Floors(verify_matmul=time_matmuls(weights, k + 1), verify_read=time_read(weights + kv),
                  plain_matmul=time_matmuls(weights, 1), plain_read=time_read(weights + kv),
                  draft_step_matmul=time_matmuls(dweights, 1), draft_step_read=time_read(dweights),
                  accept=_median_time(lambda: logits.argmax(-1)),
                  plain_accept=_median_time(lambda: plain_logits.argmax(-1)))


# ------------------------------------------------------------------------------------------------ the rounds


class PhaseLog:
    """Subscriber: the phase timings of the steady rounds (a verify round in which the row drafted ``k``)."""

    def __init__(self, k: int):
        self.k = k
        self.rows: list[dict[str, float]] = []
        self.drafted = self.accepted = 0

    def __call__(self, ev) -> None:
        if getattr(ev, "phase", None) != "verify" or not ev.rows:
            return
        rr = ev.rows[0]
        if rr.num_drafted != self.k or ev.round <= 1:  # the first round warms the draft's and verify's buffers
            return
        self.rows.append({p: ev.timings.get(p, 0.0) for p in PHASES})
        self.drafted += rr.num_drafted
        self.accepted += rr.num_accepted


def _run(decoder, log: PhaseLog, prompt: str, k: int, max_new_tokens: int) -> None:
    unsub = decoder.hooks.subscribe(log, probs=False)
    try:
        decoder.generate(prompt, k=k, max_new_tokens=max_new_tokens, temperature=0.0, record=False)
    finally:
        unsub()


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {p: float("nan") for p in PHASES} | {"total": float("nan")}
    out = {p: statistics.median(r[p] for r in rows) * 1e3 for p in PHASES}
    out["total"] = statistics.median(sum(r.values()) for r in rows) * 1e3
    return out


def run_round(target, drafter, draft_name: str, prompts: list[str], k: int, max_new_tokens: int, reps: int,
              workload: str, threads: int) -> RoundReport:
    """Plain, speculative and plain again, interleaved per prompt and repetition; floors measured between them."""
    from ..engine.decoder import SpeculativeDecoder

    plain_dec, spec_dec = SpeculativeDecoder(target, None), SpeculativeDecoder(target, drafter)
    logs = {"plain": PhaseLog(0), "spec": PhaseLog(k), "plain_again": PhaseLog(0)}
    floors: list[Floors] = []
    ctx = [len(target.encode(p)) for p in prompts]
    for _ in range(reps):
        for p in prompts:
            _run(plain_dec, logs["plain"], p, 0, max_new_tokens)
            _run(spec_dec, logs["spec"], p, k, max_new_tokens)
            _run(plain_dec, logs["plain_again"], p, 0, max_new_tokens)
        floors.append(measure_floors(target, drafter, k, int(statistics.mean(ctx)) + max_new_tokens // 2))
    fl = Floors(**{f: statistics.median(getattr(x, f) for x in floors) for f in Floors.__dataclass_fields__})
    rep = RoundReport(target.name, draft_name, k, workload, len(prompts), reps, statistics.mean(ctx), threads)
    rep.spec_ms, rep.plain_ms, rep.plain_again_ms = (_medians(logs[n].rows) for n in ("spec", "plain", "plain_again"))
    rep.draft_steps = draft_steps_of(drafter, k)
    rep.floors_ms = {**{f"{p}": fl.phase(p, rep.draft_steps) * 1e3 for p in PHASES},
                     **{f"plain_{p}": fl.plain_phase(p) * 1e3 for p in PHASES},
                     **{f"raw_{f}": getattr(fl, f) * 1e3 for f in Floors.__dataclass_fields__}}
    rep.floors_ms["total"] = sum(rep.floors_ms[p] for p in PHASES)
    rep.floors_ms["plain_total"] = sum(rep.floors_ms[f"plain_{p}"] for p in PHASES)
    s = logs["spec"]
    rep.acceptance = s.accepted / s.drafted if s.drafted else 0.0
    rep.rounds = {n: len(log.rows) for n, log in logs.items()}
    pv, sv = rep.plain_ms["verify"], rep.spec_ms["verify"]
    rep.ratios = {"verify_over_plain_verify": sv / pv, "round_over_plain_step": rep.spec_ms["total"] /
                  rep.plain_ms["total"], "draft_step_over_plain_step": rep.spec_ms["draft"] / rep.draft_steps /
                  rep.plain_ms["total"], "aa_plain_again_over_plain": rep.plain_again_ms["total"] /
                  rep.plain_ms["total"], "verify_floor_matmul_ratio": fl.verify_matmul / fl.plain_matmul
                  if fl.plain_matmul else float("nan")}
    return rep


# ------------------------------------------------------------------------------------------------ charts


def draft_steps_of(drafter, k: int) -> int:
    """Forwards a round's draft phase runs: k for a model or a head drafting a chain, 1 for a lookup."""
    return k if getattr(drafter, "lm", None) is not None or hasattr(drafter, "head") else 1


def floor_phases(target, drafter, k: int, context: int) -> dict[str, dict[str, float]]:
    """The floors of a round at k and of a plain step, ms per phase (measured now)."""
    fl = measure_floors(target, drafter, k, context)
    steps = draft_steps_of(drafter, k)
    return {f"floor: round at k={k}": {p: fl.phase(p, steps) * 1e3 for p in PHASES},
            "floor: plain step": {p: fl.plain_phase(p) * 1e3 for p in PHASES}}


def phase_frame(per_round_ms: dict[str, dict[str, float]]):
    """Long table (method, phase, ms) from {method: {phase: ms per round}}: what :func:`phases_chart` draws."""
    import pandas as pd

    return pd.DataFrame([{"method": m, "phase": p, "ms": float(v.get(p, 0.0)), "order": i}
                         for m, v in per_round_ms.items() for i, p in enumerate(PHASES)])


def per_round_from_summary(summary: dict) -> dict[str, float]:
    """A metrics summary's phase totals as ms per verify round (prefill left out)."""
    rounds = max(1, int(summary.get("rounds") or 0))
    ph = summary.get("phase_ms") or {}
    return {p: ph.get(p, 0.0) / rounds for p in PHASES}


def phases_chart(df):
    """Stacked bars: where a round's time goes, phase by phase, each method beside its floor."""
    import altair as alt

    return alt.Chart(df).mark_bar().encode(
        x=alt.X("sum(ms):Q", title="ms per round"), y=alt.Y("method:N", title=None, sort=None),
        color=alt.Color("phase:N", sort=list(PHASES)), order=alt.Order("order:Q"),
        tooltip=["method", "phase", alt.Tooltip("ms:Q", format=".3f")],
    ).properties(width=520, height=140, title="a round, phase by phase, beside the floor this machine allows")


# ------------------------------------------------------------------------------------------------ output


def format_report(r: RoundReport) -> str:
    f = r.floors_ms
    lines = [f"one round: target {r.target}, draft {r.draft}, k = {r.k}, batch 1, greedy, {r.workload} "
             f"({r.prompts} prompts x {r.reps} reps, ~{r.context_tokens:.0f} prompt tokens, {r.threads} thread(s)); "
             f"acceptance {r.acceptance:.2f}; rounds timed: {r.rounds}",
             f"{'phase':<13}{'round ms':>10}{'floor ms':>10}{'x floor':>9}{'plain ms':>10}{'floor ms':>10}"
             f"{'x floor':>9}"]

    def x(a, b):
        return f"{a / b:>9.1f}" if b > 0 else f"{'-':>9}"

    for p in PHASES + ("total",):
        fp = f[p] if p != "total" else f["total"]
        fq = f[f"plain_{p}"] if p != "total" else f["plain_total"]
        lines.append(f"{p:<13}{r.spec_ms[p]:>10.3f}{fp:>10.3f}{x(r.spec_ms[p], fp)}{r.plain_ms[p]:>10.3f}"
                     f"{fq:>10.3f}{x(r.plain_ms[p], fq)}")
    q = r.ratios
    lines += [f"verify of {r.k + 1} tokens / plain step's forward: {q['verify_over_plain_verify']:.2f}x "
              f"(the weights' matmuls alone at {r.k + 1} rows / 1 row: {q['verify_floor_matmul_ratio']:.2f}x)",
              f"draft step / plain step: {q['draft_step_over_plain_step']:.2f}x; round / plain step: "
              f"{q['round_over_plain_step']:.2f}x",
              f"A/A control (plain step again / plain step): {q['aa_plain_again_over_plain']:.2f}x",
              f"floors: verify = max(matmuls {f['raw_verify_matmul']:.3f}, read of weights + KV "
              f"{f['raw_verify_read']:.3f}) ms; a draft step = max(matmuls {f['raw_draft_step_matmul']:.3f}, read "
              f"{f['raw_draft_step_read']:.3f}) ms"]
    return "\n".join(lines)


def add_arguments(p) -> None:
    from .flags import add_flags

    add_flags(p, "target", "draft", "k", "workload", "prompts", "reps", "max_new_tokens", "threads", "out",
              draft=dict(default="eagle", help="drafter spec (default eagle)"),
              k=dict(help="draft length (default 4: a verify of 5 tokens)"),
              workload=dict(default="heldout_code", help="workload name or JSONL path (default heldout_code)"),
              prompts=dict(default=3, help="prompts from the workload (default 3)"),
              reps=dict(default=3, help="interleaved repetitions (default 3)"),
              max_new_tokens=dict(default=48, help="tokens per run (default 48)"))


def run_from_args(args) -> int:
    import torch

    from ..defaults import default_target, setup_threads
    from ..drafters.registry import make_drafter
    from ..errors import SpeclabError
    from ..limits import check_paired_run
    from ..models import load_model
    from ..workloads import load_workload

    check_paired_run(args, "a round with no drafts is the plain step it is compared with")
    prompts = [p.prompt for p in load_workload(args.workload)[: args.prompts_per_workload]]
    target = load_model(args.target or default_target())
    setup_threads(args.threads, target)
    drafter = make_drafter(args.draft, target)
    if drafter is None:
        raise SpeclabError("--draft must name a drafter (the plain step is measured anyway)")
    rep = run_round(target, drafter, args.draft, prompts, args.k, args.max_new_tokens, args.reps, args.workload,
                    torch.get_num_threads())
    print(format_report(rep))
    write_json(out_path(args, "round"), asdict(rep))
    return 0


def main(argv=None) -> int:
    import argparse

    from ..errors import SpeclabError

    p = argparse.ArgumentParser(prog="speclab bench round", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except SpeclabError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
