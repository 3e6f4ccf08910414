"""The synthetic drafter: measured acceptance matches alpha (per position), output stays exact at both
extremes and under sampling, drafts are reproducible per request seed, the stated cost is burnt; the
cost model's round plan on hand-built cases; `speclab bench synthetic` end to end."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import make_drafter
from speclab.drafters.synthetic import SyntheticDrafter, parse_spec, spin
from speclab.engine import SpeculativeDecoder
from speclab.errors import SpeclabError

NEW = 32


@pytest.fixture(scope="module")
def plain_out(target_lm):
    return SpeculativeDecoder(target_lm, None).generate(PROMPTS, k=0, max_new_tokens=NEW,
                                                        stop_on_eos=False).output_tokens


def conditional_rates(requests, k):
    """Per draft position: P(accepted | every earlier draft of the round accepted), from the raw history."""
    reached, acc = [0] * k, [0] * k
    for r in requests:
        for d, a in r.history:
            for i in range(min(d, a + 1)):
                reached[i] += 1
                acc[i] += i < a
    return [a / n if n else None for a, n in zip(acc, reached)], reached


def test_parse_and_registry(target_lm):
    assert parse_spec("synthetic:0.7") == ((0.7,), None)
    assert parse_spec("synthetic:0.9,0.8,0.6:0.25") == ((0.9, 0.8, 0.6), 0.25)
    for bad in ("synthetic", "synthetic:", "synthetic:1.5", "synthetic:0.5:-1", "synthetic:a", "synthetic:1:2:3"):
        with pytest.raises(SpeclabError):
            parse_spec(bad)
    d = make_drafter("synthetic:0.9,0.5:0.2", target_lm)
    assert isinstance(d, SyntheticDrafter) and d.name == "synthetic:0.9,0.5:0.2" and d.cost == 0.2
    assert d.alpha_at(0) == 0.9 and d.alpha_at(5) == 0.5
    assert make_drafter("synthetic:0.7", target_lm).cost == 0.1  # the default cost


@pytest.mark.parametrize("spec", ["synthetic:0.7:0", "synthetic:0.9,0.5:0"])
def test_acceptance_matches_alpha_per_position(target_lm, plain_out, spec):
    d = make_drafter(spec, target_lm)
    d.prepare(PROMPTS, NEW)
    res = SpeculativeDecoder(target_lm, d).generate(PROMPTS * 3, k=4, max_new_tokens=NEW, stop_on_eos=False)
    assert res.output_tokens == plain_out * 3
    rates, reached = conditional_rates(res.requests, 4)
    for i, (rate, n) in enumerate(zip(rates, reached)):
        a = d.alpha_at(i)
        sd = (a * (1 - a) / n) ** 0.5
        assert abs(rate - a) < 4 * sd + 1e-9, (spec, i, rate, a, n)
    assert d.unprepared == 0 and d.recomputed == 0


def test_extremes_all_and_none_accepted(target_lm, plain_out):
    for alpha, expect in ((1.0, 1.0), (0.0, 0.0)):
        d = make_drafter(f"synthetic:{alpha}:0", target_lm)
        d.prepare(PROMPTS, NEW)
        res = SpeculativeDecoder(target_lm, d).generate(PROMPTS, k=3, max_new_tokens=NEW, stop_on_eos=False)
        assert res.output_tokens == plain_out
        assert res.metrics["acceptance_rate"] == expect


def test_unprepared_prompts_are_counted_and_still_exact(target_lm, plain_out):
    d = make_drafter("synthetic:0.8:0", target_lm)
    res = SpeculativeDecoder(target_lm, d).generate(PROMPTS[:3], k=4, max_new_tokens=NEW, stop_on_eos=False)
    assert res.output_tokens == plain_out[:3]
    assert d.unprepared >= 3  # the oracles (and the step time) were computed inside the run


def test_reproducible_per_request_seed(target_lm):
    d = make_drafter("synthetic:0.6:0", target_lm)
    d.prepare(PROMPTS[:4], 16)

    def history(seed, prompts):
        res = SpeculativeDecoder(target_lm, d).generate(prompts, k=3, max_new_tokens=16, seed=seed, stop_on_eos=False)
        return [r.history for r in res.requests]

    a = history(5, PROMPTS[:4])
    assert history(5, PROMPTS[:4]) == a
    assert history(6, PROMPTS[:4]) != a
    # a row's drafts depend on its own seed, not on its batch-mates: row 0 alone with the same seed
    assert history(5, PROMPTS[:1])[0] == a[0]


def test_sampling_stays_exact_shape(target_lm):
    """Under sampling the drafts are one-hot (no probs): the engine scores them as deterministic drafts;
    the run is reproducible from its seed."""
    d = make_drafter("synthetic:0.9:0", target_lm)
    d.prepare(PROMPTS[:4], 12)
    dec = SpeculativeDecoder(target_lm, d)
    r1 = dec.generate(PROMPTS[:4], k=3, max_new_tokens=12, temperature=0.8, seed=3)
    r2 = dec.generate(PROMPTS[:4], k=3, max_new_tokens=12, temperature=0.8, seed=3)
    assert r1.output_tokens == r2.output_tokens and r1.metrics["drafted_tokens"] > 0


def test_cost_is_burnt(target_lm):
    t = time.perf_counter()
    spin(0.02)
    assert time.perf_counter() - t >= 0.02
    d = make_drafter("synthetic:0.5:3", target_lm)
    d.prepare(PROMPTS[:2], 8, rows=(2,))
    step = d.step_time(2)
    from speclab.drafters.base import DraftContext
    from speclab.engine.sampling import RowParams, SamplingParams

    ids = [target_lm.encode(p) for p in PROMPTS[:2]]
    host = [p + [d.oracle[tuple(p)][0]] for p in ids]
    L = max(len(h) for h in host)
    buf = torch.zeros(2, L + 8, dtype=torch.long)
    ctx = DraftContext(buf, torch.tensor([len(h) for h in host]), [len(h) for h in host], host,
                       request_ids=["a", "b"], seeds=[1, 2])
    d.admit(ctx, range(2))
    t = time.perf_counter()
    prop = d.propose(ctx, [4, 2], RowParams.uniform(SamplingParams(), 2, "cpu"), None, False)
    assert time.perf_counter() - t >= 3 * 4 * step  # C x (max k) steps of 2 rows
    assert prop.lengths.tolist() == [4, 2] and prop.tokens.shape == (2, 4) and prop.probs is None
    assert prop.tokens[1, 2:].tolist() == [-1, -1]


# ----------------------------------------------------------------------------------- the cost model side
def test_round_plan_hand_built():
    from speclab.analysis.round_plan import parts_round_time, predict_decode_time, round_plan

    # always accepted, k 2, budget 3, one row: one round of width 2
    assert round_plan(1.0, 2, 3, 1) == [(1.0, 1.0, [0.0, 0.0, 1.0])]
    # never accepted: every round emits one token; the last round (1 token left) drafts nothing
    plan = round_plan(0.0, 4, 3, 1)
    assert len(plan) == 3 and [p[2].index(1.0) for p in plan] == [2, 1, 0]
    # alpha 0.5, k 1, budget 2, 2 rows: round 1 runs both rows; round 2 runs when a row rejected (1 - 0.25)
    plan = round_plan(0.5, 1, 2, 2)
    assert plan[0][0] == 1.0 and plan[0][1] == 2.0
    assert plan[1][0] == pytest.approx(0.75) and plan[1][1] == pytest.approx(2 * 0.5 / 0.75)
    assert plan[1][2] == pytest.approx([1.0, 0.0])  # 1 token left: no drafts
    # decode time: the rounds' times, each round = c w f(n,1) + f(n,w+1) + o(n) when priced from its parts
    parts = parts_round_time(0.5, lambda n, T: 1.0 * T, lambda n: 0.25)
    assert predict_decode_time(1.0, 2, 1, 3, parts) == pytest.approx(0.5 * 2 * 1 + 3 + 0.25)
    assert predict_decode_time(0.0, 1, 1, 4, lambda n, w: 1.0) == pytest.approx(4.0)
    # 2 rows, alpha 0.5, k 1, budget 2: round 1 at width 1, round 2 (p 0.75) at width 0
    assert predict_decode_time(0.5, 1, 2, 2, lambda n, w: 10.0 + w) == pytest.approx(11.0 + 0.75 * 10.0)


def test_round_times_solved_from_batches_that_accept_nothing():
    """A batch at alpha 0 and k runs ``budget`` rounds, the last k narrower; its time is the sum of its rounds, and
    widths not calibrated lie on the line between the calibrated ones around them. Built from known round times,
    the batches' times give them back."""
    from speclab.analysis.round_plan import calibration_widths, round_times_from_calibration, widths_line

    assert calibration_widths(2, 4) == [2, 2, 1, 0]
    assert calibration_widths(4, 3) == [2, 1, 0]  # a budget shorter than k: every round capped
    assert widths_line({0: 1.0, 2: 3.0}, 1) == 2.0 and widths_line({0: 1.0, 2: 3.0}, 2) == 3.0
    assert round_times_from_calibration(1.0, {1: 5.0}, 3) == {0: 1.0, 1: 2.0}  # widths 1, 1, 0
    true = {0: 2.0, 1: 2.5, 2: 3.0, 3: 3.6, 4: 4.2, 5: 5.0, 6: 5.8, 7: 6.6, 8: 7.4}  # linear between 0, 1, 2, 4, 8
    budget = 31
    batches = {k: sum(true[w] for w in calibration_widths(k, budget)) for k in (1, 2, 4, 8)}
    got = round_times_from_calibration(true[0], batches, budget)
    assert set(got) == {0, 1, 2, 4, 8}
    for w, t in got.items():
        assert t == pytest.approx(true[w])
    # a round at width 3 read off the line between 2 and 4
    assert widths_line(got, 3) == pytest.approx(3.6)


def test_draws_count_the_acceptance_checks():
    """The realized alpha: accepted tokens over the checks made, a check per accepted draft and one for the first
    rejection (none after it, none in a round that drafted nothing)."""
    from speclab.analysis.round_plan import draws

    assert draws([(2, 2), (2, 0), (1, 0)]) == 4
    assert draws([(0, 0), (4, 4)]) == 4
    assert draws([(4, 1)]) == 2


@pytest.mark.slow
def test_bench_synthetic_smoke(tmp_path, capsys):
    from speclab.family import list_models

    if "target" not in {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from speclab.cli import main

    out = tmp_path / "synthetic.json"
    # 24 tokens: the decode phase is what is left after subtracting a prefill-only run, and with 8 it was a few
    # tens of milliseconds, within the machine's noise (once negative: a negative speedup)
    rc = main(["bench", "synthetic", "--alphas", "0.5,0.9", "--k", "1,2", "--batches", "1,2", "--reps", "1",
               "--prompts-per-workload", "1", "--max-new-tokens", "24", "--threads", "1", "--out", str(tmp_path),
               "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert len(rep["cells"]) == 2 * 2 * 2
    for c in rep["cells"]:
        assert c["identical"] and c["measured_speedup"] > 0 and c["predicted_speedup"] > 0
        assert len(c["rep_speedups"]) == 1 and c["rep_spread"] >= 0
        assert abs(c["measured_acceptance"] - c["alpha"]) < 0.5
        assert c["parts_predicted_speedup"] > 0
    assert rep["calibration_identical"]
    assert set(rep["round_ms"]) == {"1", "2"} and set(rep["round_ms"]["1"]) == {"0", "1", "2"}
    assert {"model_error_to_crossover", "model_error_all", "all_identical", "cells_repeatable_15pct"} <= set(
        rep["targets"])
    assert "target model_error_to_crossover" in capsys.readouterr().out
