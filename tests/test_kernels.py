"""The Triton acceptance kernel against its PyTorch reference, on the CPU with Triton's interpreter."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speclab.engine.acceptance import fused_rejection_sample, rejection_sample


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (pip install triton)")
def test_kernel_matches_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_check.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "kernel ok" in p.stdout
    assert "offsets ok" in p.stdout  # int64 offsets past 2^31 elements (row_offset)


def test_fallback_without_triton_is_the_reference():
    """On a CPU without the interpreter the wrapper is the reference itself."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter on")
    tp = torch.tensor([[[0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]])
    dp = torch.tensor([[[0.5, 0.25, 0.25]]])
    args = (torch.tensor([[0]]), dp, tp, torch.tensor([1]), torch.tensor([[0.5]]), torch.tensor([0.1]))
    a, b = fused_rejection_sample(*args), rejection_sample(*args)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
