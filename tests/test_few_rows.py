"""The few-row CPU matmul (kernels/few_rows.c): what it computes, that a row's result does not depend on how many
rows share the call, how it is built and when it steps aside for torch's matmul."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from speclab.kernels import few_rows

CAN_BUILD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and any(
    shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="needs AVX2 and a C compiler")


@needs_kernel
def test_it_builds_where_a_compiler_and_avx2_are():
    assert few_rows.load() is not None, few_rows.reason()
    assert few_rows.reason() is None


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 1), (48, 256), (768, 256), (1376, 256), (256, 688), (2048, 33)])
def test_it_computes_x_times_w_transposed(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(2, 3, k, generator=g)  # leading dims kept, as a (batch, tokens, features) activation
    y = few_rows.matmul(x, few_rows.pack(w))
    assert y.shape == (2, 3, n)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("m", range(1, few_rows.MAX_ROWS + 1))
def test_a_rows_result_is_the_same_bits_whatever_rows_share_the_call(m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(80, 300, generator=g)  # 5 panels: the one-row path's odd last panel too
    p = few_rows.pack(w)
    x = torch.randn(m, 300, generator=g)
    together = few_rows.matmul(x, p)
    alone = torch.cat([few_rows.matmul(x[i: i + 1], p) for i in range(m)])
    assert torch.equal(together, alone)


@needs_kernel
def test_a_non_contiguous_activation_is_read_as_its_values():
    w = torch.randn(32, 64)
    x = torch.randn(64, 4).t()  # (4, 64), strided
    assert not x.is_contiguous()
    torch.testing.assert_close(few_rows.matmul(x, few_rows.pack(w)), x @ w.t(), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_an_activation_of_another_width_or_dtype_is_refused():
    p = few_rows.pack(torch.randn(16, 8))
    for x in (torch.randn(2, 9), torch.randn(2, 8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="K = 8"):
            few_rows.matmul(x, p)


def test_only_float32_cpu_weights_of_whole_panels_are_packed():
    assert few_rows.packable(torch.zeros(32, 8))
    assert not few_rows.packable(torch.zeros(40, 8))  # 2.5 panels
    assert not few_rows.packable(torch.zeros(32, 8, dtype=torch.bfloat16))
    assert not few_rows.packable(torch.zeros(32))


def test_where_it_cannot_run_it_says_why_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))  # nothing built before is reused
    monkeypatch.setenv("SPECLAB_FEW_ROWS", "0")
    assert few_rows._build() == (None, "turned off (SPECLAB_FEW_ROWS=0)")
    monkeypatch.delenv("SPECLAB_FEW_ROWS")
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: error: no such target' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CC", str(failing))
    fn, why = few_rows._build()
    if CAN_BUILD:
        assert fn is None and why == f"{failing} failed: cc: error: no such target"
    else:
        assert fn is None and why


def test_a_model_built_without_it_keeps_torchs_matmul():
    from speclab.models import load_model

    with few_rows.disabled("off for this test"):
        assert few_rows.load() is None and few_rows.reason() == "off for this test"
        lm = load_model("target", device="cpu")
    assert not lm.native.few_rows and all(w.p is None for w in (lm.native.lm_head, *lm.native.layers[0][1:3]))
    assert few_rows.load() is not None or not CAN_BUILD  # restored after the block


@needs_kernel
def test_a_build_is_cached_by_the_sources_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    fn, why = few_rows._build()
    assert fn is not None and why is None
    built = list((tmp_path / "kernels").glob("few_rows-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    few_rows._build()  # the second build finds the library and compiles nothing
    assert built[0].stat().st_mtime_ns == stamp
