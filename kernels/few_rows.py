"""The few-row CPU matmul of ``few_rows.c``, built on first use and called through ctypes.

:func:`load` compiles the C file with the system's compiler into a per-user cache (well under a second; the
file's hash names the build, so an edited kernel is rebuilt) and returns the bound function, or None where it
cannot run: no AVX2 in torch's view of the CPU, no compiler, or ``SPECLAB_FEW_ROWS=0``. :func:`reason` says
which. Callers keep torch's matmul as the fallback, so nothing depends on a compiler being present.

:func:`pack` lays a (N, K) weight out as the kernel reads it; :func:`matmul` computes ``x @ W.T`` from it.

This folder imports nothing of speclab (see rejection.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

PANEL = 16  # output columns per packed panel (two AVX2 registers)
MAX_ROWS = 8  # above this many rows torch's GEMM is as fast, and it uses every thread
SOURCE = Path(__file__).with_name("few_rows.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")

_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    root = os.environ.get("SPECLAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "speclab")
    return Path(root) / "kernels"


def _build() -> tuple:
    """(the ctypes function, None) or (None, why not)."""
    if os.environ.get("SPECLAB_FEW_ROWS", "1") == "0":
        return None, "turned off (SPECLAB_FEW_ROWS=0)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None, f"the CPU has no AVX2 ({torch.backends.cpu.get_cpu_capability()})"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler found (cc, gcc or clang)"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"few_rows-{digest}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            run = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True)
            if run.returncode != 0:
                return None, f"{cc} failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}"
            os.replace(out, lib)  # atomic: a concurrent process sees no half-written library
    fn = ctypes.CDLL(str(lib)).few_rows
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p]
    return fn, None


def load():
    """The kernel, built once per process (None where it cannot run; :func:`reason` says why)."""
    with _lock:
        if "fn" not in _state:
            try:
                _state["fn"], _state["reason"] = _build()
            except OSError as e:  # an unwritable cache, a library the loader rejects
                _state["fn"], _state["reason"] = None, f"could not build or load the kernel: {e}"
        return _state["fn"]


def reason() -> str | None:
    """Why :func:`load` returned None (None when the kernel is available)."""
    load()
    return _state["reason"]


@contextlib.contextmanager
def disabled(why: str = "turned off for this block"):
    """Models built inside the block keep torch's matmul (a comparison in one process; the tests' other paths).
    The kernel is loaded first, so models built with it before or after still find it."""
    load()
    saved = dict(_state)
    with _lock:
        _state.update(fn=None, reason=why)
    try:
        yield
    finally:
        with _lock:
            _state.update(saved)


def takes(x: torch.Tensor) -> bool:
    """Whether a matmul of activations ``x`` (..., K) goes through the kernel rather than torch's: at most
    MAX_ROWS rows, and one torch thread (the kernel runs on one; with more, torch's GEMM uses them all)."""
    return x.numel() // x.shape[-1] <= MAX_ROWS and torch.get_num_threads() == 1


def packable(w: torch.Tensor) -> bool:
    """Whether a weight (N, K) can be packed: float32 on the CPU, N a whole number of panels."""
    return w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu" and w.shape[0] % PANEL == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N / 16, K, 16): panel j holds output columns 16 j .. 16 j + 15, k-major."""
    n, k = w.shape
    return w.detach().reshape(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for x (..., K) float32 with at most a few rows, from ``pack(W)``; the kernel must be loaded."""
    n_panels, k, _ = packed.shape
    if x.shape[-1] != k or x.dtype != torch.float32:  # the C side trusts both: a mismatch would read out of bounds
        raise ValueError(f"few_rows.matmul: x (..., {x.shape[-1]}) {x.dtype} against packed weights of K = {k}")
    x = x.contiguous()
    y = x.new_empty(x.shape[:-1] + (n_panels * PANEL,))
    _state["fn"](x.data_ptr(), x.numel() // k, k, packed.data_ptr(), n_panels * PANEL, y.data_ptr())
    return y
