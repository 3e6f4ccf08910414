"""The Leviathan et al. (2023) cost model, against values worked out by hand."""

import math

import pytest

from speclab.analysis.costmodel import best_k, expected_speedup, expected_tokens_per_round, speedup_curve


def test_tokens_per_round_hand_values():
    # a = 0.5, k = 2: 1 + 0.5 + 0.25 = 1.75
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    # a = 0.8, k = 4: (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616
    assert expected_tokens_per_round(0.8, 4) == pytest.approx(3.3616)
    # edge cases: a perfect draft emits k + 1, a useless one emits the target's token only
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.0, 7) == 1.0
    assert expected_tokens_per_round(0.9, 0) == 1.0


def test_speedup_hand_values():
    # a = 0.8, k = 4, c = 0.05: 3.3616 / (4 * 0.05 + 1) = 3.3616 / 1.2 = 2.801333...
    assert expected_speedup(0.8, 4, 0.05) == pytest.approx(2.8013333333)
    # a = 0.5, k = 2, c = 0.5: 1.75 / 2 = 0.875 (a slow draft loses)
    assert expected_speedup(0.5, 2, 0.5) == pytest.approx(0.875)
    # free draft, perfect acceptance: k + 1
    assert expected_speedup(1.0, 3, 0.0) == 4.0
    # k = 0 is plain decoding
    assert expected_speedup(0.7, 0, 0.3) == 1.0
    # a verify forward costing 1.5 target steps: 1.75 / (2 * 0.1 + 1.5) = 1.75 / 1.7
    assert expected_speedup(0.5, 2, 0.1, v=1.5) == pytest.approx(1.75 / 1.7)


def test_best_k_hand_values():
    # a = 0.5, c = 0.1: speedups k=1..4 = 1.5/1.1=1.364, 1.75/1.2=1.458, 1.875/1.3=1.442, 1.9375/1.4=1.384
    assert best_k(0.5, 0.1, k_max=8) == 2
    # a = 0.8, c = 0.05: k=5: (1-0.8^6)/0.2/1.25 = 3.68928/1.25 = 2.9514; k=6: 3.95142/1.3 = 3.0396;
    # k=7: 4.16114/1.35 = 3.0823; k=8: 4.32891/1.4 = 3.0921; k=9: 4.46313/1.45 = 3.0780
    assert best_k(0.8, 0.05, k_max=16) == 8
    assert best_k(0.8, 0.05, k_max=5) == 5  # capped
    # a draft that costs as much as the target never pays: 1 + a < 2 for a < 1
    assert best_k(0.9, 1.0) == 0
    # no acceptance: never speculate
    assert best_k(0.0, 0.01) == 0
    # a callable verify cost that grows with k pulls the optimum down
    assert best_k(0.8, 0.05, k_max=16, v=lambda k: 1 + 0.1 * k) < 8
    # the same as a mapping {k: v}; a = 0.5, c = 0.1, v = 1 + 0.5 k:
    # k=1: 1.5 / (0.1 + 1.5) = 0.9375 < 1 -> k=2: 1.75 / 2.2 = 0.795 -> do not speculate
    assert best_k(0.5, 0.1, k_max=4, v={k: 1 + 0.5 * k for k in range(5)}) == 0


def test_curve_and_validation():
    rows = speedup_curve(0.5, 0.1, [0, 1, 2])
    assert [r["k"] for r in rows] == [0, 1, 2]
    assert rows[0]["expected_speedup"] == 1.0
    assert rows[2]["expected_speedup"] == pytest.approx(1.75 / 1.2)
    assert math.isclose(rows[1]["expected_tokens_per_round"], 1.5)
    # verify costs as a mapping: a = 0.5, c = 0.1, k = 2, v = 1.5 -> 1.75 / 1.7
    rows_v = speedup_curve(0.5, 0.1, [2], v={2: 1.5})
    assert rows_v[0]["expected_speedup"] == pytest.approx(1.75 / 1.7)
    with pytest.raises(ValueError):
        expected_speedup(1.5, 2, 0.1)
    with pytest.raises(ValueError):
        expected_speedup(0.5, -1, 0.1)
    with pytest.raises(ValueError):
        expected_speedup(0.5, 2, -0.1)


def test_interleaved_timer_orders_and_measures():
    from speclab.analysis.costmodel import interleaved_times

    calls, now = [], [0.0]

    def run(name, cost):  # a callable that takes ``cost`` on a clock the test moves
        calls.append(name)
        now[0] += cost

    med = interleaved_times({"slow": lambda: run("s", 4.0 if len(calls) != 2 else 40.0), "fast": lambda: run("f", 1.0)},
                            reps=5, warmup=1, clock=lambda: now[0])
    assert calls[:4] == ["s", "f", "s", "f"]  # round-robin, not one block per callable
    assert len(calls) == 12
    assert med == {"slow": 4.0, "fast": 1.0}  # the median: one stretched run does not move it


def test_step_costs_on_shipped_models():
    from speclab.family import list_models

    if not {"target", "draft-xs"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from speclab.analysis.costmodel import cost_ratio, step_costs, time_forward, verify_costs
    from speclab.models import load_model

    target, draft = load_model("target"), load_model("draft-xs")
    sc = step_costs(target, draft, [0, 2, 4], context=32, reps=3)
    assert set(sc["verify_s"]) == {2, 4}  # k = 0 has no verify forward of its own
    assert sc["target_step_s"] > 0 and sc["draft_step_s"] > 0 and all(v > 0 for v in sc["verify_s"].values())
    assert step_costs(target, None, [1], context=16, reps=1)["draft_step_s"] is None
    v = verify_costs(target, [0, 3], context=16, steps=2, repeats=1)
    assert v[0] == 1.0 and v[3] > 0
    assert cost_ratio(draft, target, context=16, steps=2, repeats=1) > 0
    assert time_forward(target, batch=2, context=16, tokens=2, steps=2, repeats=1) > 0
