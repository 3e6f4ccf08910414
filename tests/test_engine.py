"""Greedy equivalence with Hugging Face generate, both drafters, ragged batches, the extremes,
EOS/length inside an accepted run. (The distribution of speculative samples: test_sampling_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import ModelDrafter, PromptLookupDrafter, Proposal, StatelessDrafter, make_drafter
from speclab.engine import SpeculativeDecoder
from speclab.models import load_model

NEW = 24


@pytest.fixture(scope="module")
def hf_greedy(target_lm):
    """Hugging Face generate(do_sample=False) per prompt: the reference."""
    ref = {}
    m, tok = target_lm.hf_model, target_lm.tokenizer
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")
        out = m.generate(**ids, do_sample=False, max_new_tokens=NEW, eos_token_id=target_lm.eos_token_id,
                         pad_token_id=target_lm.eos_token_id)
        ref[p] = out[0, ids["input_ids"].shape[1]:].tolist()
    return ref


def _drafter(kind, tiny, target):
    if kind == "ngram":
        return PromptLookupDrafter()
    return make_drafter(tiny[kind], target)


def test_plain_k0_equals_hf(target_lm, hf_greedy):
    dec = SpeculativeDecoder(target_lm, None)
    for p in PROMPTS:
        assert dec.generate([p], k=0, max_new_tokens=NEW).output_tokens[0] == hf_greedy[p], p


@pytest.mark.parametrize("kind", ["draft_close", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equivalence_batch1(tiny, target_lm, hf_greedy, kind, k):
    dec = SpeculativeDecoder(target_lm, _drafter(kind, tiny, target_lm))
    plain = SpeculativeDecoder(target_lm, None)
    drafted = 0
    for p in PROMPTS:
        res = dec.generate([p], k=k, max_new_tokens=NEW)
        assert res.output_tokens[0] == hf_greedy[p], (p, k, kind)
        assert res.output_tokens[0] == plain.generate([p], k=0, max_new_tokens=NEW).output_tokens[0]
        drafted += res.metrics["drafted_tokens"]
    assert drafted > 0  # the drafter really proposed


@pytest.mark.parametrize("kind", ["draft_close", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_equivalence_batch3_ragged(tiny, target_lm, hf_greedy, kind, k):
    """Rows of different prompt lengths, each accepting its own number of tokens per round,
    each equal to its own single run."""
    dec = SpeculativeDecoder(target_lm, _drafter(kind, tiny, target_lm))
    ragged_rounds = 0
    for i in range(0, len(PROMPTS) - 2, 3):
        batch = PROMPTS[i:i + 3]
        res = dec.generate(batch, k=k, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == hf_greedy[p], (p, k, kind)
        for ev in res.recorder.rounds[1:]:
            if len({r.num_accepted for r in ev.rows}) > 1:
                ragged_rounds += 1
    if kind == "draft_close":
        assert ragged_rounds > 0  # rows really accepted different counts in the same round


def test_hf_backend_equivalence(tiny, hf_greedy):
    """The generic backend (any AutoModelForCausalLM) gives the same tokens."""
    target = load_model(tiny["target"], device="cpu", backend="hf")
    assert target.backend == "hf"
    for drafter in (None, PromptLookupDrafter(), make_drafter(tiny["draft_close"], target)):
        dec = SpeculativeDecoder(target, drafter)
        batch = PROMPTS[:5]
        res = dec.generate(batch, k=3, max_new_tokens=NEW)
        for p, out in zip(batch, res.output_tokens):
            assert out == hf_greedy[p]


def test_padded_lm_head_draft(tiny, target_lm, hf_greedy):
    """Same tokenizer, larger vocab_size (padded head): accepted, and still exact."""
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_padded"], target_lm))
    for p in PROMPTS[:5]:
        assert dec.generate([p], k=4, max_new_tokens=NEW).output_tokens[0] == hf_greedy[p]


class AlwaysWrongDrafter(StatelessDrafter):
    """Proposes a token the target would never pick first: nothing is ever accepted.
    (Also shows a drafter plugs in through the protocol alone.)"""

    name = "always-wrong"

    def __init__(self, target):
        self.target = target

    def propose(self, ctx, ks, params, uniform, want_probs, stop=None):
        V, k = self.target.vocab_size, max(ks)
        toks = []
        for seq in ctx.host:
            logits = self.target.hf_model(torch.tensor([seq])).logits[0, -1]
            toks.append([(int(logits.argmax()) + 1) % V] * k)
        t = torch.tensor(toks)
        return Proposal(t, torch.tensor(ks), None, None)


def test_extremes(tiny, target_lm, hf_greedy):
    perfect = SpeculativeDecoder(target_lm, make_drafter(tiny["target"], target_lm))
    wrong = SpeculativeDecoder(target_lm, AlwaysWrongDrafter(target_lm))
    for p in PROMPTS[:8]:
        a = perfect.generate([p], k=4, max_new_tokens=NEW)
        b = wrong.generate([p], k=4, max_new_tokens=NEW)
        assert a.output_tokens[0] == b.output_tokens[0] == hf_greedy[p]
        if a.metrics["drafted_tokens"]:
            assert a.metrics["acceptance_rate"] == 1.0
        assert b.metrics["acceptance_rate"] == 0.0
        statuses = {t["status"] for t in b.tokens[0]}
        assert "accepted" not in statuses and "rejected" in statuses


def test_eos_and_length_inside_accepted_run(tiny, target_lm, hf_greedy):
    p = PROMPTS[1]
    ref = hf_greedy[p]
    eos = ref[5]  # pretend the 6th greedy token is EOS: it falls inside an accepted run at k = 8
    first = ref.index(eos)
    lm = load_model(tiny["target"], device="cpu")
    lm.eos_token_id = eos
    dec = SpeculativeDecoder(lm, make_drafter(tiny["target"], lm))
    res = dec.generate([p], k=8, max_new_tokens=NEW)
    assert res.output_tokens[0] == ref[:first + 1]
    assert res.finish_reasons == ["eos"]
    ids = lm.tokenizer(p, return_tensors="pt")
    hf = lm.hf_model.generate(**ids, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos)
    assert hf[0, ids["input_ids"].shape[1]:].tolist() == res.output_tokens[0]
    # the length limit inside an accepted run
    dec2 = SpeculativeDecoder(target_lm, make_drafter(tiny["target"], target_lm))
    res = dec2.generate([p], k=8, max_new_tokens=5)
    assert res.output_tokens[0] == hf_greedy[p][:5] and res.finish_reasons == ["length"]
    assert sum(1 for t in res.tokens[0] if t["status"] != "rejected") == 5


def test_sampling_reproducible_and_rows_differ(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    a = dec.generate(["hello world"] * 3, k=4, max_new_tokens=20, temperature=1.0, seed=7)
    b = dec.generate(["hello world"] * 3, k=4, max_new_tokens=20, temperature=1.0, seed=7)
    c = dec.generate(["hello world"] * 3, k=4, max_new_tokens=20, temperature=1.0, seed=8)
    assert a.output_tokens == b.output_tokens
    assert a.output_tokens != c.output_tokens
    assert len({tuple(o) for o in a.output_tokens}) > 1  # a seed per row
    statuses = {t["status"] for row in a.tokens for t in row}
    assert {"accepted", "target"} <= statuses


def test_events_cover_every_token(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    res = dec.generate(PROMPTS[:3], k=4, max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=1)
    for row, out in zip(res.tokens, res.output_tokens):
        assert [t["token"] for t in row if t["status"] != "rejected"] == out
        for t in row:
            assert t["status"] in ("accepted", "rejected", "recovered", "bonus", "target")
            assert 0.0 <= t["target_prob"] <= 1.0
            if t["status"] in ("accepted", "rejected"):
                assert 0.0 < t["draft_prob"] <= 1.0
    m = res.metrics
    assert m["drafted_tokens"] > 0 and 0 <= m["acceptance_rate"] <= 1
    assert m["mean_accepted_length"] == pytest.approx(m["accepted_tokens"] / m["row_rounds"] + 1)
    assert len(m["per_position_acceptance"]) == 4
    for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "latency_p50_ms", "latency_p95_ms", "itl_p95_ms"):
        assert m[key] is not None and m[key] >= 0
    df = res.recorder.tokens_frame()
    assert len(df) == sum(len(r) for r in res.tokens)


def test_no_subscriber_no_events(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    seen = []
    res = dec.generate(["hello"], k=2, max_new_tokens=8, record=False)
    assert res.metrics == {} and not dec.hooks.active
    unsub = dec.hooks.subscribe(seen.append)
    dec.generate(["hello"], k=2, max_new_tokens=8, record=False)
    unsub()
    kinds = [type(e).__name__ for e in seen]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished" and "RoundEvent" in kinds


def test_probabilities_only_when_a_subscriber_wants_them(tiny, target_lm):
    """subscribe(fn, probs=False) (a server): events without token probabilities, and the drafter is not
    asked for them; one subscriber that wants them (the default) turns them on for everyone."""

    class Watching(ModelDrafter):
        def propose(self, ctx, ks, params, uniform, want_probs, stop=None):
            self.asked.append(want_probs)
            return super().propose(ctx, ks, params, uniform, want_probs, stop)

    base = make_drafter(tiny["draft_close"], target_lm)
    drafter = Watching(base.lm, target_lm.vocab_size)
    drafter.asked = []  # want_probs of every propose call
    dec = SpeculativeDecoder(target_lm, drafter)
    plain = dec.generate(["hello world", "the cat"], k=3, max_new_tokens=12, record=False).output_tokens

    def records(events):
        return [t for e in events if type(e).__name__ == "RoundEvent" for r in e.rows for t in r.tokens]

    quiet = []
    unsub = dec.hooks.subscribe(quiet.append, probs=False)
    assert dec.hooks.active and not dec.hooks.wants_probs
    res = dec.generate(["hello world", "the cat"], k=3, max_new_tokens=12, record=False)
    assert res.output_tokens == plain
    recs = records(quiet)
    assert recs and all(t.target_prob is None and t.draft_prob is None for t in recs)
    assert any(t.status == "accepted" for t in recs) and drafter.asked and not any(drafter.asked)

    loud, drafter.asked[:] = [], []
    quiet.clear()
    unsub_loud = dec.hooks.subscribe(loud.append)  # probs=True
    assert dec.hooks.wants_probs
    dec.generate(["hello world", "the cat"], k=3, max_new_tokens=12, record=False)
    assert all(drafter.asked)
    for recs in (records(quiet), records(loud)):
        assert all(t.target_prob is not None for t in recs)
        assert all(t.draft_prob is not None for t in recs if t.status in ("accepted", "rejected"))
    unsub_loud()
    unsub()
    assert not dec.hooks.active and not dec.hooks.wants_probs


def test_stream_can_be_cancelled(tiny, target_lm):
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    n = 0
    for ev in dec.stream(["hello world"], k=2, max_new_tokens=64):
        n += 1
        if n == 3:
            break
    assert not dec.hooks.active  # the stream unsubscribed
    assert dec.generate(["hello"], k=2, max_new_tokens=4).output_tokens[0]


def test_model_drafter_rolls_back_by_length(tiny, target_lm):
    d = make_drafter(tiny["draft_close"], target_lm)
    assert isinstance(d, ModelDrafter)
    dec = SpeculativeDecoder(target_lm, d)
    dec.generate(["abc abc"], k=4, max_new_tokens=10)
    # after the run the drafter's cache length is at most the row length - 1 (nothing copied)
    assert d.host_dlen[0] <= len(target_lm.encode("abc abc")) + 10


def test_finished_rows_leave_the_round(tiny, target_lm):
    """A row that finishes is never drafted or verified again: the verify forwards shrink to the running
    rows, and the total verified positions equal the sum over rounds of running rows x (k+1)."""
    from speclab.engine import Scheduler
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    shapes = []
    dec_drafter = make_drafter(tiny["draft_close"], target_lm)
    sched = Scheduler(target_lm, dec_drafter, None, max_running=3, max_len=64)
    real = sched.cache.forward

    def spy(tokens, start, **kw):
        if kw.get("last_only") is None:  # verify forwards (prefill asks for the last position only)
            shapes.append(tuple(tokens.shape))
        return real(tokens, start, **kw)

    sched.cache.forward = spy
    budgets = [3, 20, 6]
    reqs = [Request(target_lm.encode(p), n, SamplingParams(), seed=0, ignore_eos=True)
            for p, n in zip(["hello world", "the cat sat", "abc abc"], budgets)]
    for r in reqs:
        sched.submit(r)
    rows_per_round = []
    while not sched.idle:
        before = len(shapes)
        sched.step()
        if len(shapes) > before:
            rows_per_round.append(shapes[-1][0])
    assert [len(r.generated) for r in reqs] == budgets
    assert rows_per_round[0] == 3 and rows_per_round[-1] == 1  # the short rows left
    assert rows_per_round == sorted(rows_per_round, reverse=True)
    # every verified row-round belongs to a running request: sum of rounds over requests
    assert sum(rows_per_round) == sum(r.rounds for r in reqs)
    assert all(r.status == "finished" for r in reqs)


def test_prefill_groups_bound_the_padding():
    from speclab.engine.prefill import prefill_groups

    assert prefill_groups([10, 12, 40, 41], 8) == [(0, 2), (2, 4)]  # 2 + 1 padding tokens
    assert prefill_groups([7], 0) == [(0, 1)]
    assert prefill_groups([3, 3, 3], 0) == [(0, 3)]
    assert prefill_groups([1, 2, 3, 4], 0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    lengths = sorted([24, 26, 32, 35, 42, 47, 47, 50, 55, 61, 61, 62, 64, 66, 66, 66, 72, 78, 82, 87, 103, 132])
    groups = prefill_groups(lengths, 32)
    assert groups[0][0] == 0 and groups[-1][1] == len(lengths)
    assert all(a < b and b == c for (a, b), (c, _) in zip(groups, groups[1:]))  # consecutive, covering
    for a, b in groups:
        assert (b - a) * lengths[b - 1] - sum(lengths[a:b]) <= 32


def test_grouped_prefill_rows_equal_their_solo_runs(tiny, target_lm):
    """Prompts of very different lengths arriving together are prefilled in several groups (each padded to its
    own longest); every row still equals its solo run, with a model draft admitted group by group."""
    prompts = ["a", "hello world", "the cat sat on the mat " * 6, "x", "one two three four five six " * 5,
               "kv cache", "rollback is bookkeeping " * 8]
    from speclab.engine.prefill import prefill_groups

    lens = sorted(len(target_lm.encode(p)) for p in prompts)
    assert len(prefill_groups(lens)) > 1  # the case under test
    dec = SpeculativeDecoder(target_lm, make_drafter(tiny["draft_close"], target_lm))
    batch = dec.generate(prompts, k=3, max_new_tokens=12).output_tokens
    for p, out in zip(prompts, batch):
        assert out == dec.generate([p], k=3, max_new_tokens=12).output_tokens[0], p


def test_admit_runs_group_consecutive_rows_within_the_padding_budget():
    from speclab.engine.prefill import admit_runs

    assert admit_runs([0, 1, 2, 5], [10, 12, 90, 11]) == [(0, 2), (2, 3), (5, 6)]
    assert admit_runs([3], [40]) == [(3, 4)]
    assert admit_runs([0, 1, 2], [50, 50, 50], 0) == [(0, 3)]
    assert admit_runs([0, 1, 2], [50, 51, 52], 0) == [(0, 1), (1, 2), (2, 3)]
    assert admit_runs([], []) == []


def test_a_model_draft_takes_a_row_in_only_when_it_first_drafts(tiny, target_lm):
    """A draft model prefills a row late, before the first round that drafts (and once): a row that never drafts
    (speculation off under load) never costs a draft prefill. Rows taken in late, next to rows taken in earlier,
    still equal plain greedy decoding."""
    from speclab.engine import Scheduler
    from speclab.engine.policies import Choice, make_policy
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    class Late:  # drafts nothing for 3 rounds, then k=3 for rows "b" and "c" only (a round drafts all rows' draft)
        name, k_max = "late", 3

        def __init__(self):
            self.rounds = 0

        def choose(self, view):
            self.rounds += 1
            on = self.rounds > 3
            return [Choice(3 if on and r.request_id in ("b", "c") else 0, "test") for r in view.rows]

        def draft_stop(self):
            return None

    prompts = {"a": "hello world", "b": "the cat sat on the mat " * 2, "c": "abc abc", "d": "one two three"}
    d = make_drafter(tiny["draft_close"], target_lm)
    taken = []
    real = d.admit
    d.admit = lambda ctx, rows, feats: (taken.append([ctx.request_ids[b] for b in rows]), real(ctx, rows, feats))

    def run(drafter, policy, ids):
        sched = Scheduler(target_lm, drafter, policy, max_running=4, max_len=96)
        reqs = [Request(target_lm.encode(prompts[i]), 16, SamplingParams(), seed=0, ignore_eos=True, request_id=i)
                for i in ids]
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return reqs

    reqs = run(d, Late(), "abcd")
    assert sorted(i for grp in taken for i in grp) == ["a", "b", "c", "d"]  # once each
    assert all(r.history[:3] == [(0, 0)] * 3 for r in reqs) and reqs[1].drafted > 0
    plain = run(None, None, "abcd")
    assert [r.generated for r in reqs] == [r.generated for r in plain]
    taken.clear()
    run(d, make_policy("batch-table:1-=0", 4), "ab")
    assert taken == []  # never drafted: never taken in


def test_a_row_taken_in_late_near_its_end_next_to_a_lagging_row(tiny, target_lm):
    """A row whose draft is taken in late, near the end of its slots, beside a row the draft has not seen for many
    plain rounds: the draft's catch-up block (as wide as the most lagging row) must not write past the cache's
    slots. Output equals plain greedy."""
    from speclab.engine import Scheduler
    from speclab.engine.policies import Choice
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    class Script:  # round 1: row "a" drafts (taken in); rounds 2-13 plain; then every row drafts
        name, k_max = "script", 2

        def __init__(self):
            self.rounds = 0

        def choose(self, view):
            self.rounds += 1
            k = 1 if self.rounds == 1 or self.rounds > 13 else 0
            return [Choice(k, "test") for r in view.rows]

        def draft_stop(self):
            return None

    long_prompt = target_lm.encode("the cat sat on the mat and then the dog ran after it " * 2)

    def run(drafter, policy):
        sched = Scheduler(target_lm, drafter, policy, max_running=2, max_len=len(long_prompt) + 16)
        a = Request(target_lm.encode("hello"), 16, SamplingParams(), seed=0, ignore_eos=True, request_id="a")
        c = Request(list(long_prompt), 16, SamplingParams(), seed=0, ignore_eos=True, request_id="c")
        sched.submit(a)
        sched.step()  # "a" alone: prefill, and a round that takes it into the draft
        sched.submit(c)  # "c" arrives later and runs plain until round 14, then is taken in 13 tokens on
        sched.run_until_idle()
        return [a, c]

    reqs = run(make_drafter(tiny["draft_close"], target_lm), Script())
    assert reqs[1].history[:12] == [(0, 0)] * 12 and any(d for d, _ in reqs[1].history[12:])
    plain = run(None, None)
    assert [r.generated for r in reqs] == [r.generated for r in plain]


def test_rows_never_taken_into_the_draft_move_slots_when_others_leave(tiny, target_lm):
    """Rows beyond the draft's first capacity that never drafted (speculation off above 2 rows) move into the slots of
    rows that finish: the draft holds nothing of them, so nothing of theirs moves there (served at 32 streams, a
    batch-table server failed 30 of 32 requests with an IndexError from the move). When the load falls and
    drafting comes back on, the moved rows are taken in where they now live. Output equals plain greedy."""
    from speclab.engine import Scheduler
    from speclab.engine.policies import make_policy
    from speclab.engine.request import Request
    from speclab.engine.sampling import SamplingParams

    texts = ["hello world", "the cat sat on the mat", "abc abc abc", "one two three", "a b c d e f", "x y z"]

    def run(drafter, policy):
        sched = Scheduler(target_lm, drafter, policy, max_running=6, capacity=2, max_len=64)
        reqs = [Request(target_lm.encode(t), 4 + 3 * i, SamplingParams(), seed=0, ignore_eos=True,
                        request_id=f"r{i}") for i, t in enumerate(texts * 2)]  # budgets 4..37: rows leave apart
        for r in reqs:
            sched.submit(r)
        sched.run_until_idle()
        return reqs

    reqs = run(make_drafter(tiny["draft_close"], target_lm), make_policy("batch-table:1-2=3,3-=0", 3))
    assert all(r.finish_reason == "length" for r in reqs)
    assert sum(r.drafted for r in reqs) > 0  # the last rows, 2 at most, drafted
    assert [r.generated for r in reqs] == [r.generated for r in run(None, None)]


@pytest.fixture(scope="module")
def target_both_layouts(tiny):
    """The tiny target as a model too big for the cache is kept: each matmul weight in both layouts."""
    import speclab.models.native_llama as nl
    from speclab.kernels import few_rows

    old = nl.CACHE_RESIDENT_BYTES
    nl.CACHE_RESIDENT_BYTES = 0
    try:
        with few_rows.disabled():  # the layouts are torch's path: where the few-row kernel cannot run
            lm = load_model(tiny["target"], device="cpu")
    finally:
        nl.CACHE_RESIDENT_BYTES = old
    assert lm.native.both_layouts
    return lm


def test_matmul_layout_follows_the_rows(target_lm, target_both_layouts):
    """A model kept in both layouts multiplies 2..10 activation rows by W as given (F.linear) and every other
    count by the stored W^T; a model that fits in the cache keeps W^T alone."""
    import torch.nn.functional as F

    from speclab.models.native_llama import FEW_ROWS, Weight

    assert not target_lm.native.both_layouts and target_lm.native.lm_head.w is None
    assert not target_both_layouts.native.few_rows
    nat = target_both_layouts.native
    w = nat.layers[0][1]
    assert isinstance(w, Weight) and torch.equal(w.w.t(), w.t)
    C = w.t.shape[0]
    for rows in (1, FEW_ROWS[0], 4, FEW_ROWS[1], FEW_ROWS[1] + 1, 32):
        x = torch.randn(1, rows, C)
        got = nat._lin(x, w)
        few = FEW_ROWS[0] <= rows <= FEW_ROWS[1]
        assert torch.equal(got, F.linear(x, w.w) if few else x @ w.t), rows


def test_few_rows_take_the_kernel_on_one_thread(target_lm):
    """With the few-row kernel, 1..MAX_ROWS activation rows go through it on one torch thread, bit for bit what the
    kernel computes; more rows, or more threads, take torch's W^T."""
    from speclab.kernels import few_rows

    if not target_lm.native.few_rows:
        pytest.skip(f"the few-row kernel does not run here: {few_rows.reason()}")
    nat = target_lm.native
    w = nat.layers[0][1]
    C = w.t.shape[0]
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 5, few_rows.MAX_ROWS, few_rows.MAX_ROWS + 1):
                x = torch.randn(1, rows, C)
                kernel = n_threads == 1 and rows <= few_rows.MAX_ROWS
                assert torch.equal(nat._lin(x, w), few_rows.matmul(x, w.p) if kernel else x @ w.t), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equivalence_with_both_layouts(tiny, target_both_layouts, hf_greedy, k):
    """Verification blocks of 2..5 rows and small batches take the other kernel: still the target's own
    greedy output, alone and in a ragged batch."""
    lm = target_both_layouts
    dec = SpeculativeDecoder(lm, _drafter("draft_close", tiny, lm))
    plain = SpeculativeDecoder(lm, None)
    for p in PROMPTS[:8]:
        assert dec.generate([p], k=k, max_new_tokens=NEW).output_tokens[0] == hf_greedy[p], (p, k)
        assert plain.generate([p], k=0, max_new_tokens=NEW).output_tokens[0] == hf_greedy[p], p
    batch = PROMPTS[8:11]
    for p, out in zip(batch, dec.generate(batch, k=k, max_new_tokens=NEW).output_tokens):
        assert out == hf_greedy[p], (p, k)
