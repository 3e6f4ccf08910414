"""Fused kernels for speclab. Each has a pure-PyTorch reference in :mod:`speclab` and a test that
compares them (on the CPU with ``TRITON_INTERPRET=1`` when Triton installs)."""

from .rejection import fused_rejection_sample, triton_available

__all__ = ["fused_rejection_sample", "triton_available"]
