"""scripts/gpu_round.py: the speculative round that runs entirely on the device (what the GPU check captures as
one CUDA graph), run eagerly on the CPU: it is greedy decoding of the target whatever the draft, its state
restores, its phases and floors add up, and the profiler's kernels are sorted into kinds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from speclab.models import load_model
from speclab.testing import char_tokenizer, tiny_llama

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
spec = importlib.util.spec_from_file_location("gpu_round", SCRIPTS / "gpu_round.py")
gpu_round = importlib.util.module_from_spec(spec)
sys.modules["gpu_round"] = gpu_round
spec.loader.exec_module(gpu_round)

P, NEW = 8, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny target, a perturbed copy (some drafts accepted, some not) and an unrelated model as drafts."""
    root = tmp_path_factory.mktemp("round_models")
    tok = char_tokenizer()
    eos = len(tok) - 1
    kw = dict(layers=2, hidden=64, kv_heads=2, max_pos=256, init=0.2, eos=eos)
    tgt = tiny_llama(root / "t", tok, seed=0, **kw)
    tiny_llama(root / "near", tok, seed=1, base_state=tgt.state_dict(), noise=0.3, **kw)
    tiny_llama(root / "far", tok, seed=2, **kw)
    load = lambda name: load_model(str(root / name), device="cpu", dtype=torch.float32)  # noqa: E731
    lm = load("t")
    prompts = torch.tensor([lm.encode(t)[:P] for t in ("hello world", "the cat sat", "abc abc abc", "quick brown")])
    ref = []
    for row in prompts:  # greedy with the HF forward, through EOS (a round does not stop at EOS either)
        ids = row[None]
        for _ in range(NEW):
            nxt = lm.hf_model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], 1)
        ref.append(ids[0, P:].tolist())
    return lm, {"near": load("near"), "far": load("far"), "self": lm}, prompts, ref


def _run(target, draft, prompts, k, rounds):
    r = gpu_round.DeviceRound(target, draft, prompts.shape[0], k, P + (rounds + 1) * (k + 1) + 1)
    r.prefill(prompts)
    for _ in range(rounds):
        r.round()
    return r


@pytest.mark.parametrize("draft", ["near", "far", "self"])
def test_the_round_is_greedy_decoding_whatever_the_draft(models, draft):
    target, drafts, prompts, ref = models
    plain = _run(target, None, prompts, 0, NEW)
    assert [row[P:] for row in plain.tokens()] == ref
    r = _run(target, drafts[draft], prompts, 3, NEW)
    assert [row[P:P + NEW] for row in r.tokens()] == ref
    accepted, drafted = int(r.accepted), 3 * NEW * len(ref)
    if draft == "self":  # the target drafting for itself: every draft kept, k + 1 tokens a round
        assert accepted == drafted and r.length.tolist() == [P + 4 * NEW] * len(ref)
    elif draft == "near":  # both accepted and rejected drafts happen, so both paths are checked
        assert 0 < accepted < drafted
    # every round emits its accepted drafts and one token more
    assert sum(length - P for length in r.length.tolist()) == NEW * len(ref) + accepted


def test_restore_replays_the_same_rounds(models):
    """The benchmark times rounds from a snapshot again and again: stale cache slots past the restored lengths
    must never change the tokens."""
    target, drafts, prompts, _ = models
    r = gpu_round.DeviceRound(target, drafts["near"], prompts.shape[0], 3, P + 12 * 4 + 1)
    r.prefill(prompts)
    snap = r.snapshot()
    for _ in range(5):
        r.round()
    first = r.tokens()
    r.restore(snap)
    for _ in range(5):
        r.round()
    assert r.tokens() == first
    r.restore(snap)
    ph = r.time_phases(3, graphs=False)
    assert set(ph) == set(gpu_round.PHASES) | {"round"} and ph["round"] == pytest.approx(sum(ph[p] for p in
                                                                                             gpu_round.PHASES))
    assert all(v >= 0 for v in ph.values()) and ph["verify"] > 0 and ph["draft"] > 0
    r.restore(snap)
    assert r.time_whole(3, graphs=False) > 0


@pytest.mark.slow  # torch.compile traces each shape (seconds each on a loaded CPU)
def test_compiled_forwards_give_the_same_tokens(models):
    target, drafts, prompts, ref = models
    r = gpu_round.DeviceRound(target, drafts["near"], prompts.shape[0], 2, P + (NEW + 1) * 3 + 1, compile="eager")
    r.prefill(prompts)
    for _ in range(NEW):
        r.round()
    assert [row[P:P + NEW] for row in r.tokens()] == ref


def test_a_draft_is_required_for_k_above_zero(models):
    with pytest.raises(ValueError, match="draft"):
        gpu_round.DeviceRound(models[0], None, 1, 2, 64)


def test_expected_tokens_and_floors(models):
    assert gpu_round.expected_tokens(0.0, 4) == 1.0 and gpu_round.expected_tokens(1.0, 4) == 5.0
    assert gpu_round.expected_tokens(0.6, 4) == pytest.approx(1 + 0.6 + 0.36 + 0.216 + 0.1296)
    lm = models[0]
    one = gpu_round.forward_floor_s(lm, 1, 1, 100, bandwidth_gbs=1000.0, peak_tflops=100.0)
    assert one["bytes"] == gpu_round.weight_bytes(lm) + gpu_round.kv_bytes(lm, 1, 100)
    assert one["floor_s"] == one["hbm_s"] == pytest.approx(one["bytes"] / 1e12)
    many = gpu_round.forward_floor_s(lm, 4096, 8, 100, bandwidth_gbs=1000.0, peak_tflops=0.001)
    assert many["floor_s"] == many["matmul_s"] > many["hbm_s"]  # at enough rows the matmuls bound it
    assert many["flops"] == 2 * (gpu_round.weight_bytes(lm) // 4) * 4096 * 8


def test_kernel_kinds_and_a_cpu_breakdown(models):
    kind = gpu_round.kernel_kind
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "matmul"
    assert kind("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matmul"
    assert kind("aten::mm") == "matmul"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert kind("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "norm"
    assert kind("Memcpy DtoD (Device -> Device)") == "copy/index"
    assert kind("void at::native::index_elementwise_kernel<128, 4>") == "copy/index"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::silu>") == "elementwise/other"
    target, drafts, prompts, _ = models
    r = gpu_round.DeviceRound(target, drafts["near"], prompts.shape[0], 2, P + 5 * 3 + 1)
    r.prefill(prompts)
    rows = gpu_round.kernel_breakdown(r.round, "cpu", reps=2)
    assert {x["kind"] for x in rows} >= {"matmul", "attention"}
    assert sum(x["share"] for x in rows) == pytest.approx(1.0)
    assert [x["busy_ms"] for x in rows] == sorted((x["busy_ms"] for x in rows), reverse=True)
