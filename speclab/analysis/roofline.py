"""The roofline step-time model: how long one forward of B rows x T tokens takes on named hardware.

A decoder forward reads every weight once and does 2 FLOPs per parameter per token (the matmuls), and
its attention reads each row's KV cache, writes the new tokens' K/V and does 4 FLOPs per layer,
hidden unit, token and context position. Each part can go no faster than the slower of its memory
traffic and its arithmetic, and every forward also pays a fixed cost (kernel launches, scheduling,
sampling, Python)::

    step(B, T) = max(W / bandwidth, 2 P B T / peak)                          the weight matmuls
               + max(B (L + T) kv / bandwidth, 4 layers hidden B T (L + T) / peak)   the attention
               + overhead
    (W = weight bytes, P = parameters, L = positions already cached, kv = K/V bytes per position)

The two parts are separate kernels, each bound on its own: one max over the summed bytes and FLOPs
would let a large batch's KV reads hide the matmuls' arithmetic. At small B*T the weights dominate and
the step costs the same whatever T is: scoring k+1 draft tokens costs one decode step (Leviathan et
al.'s assumption). As B*T grows past the ridge point (peak / bandwidth FLOPs per byte, divided by
the 2 / bytes-per-parameter FLOPs a weight byte carries per token) the matmuls turn compute-bound and
the verify forward costs more than a decode step: that is where speculation stops paying.

:data:`PRESETS` are vendor datasheet numbers (each with its source); ``cpu`` is measured on this
machine by :func:`measure_cpu` (``speclab advise measure-cpu``) and stored with the date and the
command in ``cpu_preset.json``. :class:`RooflineCosts` gives the step costs the predictions of
:mod:`speclab.analysis.costmodel` read.

Pure Python; :func:`measure_cpu` imports torch when called.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import SpeclabError

CPU_PRESET_PATH = Path(__file__).resolve().parent / "cpu_preset.json"
MEASURE_COMMAND = "speclab advise measure-cpu"


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or CPU) for the roofline: peak memory bandwidth and peak FLOP/s for the dtype
    the weights are in, plus a fixed cost every forward pays (0 = the ideal roofline)."""

    name: str
    bandwidth: float  # bytes/s (HBM / DRAM)
    peak_flops: float  # FLOP/s, dense, for ``dtype``
    dtype: str = "bf16"
    overhead_s: float = 0.0  # fixed seconds per forward
    source: str = ""
    memory: float = 0.0  # bytes of device memory (0: unknown); caps the batch that fits
    measured: dict = field(default_factory=dict)  # the CPU preset: date, command, raw numbers

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a forward is compute-bound (the roofline's ridge point)."""
        return self.peak_flops / self.bandwidth


GPU_PRESETS_PATH = Path(__file__).resolve().parent / "gpu_presets.json"


def hardware_from_dict(data: dict) -> Hardware:
    """A Hardware from its JSON form (the GPU presets' file, the measured CPU preset)."""
    return Hardware(data["name"], float(data["bandwidth"]), float(data["peak_flops"]), data.get("dtype", "fp32"),
                    overhead_s=float(data.get("overhead_s", 0.0)), source=data.get("source", ""),
                    memory=float(data.get("memory", 0.0)), measured=dict(data.get("measured", {})))


# Vendor datasheet numbers (gpu_presets.json, each with its source): dense (no structured sparsity)
# tensor-core FLOP/s for 16-bit weights, bytes/s of device memory, bytes of memory.
PRESETS: dict[str, Hardware] = {name: hardware_from_dict(d) for name, d in
                                json.loads(GPU_PRESETS_PATH.read_text(encoding="utf-8")).items()}


def load_cpu_preset(path: Path | str = CPU_PRESET_PATH) -> Hardware | None:
    """The ``cpu`` preset measured on this machine (None when it was never measured)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        return hardware_from_dict(data)
    except (KeyError, TypeError, ValueError):
        return None


def preset_names() -> list[str]:
    return list(PRESETS) + ["cpu"]


def hardware(spec, overhead_s: float | None = None) -> Hardware:
    """A preset by name ('h100', ..., 'cpu') or a Hardware as is; ``overhead_s`` replaces its fixed cost."""
    if isinstance(spec, Hardware):
        hw = spec
    else:
        name = str(spec or "").strip().lower().replace(" ", "").replace("-", "")
        if name == "cpu":
            hw = load_cpu_preset()
            if hw is None:
                raise SpeclabError(f"the cpu preset has not been measured on this machine: run `{MEASURE_COMMAND}`")
        elif name in PRESETS:
            hw = PRESETS[name]
        else:
            raise SpeclabError(f"unknown hardware '{spec}' (presets: {', '.join(preset_names())})")
    if overhead_s is not None:
        if not (overhead_s >= 0 and math.isfinite(overhead_s)):
            raise SpeclabError(f"the per-step overhead must be >= 0 seconds, got {overhead_s!r}")
        hw = replace(hw, overhead_s=float(overhead_s))
    return hw


# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model: parameters read per forward, their bytes, and the shape of
    its KV cache. ``params`` counts every weight a forward reads (a drafter head that reuses the
    target's LM head reads that head too)."""

    name: str
    params: float
    bytes_per_param: float = 2.0
    n_layers: int = 0
    hidden: int = 0  # d_model (attention FLOPs per token and context position: 4 * layers * hidden)
    n_kv_heads: int = 0
    head_dim: int = 0
    kv_bytes: float | None = None  # bytes per cached element (default: bytes_per_param)
    source: str = ""

    def __post_init__(self):
        if not (self.params > 0 and math.isfinite(self.params)):
            raise SpeclabError(f"{self.name}: parameter count must be > 0, got {self.params!r}")
        if not (self.bytes_per_param > 0 and math.isfinite(self.bytes_per_param)):
            raise SpeclabError(f"{self.name}: bytes per parameter must be > 0, got {self.bytes_per_param!r}")
        for f in ("n_layers", "hidden", "n_kv_heads", "head_dim"):
            v = getattr(self, f)
            if int(v) != v or v < 0:
                raise SpeclabError(f"{self.name}: {f} must be a whole number >= 0, got {v!r}")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one position over every layer."""
        per = self.bytes_per_param if self.kv_bytes is None else self.kv_bytes
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * per

    def flops_per_token(self, context: float) -> float:
        """Matmuls (2 per parameter) plus attention over ``context`` positions (QK^T and AV)."""
        return 2.0 * self.params + 4.0 * self.n_layers * self.hidden * context

    @classmethod
    def from_lm(cls, lm, name: str | None = None) -> ModelShape:
        """The shape of a loaded :class:`speclab.models.LM` (its dtype sets the bytes per parameter)."""
        cfg = lm.config
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        kv = int(getattr(cfg, "num_key_value_heads", 0) or heads)
        hd = int(getattr(cfg, "head_dim", 0) or (lm.hidden_size // heads if heads else 0))
        bpp = float(getattr(lm.dtype, "itemsize", 4))
        return cls(name or lm.name, float(lm.num_parameters()), bpp, lm.n_layers, lm.hidden_size, kv, hd,
                   source="measured from the loaded model")


# Named shapes for the what-if and the published-measurement validation. Parameter counts are the
# weights one forward reads; a drafter head counts the target LM head it reuses.
SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 8.03e9, 2, 32, 4096, 8, 128,
                               source="meta-llama/Llama-3.1-8B config: 32 layers, d 4096, 8 KV heads of 128"),
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 70.6e9, 2, 80, 8192, 8, 128,
                                source="meta-llama/Llama-3.1-70B config: 80 layers, d 8192, 8 KV heads of 128"),
    "llama-3.2-1b": ModelShape("Llama-3.2-1B", 1.24e9, 2, 16, 2048, 8, 64,
                               source="meta-llama/Llama-3.2-1B config: 16 layers, d 2048, 8 KV heads of 64"),
    "vicuna-7b": ModelShape("Vicuna-7B-v1.3", 6.74e9, 2, 32, 4096, 32, 128,
                            source="lmsys/vicuna-7b-v1.3 (LLaMA-7B): 32 layers, d 4096, 32 KV heads of 128"),
    "vicuna-68m": ModelShape("vicuna-68m", 68e6, 2, 2, 768, 12, 64,
                             source="double7/vicuna-68m: LLaMA, 2 layers, d 768, 12 heads of 64"),
    # EAGLE-1/2 head for Llama-3.1-8B: fc (2d -> d) 33.6M + one decoder layer 218M + the target's LM
    # head (128256 x 4096 = 525M), which every draft step reads
    "eagle-llama3.1-8b": ModelShape("EAGLE head (Llama-3.1-8B)", 0.777e9, 2, 1, 4096, 8, 128,
                                    source="yuhuili/EAGLE-LLaMA3.1-Instruct-8B: 1 layer + fc 8192->4096, reads "
                                           "the target's 128256-word LM head"),
    # EAGLE-3 head: fc (3d -> d) 50M + one layer with a 2d attention input 243M + its own 32000-word head 131M
    "eagle3-llama3.1-8b": ModelShape("EAGLE-3 head (Llama-3.1-8B)", 0.425e9, 2, 1, 4096, 8, 128,
                                     source="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: 1 layer (2d attention input), "
                                            "fc 12288->4096, draft vocabulary 32000"),
    # EAGLE-1 head for Vicuna-7B: 0.24B (EAGLE README) + the target's LM head 32000 x 4096 = 131M
    "eagle-vicuna-7b": ModelShape("EAGLE head (Vicuna-7B)", 0.37e9, 2, 1, 4096, 32, 128,
                                  source="yuhuili/EAGLE-Vicuna-7B-v1.3: 0.24B (EAGLE README) + the target's LM "
                                         "head 131M"),
    # Medusa-1 for Vicuna-7B: 5 heads, each a 4096x4096 residual block + its own 32000-word projection
    "medusa-vicuna-7b": ModelShape("Medusa-1 heads (Vicuna-7B)", 0.74e9, 2, 0, 4096, 0, 0,
                                   source="FasterDecoding/medusa-vicuna-7b-v1.3: 5 heads x (16.8M + 131M)"),
}


def shape(spec) -> ModelShape:
    """A named shape (see :data:`SHAPES`) or a ModelShape as is."""
    if isinstance(spec, ModelShape):
        return spec
    key = str(spec or "").strip().lower()
    if key not in SHAPES:
        raise SpeclabError(f"unknown model shape '{spec}' (known: {', '.join(SHAPES)}; or give --target-params "
                           f"and the layer sizes)")
    return SHAPES[key]


# ---------------------------------------------------------------------------------------------- the roofline


def forward_terms(hw: Hardware, model: ModelShape, rows: int, tokens: int, context: float,
                  overhead_s: float | None = None) -> dict:
    """The roofline of one forward of ``rows`` x ``tokens`` new positions after ``context`` cached ones,
    part by part (see the module docstring): bytes, FLOPs, memory and compute time of the weight
    matmuls and of the attention, which bound each is, and the step time."""
    if rows < 1 or tokens < 1 or context < 0:
        raise SpeclabError(f"a forward needs rows >= 1, tokens >= 1 and context >= 0 (got {rows}, {tokens}, "
                           f"{context})")
    n = rows * tokens
    w_bytes, w_flops = model.weight_bytes, 2.0 * model.params * n
    a_bytes = rows * (context + tokens) * model.kv_bytes_per_token  # read the cache, write the new K/V
    a_flops = 4.0 * model.n_layers * model.hidden * n * (context + tokens)  # every new token sees <= L + T
    w_mem, w_comp = w_bytes / hw.bandwidth, w_flops / hw.peak_flops
    a_mem, a_comp = a_bytes / hw.bandwidth, a_flops / hw.peak_flops
    over = hw.overhead_s if overhead_s is None else overhead_s
    return {"bytes": w_bytes + a_bytes, "flops": w_flops + a_flops,
            "weights_s": max(w_mem, w_comp), "weights_bound": "compute" if w_comp > w_mem else "memory",
            "attention_s": max(a_mem, a_comp), "attention_bound": "compute" if a_comp > a_mem else "memory",
            "memory_s": w_mem + a_mem, "compute_s": w_comp + a_comp, "compute_over_memory": w_comp / w_mem,
            "overhead_s": over, "step_s": max(w_mem, w_comp) + max(a_mem, a_comp) + over}


def forward_time(hw: Hardware, model: ModelShape, rows: int, tokens: int, context: float,
                 overhead_s: float | None = None) -> float:
    """Seconds for one forward (see the module docstring)."""
    return forward_terms(hw, model, rows, tokens, context, overhead_s)["step_s"]


def fit_overhead(hw: Hardware, model: ModelShape, measured_step_s: float, rows: int = 1, context: float = 0,
                 tokens: int = 1) -> float:
    """The fixed per-forward cost that makes the roofline match one measured step (>= 0): the
    calibration from a plain-decoding measurement."""
    return max(0.0, measured_step_s - forward_time(hw, model, rows, tokens, context, overhead_s=0.0))


def max_batch(hw: Hardware, target: ModelShape, draft: ModelShape | None, context: float, k: int = 0) -> int | None:
    """Rows whose KV caches (``context`` + k + 1 positions, target and draft) fit in the device memory
    beside the weights; None when the memory is unknown. Engines also keep activations and a reserve,
    so the real limit is lower."""
    if not hw.memory:
        return None
    free = hw.memory - target.weight_bytes - (draft.weight_bytes if draft is not None else 0.0)
    per_row = (context + k + 1) * (target.kv_bytes_per_token + (draft.kv_bytes_per_token if draft is not None else 0))
    if free <= 0:
        return 0
    return int(free // per_row) if per_row > 0 else None


@dataclass
class RooflineCosts:
    """Step costs from the roofline, in the interface the predictions read (:mod:`.costmodel`):
    ``target_time(rows, tokens)`` and ``draft_time(rows)`` in seconds.

    The draft is a :class:`ModelShape` (each draft step is one forward of ``draft_width`` tokens per
    row, paying ``draft_overhead_s``, default the hardware's per-forward overhead), or, with
    ``draft=None``, a fixed fraction ``draft_cost`` of the target's one-token step (0 for prompt lookup)."""

    hw: Hardware
    target: ModelShape
    draft: ModelShape | None = None
    draft_cost: float = 0.0
    context: float = 512
    draft_width: int = 1
    draft_overhead_s: float | None = None

    def target_time(self, rows: int, tokens: int) -> float:
        return forward_time(self.hw, self.target, rows, tokens, self.context)

    def draft_time(self, rows: int) -> float:
        if self.draft is None:
            return self.draft_cost * self.target_time(rows, 1)
        over = self.hw.overhead_s if self.draft_overhead_s is None else self.draft_overhead_s
        return forward_time(self.hw, self.draft, rows, self.draft_width, self.context, overhead_s=over)

    def max_batch(self, k: int = 0) -> int | None:
        return max_batch(self.hw, self.target, self.draft, self.context, k)

    def describe(self) -> dict:
        return {"hardware": asdict(self.hw), "target": asdict(self.target),
                "draft": asdict(self.draft) if self.draft is not None else {"cost_ratio": self.draft_cost},
                "context": self.context, "draft_width": self.draft_width,
                "draft_overhead_s": self.draft_overhead_s}


# ---------------------------------------------------------------------------------------------- this CPU


def _best_rate(fn, work: float, reps: int) -> tuple[float, float]:
    """(best, median) of work / seconds over ``reps`` timed calls after one warm-up call. Timed in this
    process's CPU time: on a shared machine, other processes' time slices do not count against it."""
    fn()  # page faults, caches
    times = []
    for _ in range(reps):
        t = time.process_time()
        fn()
        times.append(max(time.process_time() - t, 1e-9))
    return work / min(times), work / sorted(times)[len(times) // 2]


def _copy_bandwidth(nbytes: int, reps: int, inner: int) -> tuple[float, float]:
    """Bytes/s of ``dst.copy_(src)`` over fp32 tensors of ``nbytes``: each copy reads and writes them."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)

    def run():
        for _ in range(inner):
            dst.copy_(src)

    return _best_rate(run, 2.0 * nbytes * inner, reps)


def measure_cpu(copy_mb: int = 256, cache_kb: int = 4096, matmul_n: int = 1024, reps: int = 11) -> dict:
    """Measure this machine's roofline with torch on ONE thread: memory bandwidth from large tensor
    copies (``copy_mb`` MB, far above the last-level cache; read + write counted), cache bandwidth from
    small ones (``cache_kb`` KB), and fp32 matmul FLOP/s (``matmul_n`` cubed). Best of ``reps``
    (a roofline is a peak; other processes only ever slow a run down)."""
    import datetime
    import os
    import platform

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bw, bw_med = _copy_bandwidth(copy_mb * 2**20, reps, inner=1)
        inner = 50  # one cache-sized copy takes microseconds: time many
        cbw, cbw_med = _copy_bandwidth(cache_kb * 1024, reps, inner)
        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        fl, fl_med = _best_rate(lambda: a @ b, 2.0 * matmul_n**3, reps)
    finally:
        torch.set_num_threads(threads)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = 0.0
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            mem = next((float(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), 0.0)
    except OSError:
        pass
    return {
        "name": f"CPU ({cpu}, 1 thread, fp32)", "bandwidth": bw, "peak_flops": fl, "dtype": "fp32", "overhead_s": 0.0,
        "memory": mem,
        "source": f"measured on this machine by `{MEASURE_COMMAND}`",
        "measured": {"date": datetime.date.today().isoformat(), "command": MEASURE_COMMAND, "cpu": cpu,
                     "host_cpus": os.cpu_count(), "torch": torch.__version__, "threads": 1,
                     "copy_mb": copy_mb, "bandwidth_median": bw_med, "cache_kb": cache_kb,
                     "cache_bandwidth": cbw, "cache_bandwidth_median": cbw_med, "matmul_n": matmul_n,
                     "peak_flops_median": fl_med, "reps": reps,
                     "method": "bandwidth = 2 x bytes / time of dst.copy_(src) (read + write), best of reps; "
                               "FLOP/s = 2 n^3 / time of an n x n fp32 matmul, best of reps; torch, 1 thread; "
                               "timed in process CPU time (time.process_time)"},
    }


def save_cpu_preset(result: dict, path: Path | str = CPU_PRESET_PATH) -> Path:
    path = Path(path)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path
