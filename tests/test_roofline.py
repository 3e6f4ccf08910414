"""The roofline step-time model and the batch-aware predictions, against values worked out by hand."""

import math

import pytest

from speclab.analysis.costmodel import (
    MeasuredCosts,
    alpha_from_mean_length,
    alpha_from_rate,
    batch_table,
    best_k_for_batch,
    expected_speedup,
    predict,
    predicted_crossover,
    speedup_vs_batch,
    survival,
    tokens_per_round,
)
from speclab.analysis.roofline import (
    PRESETS,
    Hardware,
    ModelShape,
    RooflineCosts,
    fit_overhead,
    forward_terms,
    forward_time,
    hardware,
    max_batch,
    measure_cpu,
    shape,
)
from speclab.errors import SpeclabError

H100 = PRESETS["h100"]
LLAMA8B = shape("llama-3.1-8b")


def test_llama_8b_decode_step_on_h100_by_hand():
    # weights: 8.03e9 params x 2 bytes = 16.06e9 bytes / 3.35e12 B/s = 4.79403 ms
    # KV per position: 2 (K, V) x 32 layers x 8 heads x 128 x 2 bytes = 131072 bytes; 1023 cached + 1 new
    #   = 1024 x 131072 = 134217728 bytes / 3.35e12 = 0.0400650 ms
    # arithmetic: 2 x 8.03e9 = 16.06 GFLOP / 989e12 = 0.0162 ms << 4.794 ms: memory-bound
    assert LLAMA8B.kv_bytes_per_token == 131072
    t = forward_terms(H100, LLAMA8B, rows=1, tokens=1, context=1023)
    assert t["weights_bound"] == "memory" and t["attention_bound"] == "memory"
    assert t["weights_s"] == pytest.approx(16.06e9 / 3.35e12)
    assert t["attention_s"] == pytest.approx(134217728 / 3.35e12)
    assert t["step_s"] == pytest.approx(4.79403e-3 + 4.00650e-5, rel=1e-5)
    # verifying 5 tokens costs the same weight reads: only the attention part grows (1028 positions)
    assert forward_time(H100, LLAMA8B, 1, 5, 1023) == pytest.approx(16.06e9 / 3.35e12 + 1028 * 131072 / 3.35e12)
    # a fixed overhead is added once per forward
    assert forward_time(hardware("h100", overhead_s=0.001), LLAMA8B, 1, 1, 1023) == pytest.approx(t["step_s"] + 0.001)


def test_matmuls_turn_compute_bound_past_the_ridge():
    # 256 rows x 4 tokens = 1024 tokens: 2 x 8.03e9 x 1024 = 1.64454e13 FLOP / 989e12 = 16.628 ms > 4.794 ms
    t = forward_terms(H100, LLAMA8B, rows=256, tokens=4, context=0)
    assert t["weights_bound"] == "compute"
    assert t["weights_s"] == pytest.approx(2 * 8.03e9 * 1024 / 989e12)
    assert t["compute_over_memory"] == pytest.approx((2 * 8.03e9 * 1024 / 989e12) / (16.06e9 / 3.35e12))


def test_leviathan_is_the_special_case():
    # no KV cache, no overhead, batch 1 on an H100: every forward is weight-bound, so verifying k+1
    # tokens costs one step (v = 1) and a draft step costs its weight bytes over the target's (c)
    tgt = ModelShape("t", 8e9, 2)
    drf = ModelShape("d", 0.4e9, 2)  # c = 0.05
    costs = RooflineCosts(H100, tgt, drf, context=0)
    for a, k in ((0.8, 4), (0.5, 2), (0.9, 7)):
        assert predict(costs, a, k, 1)["speedup"] == pytest.approx(expected_speedup(a, k, 0.05))
    assert predict(costs, 0.8, 4, 1)["speedup"] == pytest.approx(2.8013333333)  # 3.3616 / (4 x 0.05 + 1)
    # and so is best k: a = 0.8, c = 0.05 -> 8 (tests/test_costmodel.py works it out)
    assert best_k_for_batch(costs, 0.8, 1, 16)[0] == 8


# A toy machine where the numbers are easy: 1 byte/s, 100 FLOP/s, a 1-parameter 1-byte model with no
# KV cache, and a free draft. step(B, T) = max(1, 2 B T / 100) = max(1, B T / 50) seconds.
TOY = Hardware("toy", bandwidth=1.0, peak_flops=100.0)
TOY_MODEL = ModelShape("toy", params=1.0, bytes_per_param=1.0)
TOY_COSTS = RooflineCosts(TOY, TOY_MODEL, None, draft_cost=0.0, context=0)


def test_toy_speedup_vs_batch_and_crossover():
    assert TOY_COSTS.target_time(10, 1) == 1.0 and TOY_COSTS.target_time(40, 2) == pytest.approx(1.6)
    # a perfect draft at k = 1 emits 2 tokens per round: speedup = 2 max(1, B/50) / max(1, B/25)
    assert predict(TOY_COSTS, 1.0, 1, 20)["speedup"] == pytest.approx(2.0)  # 2 x 1 / 1
    assert predict(TOY_COSTS, 1.0, 1, 40)["speedup"] == pytest.approx(1.25)  # 2 x 1 / 1.6
    assert predict(TOY_COSTS, 1.0, 1, 50)["speedup"] == pytest.approx(1.0)  # 2 x 1 / 2
    assert predicted_crossover(TOY_COSTS, 1.0, 1, k=1) == 50
    # best k: B = 10: k = 3 gives 4 / max(1, 40/50) = 4; B = 20: k = 2 and 3 both give 2.5 -> the smaller
    assert best_k_for_batch(TOY_COSTS, 1.0, 10, 3) == (3, pytest.approx(4.0))
    assert best_k_for_batch(TOY_COSTS, 1.0, 20, 3) == (2, pytest.approx(2.5))
    # from B = 50 on, every k gives (k+1) (B/50) / ((k+1) B/50) = 1: do not speculate
    assert best_k_for_batch(TOY_COSTS, 1.0, 50, 3)[0] == 0
    assert predicted_crossover(TOY_COSTS, 1.0, 3) == 50
    rows = speedup_vs_batch(TOY_COSTS, 1.0, [10, 20, 64], 3, k=1)
    assert [r["best_k"] for r in rows] == [3, 2, 0]
    assert rows[0]["speedup"] == pytest.approx(2.0) and rows[2]["speedup"] == pytest.approx(1.0)
    # TPOT and throughput: B = 40, k = 1: a round of 1.6 s emits 2 tokens per row
    p = predict(TOY_COSTS, 1.0, 1, 40)
    assert p["tpot_s"] == pytest.approx(0.8) and p["tokens_per_s"] == pytest.approx(50.0)
    assert p["plain_tokens_per_s"] == pytest.approx(40.0)
    # a useless draft never pays, even at batch 1
    assert predicted_crossover(TOY_COSTS, 0.0, 3) == 1


def test_toy_batch_table_in_vllm_form():
    # speedup at k with a perfect draft: (k+1) max(1, B/50) / max(1, B(k+1)/50)
    #   B <= 16: k = 3 wins (B = 16: 4 x 50 / 64 = 3.125 > k = 2's 3)
    #   17..24: k = 2 and 3 tie at 50/B > k = 1's 2 -> the smaller, 2
    #   25..49: every k gives 50/B (k = 1: 2 x 1 / (2B/50)) -> 1;  B >= 50: 1.0 -> 0
    table = batch_table(TOY_COSTS, 1.0, 3, max_batch=60)
    assert table == [(1, 16, 3), (17, 24, 2), (25, 49, 1), (50, 60, 0)]


def test_acceptance_inputs_by_hand():
    # per-position survival r_i (cumulative, as the engine reports): beyond the list the last
    # conditional rate continues: [0.9, 0.72] -> 0.72 / 0.9 = 0.8 -> 0.576, 0.4608
    assert survival([0.9, 0.72], 4) == pytest.approx([0.9, 0.72, 0.576, 0.4608])
    assert tokens_per_round([0.9, 0.72], 4) == pytest.approx(1 + 0.9 + 0.72 + 0.576 + 0.4608)
    assert survival([0.5, 0.6], 2) == [0.5, 0.5]  # noise above the previous position is clipped
    assert survival(0.5, 3) == [0.5, 0.25, 0.125]
    # a mean accepted length of 3.3616 at k = 4 is a = 0.8; an acceptance rate of 0.375 at k = 2 is
    # (a + a^2) / 2 = 0.375 -> a = 0.5 (not 0.375: a rejection ends the round)
    assert alpha_from_mean_length(3.3616, 4) == pytest.approx(0.8, abs=1e-9)
    assert alpha_from_rate(0.375, 2) == pytest.approx(0.5, abs=1e-9)
    with pytest.raises(ValueError):
        alpha_from_mean_length(6.0, 4)  # more than k + 1
    with pytest.raises(ValueError):
        survival([1.2], 2)


def test_calibration_and_memory_limit_by_hand():
    # SGLang's 158.34 tok/s on an H100 is 6.31553 ms a step; the roofline's 16.06e9 / 3.35e12 = 4.79403 ms
    # plus the new token's K/V write (131072 bytes / 3.35e12 = 0.04 us)
    assert fit_overhead(H100, LLAMA8B, 1 / 158.34) == pytest.approx(1 / 158.34 - (16.06e9 + 131072) / 3.35e12)
    assert fit_overhead(H100, LLAMA8B, 0.001) == 0.0  # faster than the roofline: no negative overhead
    # (80e9 - 16.06e9) bytes / (1024 positions x 131072 bytes) = 476.4 rows
    assert max_batch(H100, LLAMA8B, None, context=1023) == 476
    assert max_batch(TOY, TOY_MODEL, None, 10) is None  # unknown memory


def test_measured_costs_interpolate_like_the_engine():
    m = MeasuredCosts({(1, 1): 1.0, (1, 5): 2.0, (4, 1): 2.0, (4, 5): 5.0}, {1: 0.1, 4: 0.3})
    assert m.target_time(1, 1) == 1.0
    assert m.target_time(2, 1) == pytest.approx(1 + 1 / 3)  # between rows 1 and 4 at T = 1
    assert m.target_time(2, 3) == pytest.approx((1 + 1 / 3 + 3.0) / 2)  # rows first, then tokens
    assert m.draft_time(2) == pytest.approx(0.1 + 0.2 / 3)
    back = MeasuredCosts.from_dict(m.to_dict())
    assert back.target == m.target and back.draft == m.draft
    sc = {"target_step_s": 0.003, "draft_step_s": 0.0006, "verify_s": {4: 0.005}}
    one = MeasuredCosts.from_step_costs(sc)
    # k = 4 at batch 1 from measured costs: 1 + 0.8 + 0.64 + 0.512 + 0.4096 = 3.3616 tokens per
    # 4 x 0.6 + 5 = 7.4 ms against 3 ms a token: 3.3616 x 3 / 7.4
    assert predict(one, 0.8, 4, 1)["speedup"] == pytest.approx(3.3616 * 3 / 7.4)


def test_presets_and_errors():
    for name, hw in PRESETS.items():
        assert hw.bandwidth > 0 and hw.peak_flops > 0 and hw.memory > 0 and "datasheet" in hw.source, name
    assert hardware("H-100") is PRESETS["h100"]
    with pytest.raises(SpeclabError, match="unknown hardware"):
        hardware("tpu-v9")
    with pytest.raises(SpeclabError, match="unknown model shape"):
        shape("gpt-17")
    with pytest.raises(SpeclabError, match="overhead"):
        hardware("h100", overhead_s=-1.0)
    with pytest.raises(SpeclabError):
        ModelShape("bad", params=0)
    with pytest.raises(SpeclabError):
        forward_time(H100, LLAMA8B, 0, 1, 0)


def test_cpu_preset_is_measured_with_its_command():
    cpu = hardware("cpu")  # committed with the repository: measured by `speclab advise measure-cpu`
    assert cpu.measured["command"] == "speclab advise measure-cpu" and cpu.measured["date"]
    assert cpu.bandwidth > 1e9 and cpu.peak_flops > 1e9 and cpu.measured["threads"] == 1


def test_measure_cpu_small():
    r = measure_cpu(copy_mb=32, cache_kb=256, matmul_n=128, reps=2)
    assert r["bandwidth"] > 0 and r["peak_flops"] > 0 and math.isfinite(r["measured"]["cache_bandwidth"])
    assert r["measured"]["command"] == "speclab advise measure-cpu"
