#!/usr/bin/env python
"""The GPU check: one prepared command for a CUDA machine that writes what the lab claims
about GPUs into an output folder.

    python scripts/gpu_check.py --out DIR            # on a CUDA machine: 4-5 minutes, hard cap --budget (540 s)
    python scripts/gpu_check.py --out DIR --dry-run  # tiny sizes on the CPU: every section's code path

Sections, each in its own process (a CUDA error or a hang in one cannot take the others down), each
with a time budget (``--timeout``) and saved as it goes (a section stopped at its budget keeps its rows):

  env               device, driver and library versions; the HBM and matmul peaks used (by device name)
  kernel            the Triton acceptance kernel against the PyTorch reference, up to B*(K+1)*V past 2^31
  roofline          a 1B-class random Llama (bf16), decode and verify step at batch 1 against the HBM
                    roofline (weight + KV bytes / bandwidth), eager vs CUDA graphs; device time by kernel kind
  round             the speculative round (1B target, small draft, k = 4) run entirely on the device
                    (scripts/gpu_round.py), one CUDA graph per round: draft, verify, acceptance and
                    bookkeeping against the floor at batch 1..64, speedups at alpha 0.6 and 0.8, identity
  crossover-1b      speculative (synthetic drafts, alpha 0.6 and 0.8) vs plain decoding, batch 1..256, on
                    the 1B target with CUDA graphs: the crossover batch
  exactness         greedy identity in fp32 (speculative = plain = HF generate; family and tiny models,
                    CUDA graphs on and off); bf16 speculative vs plain
  crossover-family  the crossover rows for the embedded family (its draft, prompt lookup, synthetic)
  compile           the roofline's graph step with torch.compile (Inductor) fusing the small kernels; the
                    whole step and the whole round compiled and captured as one graph
  train             a stronger family (10x the target's tokens): only with --only train, or in --dry-run

Outputs: DIR/gpu_check.json (everything), DIR/gpu_check.md (the tables; its first table is the one for
the README), DIR/gpu_check.log (the progress lines), and for ``train`` the trained weights packed as
DIR/train_family.tar.gz.partNN (15 MiB parts). docs/gpu.md explains every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_round import (PHASES, DeviceRound, expected_tokens, forward_floor_s, kernel_breakdown,  # noqa: E402
                       kv_bytes, weight_bytes)

# Datasheet peaks by device name: HBM GB/s and dense bf16 TFLOPS (the roofline's two floors). The first name
# that occurs in torch.cuda.get_device_name() wins; --bandwidth-gbs and --peak-tflops override.
DEVICE_PEAKS = (("H200", 4800.0, 989.0), ("H100 PCIe", 2000.0, 756.0), ("H100", 3350.0, 989.0),
                ("A100", 2039.0, 312.0), ("L40S", 864.0, 362.0))
H200_GBS = DEVICE_PEAKS[0][1]
H200_TFLOPS = DEVICE_PEAKS[0][2]
TIE_RTOL = 1e-4  # a next-token mismatch is a summation-order tie when the draw is this close to a CDF step
PART_BYTES = 15 * 2**20  # what one returned file may hold (the device tool returns files up to 16 MiB)


# ---------------------------------------------------------------------------------------------- sizes
@dataclass
class Sizes:
    """Every size the sections use: the real run's, or the dry run's tiny ones (``tiny()``)."""

    device: str = "cuda"
    # kernel: (B, K, V, deterministic drafts); the large case passes 2^31 elements in target_probs
    kernel_cases: tuple = ((64, 4, 32000, False), (64, 4, 32000, True), (256, 7, 128256, False),
                           (33, 1, 50, False), (8, 0, 1000, False))
    kernel_large: tuple | None = (1800, 7, 152064, False)  # 2.19e9 elements (8.8 GB fp32) + draft 7.7 GB
    kernel_timing: tuple | None = (64, 4, 32000)
    # the 1B-class target
    big: dict = field(default_factory=lambda: dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192,
                                                   vocab=32000, max_pos=4096))
    big_dtype: str = "bfloat16"
    # the round section's draft: a small Llama on the target's vocabulary (~24M parameters, most in its head)
    draft: dict = field(default_factory=lambda: dict(hidden=512, layers=4, heads=8, kv_heads=2, ffn=1536,
                                                     vocab=32000, max_pos=4096))
    round_batches: tuple = (1, 8, 16, 32, 64)
    rounds: int = 30  # rounds timed per batch and mode
    identity_new: int = 24
    context: int = 512
    reps: int = 50
    k: int = 4
    # crossovers
    batches: tuple = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    prompt_len: int = 64
    new_tokens: int = 32
    family_new: int = 48
    alphas: tuple = (0.6, 0.8)
    # exactness
    exact_prompts: int = 6
    exact_new: int = 32
    # train: the factor on every spec's tokens, corpus and config overrides
    train_scale: float = 10.0
    train_tiny: bool = False

    @classmethod
    def tiny(cls) -> "Sizes":
        return cls(device="cpu", kernel_cases=((16, 4, 50, False), (16, 3, 64, True), (8, 0, 20, False)),
                   kernel_large=None, kernel_timing=None,
                   big=dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, max_pos=512),
                   draft=dict(hidden=32, layers=1, heads=2, kv_heads=1, ffn=64, vocab=512, max_pos=512),
                   round_batches=(1, 2), rounds=3, identity_new=12, big_dtype="float32", context=24, reps=3, batches=(1, 2, 4), prompt_len=8, new_tokens=8,
                   family_new=8, exact_prompts=2, exact_new=8, train_tiny=True)


# name, title, budget on the GPU (s), budget in the dry run (s)
# The GPU budgets add up to more than the default --budget (540 s): each is a cap for a section that hangs,
# the whole run stops at --budget, and the sections' usual times are a fraction of their caps.
SECTIONS = [
    ("env", "environment", 30, 60),
    ("kernel", "Triton acceptance kernel vs PyTorch reference", 60, 150),
    ("roofline", "1B-class decode step vs HBM roofline, eager vs CUDA graphs, where the time goes", 75, 120),
    ("round", "the speculative round taken apart on the device, one CUDA graph per round", 100, 150),
    ("crossover-1b", "speculative vs plain, synthetic drafts, 1B target", 90, 150),
    ("exactness", "greedy identity (fp32) and bf16 speculative vs plain", 75, 180),
    ("crossover-family", "speculative vs plain, embedded family", 75, 150),
    ("compile", "torch.compile + CUDA graphs: the engine's step and the whole round", 150, 150),
    ("train", "a stronger family trained on the GPU", 540, 240),
]
OPT_IN = ("train",)  # run on the GPU only when asked for with --only


# ---------------------------------------------------------------------------------------------- a section's record
class Part:
    """A section's results, written to disk after every change: a section stopped at its budget keeps
    what it had."""

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name
        self.data = {"name": name, "status": "running", "reason": "", "summary": {}, "rows": [], "notes": [],
                     "tables": {}}
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def log(self, msg: str) -> None:
        print(f"[{self.name}] {msg}", flush=True)

    def row(self, **kw) -> None:
        self.data["rows"].append(kw)
        self.save()
        self.log("  ".join(f"{k}={_fmt(v)}" for k, v in kw.items()))

    def table(self, name: str, **kw) -> None:
        """A row of a second table of the section (its own columns: a kernel breakdown, the speedups)."""
        self.data["tables"].setdefault(name, []).append(kw)
        self.save()
        self.log(f"{name}: " + "  ".join(f"{k}={_fmt(v)}" for k, v in kw.items()))

    def note(self, msg: str) -> None:
        self.data["notes"].append(msg)
        self.save()
        self.log(msg)

    def summary(self, **kw) -> None:
        self.data["summary"].update(kw)
        self.save()

    def skip(self, reason: str) -> None:
        self.data["status"], self.data["reason"] = "skipped", reason
        self.save()
        self.log(f"skipped: {reason}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ---------------------------------------------------------------------------------------------- helpers
def _torch():
    import torch

    return torch


def sync(dev) -> None:
    torch = _torch()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, reps: int, dev, warmup: int = 3) -> dict:
    """Median ms of one call with a device sync around it (what a decoder that reads its tokens back pays),
    and the mean ms of ``reps`` calls back to back with one sync at the end (launches overlap the GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return {"synced_ms": statistics.median(times) * 1e3, "pipelined_ms": (time.perf_counter() - t) / reps * 1e3}


def random_llama(dims: dict, dev: str, dtype: str, *, copy_head: bool = False, seed: int = 0):
    """A random-weight Llama as a speclab LM (native backend), built on the device. Its tokenizer maps
    ids to single characters (ids are what the benchmarks feed). ``copy_head``: the LM head tied to an
    embedding scaled up, so the greedy continuation repeats the last token with a wide margin (bf16's
    batch-shape rounding never flips it; the bytes and kernels of a step are unchanged)."""
    torch = _torch()
    from transformers import LlamaConfig, LlamaForCausalLM

    from speclab.models.lm import LM
    from speclab.testing import char_tokenizer

    V = dims["vocab"]
    tok = char_tokenizer("".join(chr(0x4E00 + i) for i in range(V - 1)))  # V - 1 characters + <eos>
    cfg = LlamaConfig(vocab_size=V, hidden_size=dims["hidden"], intermediate_size=dims["ffn"],
                      num_hidden_layers=dims["layers"], num_attention_heads=dims["heads"],
                      num_key_value_heads=dims["kv_heads"], max_position_embeddings=dims["max_pos"],
                      eos_token_id=V - 1, bos_token_id=V - 1, pad_token_id=V - 1, tie_word_embeddings=copy_head)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, dtype)).eval()
    if copy_head:
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(50.0)
    return LM(f"llama-{dims['hidden']}x{dims['layers']}-random", "", model, tok, "native")


def device_peaks(name: str) -> tuple[float, float] | None:
    """(HBM GB/s, dense bf16 TFLOPS) of a device by its name, or None for a device not in DEVICE_PEAKS."""
    for key, gbs, tflops in DEVICE_PEAKS:
        if key in name:
            return gbs, tflops
    return None


def resolve_peaks(args) -> None:
    """Fill --bandwidth-gbs and --peak-tflops the user left out from the device's name (H200's otherwise)."""
    torch = _torch()
    found = device_peaks(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    gbs, tflops = found or (H200_GBS, H200_TFLOPS)
    args.peaks_from = "device name" if found else "H200 datasheet (device not in the table)"
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = gbs
    if args.peak_tflops is None:
        args.peak_tflops = tflops


# ---------------------------------------------------------------------------------------------- env
def sec_env(part: Part, args, sz: Sizes) -> None:
    torch = _torch()
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_available": torch.cuda.is_available(), "platform": platform.platform()}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"missing ({type(e).__name__})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"{p.major}.{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count,
                    cuda=torch.version.cuda)
        free, total = torch.cuda.mem_get_info()
        info["free_gib"] = round(free / 2**30, 1)
    else:
        info["device"] = "cpu (dry run)" if args.dry_run else "cpu"
    info.update(bandwidth_gbs=args.bandwidth_gbs, peak_tflops=args.peak_tflops, peaks_from=args.peaks_from)
    part.summary(**info)
    part.row(**{k: v for k, v in info.items() if k in ("device", "torch", "triton", "transformers", "cuda")})


# ---------------------------------------------------------------------------------------------- kernel
def kernel_inputs(B: int, K: int, V: int, deterministic: bool, seed: int, dev: str):
    """Random acceptance inputs, built in place (the large case holds 16 GB): peaked target and draft
    distributions, targets half-mixed with the drafts so runs of acceptances happen, ragged draft counts."""
    torch = _torch()
    g = torch.Generator(device=dev).manual_seed(seed)
    tp = torch.rand(B, K + 1, V, generator=g, device=dev)  # (B, K+1, V)
    tp.pow_(4)
    tp.div_(tp.sum(-1, keepdim=True))
    dp = None
    if K == 0:
        drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
    elif deterministic:
        drafts = tp[:, :K].argmax(-1)  # (B, K)
        wrong = torch.rand(B, K, generator=g, device=dev) < 0.3
        drafts = torch.where(wrong, torch.randint(0, V, (B, K), generator=g, device=dev), drafts)
    else:
        dp = torch.rand(B, K, V, generator=g, device=dev)  # (B, K, V)
        dp.pow_(4)
        dp.div_(dp.sum(-1, keepdim=True))
        drafts = torch.multinomial(dp.view(-1, V), 1, generator=g).view(B, K)
        tp[:, :K].mul_(0.5).add_(dp, alpha=0.5)
    nd = torch.randint(0, K + 1, (B,), generator=g, device=dev)
    drafts = torch.where(torch.arange(K, device=dev)[None] < nd[:, None], drafts, torch.full_like(drafts, -1))
    ua = torch.rand(B, K, generator=g, device=dev)
    un = torch.rand(B, generator=g, device=dev)
    return drafts, dp, tp, nd, ua, un


def tie_gap(b: int, tok_a: int, tok_b: int, drafts, dp, tp, nd, ref, un) -> float:
    """How far (relative to the total mass) the draw of row b is from the CDF step between the two
    tokens picked, in float64: ~0 means the two implementations' sums just rounded differently."""
    from speclab.engine.acceptance import RESIDUAL_EPS

    torch = _torch()
    n = int(ref.num_accepted[b])
    t = tp[b, n].double()
    dist = t
    if n < int(nd[b]):  # rejected: the residual max(target - draft, 0), unless it has no mass
        if dp is not None:
            q = dp[b, n].double()
        else:
            q = torch.zeros_like(t)
            q[int(drafts[b, n])] = 1.0
        res = (t - q).clamp(min=0)
        dist = res if float(res.sum()) > RESIDUAL_EPS else t
    cdf = dist.cumsum(0)
    total = float(cdf[-1])
    goal = float(un[b]) * total
    lo, hi = sorted((tok_a, tok_b))
    return max(abs(float(cdf[lo]) - goal), abs(float(cdf[hi - 1]) - goal)) / total


def sec_kernel(part: Part, args, sz: Sizes) -> None:
    torch = _torch()
    from speclab.engine.acceptance import fused_rejection_sample, rejection_sample
    from speclab.kernels.rejection import triton_available

    dev = sz.device
    if not triton_available(dev):
        part.skip("Triton cannot run here (no CUDA device, no TRITON_INTERPRET=1)")
        return
    if dev == "cpu":
        part.note("Triton interpreter on the CPU (dry run): small cases only; the past-2^31 offsets are checked by "
                  "tests/kernel_check.py under the interpreter and here on the GPU")
    cases = [(c, "") for c in sz.kernel_cases]
    if sz.kernel_large is not None:
        cases.append((sz.kernel_large, "large"))
    verdicts = []
    largest = 0
    for i, ((B, K, V, det), tag) in enumerate(cases):
        elements = B * (K + 1) * V
        if tag == "large" and dev == "cuda":
            need = (B * (K + 1) * V + (0 if det else B * K * V)) * 4 * 1.2
            free = torch.cuda.mem_get_info()[0]
            if need > free:
                part.note(f"large case skipped: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
                continue
        t0 = time.perf_counter()
        inputs = kernel_inputs(B, K, V, det, seed=i, dev=dev)
        drafts, dp, tp, nd, ua, un = inputs
        ref = rejection_sample(*inputs)
        got = fused_rejection_sample(*inputs)
        sync(dev)
        acc_eq = bool(torch.equal(ref.num_accepted, got.num_accepted))
        bonus_eq = bool(torch.equal(ref.is_bonus, got.is_bonus))
        diff = (ref.next_token != got.next_token).nonzero().flatten().tolist()
        gaps = [tie_gap(b, int(ref.next_token[b]), int(got.next_token[b]), drafts, dp, tp, nd, ref, un) for b in diff]
        ties = sum(g <= TIE_RTOL for g in gaps)
        # both sides draw on an integer CDF (exact in any order): a tie is no excuse, any difference is a
        # mismatch; summation_ties says how many differing draws sat at a CDF step (a float-order symptom)
        verdict = "exact" if acc_eq and bonus_eq and not diff else "MISMATCH"
        verdicts.append(verdict)
        largest = max(largest, elements)
        part.row(B=B, K=K, V=V, drafts="deterministic" if det else "sampled", elements=elements,
                 past_2_31=elements > 2**31, accepted_equal=acc_eq, bonus_equal=bonus_eq,
                 token_mismatches=len(diff), summation_ties=ties, max_gap=max(gaps, default=0.0), verdict=verdict,
                 seconds=round(time.perf_counter() - t0, 2))
        del inputs, drafts, dp, tp, nd, ua, un, ref, got
        if dev == "cuda":
            torch.cuda.empty_cache()
    if sz.kernel_timing is not None:
        B, K, V = sz.kernel_timing
        inputs = kernel_inputs(B, K, V, False, seed=99, dev=dev)
        tk = time_fn(lambda: fused_rejection_sample(*inputs), 20, dev)
        tr = time_fn(lambda: rejection_sample(*inputs), 20, dev)
        part.summary(kernel_ms=tk["synced_ms"], reference_ms=tr["synced_ms"], timing_shape=f"B={B} K={K} V={V}")
        part.row(timing=f"B={B} K={K} V={V}", kernel_ms=tk["synced_ms"], reference_ms=tr["synced_ms"])
    overall = "MISMATCH" if "MISMATCH" in verdicts else "exact"
    part.summary(verdict=overall, cases=len(verdicts), largest_elements=largest, past_2_31=largest > 2**31)


# ---------------------------------------------------------------------------------------------- roofline
def _prefill(cache, rows: int, context: int, vocab: int, dev: str) -> None:
    torch = _torch()
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, vocab - 1, (rows, context), generator=g).to(dev)
    cache.forward(ids, torch.zeros(rows, dtype=torch.long, device=dev), kv_len=context)


def step_fns(lm, rows: int, T: int, context: int, *, graphs: bool, capture: bool, compile: str | None = None):
    """A closure running one cached forward of T tokens per row after ``context`` positions (the same
    slots every call), through the eager cache or a graphed one; and that cache."""
    torch = _torch()
    from speclab.models.cuda_graphs import GraphedCache

    dev = str(lm.device)
    V = lm.vocab_size
    inner = lm.native.new_cache(rows, context + 64)
    _prefill(inner, rows, context, V, dev)
    cache = inner
    if graphs:
        cache = GraphedCache(inner, max_tokens=max(T, 1), capture=capture, compile=compile)
        cache.live = rows
    g = torch.Generator(device="cpu").manual_seed(2)
    tok = torch.randint(0, V - 1, (rows, T), generator=g).to(dev)
    start = torch.full((rows,), context, dtype=torch.long, device=dev)
    return (lambda: cache.forward(tok, start, kv_len=context + T)), cache


def roofline_rows(part: Part, lm, sz: Sizes, modes: list[tuple[str, dict]], bandwidth: float,
                  tokens: tuple[int, ...]) -> dict:
    """Rows (T, mode, step ms, roofline ms, fraction) for each T in ``tokens`` and each mode (the first
    mode's logits are the reference of the others'), and for T = 1 where each mode's device time goes;
    returns {(T, mode): synced ms}."""
    torch = _torch()
    dev = str(lm.device)
    wb = weight_bytes(lm)
    out = {}
    for T in tokens:
        ref_logits = None
        for mode, kw in modes:
            t0 = time.perf_counter()
            try:
                fn, cache = step_fns(lm, 1, T, sz.context, **kw)
                logits = fn().logits.float()
                if ref_logits is None:
                    ref_logits = logits
                diff = float((logits - ref_logits).abs().max())
                same_argmax = bool(torch.equal(logits.argmax(-1), ref_logits.argmax(-1)))
                t = time_fn(fn, sz.reps, dev)
            except Exception as e:  # noqa: BLE001 - one mode failing leaves the others
                part.note(f"T={T} {mode}: {type(e).__name__}: {str(e)[:300]}")
                continue
            read = wb + kv_bytes(lm, 1, sz.context + T)
            floor_ms = read / (bandwidth * 1e9) * 1e3
            out[(T, mode)] = t["synced_ms"]
            part.row(T=T, mode=mode, step_ms=t["synced_ms"], pipelined_ms=t["pipelined_ms"], roofline_ms=floor_ms,
                     fraction=floor_ms / t["synced_ms"], pipelined_fraction=floor_ms / t["pipelined_ms"],
                     achieved_gbs=read / (t["synced_ms"] * 1e-3) / 1e9, max_abs_logit_diff=diff,
                     same_argmax=same_argmax, stats=dict(getattr(cache, "stats", {})),
                     setup_s=round(time.perf_counter() - t0, 2))
            if T == 1:
                for row in kernel_breakdown(fn, dev, 10):
                    part.table("kernels", T=T, mode=mode, step_ms=t["synced_ms"], **row)
    return out


def sec_roofline(part: Part, args, sz: Sizes) -> None:
    torch = _torch()
    dev = sz.device
    t0 = time.perf_counter()
    lm = random_llama(sz.big, dev, sz.big_dtype)
    n_params = sum(p.numel() for p in lm.hf_model.parameters())
    part.summary(parameters=n_params, weight_bytes_read=weight_bytes(lm), dtype=sz.big_dtype, context=sz.context,
                 bandwidth_gbs=args.bandwidth_gbs, dims=sz.big, build_s=round(time.perf_counter() - t0, 1))
    part.log(f"{n_params / 1e9:.3f}B parameters built in {time.perf_counter() - t0:.1f}s")
    cuda = dev == "cuda" and torch.cuda.is_available()
    modes = [("eager", dict(graphs=False, capture=False)), ("static eager", dict(graphs=True, capture=False))]
    if cuda:
        modes.append(("cuda graphs", dict(graphs=True, capture=True)))
    else:
        part.note("cuda graphs: skipped: no CUDA (the static-shape path they replay runs eagerly: 'static eager')")
    times = roofline_rows(part, lm, sz, modes, args.bandwidth_gbs, (1, sz.k + 1))
    floor = (weight_bytes(lm) + kv_bytes(lm, 1, sz.context + 1)) / (args.bandwidth_gbs * 1e9) * 1e3
    best = "cuda graphs" if cuda else "static eager"
    e, g = times.get((1, "eager")), times.get((1, best))
    part.summary(roofline_ms=floor, eager_ms=e, graphs_ms=g if cuda else None,
                 fraction_eager=floor / e if e else None, fraction_graphs=floor / g if (g and cuda) else None,
                 graph_speedup=e / g if (e and g and cuda) else None,
                 verify_graph_speedup=(times[(sz.k + 1, "eager")] / times[(sz.k + 1, best)]
                                       if cuda and (sz.k + 1, best) in times and (sz.k + 1, "eager") in times
                                       else None))


def sec_compile(part: Part, args, sz: Sizes) -> None:
    """The graph step again with the static forward compiled (Inductor on the GPU; on the CPU dry run the
    'eager' backend, which traces without generating code: the code path, not the speed)."""
    torch = _torch()
    dev = sz.device
    cuda = dev == "cuda" and torch.cuda.is_available()
    lm = random_llama(sz.big, dev, sz.big_dtype)
    backend = "inductor" if cuda else "eager"
    modes = [("eager", dict(graphs=False, capture=False)),
             (f"compile[{backend}]" + (" + cuda graphs" if cuda else ""),
              dict(graphs=True, capture=cuda, compile=backend))]
    if cuda:
        modes.insert(1, ("cuda graphs", dict(graphs=True, capture=True)))
    times = roofline_rows(part, lm, sz, modes, args.bandwidth_gbs, (1,))  # one shape: each compiles anew
    floor = (weight_bytes(lm) + kv_bytes(lm, 1, sz.context + 1)) / (args.bandwidth_gbs * 1e9) * 1e3
    c = times.get((1, modes[-1][0]))
    part.summary(roofline_ms=floor, compiled_ms=c, fraction_compiled=floor / c if (c and cuda) else None,
                 backend=backend, mode=modes[-1][0])
    compiled_rounds(part, args, sz, lm, backend, cuda)


def compiled_rounds(part: Part, args, sz: Sizes, target, backend: str, cuda: bool) -> None:
    """The whole round (plain decoding, then speculative with the small draft) at batch 1 with its forwards
    compiled, then captured as one graph: the least a decode step and a round take here."""
    torch = _torch()
    draft = random_llama(sz.draft, sz.device, sz.big_dtype, seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.vocab_size - 1, (1, sz.context), generator=g).to(sz.device)
    best = "cuda graph" if cuda else "eager"
    times = {}
    for k in (0, sz.k):
        t0 = time.perf_counter()
        r = DeviceRound(target, draft if k else None, 1, k, sz.context + (sz.rounds + 3) * (k + 1) + 1,
                        compile=backend)
        floors = round_floors(target, draft, 1, k, sz.context, args)
        times[k] = time_round(part, r, prompts, sz, cuda, floors, dict(batch=1, k=k, compile=backend),
                              table="whole round, compiled")[best]["round_ms"]
        part.log(f"k={k}: compiled, captured and timed in {time.perf_counter() - t0:.1f}s")
        if k == 0:
            floor = floors["verify_s"] * 1e3
            part.summary(round_compiled_ms=times[0], round_floor_ms=floor,
                         fraction_round_compiled=floor / times[0] if cuda else None, round_mode=best)
    part.summary(spec_round_compiled_ms=times[sz.k], k=sz.k,
                 spec_speedup={f"{a}": expected_tokens(a, sz.k) * times[0] / times[sz.k] for a in sz.alphas})


# ---------------------------------------------------------------------------------------------- round
def round_floors(target, draft, rows: int, k: int, slots: int, args) -> dict:
    """Floor seconds of a round's forwards: the draft's k steps (the first reads two tokens) and the verify
    forward of k + 1 tokens per row, each the longer of its HBM read and its matmuls at the peak rate."""
    f = lambda lm, T, n: forward_floor_s(lm, rows, T, n, args.bandwidth_gbs, args.peak_tflops)  # noqa: E731
    d = 0.0
    if k > 0:
        d = f(draft, 2, slots)["floor_s"] + (k - 1) * f(draft, 1, slots)["floor_s"]
    v = f(target, k + 1, slots + k)
    return {"draft_s": d, "verify_s": v["floor_s"], "verify_hbm_s": v["hbm_s"], "verify_matmul_s": v["matmul_s"]}


def time_round(part: Part, r: DeviceRound, prompts, sz: Sizes, cuda: bool, floors: dict, label: dict,
               profile: bool = False, table: str | None = None) -> dict:
    """Eager, then (on CUDA) graphed: phase times and the whole round's time; one row each (in the section's
    rows, or in ``table``); with ``profile`` the device time of the last mode's round by kind of kernel.
    Returns {mode: {round_ms, floor_ms, the phases' ms}}."""
    torch = _torch()
    r.prefill(prompts)
    snap = r.snapshot()
    modes = [("eager", False)]
    if cuda:
        t0 = time.perf_counter()
        r.capture()
        label = dict(label, capture_s=round(time.perf_counter() - t0, 2))
        modes.append(("cuda graph", True))
    out = {}
    floor_ms = (floors["draft_s"] + floors["verify_s"]) * 1e3
    for mode, graphs in modes:
        r.restore(snap)
        ph = r.time_phases(sz.rounds, graphs)
        r.restore(snap)
        whole = r.time_whole(sz.rounds, graphs)
        per_round = float((r.length - prompts.shape[1]).float().mean()) / sz.rounds
        out[mode] = dict(round_ms=whole, floor_ms=floor_ms, **{f"{p}_ms": ph[p] for p in PHASES})
        add = part.row if table is None else (lambda **kw: part.table(table, **kw))
        add(**label, mode=mode, **{f"{p}_ms": ph[p] for p in PHASES}, phases_ms=ph["round"], round_ms=whole,
            floor_ms=floor_ms, fraction=floor_ms / whole, draft_floor_ms=floors["draft_s"] * 1e3,
            verify_floor_ms=floors["verify_s"] * 1e3,
            verify_bound="matmul" if floors["verify_matmul_s"] > floors["verify_hbm_s"] else "hbm",
            tokens_per_round=per_round)
    if profile:
        mode, graphs = modes[-1]
        r.restore(snap)
        kinds = kernel_breakdown(lambda: r.replay("round") if graphs else r.round(), r.dev, sz.rounds - 1)
        if not kinds:
            part.note(f"{label}: the profiler saw no kernels in the {mode} round")
        for row in kinds:
            part.table("kernels", **label, mode=mode, round_ms=out[mode]["round_ms"], **row)
    r.restore(snap)
    if cuda:
        torch.cuda.synchronize()
    return out


def sec_round(part: Part, args, sz: Sizes) -> None:
    """The speculative round of a 1B target and a small draft taken apart (draft steps, verify, acceptance,
    bookkeeping) at each batch, against its floor, eagerly and as CUDA graphs (one per phase, and one for the
    whole round); plain decoding through the same code (k = 0) beside it; the speedups at acceptance 0.6 and
    0.8 that the measured round times imply; greedy identity of the round with graphs on and off."""
    torch = _torch()
    dev = sz.device
    cuda = dev == "cuda" and torch.cuda.is_available()
    target = random_llama(sz.big, dev, sz.big_dtype, copy_head=True)
    draft = random_llama(sz.draft, dev, sz.big_dtype, copy_head=True, seed=1)
    part.summary(target_dims=sz.big, draft_dims=sz.draft, dtype=sz.big_dtype, k=sz.k, context=sz.context,
                 rounds=sz.rounds, bandwidth_gbs=args.bandwidth_gbs, peak_tflops=args.peak_tflops,
                 cuda_graphs=cuda, draft_parameters=sum(p.numel() for p in draft.hf_model.parameters()))
    if not cuda:
        part.note("cuda graphs: skipped: no CUDA (the phases and rounds run eagerly)")
    part.note("random weights with copy heads: every draft is accepted (k + 1 tokens a round); a static round's "
              "time does not depend on acceptance, so speedups at other acceptance rates follow from the times")
    g = torch.Generator().manual_seed(0)
    V = target.vocab_size
    best = "cuda graph" if cuda else "eager"
    speed: dict[str, dict[int, float]] = {f"{a}": {} for a in sz.alphas}
    for rows in sz.round_batches:
        prompts = torch.randint(0, V - 1, (rows, sz.context), generator=g).to(dev)
        times = {}
        for k in (0, sz.k):
            max_len = sz.context + (sz.rounds + 1) * (k + 1) + 1
            r = DeviceRound(target, draft if k else None, rows, k, max_len)
            floors = round_floors(target, draft, rows, k, sz.context, args)
            try:
                times[k] = time_round(part, r, prompts, sz, cuda, floors, dict(batch=rows, k=k), profile=rows == 1)
            except Exception as e:  # noqa: BLE001 - one batch failing (memory) leaves the others
                part.note(f"batch {rows} k={k}: {type(e).__name__}: {str(e)[:300]}")
            del r
        if 0 in times and sz.k in times:
            for a in sz.alphas:
                t0, tk = times[0][best]["round_ms"], times[sz.k][best]["round_ms"]
                sp = expected_tokens(a, sz.k) * t0 / tk
                speed[f"{a}"][rows] = sp
                part.table("speedup", batch=rows, k=sz.k, mode=best, alpha=a, speedup=sp,
                           tokens_per_s=rows * expected_tokens(a, sz.k) / tk * 1e3, plain_tokens_per_s=rows / t0 * 1e3)
            if rows == 1:
                part.summary(batch1={"plain": times[0][best], "speculative": times[sz.k][best]})
        if cuda:
            torch.cuda.empty_cache()
        # after every batch: a section stopped at its budget keeps the crossover of the batches it measured
        cross = {a: next((b for b, v in sorted(sp.items()) if v < 1.0), None) for a, sp in speed.items()}
        part.summary(speedup=speed, crossover_batch=cross, batches=[b for b in sz.round_batches if b <= rows],
                     mode=best)
    del target, draft
    round_identity(part, sz, cuda)


def _round_tokens(target, draft, prompts, k: int, new: int, graphs: bool) -> list[list[int]]:
    """Every row's first ``new`` generated tokens from DeviceRound (graphed or eager)."""
    P = prompts.shape[1]
    r = DeviceRound(target, draft if k else None, prompts.shape[0], k, P + (new + 3) * (k + 1) + 1)
    r.prefill(prompts)
    if graphs:
        r.capture()
    for _ in range(new):  # at least one token a round
        r.replay("round") if graphs else r.round()
    return [row[P:P + new] for row in r.tokens()]


def round_identity(part: Part, sz: Sizes, cuda: bool) -> None:
    """fp32 tiny models (the draft a perturbed copy of the target: some drafts accepted, some not): the round,
    plain and speculative, graphed and eager, against HF generate. bf16 1B (random heads: greedy paths that
    vary): the round with graphs on against off, and speculative against plain."""
    modes = (False, True) if cuda else (False,)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_round_"))
    try:
        ok = tiny_round_identity(part, sz, modes, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    part.summary(fp32_identical=ok)
    torch = _torch()
    target = random_llama(sz.big, sz.device, sz.big_dtype)
    draft = random_llama(sz.draft, sz.device, sz.big_dtype, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, target.vocab_size - 1, (4, sz.context), generator=g).to(sz.device)
    outs = {(gr, k): _round_tokens(target, draft, prompts, k, sz.identity_new, gr) for gr in modes for k in (0, sz.k)}
    if cuda:
        for k in (0, sz.k):
            same = _identity_row(part, f"{_round_name(k)}, graph = eager", sz.big_dtype, True,
                                 outs[(True, k)], outs[(False, k)])
            part.summary(**{f"graph_equals_eager_k{k}": same})
    _identity_row(part, f"{_round_name(sz.k)} = plain round", sz.big_dtype, cuda, outs[(cuda, sz.k)], outs[(cuda, 0)])


def tiny_round_identity(part: Part, sz: Sizes, modes: tuple, tmp: Path) -> bool:
    torch = _torch()
    from speclab.models import load_model

    tname, dname, texts = _tiny_models(tmp)
    tl = load_model(tname, device=sz.device, dtype=torch.float32, role="target")
    dl = load_model(dname, device=sz.device, dtype=torch.float32, role="draft")
    prompts = torch.tensor([tl.encode(t)[:8] for t in texts if len(tl.encode(t)) >= 8], device=tl.device)
    ref = []
    for row in prompts:  # HF stops at EOS (and emits it); the round does not stop: compare up to HF's end
        gen = tl.hf_model.generate(input_ids=row[None], attention_mask=torch.ones_like(row[None]), do_sample=False,
                                   max_new_tokens=sz.identity_new, pad_token_id=0)
        ref.append(gen[0, prompts.shape[1]:].tolist())
    ok = True
    for graphs in modes:
        for k in (0, sz.k):
            got = _round_tokens(tl, dl, prompts, k, sz.identity_new, graphs)
            got = [x[:len(y)] for x, y in zip(got, ref)]
            ok &= _identity_row(part, f"{_round_name(k)} = HF generate", "fp32", graphs, got, ref)
    return ok


def _round_name(k: int) -> str:
    return f"speculative round (k={k})" if k else "plain round"


def _identity_row(part: Part, check: str, dtype: str, graphs: bool, got, ref) -> bool:
    same, share = _agreement(got, ref)
    part.table("identity", check=check, dtype=dtype, cuda_graph=graphs, rows_identical=f"{same}/{len(ref)}",
               tokens_in_common_prefix=share, ok=same == len(ref))
    return same == len(ref)


# ---------------------------------------------------------------------------------------------- crossovers
def decode_step_s(lm, rows: int, context: int, graphs: bool, reps: int) -> float:
    """Median seconds of a decode step (T = 1) at ``rows`` rows, eager or through CUDA graphs."""
    cuda = lm.device.type == "cuda"
    fn, _ = step_fns(lm, rows, 1, context, graphs=graphs and cuda, capture=cuda)
    return time_fn(fn, reps, str(lm.device))["synced_ms"] / 1e3


def run_batch(lm, drafter, k: int, prompts: list[list[int]], new: int, graphs: bool) -> dict:
    """One persistent scheduler (its graphs captured before the clock starts), a warm-up run, then the
    measured run of ``prompts`` (EOS ignored: every row generates ``new`` tokens)."""
    from speclab.engine import Request, Scheduler
    from speclab.engine.policies import Fixed
    from speclab.models.cuda_graphs import GraphedCache

    dev = str(lm.device)
    b = len(prompts)
    longest = max(len(p) for p in prompts) + new
    s = Scheduler(lm, drafter, Fixed(k) if drafter is not None else None, max_running=b, max_waiting=b,
                  max_len=longest, capacity=b, record_costs=False, cuda_graphs=graphs)
    captured = 0
    for c in (s.cache, getattr(drafter, "cache", None)):
        if isinstance(c, GraphedCache):  # the shapes of the first and the last rounds (their kv buckets)
            for kv in sorted({min(len(p) for p in prompts) + 1, longest}):
                captured += c.capture_shapes([b], list(range(1, s.k_max + 2)), kv)

    def once(n_new: int):
        reqs = [Request(list(p), n_new, ignore_eos=True) for p in prompts]
        for r in reqs:
            s.submit(r)
        sync(dev)
        t = time.perf_counter()
        s.run_until_idle()
        sync(dev)
        return reqs, time.perf_counter() - t

    once(min(new, k + 2))
    r0 = s.round
    reqs, wall = once(new)
    tokens = sum(len(r.generated) for r in reqs)
    drafted, accepted = sum(r.drafted for r in reqs), sum(r.accepted for r in reqs)
    stats = {}
    if isinstance(s.cache, GraphedCache):
        stats = dict(s.cache.stats)
    return dict(tokens_per_s=tokens / wall, wall_s=wall, tokens=tokens, rounds=s.round - r0,
                acceptance=accepted / drafted if drafted else None, captured=captured, graph_stats=stats)


def crossover_rows(part: Part, lm, configs: list[tuple[str, object]], prompt_sets: dict, sz: Sizes, new: int,
                   graphs: bool, before_batch=None) -> dict:
    """Per batch: plain decoding, then each (name, drafter) config; speedup = tokens/s over plain's.
    Returns {config: crossover batch (the smallest batch where speculation loses) or None}."""
    losing: dict[str, int | None] = {name: None for name, _ in configs}
    for b in sz.batches:
        prompts = prompt_sets[b]
        if before_batch is not None:
            before_batch(b)
        try:
            base = run_batch(lm, None, 0, prompts, new, graphs)
        except Exception as e:  # noqa: BLE001
            part.note(f"batch {b} plain: {type(e).__name__}: {str(e)[:300]}")
            continue
        part.row(batch=b, draft="none", k=0, tokens_per_s=base["tokens_per_s"], speedup=1.0, acceptance=None,
                 rounds=base["rounds"], wall_s=base["wall_s"], captured=base["captured"])
        for name, drafter in configs:
            try:
                m = run_batch(lm, drafter, sz.k, prompts, new, graphs)
            except Exception as e:  # noqa: BLE001
                part.note(f"batch {b} {name}: {type(e).__name__}: {str(e)[:300]}")
                continue
            sp = m["tokens_per_s"] / base["tokens_per_s"]
            extra = {}
            for attr in ("recomputed", "unprepared", "cost"):
                if hasattr(drafter, attr):
                    extra[attr] = getattr(drafter, attr)
            part.row(batch=b, draft=name, k=sz.k, tokens_per_s=m["tokens_per_s"], speedup=sp,
                     acceptance=m["acceptance"], rounds=m["rounds"], wall_s=m["wall_s"], captured=m["captured"],
                     **extra)
            if sp < 1.0 and losing[name] is None:
                losing[name] = b
    return losing


def synthetic_configs(lm, sz: Sizes, args, all_prompts: list[list[int]], new: int, graphs: bool, part: Part):
    """The synthetic drafters (one per alpha), prepared outside the timed runs, and a per-batch hook that
    sets their cost: ``--draft-cost`` x the decode step *as run* (the drafter calibrates on eager steps;
    with CUDA graphs a step is faster, so its cost factor is scaled by graphed / eager step time)."""
    from speclab.drafters import make_drafter

    drafters = []
    for a in sz.alphas:
        d = make_drafter(f"synthetic:{a}:{args.draft_cost}", lm)
        spent = d.prepare(all_prompts, new, rows=sz.batches)
        part.log(f"synthetic:{a} prepared in {spent:.1f}s (oracles + eager step times)")
        drafters.append((f"synthetic:{a}:{args.draft_cost}", d))
    cuda = lm.device.type == "cuda"

    def before_batch(b: int) -> None:
        scale = 1.0
        if graphs and cuda:
            ctx = drafters[0][1].context
            t_graph = decode_step_s(lm, b, ctx, True, max(5, sz.reps // 5))
            t_eager = drafters[0][1].step_time(b)
            scale = t_graph / t_eager
            part.log(f"batch {b}: decode step {t_graph * 1e3:.3f} ms with graphs, {t_eager * 1e3:.3f} ms eager "
                     f"(calibrated): synthetic cost x{scale:.2f}")
        for _, d in drafters:
            d.cost = args.draft_cost * scale

    return drafters, before_batch


def sec_crossover_1b(part: Part, args, sz: Sizes) -> None:
    torch = _torch()
    dev = sz.device
    graphs = not args.no_graphs
    lm = random_llama(sz.big, dev, sz.big_dtype, copy_head=True)
    part.summary(dims=sz.big, dtype=sz.big_dtype, k=sz.k, prompt_len=sz.prompt_len, new_tokens=sz.new_tokens,
                 draft_cost=args.draft_cost, cuda_graphs=graphs and dev == "cuda",
                 static_path=graphs and dev != "cuda")
    g = torch.Generator().manual_seed(0)
    V = lm.vocab_size
    pool = [torch.randint(0, V - 1, (sz.prompt_len,), generator=g).tolist() for _ in range(max(sz.batches))]
    prompt_sets = {b: pool[:b] for b in sz.batches}
    configs, before = synthetic_configs(lm, sz, args, pool, sz.new_tokens, graphs, part)
    cross = crossover_rows(part, lm, configs, prompt_sets, sz, sz.new_tokens, graphs, before)
    part.summary(crossover_batch=cross, batches=list(sz.batches))


def sec_crossover_family(part: Part, args, sz: Sizes) -> None:
    from speclab.analysis.sweep import cached_model
    from speclab.defaults import default_draft, default_target
    from speclab.drafters import make_drafter
    from speclab.workloads import load_all

    dev = sz.device
    graphs = not args.no_graphs
    lm = cached_model(default_target(), device=dev, role="target")
    texts = [p.prompt for ps in load_all().values() for p in ps]
    ids = [lm.encode(t)[: 4 * sz.prompt_len] for t in texts]
    prompt_sets = {b: [ids[i % len(ids)] for i in range(b)] for b in sz.batches}
    part.summary(target=lm.name, dtype=str(lm.dtype), k=sz.k, new_tokens=sz.family_new, cuda_graphs=graphs,
                 prompts=len(ids))
    draft = default_draft()
    configs = [(draft, make_drafter(draft, lm)), ("ngram", make_drafter("ngram", lm))]
    synth, before = synthetic_configs(lm, sz, args, ids[: max(sz.batches)], sz.family_new, graphs, part)
    cross = crossover_rows(part, lm, configs + synth, prompt_sets, sz, sz.family_new, graphs, before)
    part.summary(crossover_batch=cross, batches=list(sz.batches))


# ---------------------------------------------------------------------------------------------- exactness
def _tiny_models(root: Path) -> tuple[str, str, list[str]]:
    """A tiny random target and a perturbed-copy draft (partial acceptance), with a character tokenizer."""
    from speclab.testing import char_tokenizer, tiny_llama

    tok = char_tokenizer()
    eos = len(tok) - 1
    tgt = tiny_llama(root / "target", tok, seed=0, layers=2, hidden=64, kv_heads=2, max_pos=256, init=0.2, eos=eos)
    tiny_llama(root / "draft", tok, seed=1, layers=2, hidden=64, kv_heads=2, max_pos=256, init=0.2, eos=eos,
               base_state=tgt.state_dict(), noise=0.3)
    prompts = ["hello world", "the cat sat on the mat", "abc abc abc abc", "speculative decoding works",
               "quick brown fox", "one two three four"]
    return str(root / "target"), str(root / "draft"), prompts


def _hf_greedy(lm, prompts: list[str], new: int) -> list[list[int]]:
    torch = _torch()
    out = []
    eos = list(lm.eos_token_ids) or None
    for p in prompts:
        ids = torch.tensor([lm.encode(p)], device=lm.device)
        gen = lm.hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new, eos_token_id=eos, pad_token_id=eos[0] if eos else None)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


def _greedy(lm, drafter, prompts, k: int, new: int, graphs: bool, batched: bool) -> list[list[int]]:
    from speclab.engine import SpeculativeDecoder

    dec = SpeculativeDecoder(lm, drafter, cuda_graphs=graphs)
    if batched:
        return dec.generate(prompts, k=k, max_new_tokens=new, record=False).output_tokens
    return [dec.generate([p], k=k, max_new_tokens=new, record=False).output_tokens[0] for p in prompts]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(rows identical, share of b's tokens inside the common prefix of each row)."""
    same = sum(x == y for x, y in zip(a, b))
    common = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        common += n
    return same, common / max(1, sum(len(y) for y in b))


def sec_exactness(part: Part, args, sz: Sizes) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_tiny_"))
    try:
        exactness(part, sz, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def exactness(part: Part, sz: Sizes, tmp: Path) -> None:
    torch = _torch()
    from speclab.defaults import default_draft, default_target
    from speclab.drafters import make_drafter
    from speclab.family import resolve
    from speclab.models import load_model
    from speclab.workloads import load_all

    dev = sz.device
    n_p, new, k = sz.exact_prompts, sz.exact_new, sz.k
    sets = []
    if resolve(default_target()) is not None:
        texts = [ps[0].prompt for ps in load_all().values()]
        sets.append(("family", default_target(), default_draft(), (texts * n_p)[:n_p]))
    tgt, drf, tiny_prompts = _tiny_models(tmp)
    sets.append(("tiny", tgt, drf, tiny_prompts[:n_p]))
    all_ok = True
    graph_modes = (True, False)  # on CUDA: captured graphs; on the CPU: the static path, run eagerly
    for label, tname, dname, prompts in sets:
        lm = load_model(tname, device=dev, dtype=torch.float32, role="target")
        ref = _hf_greedy(lm, prompts, new)
        for graphs in graph_modes:
            plain1 = _greedy(lm, None, prompts, 0, new, graphs, False)
            plainb = _greedy(lm, None, prompts, 0, new, graphs, True)
            for dspec in (dname, "ngram"):
                d = make_drafter(dspec, lm)
                spec1 = _greedy(lm, d, prompts, k, new, graphs, False)
                specb = _greedy(lm, d, prompts, k, new, graphs, True)
                for what, got in (("plain, batch 1 = HF generate", plain1),
                                  (f"plain, ragged batch {len(prompts)} = HF generate", plainb),
                                  (f"speculative ({d.name}, k={k}), batch 1 = HF generate", spec1),
                                  (f"speculative ({d.name}, k={k}), ragged batch = HF generate", specb)):
                    if dspec == "ngram" and what.startswith("plain"):
                        continue  # plain rows once per graph mode
                    same, share = _agreement(got, ref)
                    ok = same == len(ref)
                    all_ok &= ok
                    part.row(models=label, dtype="fp32", cuda_graphs=graphs, check=what,
                             rows_identical=f"{same}/{len(ref)}", tokens_in_common_prefix=share, ok=ok)
        del lm
    # bf16: speculative vs plain on the same device (no HF reference: bf16 sums differ by batch shape)
    label, tname, dname, prompts = sets[0]
    lm = load_model(tname, device=dev, dtype=torch.bfloat16, role="target")
    bf_rows, bf_same, bf_share = 0, 0, []
    for batched in (False, True):
        plain = _greedy(lm, None, prompts, 0, new, True, batched)
        d = make_drafter(dname, lm)
        spec = _greedy(lm, d, prompts, k, new, True, batched)
        same, share = _agreement(spec, plain)
        bf_rows += len(plain)
        bf_same += same
        bf_share.append(share)
        part.row(models=label, dtype="bf16", cuda_graphs=True, check=f"speculative ({d.name}, k={k}) = plain, "
                 f"{'ragged batch' if batched else 'batch 1'}", rows_identical=f"{same}/{len(plain)}",
                 tokens_in_common_prefix=share, ok=same == len(plain))
    part.summary(fp32_identical=all_ok, bf16_rows_identical=f"{bf_same}/{bf_rows}",
                 bf16_tokens_in_common_prefix=statistics.mean(bf_share))


# ---------------------------------------------------------------------------------------------- train
def train_specs(sz: Sizes):
    """The stronger family: the shipped specs (run with ``train_scale`` x the batch and tokens, same steps);
    in the dry run, tiny models for two steps each."""
    from speclab.family.specs import DEFAULT_SPECS

    if not sz.train_tiny:
        return list(DEFAULT_SPECS)
    return [replace(s, hidden=32, layers=1, heads=2, ffn=64, seq=64, batch=4, tokens=2 * 4 * 64, warmup=1,
                    copy_schedule=((1, 0.25),) if s.copy_schedule else (),
                    code_schedule=((1, 0.25),) if s.code_schedule else ()) for s in DEFAULT_SPECS]


def pack(src: Path, out_dir: Path, stem: str, max_parts: int = 4) -> list[str]:
    """``src`` as a .tar.gz split into PART_BYTES pieces in ``out_dir`` (the device tool returns at most
    8 files of 16 MiB): join with ``cat stem.tar.gz.part* > stem.tar.gz``."""
    import tarfile

    blob = out_dir / f"{stem}.tar.gz"
    with tarfile.open(blob, "w:gz") as tar:
        tar.add(src, arcname=stem)
    data = blob.read_bytes()
    blob.unlink()
    parts = []
    n = -(-len(data) // PART_BYTES)
    if n > max_parts:
        raise RuntimeError(f"{len(data) / 2**20:.1f} MiB packed is more than {max_parts} parts of 15 MiB")
    for i in range(n):
        p = out_dir / f"{stem}.tar.gz.part{i:02d}"
        p.write_bytes(data[i * PART_BYTES:(i + 1) * PART_BYTES])
        parts.append(p.name)
    return parts


def sec_train(part: Part, args, sz: Sizes) -> None:
    from speclab.family import train as tr

    specs = train_specs(sz)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_train_"))
    scale = 1 if sz.train_tiny else int(sz.train_scale)
    kw = dict(seed=0, out_dir=work / "family", runs_dir=work / "runs", specs=specs, quality=False,
              acceptance=False, progress=False, threads=os.cpu_count() or 1, device=sz.device, batch_scale=scale)
    if not sz.train_tiny:  # 10x the tokens need more data than the standard library: see LARGE_CORPUS
        kw.update(corpus_kwargs=dict(tr.LARGE_CORPUS), copy_chars=tr.LARGE_COPY_CHARS,
                  tokenizer_chars=tr.LARGE_TOKENIZER_CHARS)
    else:
        kw.update(threads=1, vocab_size=512, alt_vocab_size=256, eval_tokens=2000, copy_chars=50_000,
                  corpus_kwargs=dict(code_chars=150_000, prose_chars=60_000, record_chars=100_000,
                                     packages=("numpy",)), tokenizer_chars=300_000)
    cfg = tr.TrainConfig(**kw)
    part.summary(specs=[dict(name=s.name, tokens=s.tokens, batch=s.batch, hidden=s.hidden, layers=s.layers)
                        for s in tr.scale_batches(specs, scale)],
                 batch_scale=scale, device=sz.device,
                 command=f"speclab train --device {sz.device} --batch-scale {scale} --seed 0"
                 + ("" if sz.train_tiny else " --large-corpus"))
    t0 = time.perf_counter()
    try:
        def saved(m: dict) -> None:  # each model as it is saved: its row, and the weights so far packed
            part.row(model=m["name"], role=m["role"], parameters=m["parameters"], tokens_seen=m["tokens_seen"],
                     heldout_loss=m["heldout_loss"], train_s=m.get("train_seconds"))
            for old in Path(args.out).glob("train_family.tar.gz.part*"):
                old.unlink()
            part.summary(weights=pack(work / "family", Path(args.out), "train_family"))

        tr.train_family(cfg, log=part.log, after_each=saved)
        parts = part.data["summary"]["weights"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    part.summary(train_s=round(time.perf_counter() - t0, 1), weights=parts)


FUNCS = {"env": sec_env, "kernel": sec_kernel, "roofline": sec_roofline, "round": sec_round,
         "crossover-1b": sec_crossover_1b,
         "exactness": sec_exactness, "crossover-family": sec_crossover_family, "compile": sec_compile,
         "train": sec_train}


# ---------------------------------------------------------------------------------------------- child
def run_child(args) -> int:
    sz = Sizes.tiny() if args.dry_run else Sizes()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading and saving bars would bury the progress lines
    hf_logging.set_verbosity_error()
    if args.dry_run:
        import torch

        torch.set_num_threads(1)
    resolve_peaks(args)
    part = Part(Path(args.part), args.child)
    try:
        FUNCS[args.child](part, args, sz)
        if part.data["status"] == "running":
            part.data["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded, and the parent goes on with the next section
        part.data["status"] = "failed"
        part.data["reason"] = f"{type(e).__name__}: {e}"
        part.data["traceback"] = traceback.format_exc()[-4000:]
        print(part.data["traceback"], flush=True)
    part.save()
    return 0


# ---------------------------------------------------------------------------------------------- parent
def select(args) -> list[tuple]:
    names = [s[0] for s in SECTIONS]
    only = [x for x in (args.only or "").split(",") if x]
    skip = [x for x in (args.skip or "").split(",") if x]
    for x in only + skip:
        if x not in names:
            raise SystemExit(f"gpu_check: unknown section '{x}' (sections: {', '.join(names)})")
    chosen = []
    for s in SECTIONS:
        if only and s[0] not in only:
            continue
        if s[0] in skip:
            continue
        if not only and s[0] in OPT_IN and not args.dry_run:
            continue
        chosen.append(s)
    return chosen


def timeouts(args) -> dict:
    """--timeout S (every section) or NAME=S (one), repeatable."""
    out = {}
    for t in args.timeout or []:
        if "=" in t:
            k, v = t.split("=", 1)
            out[k] = float(v)
        else:
            out["*"] = float(t)
    return out


def run_section(name: str, args, part_path: Path, limit: float, log) -> tuple[str, float]:
    """The section in its own process; its output goes to stdout and the log. Returns (how it ended, s)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--part", str(part_path),
            "--out", str(args.out), "--draft-cost", str(args.draft_cost)]
    for flag, v in (("--bandwidth-gbs", args.bandwidth_gbs), ("--peak-tflops", args.peak_tflops)):
        if v is not None:
            argv += [flag, str(v)]
    if args.dry_run:
        argv.append("--dry-run")
    if args.no_graphs:
        argv.append("--no-graphs")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if args.dry_run:
        env["OMP_NUM_THREADS"] = "1"
        if name == "kernel":
            env["TRITON_INTERPRET"] = "1"  # the kernel on the CPU, through Triton's interpreter
    else:
        env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def pump():
        for line in proc.stdout:
            log(line.rstrip("\n"))

    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        proc.wait(timeout=limit)
        how = "exited"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the section's own process group (it started a new session)
        proc.wait()
        how = "timeout"
    th.join(timeout=5)
    return how, time.perf_counter() - t0


def _f(x, spec) -> str:
    return "n/a" if x is None else format(x, spec)


def headline(sections: dict, dry: bool) -> list[tuple[str, str, str]]:
    """(metric, value, target) rows for the README."""

    def s(name):
        return sections.get(name, {}).get("summary", {})

    rows = _step_headline(s("roofline"), s("compile")) + _round_headline(s("round"))
    for name, label in (("crossover-1b", "1B target, engine"), ("crossover-family", "embedded family, engine")):
        x = s(name).get("crossover_batch")
        if x:
            top = max(s(name).get("batches") or [0])
            val = ", ".join(f"{d}: {b if b is not None else f'none up to {top}'}" for d, b in x.items())
            rows.append((f"crossover batch (speculation stops paying), {label}", val, ""))
    k = s("kernel")
    if k:
        rows.append(("Triton kernel vs PyTorch reference", f"{k.get('verdict')} ({k.get('cases')} cases, up to "
                     f"{_f(k.get('largest_elements'), ',')} elements)", "exact"))
    e = s("exactness")
    if e:
        rows.append(("greedy identity, fp32 (speculative = plain = HF generate)",
                     "identical" if e.get("fp32_identical") else "DIFFERENT", "identical"))
        rows.append(("bf16 speculative vs plain, rows identical", f"{e.get('bf16_rows_identical')} (tokens in common "
                     f"prefix {_f(e.get('bf16_tokens_in_common_prefix'), '.1%')})", ""))
    if dry:
        rows = [(m, v + " [dry run]", t) for m, v, t in rows]
    return rows


def _step_headline(r: dict, c: dict) -> list[tuple[str, str, str]]:
    rows = []
    if r:
        rows.append((f"1B decode step, batch 1 ({r.get('dtype')}, {r.get('context')} ctx), eager",
                     f"{_f(r.get('eager_ms'), '.3f')} ms = {_f(r.get('fraction_eager'), '.0%')} of roofline "
                     f"({_f(r.get('roofline_ms'), '.3f')} ms at {_f(r.get('bandwidth_gbs'), '.0f')} GB/s)", ""))
        rows.append(("... the engine's graphed step", f"{_f(r.get('graphs_ms'), '.3f')} ms = "
                     f"{_f(r.get('fraction_graphs'), '.0%')} of roofline", ""))
        rows.append(("CUDA-graph speedup, decode step (verify k+1)", f"{_f(r.get('graph_speedup'), '.2f')}x "
                     f"({_f(r.get('verify_graph_speedup'), '.2f')}x)", ""))
    if c and c.get("compiled_ms") is not None:
        rows.append((f"... the engine's step, {c.get('mode')}",
                     f"{_f(c.get('compiled_ms'), '.3f')} ms = {_f(c.get('fraction_compiled'), '.0%')} of roofline",
                     ""))
    if c and c.get("round_compiled_ms") is not None:
        rows.append((f"... the whole step (forward, argmax, bookkeeping) compiled, {c.get('round_mode')}",
                     f"{_f(c.get('round_compiled_ms'), '.3f')} ms = {_f(c.get('fraction_round_compiled'), '.0%')} "
                     f"of roofline", ">= 60%"))
        sp = c.get("spec_speedup") or {}
        rows.append((f"speculative round (k={c.get('k')}) compiled, {c.get('round_mode')}, batch 1",
                     f"{_f(c.get('spec_round_compiled_ms'), '.3f')} ms; speedup over the compiled step "
                     + ", ".join(f"{_f(v, '.2f')}x at alpha {a}" for a, v in sp.items()), ""))
    return rows


def _round_headline(r: dict) -> list[tuple[str, str, str]]:
    if not r:
        return []
    rows = []
    b1 = r.get("batch1") or {}
    sp = b1.get("speculative")
    if sp:
        phases = ", ".join(f"{p} {_f(sp.get(p + '_ms'), '.3f')}" for p in PHASES)
        rows.append((f"speculative round, batch 1, k={r.get('k')}, {r.get('mode')} ({r.get('dtype')})",
                     f"{_f(sp['round_ms'], '.3f')} ms ({phases} ms); floor {_f(sp['floor_ms'], '.3f')} ms "
                     f"= {_f(sp['floor_ms'] / sp['round_ms'], '.0%')}", ""))
    speed = r.get("speedup") or {}
    if speed:
        val = "; ".join(f"alpha {a}: " + ", ".join(f"b{b} {_f(v, '.2f')}x" for b, v in sorted(d.items(),
                        key=lambda x: int(x[0]))) for a, d in speed.items())
        rows.append(("speculative / plain round (same code, one graph each)", val, ""))
        top = max(r.get("batches") or [0])
        cross = r.get("crossover_batch") or {}
        rows.append(("crossover batch, whole-round graphs", ", ".join(
            f"alpha {a}: {b if b is not None else f'none up to {top}'}" for a, b in cross.items()), ""))
    if "fp32_identical" in r:
        same = r.get("fp32_identical") and r.get(f"graph_equals_eager_k{r.get('k')}", True)
        rows.append(("greedy identity of the round, graphs on and off (fp32 = HF generate; bf16 graph = eager)",
                     "identical" if same else "DIFFERENT", "identical"))
    return rows


def write_outputs(out: Path, report: dict) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    lines = ["# GPU check", ""]
    if report["dry_run"]:
        lines += ["**Dry run: tiny sizes on the CPU. These numbers are not measurements; they show that every "
                  "section runs.**", ""]
    lines += [f"`{report['command']}`  ", f"device: {report.get('device', '?')} · started {report['started']} · "
              f"{report.get('wall_s', 0):.0f} s of a {report['budget_s']:.0f} s budget", ""]
    lines += ["| metric | value | target |", "|---|---|---|"]
    lines += [f"| {_cell(m)} | {_cell(v)} | {_cell(t)} |" for m, v, t in report.get("headline", [])]
    lines += ["", "## Sections", "", "| section | status | time / budget (s) | notes |", "|---|---|---|---|"]
    for name, sec in report["sections"].items():
        why = sec.get("reason") or "; ".join(sec.get("notes", [])[:2])
        lines.append(f"| {name} | {sec['status']} | {sec.get('wall_s', 0):.0f} / {sec.get('budget_s', 0):.0f} | "
                     f"{_cell(why)[:300]} |")
    for name, sec in report["sections"].items():
        rows = sec.get("rows") or []
        lines += ["", f"## {name}: {sec.get('title', '')}", ""]
        if sec.get("summary"):
            lines.append("summary: " + _cell(sec["summary"]))
            lines.append("")
        if not rows:
            lines.append(f"_{sec['status']}{': ' + sec['reason'] if sec.get('reason') else ''}_")
            continue
        lines += _table(rows)
        for tname, trows in (sec.get("tables") or {}).items():
            lines += ["", f"### {name}: {tname}", ""] + _table(trows)
        for n in sec.get("notes", []):
            lines.append(f"\n- {_cell(n)}")
    return "\n".join(lines) + "\n"


def _table(rows: list[dict]) -> list[str]:
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols and c != "stats" and c != "graph_stats"]
    return (["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            + ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows])


def run_parent(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (for the CPU rehearsal, add --dry-run)", file=sys.stderr)
        return 2
    chosen = select(args)
    limits = timeouts(args)
    budget = args.budget if args.budget is not None else (1200.0 if args.dry_run else 540.0)
    logf = open(out / "gpu_check.log", "w", encoding="utf-8")
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            print(line, flush=True)
            logf.write(line + "\n")
            logf.flush()

    cmd = "python scripts/gpu_check.py " + " ".join(sys.argv[1:])
    report = {"command": cmd, "dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "budget_s": budget, "bandwidth_gbs": args.bandwidth_gbs, "sections": {}, "headline": []}
    t_start = time.perf_counter()
    parts = Path(tempfile.mkdtemp(prefix="gpu_check_parts_"))
    plan = ", ".join(f"{n} {(db if args.dry_run else b)}s" for n, _, b, db in chosen)
    log(f"gpu_check: {'DRY RUN (CPU, tiny sizes)' if args.dry_run else 'GPU run'}; budget {budget:.0f}s; "
        f"sections: {plan}")
    for name, title, b_real, b_dry in chosen:
        left = budget - (time.perf_counter() - t_start)
        limit = min(limits.get(name, limits.get("*", b_dry if args.dry_run else b_real)), left)
        sec = {"title": title, "budget_s": limit}
        if left < 10:
            sec.update(status="skipped", reason="no time left in the budget", wall_s=0.0)
            report["sections"][name] = sec
            log(f"[{name}] skipped: no time left in the budget")
            continue
        log(f"[{name}] {title}: up to {limit:.0f}s ({budget - left:.0f}s of {budget:.0f}s used)")
        path = parts / f"{name}.json"
        how, wall = run_section(name, args, path, limit, log)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {"status": "failed", "reason": "the section wrote nothing", "rows": [], "notes": [], "summary": {}}
        if how == "timeout":
            data["status"], data["reason"] = "timeout", f"stopped at its budget ({limit:.0f}s); rows so far kept"
        elif data.get("status") == "running":
            data["status"], data["reason"] = "failed", "the section's process died"
        sec.update(data)
        sec["wall_s"] = wall
        report["sections"][name] = sec
        if name == "env":
            report["device"] = data.get("summary", {}).get("device")
            report["bandwidth_gbs"] = data.get("summary", {}).get("bandwidth_gbs", report["bandwidth_gbs"])
        report["wall_s"] = time.perf_counter() - t_start
        report["headline"] = headline(report["sections"], args.dry_run)
        write_outputs(out, report)
        log(f"[{name}] {sec['status']} in {wall:.1f}s" + (f": {sec['reason']}" if sec.get("reason") else ""))
    report["wall_s"] = time.perf_counter() - t_start
    report["headline"] = headline(report["sections"], args.dry_run)
    write_outputs(out, report)
    for m, v, t in report["headline"]:
        log(f"  {m}: {v}" + (f"   (target {t})" if t else ""))
    log(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['wall_s']:.0f}s")
    logf.close()
    for p in parts.iterdir():
        p.unlink()
    parts.rmdir()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (gpu_check.json, gpu_check.md, gpu_check.log)")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU: every section's code path")
    ap.add_argument("--only", default=None, help="comma-separated sections to run (train runs only when named)")
    ap.add_argument("--skip", default=None, help="comma-separated sections to leave out")
    ap.add_argument("--timeout", action="append", default=None, metavar="[NAME=]SECONDS",
                    help="a section's time limit (repeatable; without NAME: every section)")
    ap.add_argument("--budget", type=float, default=None,
                    help="the whole run's limit in seconds (default 540 on the GPU, 1200 dry): a section gets at "
                         "most what is left")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="HBM bandwidth in GB/s (default: the device's datasheet peak, e.g. H100 3350, H200 4800)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 matmul peak in TFLOPS (default: the device's, e.g. 989 on an H100 or H200)")
    ap.add_argument("--draft-cost", type=float, default=0.1,
                    help="synthetic draft step cost, as a fraction of the target's decode step as run")
    ap.add_argument("--no-graphs", action="store_true", help="crossovers without CUDA graphs")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
