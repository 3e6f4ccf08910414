"""Draft-length policies: each rule against hand-built histories and hand-built cost tables, the cost
table's interpolation and calibration, exactness with every policy (greedy identity, the sampled
distribution), the sweep's policy dimension and `speclab bench policies` end to end."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import PromptLookupDrafter, make_drafter
from speclab.engine import SpeculativeDecoder, make_policy
from speclab.engine.costs import PLAIN_SAMPLES, OnlineCosts, interpolate, time_shapes
from speclab.engine.policies import (
    POLICIES,
    AcceptanceTracker,
    BatchTable,
    Confidence,
    CostGate,
    Ema,
    Goodput,
    Heuristic,
    OffHold,
    PlainCheck,
    PolicyView,
    ProbeBudget,
    RoundTimes,
    RowView,
    batch_tokens,
    draft_prefill_share,
    ema_tiers,
    expected_tokens,
    parse_table,
    position_priors,
    switch_on,
)
from speclab.errors import SpeclabError


def view(histories, costs=None, remaining=1000, waiting=0, ids=None):
    rows = tuple(RowView(ids[i] if ids else f"r{i}", tuple(h), remaining=remaining) for i, h in enumerate(histories))
    return PolicyView(rows, len(rows), waiting, costs)


def table(step_ms=1.0, verify_ms_per_token=0.1, draft_ms=0.1, rows=(1,), k_max=8, overhead_ms=0.0, steep=False):
    """A hand-built cost table: target(n, T) = step + per_token (T - 1) (steep: step x T, compute-bound),
    a draft phase of s steps = s x draft, overhead per round."""
    c = OnlineCosts()
    for n in rows:
        for T in range(1, k_max + 2):
            ms = step_ms * T if steep else step_ms + verify_ms_per_token * (T - 1)
            for _ in range(PLAIN_SAMPLES if T == 1 else 1):  # plain steps: as many as a policy wants timed
                c.record_target(n, T, ms / 1e3)
        for s in range(1, k_max + 1):
            c.record_draft(n, s, s * draft_ms / 1e3)
        if overhead_ms:
            c.record_overhead(n, overhead_ms / 1e3)
    return c


def _accept(alpha, r, i):
    # a low-discrepancy sequence: position i of round r is accepted when frac((r + 1) * phi + i * sqrt2) < alpha
    return ((r + 1) * 0.6180339887 + i * 0.4142135624) % 1.0 < alpha


def hist(alpha, k, rounds):
    out = []
    for r in range(rounds):
        a = 0
        while a < k and _accept(alpha, r, a):
            a += 1
        out.append((k, a))
    return out


# ----------------------------------------------------------------------------------- registry
def test_make_policy_names_and_arguments():
    assert set(POLICIES) == {"fixed", "off", "batch-table", "heuristic", "ema", "goodput", "confidence"}
    assert make_policy(None, 4).name == "fixed" and make_policy(None, 0).name == "off"
    for name in POLICIES:
        p = make_policy(name, 3)
        assert p.name == name and p.k_max == (0 if name == "off" else 3)
    assert make_policy("batch-table:1-2=3,3-=0", 4).table == [(1, 2, 3), (3, None, 0)]
    assert make_policy("confidence:0.25", 4).threshold == 0.25
    g = Goodput(2)
    assert make_policy(g) is g
    for bad in ("nope", "goodput:1", "batch-table:x", "batch-table:4-2=1", "confidence:2"):
        with pytest.raises(SpeclabError):
            make_policy(bad, 4)


def test_parse_table():
    assert parse_table("1-8=4, 9-32=2,33-=0") == [(1, 8, 4), (9, 32, 2), (33, None, 0)]
    assert parse_table("5=1") == [(5, 5, 1)]
    with pytest.raises(SpeclabError):
        parse_table("")


# ----------------------------------------------------------------------------------- the rules
def test_batch_table_lookup():
    p = BatchTable(4)  # default: K up to 8 rows, K/2 up to 32, off above
    assert [p.lookup(n)[0] for n in (1, 8, 9, 32, 33, 500)] == [4, 4, 2, 2, 0, 0]
    p = BatchTable(4, "1-2=3,5-6=1")
    assert [p.lookup(n)[0] for n in (1, 2, 3, 5, 7)] == [3, 3, 0, 1, 0]
    assert p.k_max == 4
    ch = p.choose(view([[], []]))
    assert [c.k for c in ch] == [3, 3] and "1-2" in ch[0].reason


def test_heuristic_plus_two_minus_one():
    p = Heuristic(6, gate=False)
    # starts at K=6; all accepted -> +2 (capped at 6); a miss -> -1; never below 1; rounds without drafts ignored
    h = [(6, 2), (5, 1), (4, 4), (6, 6), (0, 0), (6, 0), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]
    expect = [6, 5, 4, 6, 6, 6, 5, 4, 3, 2, 1, 1, 3]
    for i in range(len(h) + 1):
        assert p.choose(view([h[:i]]))[0].k == expect[i], i
    # incremental state equals a fresh replay of the whole history
    assert Heuristic(6, gate=False).choose(view([h]))[0].k == 3


def test_ema_tiers_and_hysteresis():
    assert ema_tiers(6) == [1, 2, 4, 6] and ema_tiers(1) == [1] and ema_tiers(8) == [1, 2, 4, 8]
    p = Ema(8, gate=False)  # tiers 1,2,4,8, starts at the middle tier (2)
    assert p.choose(view([[]]))[0].k == 2
    ema, tier = p.step(None, 1, 2)  # all accepted at tier 2 -> up to 4
    assert (ema, tier) == (2.0, 2)
    ema2, tier2 = p.step(ema, tier, 2)  # 2 of 4: ema 2.0 < 0.8*4, >= 0.3*4 -> stays (hysteresis band)
    assert tier2 == 2 and ema2 == pytest.approx(2.0)
    _, t = p.step(1.1, 2, 0)  # ema 0.77 < 0.3*4 -> down to 2
    assert t == 1
    # a row at the edge does not flip every round: accepted alternating 1, 2 at tier 2 stays at tier 2
    st = (None, 1)
    tiers = []
    for a in [1, 2] * 6:
        st = p.step(st[0], st[1], a)
        tiers.append(st[1])
    assert len(set(tiers[2:])) == 1
    with pytest.raises(SpeclabError):
        Ema(4, up=0.2, down=0.5)


def test_tracker_per_position_and_prior():
    tr = AcceptanceTracker(4, decay=1.0, prior_weight=2.0, default=0.8)
    # one row: 10 rounds of k=4 accepting exactly 2: positions 0,1 always accepted, 2 always rejected, 3 never reached
    v = view([[(4, 2)] * 10])
    tr.update(v)
    c = tr.conditional("r0")
    assert c[0] == pytest.approx((10 + 2 * tr.population()[0]) / 12)
    assert c[2] < 0.2 and c[3] == pytest.approx(tr.population()[3])  # unseen position: the population's there
    chain = AcceptanceTracker(4, decay=1.0, prior_weight=2.0, default=0.8, position_prior="chain")
    chain.update(v)
    cc = chain.conditional("r0")
    assert cc[3] == pytest.approx(cc[2])  # 'chain': the row's own estimate before it
    s = tr.survival("r0")
    assert s == sorted(s, reverse=True) and s[0] == pytest.approx(c[0])
    # a new row starts from the population, which learned from r0
    tr.update(view([[(4, 2)] * 10, []]))
    assert tr.conditional("r1")[0] == pytest.approx(tr.population()[0]) and tr.population()[0] > 0.9
    # rows that left are forgotten; their rounds stay in the population
    tr.update(view([[]], ids=["r9"]))
    assert set(tr.rows) == {"r9"}


def test_position_priors_by_hand():
    assert position_priors("chain", 0.6, [0.7, 0.9], 1) == 0.6
    assert position_priors("population", 0.6, [0.7, 0.9], 1) == 0.9
    assert position_priors("logit", 0.6, [0.7, 0.9], 1) == pytest.approx(0.8526, abs=1e-4)
    assert position_priors("logit", 0.7, [0.7, 0.9], 1) == pytest.approx(0.9)  # at the population: its value
    with pytest.raises(ValueError):
        AcceptanceTracker(4, position_prior="iid")


def test_a_row_without_evidence_starts_from_the_population_at_every_position():
    """JSON-like acceptance: a first draft token often missed, the later ones almost always taken once the first
    is. A row the tracker holds but that has not drafted yet (its rounds so far at k = 0) must start from the
    population's per-position estimate, as a row it has never seen does, not from the population's first position
    at every position (0.69^i: [0.69, 0.48, 0.33, 0.23] where the population read [0.69, 0.61, 0.55, 0.50]; a
    4-row JSON burst then predicted no k paying and ran 82% of its rounds off, 0.94x plain where fixed k = 4 read
    1.18x)."""
    tr = AcceptanceTracker(4, decay=1.0, prior_weight=4.0)
    tr.update(view([[(4, 0)] * 3 + [(4, 4)] * 7]))  # position 0: 7 of 10; the rest: every one reached accepted
    pop = tr.population()
    assert pop[0] == pytest.approx((7 + 0.8) / 11) and min(pop[1:]) > 0.85
    tr.update(view([[(0, 0)] * 5], ids=["new"]))  # held, not drafting
    fresh = tr.survival("unknown", pop)
    held = tr.survival("new", pop)
    assert held == pytest.approx(fresh)
    assert held[3] > 0.45 and held[3] > 1.5 * pop[0] ** 4
    chain = AcceptanceTracker(4, decay=1.0, prior_weight=4.0, position_prior="chain")
    chain.update(view([[(4, 0)] * 3 + [(4, 4)] * 7]))
    chain.update(view([[(0, 0)] * 5], ids=["new"]))
    assert chain.survival("new")[3] == pytest.approx(pop[0] ** 4)  # what 'chain' did


def test_tracker_replay_log_loss_by_hand():
    from benchmarks.tracker_fit import replay_log_loss

    # one request, one round drafting 1, accepted: one prediction (the default 0.8), a success
    loss, brier, n = replay_log_loss([[(1, 1)]], 4, default=0.8)
    assert n == 1 and loss == pytest.approx(-math.log(0.8)) and brier == pytest.approx(0.04)
    # a round (4, 1) reaches positions 0 and 1: two predictions, a success then a failure
    assert replay_log_loss([[(4, 1)]], 4)[2] == 2
    assert replay_log_loss([[(0, 0), (0, 0)]], 4)[2] == 0  # rounds that drafted nothing predict nothing


def test_tracker_fit_prefers_forgetting_only_where_acceptance_moves():
    """Statistical: rows whose acceptance never changes are predicted better by a tracker that never forgets;
    rows whose acceptance flips halfway, by one that forgets fast. A fit that ignored the histories would rank
    the two settings the same way on both."""
    import random

    from benchmarks.tracker_fit import replay_log_loss

    rng = random.Random(0)

    def rows(rates):  # k = 1 rounds, a list of per-row acceptance rates over time
        return [[(1, int(rng.random() < p)) for p in r] for r in rates]

    steady = rows([[rng.choice((0.2, 0.9))] * 80 for _ in range(24)])
    flips = rows([[a] * 40 + [b] * 40 for a, b in [(0.95, 0.1), (0.1, 0.95)] * 12])
    keep, forget = dict(decay=1.0, prior_weight=4.0), dict(decay=0.8, prior_weight=4.0)
    assert replay_log_loss(steady, 1, **keep)[0] < replay_log_loss(steady, 1, **forget)[0]
    assert replay_log_loss(flips, 1, **forget)[0] < replay_log_loss(flips, 1, **keep)[0]


def test_tracker_fit_prefers_a_slow_population_only_where_the_population_holds_still():
    """Statistical, for the population's decay: short requests (three k = 1 rounds each, so their predictions lean on
    the population) whose acceptance is the same all run long are predicted better by a population that forgets
    slowly; when every request's acceptance switches halfway through the run, by one that forgets fast."""
    import random

    from benchmarks.tracker_fit import replay_log_loss

    rng = random.Random(1)

    def requests(rates):  # one acceptance rate per request, three k = 1 rounds each
        return [[(1, int(rng.random() < p)) for _ in range(3)] for p in rates]

    steady = requests([0.7] * 400)
    shift = requests([0.9] * 200 + [0.2] * 200)
    slow, fast = dict(population_decay=0.995), dict(population_decay=0.8)
    assert replay_log_loss(steady, 1, **slow)[0] < replay_log_loss(steady, 1, **fast)[0]
    assert replay_log_loss(shift, 1, **fast)[0] < replay_log_loss(shift, 1, **slow)[0]


def test_monotone_round_times():
    from speclab.engine.policies import monotone

    assert monotone([1, 3, 2, 4]) == [1, 2.5, 2.5, 4] and monotone([3, 2, 1]) == [2, 2, 2]
    assert monotone([1, 2, 3]) == [1, 2, 3] and monotone([]) == []


def test_affine_round_times_in_k():
    from speclab.engine.policies import affine_in_k

    assert affine_in_k([5, 8, 9, 13, 12]) == pytest.approx([5, 8.1, 9.7, 11.3, 12.9])
    assert affine_in_k([5, 9, 8, 7, 6]) == pytest.approx([5, 7.5, 7.5, 7.5, 7.5])  # never falling: flat at the mean
    assert affine_in_k([5, 8]) == [5, 8] and affine_in_k([1, 2, 3, 4]) == pytest.approx([1, 2, 3, 4])


def test_affine_round_times_weighted():
    from speclab.engine.policies import affine_in_k

    assert affine_in_k([5, 8, 9, 13, 12], [1, 1, 1, 1]) == pytest.approx(affine_in_k([5, 8, 9, 13, 12]))
    # weight 0: left out of the line and kept as it is; the line through k = 1, 2 passes through both
    assert affine_in_k([0, 26.5, 38.5, 45, 50], [1, 1, 0, 0]) == pytest.approx([0, 26.5, 38.5, 45, 50])
    # a small weight pulls the line a little towards them: k = 1 at 27.6 (the unweighted line: 28.45)
    low = affine_in_k([0, 26.5, 38.5, 45, 50], [1, 1, 0.1, 0.1])
    assert low[1] == pytest.approx(27.616, abs=1e-3) and affine_in_k([0, 26.5, 38.5, 45, 50])[1] == pytest.approx(28.45)
    assert affine_in_k([1, 5, 3, 4], [1, 0, 0]) == [1, 5, 3, 4]  # fewer than two lengths to fit: as it is
    # one length timed, three calibrated at 0.1: the line keeps close to the timed one (the unweighted line: 27.71)
    assert affine_in_k([0, 26.7, 39.6, 50, 59.1], [1, 0.1, 0.1, 0.1])[1] == pytest.approx(26.838, abs=1e-3)


def test_goodput_prices_a_draft_length_from_the_widths_timed_online():
    """64 rows, as on a JSON workload: verifies of 2 and 3 tokens timed online at 22 and 31 ms (1.5x their
    calibration), 4 and 5 tokens only calibrated, rescaled by that 1.5 to more than rounds of k = 3 and 4 cost in a
    line with the others (the verify grows ever less per token there). The line through every draft length's round
    priced k = 1 at 28.45 ms against 26.5 from its parts, and goodput stayed off at a predicted 1.04x where drafting
    pays 1.12x; with the calibrated lengths weighing little in the line it drafts k = 1. The kept weight and no
    weight at all both switch on."""
    from speclab.engine.policies import affine_in_k

    c = OnlineCosts()
    c.set_calibrated({(64, 1): 17e-3, (64, 2): 22e-3 / 1.5, (64, 3): 31e-3 / 1.5, (64, 4): 23e-3, (64, 5): 24.33e-3})
    for _ in range(PLAIN_SAMPLES):
        c.record_target(64, 1, 17e-3)
    for _ in range(2):  # a calibrated shape's first online sample alone does not set its estimate
        c.record_target(64, 2, 22e-3)
        c.record_target(64, 3, 31e-3)
    for s in range(1, 5):
        c.record_draft(64, s, s * 3e-3)
    c.record_overhead(64, 1.5e-3)
    c.record_overhead(64, 1.5e-3, drafted=False)
    assert [c.measured(64, T) for T in range(1, 6)] == [True, True, True, False, False]
    assert [c.round_time(64, k) * 1e3 for k in range(5)] == pytest.approx([18.5, 26.5, 38.5, 45.0, 50.0], abs=0.01)
    v = view([hist(0.6, 1, 40)] * 64, c, ids=[f"r{i}" for i in range(64)])
    assert Goodput(4).choose(v)[0].k == 1
    none = Goodput(4)
    none.times = RoundTimes(4, calibrated=0.0)
    assert none.choose(v)[0].k == 1
    unweighted = Goodput(4)
    unweighted.times = RoundTimes(4, fit=lambda t: affine_in_k(t))  # every length in the line alike
    assert unweighted.choose(v)[0].k == 0
    everything = OnlineCosts()  # every length timed online: the line as before, whatever the weight
    for T, ms in enumerate([17, 22, 31, 38, 44], start=1):
        for _ in range(PLAIN_SAMPLES if T == 1 else 1):
            everything.record_target(64, T, ms / 1e3)
    for s in range(1, 5):
        everything.record_draft(64, s, s * 3e-3)
    assert RoundTimes(4).get(everything, 64) == pytest.approx(RoundTimes(4, fit=lambda t: affine_in_k(t)).get(
        everything, 64))


def test_goodput_does_not_trust_one_slow_reading_of_a_draft_length():
    """Rounds of k = 1, 2 and 4 timed on a line, k = 3 read in a slow spell (14 ms against its 9.5): goodput with
    high acceptance still drafts 4. Pooling adjacent violators alone made k = 3 and 4 one 12.5 ms block and
    settled on k = 2; the line through every length's rounds keeps one slow reading from deciding."""
    costs = table(step_ms=5.0, verify_ms_per_token=0.3, draft_ms=1.2, k_max=4)  # rounds 5 + 1.5 k ms
    for _ in range(9):
        costs.record_draft(1, 3, (1.2 * 3 + 4.5) / 1e3)
    assert costs.round_time(1, 3) == pytest.approx(14e-3)
    h = [hist(0.9, 4, 40)]
    g = Goodput(4)
    assert g.choose(view(h, costs))[0].k == 4
    pav = Goodput(4)
    pav.times.fit = list  # no line: pool adjacent violators only
    assert pav.choose(view(h, costs))[0].k == 2


def test_expected_and_batch_tokens():
    assert expected_tokens([0.5, 0.25], 2) == 1.75 and expected_tokens([0.5, 0.25], 0) == 1.0
    tot = batch_tokens([[0.5, 0.25, 0.1], [1.0, 1.0, 1.0]], [100, 2], 3)
    assert tot == pytest.approx([2.0, 2.0 + 1.5, 2.0 + 1.75, 2.0 + 1.85])  # row 2 can draft at most 1


def test_draft_prefill_share_by_hand():
    row = RowView("r", (), remaining=30, prompt_len=100, generated=10)  # budget 40
    assert draft_prefill_share([row], [[0.5, 0.25]], 2, 1e-4) == pytest.approx([0.0, 3.75e-4, 4.375e-4])
    assert draft_prefill_share([row], [[0.5, 0.25]], 2, 0.0) == [0.0, 0.0, 0.0]  # nothing measured: no charge
    near_end = RowView("r", (), remaining=2, prompt_len=100, generated=38)  # may draft 1: k = 2 emits as k = 1
    assert draft_prefill_share([near_end], [[0.5, 0.25]], 2, 1e-4) == pytest.approx([0.0, 3.75e-4, 3.75e-4])
    unbounded = RowView("r", (), prompt_len=100)  # no budget known: nothing to spread the cost over
    assert draft_prefill_share([unbounded, row], [[0.5, 0.25]] * 2, 2, 1e-4)[1] == pytest.approx(3.75e-4)


def test_goodput_weighs_the_draft_prefill():
    """A draft that pays off by 10% in the round loses once its prefill, spread over each row's output, is
    counted: long prompts, short outputs. The prefill is measured online (record_draft_prefill)."""
    costs = table(step_ms=1.0, verify_ms_per_token=0.3, draft_ms=0.25, rows=(4,))  # k = 1: 1.55 ms, 1 + a tokens
    h = [(1, 1)] * 7 + [(1, 0)] * 3  # about 0.7 accepted at position 0
    rows = tuple(RowView(f"r{i}", tuple(h), remaining=20, prompt_len=400, generated=12) for i in range(4))
    assert Goodput(1).choose(PolicyView(rows, 4, 0, costs))[0].k == 1
    costs.record_draft_prefill(400, 400 * 5e-5)  # 0.05 ms a token: 20 ms a row, over 32 tokens
    assert costs.draft_prefill_time(10) == pytest.approx(5e-4)
    ch = Goodput(1).choose(PolicyView(rows, 4, 0, costs))
    assert ch[0].k == 0, ch[0].reason


def test_goodput_follows_acceptance_on_a_cheap_draft():
    costs = table(step_ms=1.0, verify_ms_per_token=0.1, draft_ms=0.1)  # drafting is cheap
    low, high = Goodput(8), Goodput(8)
    kl = low.choose(view([hist(0.1, 4, 30)], costs))[0]
    kh = high.choose(view([hist(0.9, 4, 30)], costs))[0]
    assert kl.k == 0 and "goodput" in kl.reason
    assert kh.k >= 3, kh.reason


def test_goodput_switches_off_under_load():
    """The same acceptance; the table says a verify of k+1 tokens costs k+1 steps at 64 rows (compute-bound)
    and about one step at 1 row: k > 0 at 1 row, k = 0 at 64."""
    costs = table(rows=(1,))
    for n in (32, 64):
        for T in range(1, 10):
            costs.record_target(n, T, 1e-3 * n * T)
        for s in range(1, 9):
            costs.record_draft(n, s, 0.1e-3 * n * s)
    p = Goodput(8)
    assert p.choose(view([hist(0.8, 4, 30)], costs))[0].k > 0
    ch = p.choose(view([hist(0.8, 4, 30)] * 64, costs))
    assert {c.k for c in ch} == {0} and "64 rows" in ch[0].reason


def test_catch_up_after_rounds_at_k0_is_charged():
    """A draft model that holds a row misses one token per round at k = 0 and catches up on all of them (one block
    as wide as the most lagging row) before it drafts again: goodput and the cost gate charge that to the round
    that switches drafting back on. By hand, then on a table where drafting pays in steady rounds."""
    from speclab.engine.policies import catch_up_time

    tr = AcceptanceTracker(4)
    tr.update(view([[(4, 2), (0, 0), (0, 0)], [(0, 0)] * 5, [(0, 0)] * 9], ids=["a", "b", "c"]))
    assert [tr.idle_rounds(x) for x in "abc"] == [2, 5, 9] and tr.idle_rounds("new") == 0
    rows = (RowView("a", (), taken_in=True), RowView("b", (), taken_in=True), RowView("c", (), taken_in=False))
    assert catch_up_time(rows, tr, 1e-4) == pytest.approx(1e-4 * 2 * 5)  # 2 rows held, the longest 5 behind
    assert catch_up_time(rows, tr, 0.0) == 0.0  # a drafter without a model: nothing to catch up
    tr.update(view([[(4, 2), (0, 0), (0, 0), (1, 1)]], ids=["a"]))
    assert tr.idle_rounds("a") == 0

    costs = table(rows=(16,), step_ms=1.0, verify_ms_per_token=0.1, draft_ms=0.1)
    costs.record_draft_prefill(1000, 1e-2)  # 10 us a token: 16 rows x 20 tokens behind = 3.2 ms
    steady, behind = hist(0.8, 4, 30), hist(0.8, 4, 30) + [(0, 0)] * 20
    assert Goodput(4).choose(view([steady] * 16, costs))[0].k > 0
    assert Goodput(4).choose(view([behind] * 16, costs))[0].k == 0
    gate = Heuristic(4)
    gate.choose(view([steady] * 16, costs, ids=[f"s{i}" for i in range(16)]))
    assert gate.choose(view([behind] * 16, costs))[0].k == 0


def test_goodput_per_position_not_iid():
    """Acceptance that collapses after position 2 (e.g. a fixed-length field): goodput stops at 2, where an
    i.i.d. estimate with the same overall rate would draft further."""
    costs = table(step_ms=1.0, verify_ms_per_token=0.15, draft_ms=0.1)
    h = [(6, 2)] * 40  # positions 0, 1 always accepted, position 2 never
    assert Goodput(6).choose(view([h], costs))[0].k == 2


def test_goodput_cold_start_explores_then_decides():
    p = Goodput(4)
    assert p.choose(view([[]], None))[0].k == 4  # no cost model at all: the rule's K
    c = OnlineCosts()
    assert "plain" in p.choose(view([[]], c))[0].reason  # nothing measured: a plain step first
    c.record_target(1, 1, 1e-3)
    assert p.choose(view([[]], c))[0].k == 4  # then one round at K
    c.record_target(1, 5, 1.4e-3)
    c.record_draft(1, 4, 0.4e-3)
    good = view([hist(0.9, 4, 20)], c)
    assert "timing plain steps" in p.choose(good)[0].reason  # one plain step timed: more before drafting on it
    for _ in range(PLAIN_SAMPLES - 1):
        c.record_target(1, 1, 1e-3)
    assert "goodput: k=" in p.choose(good)[0].reason


def test_goodput_probes_when_acceptance_closed_it():
    costs = table()
    p = Goodput(4, probe_every=4, probe_budget=1.0)  # a probe (0.2 ms over a 1 ms round) is always within budget
    ks = [p.choose(view([hist(0.05, 4, 30)], costs))[0].k for _ in range(8)]
    assert ks == [0, 0, 0, 1, 0, 0, 0, 1]  # a probe every 4 rounds at k = 0
    steep = table(step_ms=1.0, steep=True, draft_ms=1.0)  # even a good draft loses: never probe
    q = Goodput(4, probe_every=2)
    assert [q.choose(view([hist(0.05, 4, 30)], steep))[0].k for _ in range(6)] == [0] * 6


def _policy_run(policy, rounds, alpha, accepted, ids=("r0",)):
    """Feed ``policy`` a run on a cheap table, every row starting from ``hist(alpha, 4, 30)`` and each round's choice
    appended to every row's history with ``accepted(k, round)`` of its drafts accepted: the ks chosen, the reasons,
    and how many rounds were weighed (``scores`` called)."""
    costs, hs = table(), {i: hist(alpha, 4, 30) for i in ids}
    weighed = [0]
    scores = policy.scores

    def counted(v):
        weighed[0] += 1
        return scores(v)

    policy.scores = counted
    ks, why = [], []
    for r in range(rounds):
        c = policy.choose(PolicyView(tuple(RowView(i, tuple(hs[i]), remaining=1000) for i in ids), len(ids), 0,
                                     costs))[0]
        ks.append(c.k)
        why.append(c.reason)
        for i in ids:
            hs[i].append((c.k, accepted(c.k, r)))
    return ks, why, weighed[0]


def _off_run(policy, rounds, ids=("r0",)):
    """A run at acceptance 0.05 in which every draft (a probe at k = 1) is rejected (:func:`_policy_run`)."""
    return _policy_run(policy, rounds, 0.05, lambda k, r: 0, ids)


def test_off_hold_skips_the_weighing_and_keeps_the_decisions():
    """A k = 0 decision held for the next rounds: the same ks as weighing every round, probes on the same rounds
    (held rounds count towards them), and most rounds not weighed at all."""
    every = Goodput(4, probe_every=8, probe_budget=1.0)
    every.hold = OffHold(0)
    held = Goodput(4, probe_every=8, probe_budget=1.0)
    ks0, _, w0 = _off_run(every, 40)
    ks1, why1, w1 = _off_run(held, 40)
    assert ks1 == ks0 and ks0.count(1) == 5 and ks0[7] == 1  # a probe every 8 rounds, the first on the 8th
    assert w0 == 40 and w1 <= 15
    assert any(w.endswith("(held)") for w in why1) and not why1[0].endswith("(held)")


def test_off_hold_ends_when_the_rows_change():
    p = Goodput(4, probe_every=8, probe_budget=1.0)
    costs = table()
    h = tuple(hist(0.05, 4, 30))
    one = PolicyView((RowView("a", h, remaining=1000),), 1, 0, costs)
    assert p.choose(one)[0].k == 0 and p.hold.left > 0
    assert p.choose(one)[0].reason.endswith("(held)")
    other = PolicyView((RowView("b", h, remaining=1000),), 1, 0, costs)  # a row left, another arrived
    assert not p.choose(other)[0].reason.endswith("(held)")
    two = PolicyView((RowView("b", h, remaining=1000), RowView("c", h, remaining=1000)), 2, 0, table(rows=(1, 2)))
    assert not p.choose(two)[0].reason.endswith("(held)")


def test_off_hold_never_passes_a_probe_the_budget_allows():
    """With probes every round but a budget that allows one every few rounds, the hold ends on the round the budget
    covers the probe."""
    def run(hold_rounds):
        q = Goodput(4, probe_every=1, probe_budget=0.11, probe_backoff=0)  # 0.2 ms probe, 1 ms rounds: one every 2
        q.hold = OffHold(hold_rounds)
        return _off_run(q, 12)[0]

    assert run(8) == run(0) == [0, 1] * 6


def test_switch_on_by_hand():
    assert switch_on(1.03, on=True) and not switch_on(1.03, on=False)  # inside the band: as it was
    assert switch_on(1.06, on=False) and not switch_on(0.99, on=True)
    assert switch_on(1.0, on=False, margin=0.0) and not switch_on(1.0, on=True)


def test_goodput_switches_on_only_past_the_margin_and_off_below_break_even():
    """Hysteresis on the predicted gain: a draft predicted at a few percent over plain decoding does not switch a
    policy that is off back on (its switching costs are not in the prediction), but keeps one that is on."""
    costs = table(step_ms=1.0, verify_ms_per_token=0.3, draft_ms=0.1)  # k = 1: 1.4 ms
    h = hist(0.45, 1, 40)  # about 1.45 tokens a round at k = 1: 1.45 / 1.4 = 1.03x plain

    def first(p):
        return p.choose(view([h], costs))[0]

    off = first(Goodput(4, probe_every=0))
    assert off.k == 0 and "to switch on" in off.reason
    assert first(Goodput(4, probe_every=0, switch_margin=0.0)).k > 0  # no band: on at once
    p = Goodput(4, probe_every=0, draft_hold=0)  # every round weighed (the hold: test_draft_hold_*)
    assert p.choose(view([hist(0.9, 1, 40)], costs))[0].k > 0  # clearly paying: on
    assert p.choose(view([hist(0.9, 1, 40) + h], costs))[0].k > 0  # then 1.03x: stays on
    assert p.choose(view([hist(0.9, 1, 40) + hist(0.05, 1, 60)], costs))[0].k == 0  # below break-even: off


def _draft_run(policy, rounds, alpha=0.9, ids=("r0",)):
    """A run at acceptance ``alpha``, its drafts accepted as ``hist`` would accept them (:func:`_policy_run`)."""
    def accepted(k, r):
        a = 0
        while a < k and _accept(alpha, 30 + r, a):
            a += 1
        return a

    return _policy_run(policy, rounds, alpha, accepted, ids)


def test_draft_hold_skips_the_weighing_while_drafting_clearly_pays():
    """A drafting decision well clear of switching off is kept for the next ``draft_hold`` rounds while the same rows
    run: the same ks as weighing every round at a steady high acceptance, one round in five weighed."""
    ks0, _, w0 = _draft_run(Goodput(4, draft_hold=0), 20)
    ks1, why1, w1 = _draft_run(Goodput(4, draft_hold=4), 20)
    assert ks1 == ks0 and min(ks0) > 0
    assert w0 == 20 and w1 == 4
    assert why1[1].endswith("(held)") and not why1[5].endswith("(held)")


def test_draft_hold_ends_when_the_rows_change():
    p = Goodput(4)
    costs = table()
    h = tuple(hist(0.9, 4, 30))
    one = PolicyView((RowView("a", h, remaining=1000),), 1, 0, costs)
    assert p.choose(one)[0].k > 0 and p.drafting.left == 4
    assert p.choose(one)[0].reason.endswith("(held)")
    other = PolicyView((RowView("b", h, remaining=1000),), 1, 0, costs)  # a row left, another arrived
    assert not p.choose(other)[0].reason.endswith("(held)")
    two = PolicyView((RowView("b", h, remaining=1000), RowView("c", h, remaining=1000)), 2, 0, table(rows=(1, 2)))
    assert not p.choose(two)[0].reason.endswith("(held)")
    # a k = 0 decision after the hold ends is not held as a drafting one
    low = PolicyView((RowView("d", tuple(hist(0.02, 4, 60)), remaining=1000),), 1, 0, costs)
    q = Goodput(4, probe_every=0)
    assert q.choose(low)[0].k == 0 and q.drafting.left == 0


def test_probe_cost_by_hand():
    from speclab.engine.policies import probe_cost

    held = RowView("a", (), prompt_len=100, generated=20)
    new = RowView("b", (), prompt_len=100, generated=20, taken_in=False)
    assert probe_cost([held], 10e-3, 14e-3, 1e-4) == pytest.approx(4e-3)
    assert probe_cost([held, new], 10e-3, 14e-3, 1e-4) == pytest.approx(16e-3)  # + 120 tokens of draft prefill


def test_goodput_probes_within_its_budget():
    """A probe costs at most ``probe_budget`` of the time spent at k = 0 since the last one; rows the draft has not
    taken in yet make it dearer (their draft prefill), so it comes later."""
    def rows(taken_in):
        return (RowView("r0", tuple(hist(0.05, 4, 30)), remaining=1000, prompt_len=100, taken_in=taken_in),)

    costs = table()  # 1 ms plain rounds, 1.2 ms at k = 1: a probe costs 0.2 ms
    p = Goodput(4, probe_every=1, probe_budget=0.11, probe_backoff=0)  # 0.2 ms: 2 rounds (2 x 1 ms x 0.11 = 0.22)
    assert [p.choose(PolicyView(rows(True), 1, 0, costs))[0].k for _ in range(6)] == [0, 1, 0, 1, 0, 1]
    b = Goodput(4, probe_every=1, probe_budget=0.11)  # backoff: each probe that found nothing halves the budget
    ks = [b.choose(PolicyView(rows(True), 1, 0, costs))[0].k for _ in range(22)]
    assert ks == [0, 1] + [0] * 3 + [1] + [0] * 7 + [1] + [0] * 7 + [1]  # 2 rounds, then 4, then 8 (at most 2 halvings)
    costs.record_draft_prefill(100, 1e-3)  # 10 us a token: taking the row in costs 1 ms more (1.2 ms: 11 rounds)
    q = Goodput(4, probe_every=1, probe_budget=0.11, probe_backoff=0)
    ks = [q.choose(PolicyView(rows(False), 1, 0, costs))[0].k for _ in range(12)]
    assert ks == [0] * 10 + [1, 0]


def test_probe_budget_backs_off_and_is_whole_again_once_drafting_is_on():
    pb = ProbeBudget(every=1, budget=0.1, backoff=2)
    fired = [pb.off_round((), 1e-3, 1.2e-3, 0.0, 0.5, 0.6) for _ in range(15)]  # 0.2 ms probes, 1 ms rounds
    assert [i for i, w in enumerate(fired) if w] == [1, 5, 13]  # 2 rounds, then 4 (0.05), then 8 (0.025)
    assert pb.share == pytest.approx(0.025)
    pb.reset()  # drafting switched on
    assert pb.share == pytest.approx(0.1)
    assert [bool(pb.off_round((), 1e-3, 1.2e-3, 0.0, 0.5, 0.6)) for _ in range(2)] == [False, True]


def test_population_keeps_its_estimate_while_nobody_drafts():
    """The population's evidence ages with new evidence, not with rounds in which nobody drafted: switched off, it
    keeps what it measured (only a budgeted probe tries again), instead of drifting back to its optimistic prior."""
    tr = AcceptanceTracker(4)
    h = [(4, 0), (4, 0), (4, 1)] * 7
    tr.update(view([h]))
    low = tr.population()[0]
    assert low < 0.4
    for _ in range(100):
        h = h + [(0, 0)]
        tr.update(view([h]))
    assert tr.population()[0] == pytest.approx(low)
    tr.update(view([h + [(4, 4)]]))  # new evidence moves it again
    assert tr.population()[0] > low


def test_cost_gate_turns_rules_off_and_probes():
    steep = table(step_ms=1.0, steep=True, draft_ms=0.5)  # verify k+1 costs k+1 steps: drafts never pay
    for cls in (Heuristic, Ema, Confidence):
        p = cls(4)
        ch = p.choose(view([hist(0.6, 4, 10)], steep))
        assert {c.k for c in ch} == {0} and ch[0].reason.startswith("off:"), cls
        ungated = cls(4, gate=False).choose(view([hist(0.6, 4, 10)], steep))
        assert ungated[0].k > 0
    cheap = table()
    assert Heuristic(4).choose(view([hist(0.9, 4, 10)], cheap))[0].k > 0
    tr = AcceptanceTracker(4)
    gate = CostGate(tr, probe_every=3, probe_budget=1.0)  # a probe (0.2 ms over a 1 ms round) always within budget
    from speclab.engine.policies import Choice

    v = view([hist(0.05, 4, 20)], cheap)
    tr.update(v)
    got = [gate.apply(v, [Choice(4, "rule")], "rule")[0] for _ in range(6)]
    assert [c.k for c in got] == [0, 0, 1, 0, 0, 1] and "probe k=1" in got[2].reason


def test_cost_gate_holds_its_off_decision_without_asking_the_rule():
    steep = table(step_ms=1.0, steep=True, draft_ms=0.5)
    p = Heuristic(4)
    asked = []
    rule = p.row_k
    p.row_k = lambda r: asked.append(r.request_id) or rule(r)
    h = hist(0.6, 4, 10)
    first = p.choose(view([h], steep))
    assert first[0].k == 0 and not first[0].reason.endswith("(held)") and asked == ["r0"]
    again = p.choose(view([h + [(0, 0)]], steep))
    assert again[0].k == 0 and again[0].reason.endswith("(held)")
    assert asked == ["r0"]  # the rule was not asked again


def test_cost_gate_times_a_plain_step_a_rule_would_never_run():
    """Hugging Face's rule never drafts fewer than one token: with only draft rounds timed at a row count, the gate
    would have nothing to weigh them against and stay open for good. It runs one plain round there, then judges."""
    c = OnlineCosts()
    for n in (1, 2):
        c.record_target(n, 5, 2e-3 * n)  # verify rounds of k = 4
        c.record_draft(n, 4, 1e-3)
    p = Heuristic(4)
    poor = view([hist(0.2, 4, 10), hist(0.2, 4, 10)], c)
    first = p.choose(poor)
    assert [x.k for x in first] == [0, 0] and first[0].reason.startswith("gate: measuring plain steps at 2 rows")
    c.record_target(2, 1, 1.2e-3)  # the plain round, timed by the scheduler
    then = p.choose(poor)
    assert {x.k for x in then} == {0} and then[0].reason.startswith("off:")  # 0.2 acceptance does not pay here
    good = view([hist(1.0, 4, 10), hist(1.0, 4, 10)], c)
    assert Heuristic(4).choose(good)[0].reason.startswith("gate: timing plain steps")  # one plain step: more first
    for _ in range(PLAIN_SAMPLES - 1):
        c.record_target(2, 1, 1.2e-3)
    assert Heuristic(4).choose(good)[0].k == 4  # and a draft that does pay passes


def _calibrated_only(n=16):
    """Calibrated at 2 and n rows (at n: a plain step 4 ms, each verified token 0.5 ms more, a draft step 0.5 ms;
    2 rows at 2/n of that), nothing timed online."""
    c = OnlineCosts()
    c.set_calibrated({(m, T): (4e-3 + 0.5e-3 * (T - 1)) * m / n for m in (2, n) for T in range(1, 6)},
                     draft_step={2: 0.5e-3 * 2 / n, n: 0.5e-3})
    return c


def test_plain_samples_count_plain_steps_timed_online_per_load_level():
    c = _calibrated_only()
    assert c.plain_samples(16) == 0 and c.plain_samples(2) == 0  # calibrated only
    c.record_target(2, 2, 1e-3)
    assert c.plain_samples(2) == 0  # a verify block is not a plain step
    c.record_target(2, 1, 1e-3)
    c.record_target(2, 1, 1e-3)
    assert c.plain_samples(2) == 2 and c.plain_samples(1) == 0 and c.plain_samples(3) == 0  # 3 rounds up to 4
    c.record_target(3, 1, 1e-3)
    assert c.plain_samples(4) == 1 and c.copy().plain_samples(3) == 1
    c.frozen = True
    c.record_target(3, 1, 1e-3)
    assert c.plain_samples(4) == 1


def test_plain_overhead_is_never_above_a_drafting_rounds():
    """A plain-round overhead known at 2 rows only extrapolates in proportion to the rows (8x at 16 rows); a
    drafting round's, measured at 16 rows, bounds it there (a plain round does a part of its work)."""
    c = OnlineCosts()
    c.record_overhead(2, 0.5e-3, drafted=False)
    assert c.overhead_time(16, drafted=False) == pytest.approx(4e-3)  # nothing else known: the extrapolation
    c.record_overhead(16, 0.9e-3, drafted=True)
    assert c.overhead_time(16, drafted=False) == pytest.approx(0.9e-3)
    assert c.overhead_time(2, drafted=False) == pytest.approx(0.5e-3)  # below the bound: its own
    assert c.overhead_time(16, drafted=True) == pytest.approx(0.9e-3)


def test_plain_check_counts_per_load_level_and_stops_once_timed():
    c = _calibrated_only()
    chk = PlainCheck(rounds=3)
    assert [chk.due(c, 16) for _ in range(4)] == [True, True, True, False]  # at most 3 rounds for the level
    assert chk.due(c, 2)  # another level: its own count
    for _ in range(PLAIN_SAMPLES - 1):
        c.record_target(2, 1, 1e-3)
    assert chk.due(c, 2)  # not yet: one sample alone would set the estimate
    c.record_target(2, 1, 1e-3)
    assert not chk.due(c, 2)  # timed enough: nothing to check
    c.frozen = True
    assert not PlainCheck().due(c, 16)  # a frozen table never learns: no check
    assert not PlainCheck().due(None, 16)


def test_goodput_times_the_plain_step_before_drafting_where_it_was_only_calibrated():
    """Where the plain step is only calibrated, goodput runs k = 0 until the scheduler has timed one (a policy that
    drafts from the first round would otherwise never learn it), then decides on the timed value: here the plain
    step really takes 2 ms, not the calibrated 4 ms, and drafting at 0.5 acceptance no longer pays."""
    c = _calibrated_only()
    for m in (2, 16):  # drafting rounds timed online (as a run that drafts sees them)
        for T in range(2, 6):
            c.record_target(m, T, (4e-3 + 0.5e-3 * (T - 1)) * m / 16)
    v = view([hist(0.5, 4, 10)] * 16, c)
    blind = Goodput(4)
    blind.plain.rounds = 0  # without the check: the calibrated 4 ms plain step makes k >= 1 look worth it
    assert blind.choose(v)[0].k > 0
    p = Goodput(4)
    first = p.choose(v)
    assert {x.k for x in first} == {0} and first[0].reason.startswith("goodput: timing plain steps at 16 rows")
    for _ in range(PLAIN_SAMPLES):
        c.record_target(16, 1, 2e-3)  # the scheduler timed the plain step: 2 ms
    then = Goodput(4).choose(v)  # (a fresh one: p's round times are cached for a few rounds)
    assert {x.k for x in then} == {0} and not then[0].reason.startswith("goodput: timing")
    assert Goodput(4).choose(view([hist(1.0, 4, 10)] * 16, c))[0].k > 0  # a draft that pays still drafts


def test_cost_gate_times_the_plain_step_before_letting_drafts_through_where_it_was_only_calibrated():
    c = _calibrated_only()
    for T in range(2, 6):
        c.record_target(16, T, 4e-3 + 0.5e-3 * (T - 1))
    good = view([hist(1.0, 4, 10)] * 16, c)
    h = Heuristic(4)
    first = h.choose(good)
    assert {x.k for x in first} == {0} and first[0].reason.startswith("gate: timing plain steps at 16 rows")
    for _ in range(PLAIN_SAMPLES):
        c.record_target(16, 1, 2e-3)
    assert {x.k for x in h.choose(good)} == {4}  # timed, and a draft accepted in full still pays


def test_confidence_gate_counts_a_stopped_draft_as_a_rejection():
    """Rounds whose drafts the confidence rule stopped at once paid a draft step and verified nothing. They count
    as rejections at the stop (what they yield) and are timed at the width they reached plus the step that
    stopped, so the gate turns a rule off that stops everything; one whose drafts run and are accepted stays on."""
    c = table(step_ms=1.0, verify_ms_per_token=0.1, draft_ms=0.3)

    def run(drafted_per_round: int, rounds: int = 30) -> list:
        p, hist, out = Confidence(4), [], []
        for _ in range(rounds):
            ch = p.choose(view([hist], c, ids=["row"]))
            out.append(ch[0])
            hist.append((drafted_per_round, drafted_per_round) if ch[0].k else (0, 0))
        return out

    stopped = run(0)
    assert stopped[0].k == 4 and stopped[2].reason.startswith("off:")  # it tried, then switched itself off
    assert sum(x.k > 0 for x in stopped) <= 6  # it tries again now and then (the row's evidence ages)
    assert all(x.k == 4 for x in run(4))  # accepted drafts of full length: always on
    p = Confidence(4)  # a stop that cut a draft short counts as a rejection there
    p._asked["row"] = [{0: 4, 1: 4, 2: 2}, []]
    seen = p.realized(RowView("row", ((0, 0), (2, 2), (2, 2), (3, 1))))
    assert tuple(seen.history) == ((4, 0), (4, 2), (2, 2), (3, 1))


def test_confidence_stop_rule():
    stop = Confidence(4, threshold=0.4, floor=0.0).draft_stop()
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.35, 0.33, 0.32], [0.5, 0.5, 0.0]])
    assert stop(0, probs).tolist() == [False, True, False]
    # AdaEDL: 1 - sqrt(gamma * H) < floor stops a draft that is confident enough on top but spread out
    ada = Confidence(4, threshold=0.0, floor=0.5, gamma=0.5).draft_stop()
    flat = torch.full((1, 64), 1 / 64)  # H = ln 64 = 4.16: bound 1 - sqrt(2.08) < 0
    sharp = torch.tensor([[0.97] + [0.03 / 63] * 63])
    assert ada(0, flat).tolist() == [True] and ada(0, sharp).tolist() == [False]
    assert Confidence(4).choose(view([[], []]))[0].k == 4


# ----------------------------------------------------------------------------------- the cost table
def test_interpolate():
    f = {1: 2.0, 4: 5.0}.__getitem__
    assert interpolate([1, 4], f, 2) == 3.0 and interpolate([1, 4], f, 8) == 9.0
    assert interpolate([1, 4], f, 0.5) == 1.5
    assert interpolate([2], {2: 4.0}.__getitem__, 4) == 8.0 and interpolate([2], {2: 4.0}.__getitem__, 1) == 4.0
    assert interpolate([2], {2: 4.0}.__getitem__, 1, below_proportional=True) == 2.0
    assert interpolate([], f, 1) is None


def test_online_costs_predict_clip_and_scale():
    c = OnlineCosts()
    assert c.target_time(1, 1) is None and c.round_time(1, 0) is None
    c.record_target(4, 1, 2e-3)
    c.record_target(4, 5, 4e-3)
    c.record_target(8, 1, 3e-3)
    assert c.target_time(4, 3) == pytest.approx(3e-3)  # along T at 4 rows
    assert c.target_time(6, 1) == pytest.approx(2.5e-3)  # along rows at T=1
    assert c.target_time(4, 1) == pytest.approx(2e-3)
    c.record_target(4, 1, 60e-3)  # a burst of load: the median of the recent samples ignores it
    c.record_target(4, 1, 2.2e-3)
    assert c.target_time(4, 1) == pytest.approx(2.2e-3)
    c.record_draft(4, 2, 1e-3)
    assert c.draft_total(4, 1) == pytest.approx(0.5e-3)  # fewer steps: proportional
    c.record_overhead(3, 0.2e-3)  # by load level: 3 rows -> bucket 4
    assert c.overhead_time(4) == pytest.approx(0.2e-3)
    assert c.round_time(4, 2) == pytest.approx(1e-3 + c.target_time(4, 3) + 0.2e-3)
    assert c.overhead_time(4, drafted=False) == pytest.approx(0.2e-3)  # no plain round yet: the drafting rounds'
    c.record_overhead(4, 0.05e-3, drafted=False)  # a plain round has less to accept and nothing to roll back
    assert c.round_time(4, 0) == pytest.approx(c.target_time(4, 1) + 0.05e-3)
    assert c.round_time(4, 2) == pytest.approx(1e-3 + c.target_time(4, 3) + 0.2e-3)
    assert c.coverage(4) == (True, True, True) and c.coverage(64) == (False, False, False)
    snap = c.snapshot()
    assert "4x1" in snap["target"] and "4" in snap["overhead"]
    c.frozen = True  # a fixed table: records change nothing
    c.record_target(4, 1, 1.0)
    assert c.target_time(4, 1) == pytest.approx(2.2e-3)


def test_a_width_known_at_few_rows_borrows_the_growth_of_one_known_across_them():
    """A verify width measured only at 2 rows is predicted at 16 by how plain steps grew from 2 to 16, not by a
    straight line from one point (which made speculation look several times dearer under load than it is)."""
    c = OnlineCosts()
    for n, s in ((1, 2e-3), (2, 2.5e-3), (4, 3e-3), (16, 6e-3)):
        c.record_target(n, 1, s)
    c.record_target(2, 5, 4e-3)
    assert c.target_time(16, 5) == pytest.approx(4e-3 * 6e-3 / 2.5e-3)  # 9.6 ms; a straight line: 32 ms
    assert c.target_time(1, 5) == pytest.approx(4e-3 * 2e-3 / 2.5e-3)  # below its rows as well
    assert c.target_time(8, 5) == pytest.approx(4e-3 * 4e-3 / 2.5e-3)  # 8 rows: plain interpolated to 4 ms
    c.record_target(16, 5, 10e-3)  # known at both ends now: interpolated between them, as before
    assert c.target_time(9, 5) == pytest.approx(4e-3 + (10e-3 - 4e-3) * 7 / 14)
    lone = OnlineCosts()  # no width known across the rows: the one point, as before
    lone.record_target(2, 5, 4e-3)
    assert lone.target_time(4, 5) == pytest.approx(8e-3)


def test_a_draft_length_left_untimed_falls_back_to_its_calibration_at_the_current_scale():
    """A policy times only the draft lengths it chooses. A served goodput at one row chose k = 3 when a slow spell
    priced its k = 4 rounds high, and k = 4, never timed again, kept that price after the spell. Once STALE samples of
    its kind at its row count have passed a calibrated shape by, its online samples are forgotten: it reads its
    calibration at the level's current online / calibrated scale, which the samples since the spell set. Plain steps
    (the other kind) and shapes never calibrated (nothing to fall back to) keep theirs."""
    from speclab.engine.costs import STALE

    c = OnlineCosts()
    c.set_calibrated({(1, t): 1e-3 * (1 + 0.1 * t) for t in range(1, 6)}, {1: 0.5e-3})
    c.record_target(1, 1, 1.3e-3)  # a plain step, 1.18x its calibration of 1.1 ms
    c.record_target(1, 7, 3e-3)  # a width never calibrated
    plain = c.target_time(1, 1)
    for _ in range(9):  # the spell: k = 4's verifies (calibrated 1.5 ms) read 5 ms
        c.record_target(1, 5, 5e-3)
    spell = c.target_time(1, 5)
    assert spell > 3e-3 and c.measured(1, 5)
    for _ in range(STALE - 1):  # then k = 3, at its calibration
        c.record_target(1, 4, 1.4e-3)
    assert c.target_time(1, 5) == spell  # not yet
    c.record_target(1, 4, 1.4e-3)
    assert not c.measured(1, 5)
    # the level's verify scale is the median of its last 27 ratios: 3 of the spell's, 24 at 1.0
    assert c.target_time(1, 5) == pytest.approx(1.5e-3)
    assert c.target_time(1, 1) == plain and c.measured(1, 7) and c.target_time(1, 7) == pytest.approx(3e-3)
    c.record_target(1, 5, 1.6e-3)  # timed again: its own samples from here
    assert c.measured(1, 5) and c.target_time(1, 5) == pytest.approx(1.5e-3)  # median of 1.6 and twice 1.5


def test_a_calibrated_shapes_first_online_sample_does_not_vouch_for_itself():
    """The calibrated prior a sample is weighed against is scaled by what the other samples say, not by the sample's
    own ratio. Seen in ``speclab serve`` with the ema policy at one stream on JSON: the first verify of 3 tokens ran
    on cold caches at 3.2x its calibration; scaled by its own ratio, the prior equalled it, and it became the estimate
    while verifies of 5 tokens ran at 1.5x theirs. The line through the round times then priced every draft length at
    7.5 ms against 2.5 for a plain step, and the gate never drafted again (0.67x the fixed k there)."""
    c = OnlineCosts()
    c.set_calibrated({(1, 1): 1.55e-3, (1, 2): 1.8e-3, (1, 3): 1.75e-3, (1, 4): 2.25e-3, (1, 5): 2.21e-3},
                     draft_phase={(1, s): 0.25e-3 + 0.3e-3 * s for s in range(1, 5)})
    for _ in range(PLAIN_SAMPLES):
        c.record_target(1, 1, 2.0e-3)
    c.record_target(1, 3, 5.57e-3)  # cold
    assert c.target_time(1, 3) == pytest.approx(1.75e-3 * 2.0 / 1.55)  # the plain steps' scale, not its own 3.2x
    for _ in range(5):
        c.record_target(1, 5, 3.4e-3)
    assert c.target_time(1, 3) < 2.5e-3 and c.target_time(1, 5) == pytest.approx(3.4e-3)
    times = RoundTimes(4).get(c, 1)
    assert times[1] < times[2] < times[4] < 5e-3  # rising in k, and a drafting round well under 7.5 ms
    ema = Ema(4)
    assert ema.choose(view([hist(0.8, 4, 6)], c, remaining=30))[0].k == 4  # the gate lets ema's tier through
    fresh = OnlineCosts()  # a fresh table: the first sample alone moves nothing; the samples that follow take over
    fresh.set_calibrated({(1, 5): 2e-3})
    fresh.record_target(1, 5, 6e-3)
    assert fresh.target_time(1, 5) == pytest.approx(2e-3)
    for _ in range(3):
        fresh.record_target(1, 5, 3e-3)
    assert fresh.target_time(1, 5) == pytest.approx(3e-3)


def test_calibrated_shapes_are_rescaled_by_their_own_load_level():
    """The online / calibrated ratio learnt at 64 rows does not rescale one row's untried shapes when one row
    has a ratio of its own; a level never measured takes the nearest level's (of the shape's own kind)."""
    c = OnlineCosts()
    c.set_calibrated({(n, t): 1e-3 * n * t for n in (1, 2, 16, 64) for t in (1, 2, 5)})
    for _ in range(10):
        c.record_target(64, 2, 2 * 128e-3)  # in the loop, 64 rows run at 2x their calibration
        c.record_target(1, 2, 1.25 * 2e-3)  # one row: 1.25x
    assert c.target_time(64, 5) == pytest.approx(2 * 320e-3)
    assert c.target_time(1, 5) == pytest.approx(1.25 * 5e-3)  # not 2x: its own level's ratio
    assert c.target_time(2, 5) == pytest.approx(1.25 * 10e-3)  # level 2 unmeasured: the nearest, level 1
    assert c.target_time(16, 5) == pytest.approx(2 * 80e-3)  # level 16: the nearest is 64
    snap = c.snapshot()["scale_by_level"]["target"]
    assert snap["1xmore"] == pytest.approx(1.25) and snap["64xmore"] == pytest.approx(2.0)


def test_plain_steps_and_verify_blocks_are_rescaled_apart():
    """A plain step and a verify block drift from their calibration apart (at 64 rows verify blocks ran 1.37x
    theirs while plain steps ran at theirs): a plain step only calibrated takes plain steps' ratio, from the
    nearest level that measured one, not the verify blocks' ratio at its own level. Otherwise a policy that always
    drafts at 64 rows (and so never times a plain step there) weighs drafting against an inflated plain step."""
    c = OnlineCosts()
    c.set_calibrated({(n, t): 1e-3 * n * t for n in (1, 64) for t in (1, 2, 5)})
    for _ in range(10):
        c.record_target(64, 5, 1.4 * 320e-3)  # verify blocks at 64 rows: 1.4x
        c.record_target(1, 1, 1.1 * 1e-3)  # plain steps, measured at one row only: 1.1x
    assert c.target_time(64, 2) == pytest.approx(1.4 * 128e-3)  # a verify block: its kind at its level
    assert c.target_time(64, 1) == pytest.approx(1.1 * 64e-3)  # a plain step: plain steps' ratio, from level 1
    d = OnlineCosts()
    d.set_calibrated({(n, t): 1e-3 * n * t for n in (1, 64) for t in (1, 2)})
    d.record_target(64, 2, 1.4 * 128e-3)
    assert d.target_time(64, 1) == pytest.approx(1.4 * 64e-3)  # no plain step measured anywhere: the other kind's


def test_online_costs_copy_learns_apart():
    """A copy starts from the same calibration and samples and then learns on its own: its records (and the
    online / calibrated scale they set) move neither the original nor another copy."""
    c = OnlineCosts()
    c.set_calibrated({(n, t): 1e-3 * n * t for n in (1, 4) for t in (1, 2, 5)})
    c.record_target(1, 1, 1e-3)
    a, b = c.copy(), c.copy()
    assert a.target_time(1, 1) == c.target_time(1, 1) and a.target_time(4, 5) == pytest.approx(20e-3)
    for _ in range(10):
        a.record_target(4, 1, 3 * 4e-3)  # 3x its calibration at 4 rows
    assert a.target_time(4, 5) == pytest.approx(60e-3)  # a's scale at level 4
    assert c.target_time(4, 5) == pytest.approx(20e-3) and b.target_time(4, 5) == pytest.approx(20e-3)
    assert c.snapshot()["scale_by_level"]["target"] == b.snapshot()["scale_by_level"]["target"] != \
        a.snapshot()["scale_by_level"]["target"]
    a.record_target(1, 1, 1.0)
    assert c.version == b.version < a.version


def _fake_lm(on_forward):
    """A model class for ``time_shapes`` whose cache forwards only call ``on_forward(tokens, kv_len)``."""
    class Cache:
        def forward(self, toks, start, kv_len):
            on_forward(toks, kv_len)

        def commit(self, lengths):
            pass

    class LM:
        device, vocab_size = torch.device("cpu"), 50

        def new_cache(self, n, slots):
            return Cache()

    return LM


def test_time_shapes_times_plain_steps_one_after_another():
    """On the CPU a one-token step reads the other layout of the weights, so one timed right after a wider forward
    runs cold; plain decoding runs them back to back. The one-token forwards are timed consecutively (after one
    warm-up), the wider ones round-robin among themselves."""
    calls = []
    LM = _fake_lm(lambda toks, kv_len: calls.append(toks.shape[1]))
    out = time_shapes(LM(), (1, 2), (1, 2, 3), context=8, reps=2)
    assert set(out) == {(n, T) for n in (1, 2) for T in (1, 2, 3)}
    per_rows = [8, 1, 1, 1, 2, 3, 2, 3, 2, 3]  # the context's prefill, 1 x (reps + 1), then the rest round-robin
    assert calls == per_rows * 2
    calls.clear()
    time_shapes(LM(), (1,), (1, 2, 3), context=8, reps=2, plain_apart=False)  # bench synthetic's way
    assert calls == [8, 1, 2, 3, 1, 2, 3, 1, 2, 3]


def test_time_shapes_min_is_not_moved_by_a_preempted_run():
    """Runs preempted by another process only get slower: the fastest of them (``stat="min"``, what servers and the
    policies benchmark calibrate with) reads the shape's cost where a median of few runs takes the preemptions."""
    now, durations = [0.0], []

    def forward(toks, kv_len):
        if toks.shape[1] == 1 and kv_len > 8:  # the timed one-token forwards (not the context's prefill)
            now[0] += durations.pop(0)

    LM = _fake_lm(forward)
    runs = [9.0, 1.0, 5.0, 6.0]  # a warm-up, then three runs, two of them preempted
    durations[:] = runs
    assert time_shapes(LM(), (1,), (1,), 8, 3, clock=lambda: now[0])[(1, 1)] == 5.0
    durations[:] = runs
    assert time_shapes(LM(), (1,), (1,), 8, 3, clock=lambda: now[0], stat="min")[(1, 1)] == 1.0
    with pytest.raises(ValueError):
        time_shapes(LM(), (1,), (1,), 8, 3, stat="mean")


def test_calibration_rows():
    from speclab.engine.costs import calibration_rows

    assert calibration_rows(1) == (1,) and calibration_rows(6) == (1, 2, 4, 6)
    assert calibration_rows(1, 16, 64) == (1, 2, 4, 8, 16, 32, 64)


def test_seed_costs_calibrates_for_adaptive_policies_only(target_lm):
    """What `speclab generate --policy` and `speclab serve --spec-policy` call before any timed work: an adaptive
    policy gets every shape it chooses between timed at up to the given rows; fixed k and off get nothing."""
    from speclab.engine.policies import Fixed, seed_costs

    c = OnlineCosts()
    spent = seed_costs(Goodput(2), c, target_lm, target_lm, rows=2, context=16)
    assert spent is not None and spent > 0
    assert all(c.coverage(n) for n in (1, 2)) and c.round_time(2, 2) is not None
    assert seed_costs(Fixed(2), OnlineCosts(), target_lm, target_lm, rows=2) is None
    assert seed_costs(make_policy("off"), OnlineCosts(), target_lm, target_lm, rows=2) is None


def test_start_up_calibration_times_by_the_threads_cpu_time_on_one_cpu_thread(target_lm):
    """Another process taking the core cannot stretch a forward's own CPU time: seed_costs times by it on a CPU with
    one torch thread, and by the wall clock on a GPU or with more threads (their work is not the calling thread's)."""
    import time

    import torch

    from speclab.engine.costs import calibration_clock
    from speclab.engine.policies import seed_costs

    assert calibration_clock(torch.device("cpu"), 1) is time.thread_time
    assert calibration_clock(torch.device("cpu"), 2) is time.perf_counter
    assert calibration_clock(torch.device("cuda"), 1) is time.perf_counter

    c, threads = OnlineCosts(), torch.get_num_threads()
    assert c.clock is time.perf_counter  # uncalibrated: online samples by the wall clock
    try:
        torch.set_num_threads(1)
        assert seed_costs(Goodput(2), c, target_lm, target_lm, rows=1, context=16) > 0
    finally:
        torch.set_num_threads(threads)
    assert c.clock is time.thread_time and c.coverage(1)  # and the online samples are timed with it from now on


def test_calibration_is_a_prior_rescaled_by_online_numbers(target_lm):
    c = OnlineCosts()
    spent = c.calibrate(target_lm, target_lm, rows=(1, 2), tokens=(1, 2, 3), context=16, reps=1)
    assert spent > 0 and c.coverage(1) == (True, True, True) and c.coverage(2) == (True, True, True)
    t11 = c.target_time(1, 1)
    again = OnlineCosts()
    assert again.calibrate(target_lm, target_lm, rows=(1, 2), tokens=(1, 2, 3), context=16, reps=1) < spent
    # online numbers replace a calibrated shape and rescale the shapes only calibrated
    for _ in range(40):
        c.record_target(1, 2, 2 * c.target_time(1, 2))
    assert c.scale["target"] > 1.5
    assert c.target_time(1, 1) > 1.5 * t11


def _forward_clock(monkeypatch):
    """A clock that reads how many cached model forwards have run: timings taken with it count forwards, the same on
    an idle machine and a busy one."""
    from speclab.models.native_llama import StaticKVCache

    forwards = [0]
    forward = StaticKVCache.forward

    def counted(self, *args, **kwargs):
        forwards[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(StaticKVCache, "forward", counted)
    return lambda: float(forwards[0])


def test_draft_phases_are_timed_as_a_round_runs_them(tiny, target_lm, monkeypatch):
    """Calibrating with a model drafter times its whole draft phase of s = 1..K steps through ``propose`` at every row
    count, on a copy of the drafter: the drafter itself keeps its cache and lengths. Timed by a clock that counts
    forwards, a phase of s steps is s forwards: the catch-up forward and s - 1 draft steps (the last draft token is
    never fed), so what the table prices is the phase a round runs, not one step times s."""
    from speclab.engine.costs import time_draft_phases

    clock = _forward_clock(monkeypatch)
    drafter = make_drafter(tiny["draft_close"], target_lm)
    assert drafter.lm.native is not None  # the forwards counted are the native cache's
    drafter.reset(2, 64)
    cache, dlen = drafter.cache, drafter.dlen
    got = time_draft_phases(drafter, (1, 2), 3, 16, 2, target_lm.vocab_size, clock=clock)
    assert got == {(n, s): float(s) for n in (1, 2) for s in (1, 2, 3)}
    assert drafter.cache is cache and drafter.dlen is dlen
    c = OnlineCosts()
    c.calibrate(target_lm, drafter, rows=(1, 2), tokens=(1, 2, 3, 4), context=16, reps=1, clock=clock)
    assert c.coverage(2) == (True, True, True)
    assert [c.draft_total(2, s) for s in (1, 2, 3)] == pytest.approx([1.0, 2.0, 3.0])
    assert c.target_time(2, 3) == pytest.approx(1.0)  # a verify of any width: one forward


# ----------------------------------------------------------------------------------- exactness
def _policies(k):
    return [make_policy(name, k) for name in POLICIES if name != "off"] + \
        [BatchTable(k, "1-2=1,3-=%d" % k), Confidence(k, threshold=0.3, gate=False), Heuristic(k, gate=False),
         Ema(k, gate=False)]


@pytest.mark.parametrize("kind", ["draft_close", "ngram", "synthetic:0.6"])
def test_greedy_identity_with_every_policy(tiny, target_lm, kind):
    """Speculative output with each policy == plain greedy output, single rows and a ragged batch."""
    drafter = PromptLookupDrafter() if kind == "ngram" else make_drafter(
        kind if kind.startswith("synthetic") else tiny[kind], target_lm)
    prompts = PROMPTS[:7]
    plain = SpeculativeDecoder(target_lm, None).generate(prompts, k=0, max_new_tokens=20).output_tokens
    dec = SpeculativeDecoder(target_lm, drafter)
    dec.costs.calibrate(target_lm, drafter, rows=(1, 2, 4, 8), tokens=(1, 2, 3, 4, 5), context=16,
                        reps=1)  # a model draft's phases timed on a copy of it; n-gram and synthetic: none
    for pol in _policies(4):
        got = dec.generate(prompts, k=4, max_new_tokens=20, policy=pol).output_tokens
        assert got == plain, (kind, pol.name)
        one = dec.generate(prompts[2:3], k=4, max_new_tokens=20, policy=pol).output_tokens
        assert one == plain[2:3], (kind, pol.name)


class _Zigzag:
    """Drafts in some rounds and rows and not in others, on a fixed pattern: whole rounds off, ragged rounds, runs of
    rounds off for one row while the others draft."""

    name, k_max = "zigzag", 4
    pattern = (4, 0, 0, 2, 0, 1, 0, 0, 0, 3, 4, 0)

    def __init__(self):
        self.round = 0

    def choose(self, view):
        from speclab.engine.policies import Choice

        self.round += 1
        if self.round % 3 == 0:
            return [Choice(0, "off")] * len(view.rows)
        return [Choice(self.pattern[(self.round + 5 * b) % len(self.pattern)], "zigzag") for b in range(len(view.rows))]

    def draft_stop(self):
        return None


def test_rounds_without_drafts_between_drafting_rounds(tiny, target_lm):
    """Rows skip rounds (nothing proposed, so the draft model's commit is skipped too) and draft again later: the
    output is the target's greedy output, and every draft is the draft model's own greedy continuation of the
    row's text at that round (its cache caught up on the tokens it skipped, nothing stale)."""
    drafter = make_drafter(tiny["draft_close"], target_lm)
    dec = SpeculativeDecoder(target_lm, drafter)
    prompts = [target_lm.encode(p) for p in PROMPTS[:5]]
    want = SpeculativeDecoder(target_lm, None).generate(prompts, k=0, max_new_tokens=24).output_tokens
    rounds = []
    unsub = dec.hooks.subscribe(lambda e: rounds.append(e) if getattr(e, "phase", "") == "verify" else None)
    try:
        got = dec.generate(prompts, k=4, max_new_tokens=24, policy=_Zigzag()).output_tokens
    finally:
        unsub()
    assert got == want
    solo = SpeculativeDecoder(drafter.lm, None)
    checked = 0
    for e in rounds:
        for r in e.rows:
            if not r.num_drafted:
                continue
            drafts = [t.token for t in r.tokens if t.status in ("accepted", "rejected")]
            g0 = r.tokens[0].position
            own = solo.generate([prompts[r.row] + got[r.row][:g0]], k=0, max_new_tokens=len(drafts),
                                stop_on_eos=False, record=False).output_tokens[0]
            assert drafts == own, (r.row, g0)
            checked += 1
    assert checked >= 10 and any(r.num_drafted == 0 for e in rounds for r in e.rows)


def test_draft_costs_are_sampled_in_steady_rounds_only(tiny, target_lm):
    """The cost model's draft-phase samples come from rounds right after a drafting round: the first drafting round
    after rounds without drafts runs cold weights and catches up on every skipped token (a switching cost paid once),
    and would make drafting look dearer than it is to a policy deciding whether to keep drafting. Its plain-step
    samples, symmetrically, come from rounds right after a round without drafts, and never from a round right after
    a prefill (the same cold weights)."""
    from speclab.engine import Scheduler
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    sched = Scheduler(target_lm, make_drafter(tiny["draft_close"], target_lm), _Zigzag(), max_running=3, max_len=96)
    sampled, plain = [], []
    real, real_t = sched.costs.record_draft, sched.costs.record_target
    sched.costs.record_draft = lambda n, steps, sec: (sampled.append(sched.round), real(n, steps, sec))
    sched.costs.record_target = lambda n, T, sec: ((plain.append(sched.round) if T == 1 else None), real_t(n, T, sec))
    reqs = [sched.submit(Request(target_lm.encode(p), 24, SamplingParams(), ignore_eos=True, request_id=str(i)))
            for i, p in enumerate(PROMPTS[:3])]
    sched.run_until_idle()
    rounds = max(len(r.history) for r in reqs)
    drafted = [any(i < len(r.history) and r.history[i][0] for r in reqs) for i in range(rounds)]  # round i + 1
    steady = [i + 1 for i in range(1, rounds) if drafted[i] and drafted[i - 1]]
    assert sampled == steady and 0 < len(steady) < sum(drafted)
    # plain steps likewise: only rounds after a round without drafts, and not the first (its step prefilled the rows
    # just before it: every request is admitted at once here)
    steady_plain = [i + 1 for i in range(1, rounds) if not drafted[i] and not drafted[i - 1]]
    assert plain == steady_plain and 0 < len(steady_plain) < rounds - sum(drafted)


def test_step_costs_sampled_one_steady_round_in_a_stride_once_warm(tiny, target_lm):
    """Recording a round's costs between two forwards is not free (at one row it took 2.4% of a run that recorded
    every round): once the tables hold COST_WARM samples, one steady round in COST_STRIDE of each kind is recorded,
    target, overhead and draft phase together."""
    from speclab.engine import Fixed, Scheduler
    from speclab.engine import scheduler as S
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    def run(warm: bool):
        sched = Scheduler(target_lm, make_drafter(tiny["draft_close"], target_lm), Fixed(2), max_running=3,
                          max_len=96)
        if warm:
            sched.costs.version = S.COST_WARM  # as if the tables were full already
        rec = {"target": [], "overhead": [], "draft": []}
        rt, ro, rd = sched.costs.record_target, sched.costs.record_overhead, sched.costs.record_draft
        sched.costs.record_target = lambda n, T, sec: (rec["target"].append(sched.round), rt(n, T, sec))
        sched.costs.record_overhead = lambda n, sec, d=True: (rec["overhead"].append(sched.round), ro(n, sec, d))
        sched.costs.record_draft = lambda n, st, sec: (rec["draft"].append(sched.round), rd(n, st, sec))
        for i, p in enumerate(PROMPTS[:3]):
            sched.submit(Request(target_lm.encode(p), 24, SamplingParams(), ignore_eos=True, request_id=str(i)))
        sched.run_until_idle()
        return sched.round, rec

    rounds, young = run(False)  # the tables young all through: every steady round recorded
    # every round drafts but the last (the rows' budgets end it at k = 0, after drafts), and the first is a fresh
    # scheduler's warm-up (its first touch of the draft's cache and the verify's buffers): not a sample
    steady = young["target"]
    assert steady == young["overhead"] == young["draft"] == list(range(2, rounds))
    _, warm = run(True)  # the same greedy rounds: the 4th, 8th, 12th ... steady round recorded, all three together
    every = steady[S.COST_STRIDE - 1::S.COST_STRIDE]
    assert warm["target"] == warm["overhead"] == warm["draft"] == every and len(every) >= 4


def test_step_costs_are_timed_with_the_cost_tables_clock(tiny, target_lm):
    """Online cost samples are timed with OnlineCosts.clock, the clock the table was calibrated with (the thread's CPU
    time on a CPU with one torch thread), while the events' phase timings stay on the wall clock. A forward that
    waits (here a sleep, which uses no CPU: a stand-in for another process taking the core) stretches wall-clock
    samples; a table on another clock reads only that clock. Why it matters: with two engine cores sharing 2 CPUs
    with the HTTP side, wall-clock samples priced one core's verify blocks at 8 rows at 3.7x a plain step (the other
    core's: 1.9x), and it drafted k = 1 where k = 4 paid."""
    import time

    from speclab.engine import Fixed, Scheduler
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    wait = 0.05

    def run(clock):
        sched = Scheduler(target_lm, make_drafter(tiny["draft_close"], target_lm), Fixed(2), max_running=2,
                          max_len=96)
        sched.costs.clock = clock
        forward = sched.cache.forward

        def slow(*a, **kw):
            time.sleep(wait)
            return forward(*a, **kw)

        sched.cache.forward = slow
        seen, verify = [], []
        record = sched.costs.record_target
        sched.costs.record_target = lambda n, T, sec: (seen.append(sec), record(n, T, sec))
        sched.hooks.subscribe(lambda ev: verify.append(ev.timings["verify"]) if getattr(ev, "phase", None) == "verify"
                              else None)
        for i, p in enumerate(PROMPTS[:2]):
            sched.submit(Request(target_lm.encode(p), 8, SamplingParams(), ignore_eos=True, request_id=str(i)))
        sched.run_until_idle()
        return seen, verify

    ticks = iter(range(1, 1 << 30))
    wall, wall_events = run(time.perf_counter)
    counted, counted_events = run(lambda: 1000.0 * next(ticks))  # a clock that only moves when it is read
    assert wall and min(wall) >= wait  # the wait counted
    # samples from the table's clock: whole readings of it (a wall-clock sample here is about 0.05)
    assert counted and all(s >= 1000 and s % 1000 == 0 for s in counted)
    assert min(wall_events + counted_events) >= wait  # what the phases report: the wall clock either way


def test_events_carry_k_and_reason(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    res = dec.generate(PROMPTS[:3], k=3, max_new_tokens=12, policy="heuristic")
    rf = res.recorder.rounds_frame()
    v = rf[rf["phase"] == "verify"]
    assert len(v) and v["k"].between(0, 3).all() and v["k_reason"].str.len().gt(0).all()
    assert (v["drafted"] <= v["k"]).all()


def _exact_third_token_dist(lm, prompt, temperature):
    """P(t3) = sum_{t1,t2} P(t1) P(t2 | t1) P(t3 | t1 t2) under the target, over the small vocabulary."""
    m, ids = lm.hf_model, lm.encode(prompt)
    with torch.no_grad():
        p1 = (m(torch.tensor([ids])).logits[0, -1].double() / temperature).softmax(-1)  # (V,)
        V = p1.shape[0]
        ext = torch.tensor([ids + [t] for t in range(V)])  # (V, L+1)
        p2 = (m(ext).logits[:, -1].double() / temperature).softmax(-1)  # (V, V)
        ext2 = torch.tensor([ids + [a, b] for a in range(V) for b in range(V)])  # (V*V, L+2)
        p3 = (m(ext2).logits[:, -1].double() / temperature).softmax(-1).view(V, V, V)
    return ((p1[:, None] * p2)[..., None] * p3).sum((0, 1))  # (V,)


@pytest.fixture(scope="module")
def near(target_lm, tmp_path_factory):
    """A draft close to the target (a little weight noise): many drafts accepted, many rejected."""
    from conftest import make_model

    path = tmp_path_factory.mktemp("near") / "draft_near"
    make_model(path, seed=5, base_state=target_lm.hf_model.state_dict(), noise=0.1)
    return str(path)


def _policy_p_values(near, target_lm, name) -> dict[str, float]:
    """3,000 rows sampled at T = 0.7 with policy ``name``, drafting in batches of 60 rows (so k and the
    confidence stop vary between rows and rounds): p-values of the third generated token against the
    target's exact marginal, and of every generated token against its exact conditional given the row's
    own prefix."""
    from test_acceptance import chi_square
    from test_sampling_engine import conditional_chi_square

    from speclab.engine.sampling import SamplingParams, logits_to_probs

    temperature, n, B, new = 0.7, 3000, 60, 4
    prompt = "hello wor"
    exact = _exact_third_token_dist(target_lm, prompt, temperature)
    dec = SpeculativeDecoder(target_lm, make_drafter(near, target_lm))
    dec.costs = table(rows=(1, B), k_max=4)  # drafting pays in this table: the cost-weighing policies draft
    dec.costs.frozen = True  # ... and it stays so (no timings of this machine mixed in)
    pol = {"heuristic": Heuristic(4, gate=False), "ema": Ema(4, gate=False), "goodput": Goodput(4),
           "confidence": Confidence(4, threshold=0.3, floor=0.3, gamma=0.2, gate=False),
           "batch-table": BatchTable(4, "1-=3")}[name]
    gen, drafted = [], 0
    for i in range(n // B):
        res = dec.generate([prompt] * B, k=4, max_new_tokens=new, temperature=temperature, seed=i * B,
                           record=False, stop_on_eos=False, policy=pol)
        gen += res.output_tokens
        drafted += sum(r.drafted for r in res.requests)
    assert drafted > n // 2  # the policy really drafted
    gen = torch.tensor(gen)  # (n, new)
    out = {"marginal t3": chi_square(torch.bincount(gen[:, 2], minlength=target_lm.vocab_size), exact)[2]}
    ids = target_lm.encode(prompt)
    with torch.no_grad():
        logits = target_lm.hf_model(torch.cat([torch.tensor(ids).expand(n, -1), gen[:, :-1]], 1)).logits
    probs = logits_to_probs(logits[:, len(ids) - 1:], SamplingParams(temperature))  # (n, new, V)
    for i in range(new):
        out[f"conditional t{i}"] = conditional_chi_square(gen[:, i], probs[:, i])[2]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["heuristic", "ema", "goodput", "confidence", "batch-table"])
def test_sampled_tokens_follow_the_target_with_each_policy(near, target_lm, name):
    from test_acceptance import PASS_P

    pv = _policy_p_values(near, target_lm, name)
    assert min(pv.values()) > PASS_P, (name, pv)


@pytest.mark.slow
def test_a_wrong_rule_fails_the_policy_distribution_test(near, target_lm, monkeypatch):
    """The same test has the power to see a wrong acceptance rule under a policy that stops drafts early."""
    from test_acceptance import FAIL_P, mutants

    import speclab.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "rejection_impl", lambda device: mutants(0.7)["sample_from_target_on_rejection"])
    pv = _policy_p_values(near, target_lm, "confidence")
    assert min(pv.values()) < FAIL_P, pv


# ----------------------------------------------------------------------------------- sweeps and the bench
def test_sweep_policy_dimension(tiny, target_lm):
    from speclab.analysis.sweep import SweepSpec, crossover_batch, run_sweep

    spec = SweepSpec(workloads=["json"], drafts=["ngram"], ks=[2], batches=[1, 2], max_new_tokens=6,
                     prompts_per_workload=2, policies=["fixed", "goodput", "heuristic"])
    df = run_sweep(target_lm, spec)
    assert len(df) == 2 * (1 + 3)  # per batch: the baseline, then one row per policy
    assert set(df["policy"]) == {"off", "fixed", "goodput", "heuristic"}
    assert (df[df["policy"] == "off"]["k"] == 0).all() and (df["tokens_per_s"] > 0).all()
    cross = crossover_batch(df)
    assert "policy" in cross.columns and len(cross) == 3
    default = run_sweep(target_lm, SweepSpec(workloads=["json"], drafts=["ngram"], ks=[2], batches=[1],
                                             max_new_tokens=4, prompts_per_workload=1))
    assert list(default["policy"]) == ["off", "fixed"]


def test_policy_targets_from_a_hand_built_report():
    from speclab.analysis.bench_policies import policy_targets

    def row(w, b, config, policy, sp):
        return dict(workload=w, batch=b, config=config, policy=policy, speedup=sp, identical=True,
                    adaptive=policy in ("goodput", "ema"))

    rows = []
    for w, sps in (("json", (1.5, 1.2, 1.45, 1.3)), ("mixed", (1.1, 1.3, 1.35, 1.2))):
        for b, f in ((1, 1.0), (16, 0.6)):  # at batch 16 every fixed k loses; goodput switches itself off
            f1, f2, gp, em = sps
            rows += [row(w, b, "plain", "off", 1.0), row(w, b, "fixed-1", "fixed", f1 * f),
                     row(w, b, "fixed-2", "fixed", f2 * f), row(w, b, "goodput", "goodput", max(gp * f, 1.0)),
                     row(w, b, "ema", "ema", em * f)]
    t = policy_targets({"rows": rows})
    g = t["goodput_vs_best_fixed"]
    assert g["value"] == pytest.approx(1.45 / 1.5) and g["where"] == "json batch 1" and g["met"]
    m = t["mixed_goodput_vs_best_single_k"]  # geometric means over the levels: fixed-2 1.007, goodput 1.162
    assert m["best_fixed"] == "fixed-2" and m["value"] == pytest.approx(math.sqrt(1.35) / math.sqrt(1.3 * 0.78))
    assert m["met"]
    a = t["adaptive_vs_plain_floor"]
    assert a["value"] == pytest.approx(0.72) and a["where"] == "ema on mixed batch 16" and not a["met"]
    assert t["all_identical"]["met"]
    assert "control_apart" not in t
    # the A/A control (--control): a second plain configuration, never the best fixed k even when it reads higher
    ctl = [dict(workload=w, batch=b, config="plain-again", policy="control", speedup=sp, identical=True,
                adaptive=False) for (w, b), sp in zip([("json", 1), ("json", 16), ("mixed", 1), ("mixed", 16)],
                                                       (1.01, 0.97, 1.02, 1.9))]
    t2 = policy_targets({"rows": rows + ctl})
    assert {k: t2[k]["value"] for k in t} == {k: t[k]["value"] for k in t}  # nothing else moves
    c = t2["control_apart"]
    assert c["value"] == pytest.approx(0.025) and c["max"] == pytest.approx(0.9) and c["met"]
    assert c["where"] == "mixed batch 16 (1.900x)"
    # --oracle: the kind oracle's geometric mean over the mixed levels against the best single fixed k of its own run
    orc = [dict(batch=1, ks={"json": 2, "code": 0}, speedup={"plain": 1.0, "fixed-1": 1.1, "fixed-2": 1.2,
                                                           "kind-oracle": 1.3}, identical=True),
           dict(batch=16, ks={"json": 1, "code": 0}, speedup={"plain": 1.0, "fixed-1": 0.9, "fixed-2": 0.7,
                                                            "kind-oracle": 1.0}, identical=True)]
    t3 = policy_targets({"rows": rows, "oracle": orc})
    o = t3["mixed_oracle_vs_best_single_k"]  # fixed-1 sqrt(0.99), fixed-2 sqrt(0.84), plain 1: plain is best
    assert o["best_fixed"] == "plain" and o["value"] == pytest.approx(math.sqrt(1.3)) and o["met"]
    assert {k: t3[k]["value"] for k in t} == {k: t[k]["value"] for k in t}
    orc[1]["identical"] = False
    assert not policy_targets({"rows": rows, "oracle": orc})["all_identical"]["met"]


def test_kind_oracle_by_hand():
    """The mixed stream's headroom policy: each row's kind's k, one k a round (the rounded mean of the rows' ks); each
    kind's k is its best fixed configuration at the level (plain = 0)."""
    from benchmarks.policy_oracle import KindOracle, best_fixed_by_kind

    o = KindOracle({"a": "json", "b": "code", "c": "code"}, {"json": 4, "code": 1})
    assert o.k_max == 4 and o.draft_stop() is None and o.choose(view([])) == []
    assert [c.k for c in o.choose(view([[]], ids=["a"]))] == [4]
    assert [c.k for c in o.choose(view([[], [], []], ids=["a", "b", "c"]))] == [2, 2, 2]  # round(6 / 3)
    assert [c.k for c in o.choose(view([[], []], ids=["b", "zz"]))] == [1, 1]  # round(0.5): an unknown row is plain
    by = {(w, 4, c): dict(speedup=sp, k=k) for w, c, k, sp in (
        ("json", "plain", 0, 1.0), ("json", "fixed-2", 2, 1.3), ("json", "fixed-4", 4, 1.4),
        ("code", "plain", 0, 1.0), ("code", "fixed-2", 2, 0.95), ("code", "fixed-4", 4, 0.8))}
    assert best_fixed_by_kind(by, ["json", "code"], 4, ["plain", "fixed-2", "fixed-4"]) == {"json": 4, "code": 0}


def test_a_cells_speedup_is_the_median_of_its_repetitions_ratios():
    """Lockstep pairs each configuration's repetition with plain decoding's in the same repetition: the speedup is the
    median of those ratios, not the ratio of the medians (which pairs different repetitions)."""
    from speclab.analysis.bench_policies import paired_ratios

    plain, policy = [100.0, 50.0, 90.0], [105.0, 60.0, 80.0]  # the machine halved its speed in the second repetition
    ratios = paired_ratios(policy, plain)
    assert ratios == pytest.approx([1.05, 1.2, 80 / 90])
    assert statistics.median(ratios) == pytest.approx(1.05)
    assert statistics.median(policy) / statistics.median(plain) == pytest.approx(80 / 90)  # the old statistic


def test_policy_configs_with_the_control():
    from speclab.analysis.bench_policies import CONTROL, policy_configs

    base = policy_configs([1, 2], ["goodput", "off"])
    assert base == [("plain", None, 0), ("fixed-1", "fixed", 1), ("fixed-2", "fixed", 2), ("goodput", "goodput", 2)]
    assert policy_configs([1, 2], ["goodput"], control=True) == base + [(CONTROL, None, 0)]


def test_lockstep_runs_configurations_side_by_side(tiny, target_lm):
    """The benchmark's interleaved runs: each configuration its own scheduler over the same prompts, stepped in turn,
    charged only its own steps; the output equals plain greedy decoding in every one."""
    from speclab.analysis.bench_runs import at_concurrency, lockstep
    from speclab.engine import Fixed

    prompts = [target_lm.encode(p) for p in PROMPTS[:5]]
    ticks = iter(range(10 ** 6))  # a clock that advances one second per reading: every step costs exactly 1 s
    out = lockstep(target_lm, [(None, None), (make_drafter(tiny["draft_close"], target_lm), Fixed(3))], prompts, 2, 12,
                   clock=lambda: float(next(ticks)))
    (n0, t0, r0), (n1, t1, r1) = out
    plain = at_concurrency(target_lm, None, None, prompts, 2, 12)[2]
    assert [r.generated for r in r0] == [r.generated for r in r1] == [r.generated for r in plain]
    assert n0 == n1 == sum(len(r.generated) for r in plain)
    assert t0 == int(t0) and t1 == int(t1) and 0 < t1 < t0  # 1 s per own step: speculation needs fewer steps
    assert sum(r.rounds for r in r1) < sum(r.rounds for r in r0)


def _fake_scheduler(order: list):
    """A scheduler stand-in for ``interleave``: ``Fake(name, steps)`` is idle after ``steps`` steps, and each step
    appends its name to ``order``."""
    class Fake:
        def __init__(self, name, steps):
            self.name, self.left = name, steps

        @property
        def idle(self):
            return self.left == 0

        def step(self):
            order.append(self.name)
            self.left -= 1

    return Fake


def test_interleave_rotates_and_charges_each_its_own_steps():
    """One step of each unfinished scheduler per cycle, the first one rotating each cycle from ``offset``; a scheduler
    already idle is never stepped; each is charged only the clock time of its own steps."""
    from speclab.analysis.bench_runs import interleave

    order = []
    Fake = _fake_scheduler(order)

    scheds = [Fake("a", 3), Fake("b", 1), Fake("c", 0), Fake("d", 2)]
    ticks = iter(range(10 ** 6))
    spent = interleave(scheds, clock=lambda: float(next(ticks)), offset=1)
    # live a, b, d: cycle 1 starts at the 2nd (offset 1); then live a, d: cycle 2 starts at 2 % 2 = the 1st
    assert order == ["b", "d", "a", "a", "d", "a"]
    assert spent == [3.0, 1.0, 0.0, 2.0]  # one second per own step (a clock reading before and after each)
    order.clear()
    scheds = [Fake("a", 2), Fake("b", 2)]
    interleave(scheds, offset=0)
    assert order == ["a", "b", "b", "a"]


def test_interleave_shuffled_puts_every_configuration_after_every_other():
    """Rotated, a configuration always runs right after the same one (on the CPU its time then carries that
    neighbour's weight layout); shuffled each cycle, every ordered pair of neighbours comes up, each configuration is
    stepped once per cycle, and the same seed gives the same order."""
    import random
    from collections import Counter

    from speclab.analysis.bench_runs import interleave

    order = []
    Fake = _fake_scheduler(order)

    def pairs(seq, n):  # (before, after) within each cycle of n steps
        return Counter((seq[i], seq[i + 1]) for c in range(0, len(seq), n) for i in range(c, c + n - 1))

    interleave([Fake(x, 60) for x in "abcd"])
    assert set(pairs(order, 4)) == {("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")}  # rotated: fixed neighbours
    order.clear()
    spent = interleave([Fake(x, 60) for x in "abcd"], shuffle=random.Random(0))
    first = list(order)
    assert len(first) == 240 and all(sorted(first[c:c + 4]) == list("abcd") for c in range(0, 240, 4))
    seen = pairs(first, 4)
    assert len(seen) == 12 and min(seen.values()) >= 5  # all 12 ordered pairs, none rare
    assert len(spent) == 4
    order.clear()
    interleave([Fake(x, 60) for x in "abcd"], shuffle=random.Random(0))
    assert order == first


def test_decoder_scheduler_is_what_generate_drives(tiny, target_lm):
    """``SpeculativeDecoder.scheduler``: the scheduler ``generate`` would run, prompts submitted, stepped by the caller;
    its output equals ``generate``'s."""
    from speclab.engine import SpeculativeDecoder

    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    want = dec.generate(PROMPTS[:3], k=3, max_new_tokens=10, record=False, stop_on_eos=False).output_tokens
    sched, reqs = dec.scheduler(PROMPTS[:3], k=3, max_new_tokens=10, stop_on_eos=False)
    assert not sched.idle and all(not r.generated for r in reqs)
    steps = 0
    while not sched.idle:
        sched.step()
        steps += 1
    assert [r.generated for r in reqs] == want and 0 < steps < 10


@pytest.mark.slow
def test_bench_policies_smoke(tmp_path, capsys):
    from speclab.family import list_models

    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from speclab.cli import main

    out = tmp_path / "policies.json"
    rc = main(["bench", "policies", "--workload", "json,code", "--batches", "1,2", "--k", "1,2",
               "--prompts-per-workload", "1", "--reps", "2", "--max-new-tokens", "6", "--threads", "1",
               "--control", "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert rep["workloads"] == ["json", "code", "mixed"] and rep["calibration_s"] > 0
    configs = {r["config"] for r in rep["rows"]}
    assert {"plain", "fixed-1", "fixed-2", "goodput", "heuristic", "ema", "confidence", "batch-table",
            "plain-again"} <= configs
    assert rep["targets"]["control_apart"]["value"] >= 0
    assert all(r["identical"] and r["tokens_per_s"] > 0 for r in rep["rows"])
    # budgets spread around --max-new-tokens (6 x [0.5, 1.5]) by default, the same for every configuration of a cell
    from speclab.load.shapes import spread_lengths

    assert rep["length_spread"] == 0.5 and rep["tokens_per_cell"] == {
        f"{w}@{B}": sum(spread_lengths(6, max(1, B) + B, 0.5, f"0-{w}-{B}")) for w in rep["workloads"] for B in (1, 2)}
    # a cell's speedup: the median of its repetitions' ratios to plain, not the ratio of the medians
    assert all(len(r["speedups"]) == 2 and r["speedup"] == pytest.approx(statistics.median(r["speedups"]))
               for r in rep["rows"])
    plain = {(r["workload"], r["batch"]): r["tokens_per_s"] for r in rep["rows"] if r["config"] == "plain"}
    assert all(r["speedup_of_medians"] == pytest.approx(r["tokens_per_s"] / plain[(r["workload"], r["batch"])])
               for r in rep["rows"])
    assert {"goodput_vs_best_fixed", "mixed_goodput_vs_best_single_k", "adaptive_vs_plain_floor",
            "all_identical"} <= set(rep["targets"])
    assert "target goodput_vs_best_fixed" in capsys.readouterr().out


def test_spread_lengths_are_drawn_once_per_cell_and_stay_in_range():
    from speclab.analysis.bench_runs import budgets
    from speclab.load.shapes import spread_lengths

    assert spread_lengths(32, 5, 0.0, "s") == [32] * 5
    a = spread_lengths(32, 200, 0.5, "0-json-4")
    assert a == spread_lengths(32, 200, 0.5, "0-json-4")  # the same draws for every configuration
    assert a != spread_lengths(32, 200, 0.5, "0-code-4")
    assert min(a) == 16 and max(a) == 48 and 28 < sum(a) / len(a) < 36
    assert spread_lengths(2, 50, 0.9, 1) and min(spread_lengths(2, 50, 0.9, 1)) >= 1
    assert budgets(7, 3) == [7, 7, 7] and budgets([1, 2], 2) == [1, 2]


def test_bench_tracker_fit_smoke(tmp_path, capsys):
    from speclab.family import list_models

    if not {"target", "draft-xs-distill"} <= {m["name"] for m in list_models()}:
        pytest.skip("family not trained")
    from benchmarks.tracker_fit import main

    out = tmp_path / "tracker_fit.json"
    rc = main(["--workload", "json", "--k", "1,2", "--prompts-per-workload", "4", "--max-new-tokens", "12",
               "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    rep = json.loads(out.read_text())
    assert set(rep["relative_log_loss"]) == {"json:1", "json:2"} and rep["best"] in rep["mean"]
    defaults = f"{rep['defaults']['decay']}/{rep['defaults']['prior_weight']}"
    own = f"prior={rep['defaults']['position_prior']}"
    assert all(r[defaults] == pytest.approx(1.0) and r[own] == pytest.approx(1.0)
               for r in rep["relative_log_loss"].values())
    assert {"prior=chain", "prior=population", "prior=logit"} <= set(rep["mean"])
    pop = f"pop={rep['defaults']['population_decay']}"
    assert all(r[pop] == pytest.approx(1.0) for r in rep["relative_log_loss"].values())
    assert {"pop=0.9", "pop=0.99"} <= set(rep["mean"])
    assert len(rep["histories"]["json:1"]) == 4 and "best: " in capsys.readouterr().out


def test_survival_is_the_product_of_the_conditionals():
    """``survival`` computes its products in one loop (policies ask for every row every round): it equals the
    cumulative products of ``conditional`` for a row with evidence, one without any, and one never seen."""
    tr = AcceptanceTracker(4)
    v = view([[(4, 2), (4, 4), (2, 1), (0, 0)], [(0, 0), (0, 0)]], ids=["seen", "blank"])
    tr.update(v)
    pop = tr.population()
    for rid in ("seen", "blank", "never"):
        prods, s = [], 1.0
        for c in tr.conditional(rid, pop):
            s *= c
            prods.append(s)
        assert tr.survival(rid, pop) == pytest.approx(prods, rel=1e-12), rid


def test_cost_gate_weighs_the_draft_prefill_share():
    """Speculating takes every row into the draft model: the gate charges a drafting round its share of that
    prefill (the prompt spread over the row's budget), as goodput does. A good draft (2.3x by the round times alone)
    stays on for short prompts and is switched off when a long prompt's prefill outweighs the gain."""
    costs = table()  # 1 ms plain rounds; k = 4: 0.4 ms of drafts + 1.4 ms verify
    costs.record_draft_prefill(1000, 1e-2)  # 10 us a prompt token

    def rows(prompt_len):
        return (RowView("r0", tuple(hist(0.9, 4, 10)), remaining=30, prompt_len=prompt_len, generated=10),)

    for cls in (Heuristic, Ema, Confidence):
        short = cls(4).choose(PolicyView(rows(100), 1, 0, costs))  # 100 x 10 us / 40 tokens: 25 us a token
        assert short[0].k > 0, cls
        long = cls(4).choose(PolicyView(rows(4000), 1, 0, costs))  # 1 ms a token: ~4 ms more per round
        assert long[0].k == 0 and long[0].reason.startswith("off:"), (cls, long[0].reason)
