"""CUDA graphs (speclab.models.cuda_graphs): the bucketing, padding and static-buffer layer on the CPU,
and the padded static-shape forward, run eagerly here (a replay performs the same computation), against
the eager forward for the real rows. The capture test needs a CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from speclab.drafters import make_drafter
from speclab.engine import Request, Scheduler, SpeculativeDecoder
from speclab.engine.policies import Fixed
from speclab.models import cuda_graphs as cg
from speclab.models.cuda_graphs import GraphedCache, GraphKey, StaticInputs, graph_key, kv_bucket, row_bucket
from speclab.models.native_llama import StaticKVCache

ATOL = 2e-5


# ---------------------------------------------------------------------------------------------- pure layer
def test_row_bucket():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 17, 64, 65, 200, 256)] == [1, 2, 4, 4, 8, 32, 64, 128, 256, 256]
    assert row_bucket(257) is None
    assert row_bucket(3, (1, 8)) == 8 and row_bucket(9, (1, 8)) is None
    assert row_bucket(2, (8, 1, 4)) == 4  # order of the buckets given does not matter


def test_kv_bucket():
    assert kv_bucket(10, 1000) == 256  # the floor
    assert kv_bucket(256, 1000) == 256
    assert kv_bucket(257, 1000) == 512
    assert kv_bucket(300, 1000) == 512
    assert kv_bucket(600, 1000) == 1000  # capped at the cache length
    assert kv_bucket(10, 100) == 100
    assert kv_bucket(5, 100, floor=4) == 8
    assert kv_bucket(1, 100, floor=1) == 1


def _key(n=3, T=5, kv_len=40, **kw):
    args = dict(rows_start=0, tree=False, capacity=8, live=0, max_tokens=5, max_len=100)
    args.update(kw)
    return graph_key(n, T, kv_len, **args)


def test_graph_key_serves_chain_forwards():
    key, why = _key()
    assert key == GraphKey(rows=4, tokens=5, kv=100, hidden=(), layers=None) and why == ""
    key, _ = _key(n=1, T=1, kv_len=3, max_len=1000, hidden=(-1,), layers=2)
    assert key == GraphKey(1, 1, 256, (-1,), 2)
    # live rows inside the batch, or the batch filling its bucket, need no spare rows
    assert _key(n=3, live=3)[0] is not None and _key(n=4, live=8)[0] is not None


@pytest.mark.parametrize("kw,why", [
    (dict(tree=True), "tree"),
    (dict(rows_start=2), "rows offset"),
    (dict(T=6), "tokens per row"),
    (dict(n=300, capacity=512), "batch past the largest bucket"),
    (dict(n=5, capacity=6), "capacity"),
    (dict(n=3, live=4), "live rows past the batch"),
    (dict(kv_len=101), "past the cache"),
])
def test_graph_key_eager_reasons(kw, why):
    key, got = _key(**kw)
    assert key is None and got == why


def test_static_inputs_pad_with_dummy_rows():
    inp = StaticInputs(4, 2, "cpu")
    inp.fill(torch.tensor([[5, 6], [7, 8], [9, 10]]), torch.tensor([3, 4, 5]))
    assert inp.tokens.tolist() == [[5, 6], [7, 8], [9, 10], [0, 0]] and inp.start.tolist() == [3, 4, 5, 0]
    inp.fill(torch.tensor([[1, 2]]), torch.tensor([9]))  # fewer real rows: the old ones become dummy rows
    assert inp.tokens.tolist() == [[1, 2], [0, 0], [0, 0], [0, 0]] and inp.start.tolist() == [9, 0, 0, 0]


def test_use_cuda_graphs():
    assert cg.use_cuda_graphs(None, "cuda") and not cg.use_cuda_graphs(None, "cpu")
    assert cg.use_cuda_graphs(True, "cpu") and not cg.use_cuda_graphs(False, "cuda")


# ---------------------------------------------------------------------------------------------- static forward
def _prefilled(lm, capacity, prompts, max_len=64):
    """A cache with each prompt's ids prefilled in its row; returns (cache, ids per row)."""
    ids = [lm.encode(p) for p in prompts]
    cache = lm.new_cache(capacity, max_len)
    for r, t in enumerate(ids):
        cache.forward(torch.tensor([t]), torch.zeros(1, dtype=torch.long), kv_len=len(t), rows=slice(r, r + 1))
    return cache, ids


def _verify_inputs(ids, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(ids)
    tokens = torch.randint(0, 20, (n, T), generator=g)
    start = torch.tensor([len(t) for t in ids])  # (n,) the block goes right after each prompt
    return tokens, start, int(start.max()) + T


@pytest.mark.parametrize("n,T", [(1, 1), (1, 5), (3, 1), (3, 4), (5, 2)])
def test_padded_static_forward_equals_eager(target_lm, n, T):
    """The static path (rows padded to the bucket, attention over the whole bucket of slots with the
    position mask) gives the eager forward's logits and cache contents for the real rows."""
    prompts = PROMPTS[:n]
    eager, ids = _prefilled(target_lm, n, prompts)
    static, _ = _prefilled(target_lm, n, prompts)
    gc = GraphedCache(static, max_tokens=5, kv_floor=16)
    assert static.capacity >= row_bucket(n)  # room for the padding rows
    gc.live = n  # the prefills above went around the wrapper
    tokens, start, kv_len = _verify_inputs(ids, T)
    a = eager.forward(tokens, start, kv_len=kv_len, rows=slice(0, n), hidden=(-1, 0))
    b = gc.forward(tokens, start, kv_len=kv_len, rows=slice(0, n), hidden=(-1, 0))
    assert gc.stats["static eager"] == 1 and not any(k.startswith("eager") for k in gc.stats)
    assert b.logits.shape == a.logits.shape == (n, T, target_lm.vocab_size)
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=1e-5)
    assert torch.equal(b.logits.argmax(-1), a.logits.argmax(-1))
    for i in (-1, 0):
        torch.testing.assert_close(b.hidden[i], a.hidden[i], atol=ATOL, rtol=1e-5)
    # the real rows' caches hold the same keys and values; the padding rows wrote only past the batch
    for kc_a, kc_b in zip(eager.k + eager.v, static.k + static.v):
        torch.testing.assert_close(kc_b[:n], kc_a[:n], atol=ATOL, rtol=1e-5)


def test_padding_rows_never_touch_live_rows(target_lm):
    """A row past the batch that still holds a cache (live) forces the eager path; after release the
    spare rows take the padding, and the rows that left are the only ones written."""
    eager, ids = _prefilled(target_lm, 4, PROMPTS[:4])
    static, _ = _prefilled(target_lm, 4, PROMPTS[:4])
    gc = GraphedCache(static, max_tokens=4, kv_floor=16)
    gc.live = 4
    row3 = [c[3].clone() for c in static.k + static.v]
    tokens, start, kv_len = _verify_inputs(ids[:3], 2)
    gc.forward(tokens, start, kv_len=kv_len, rows=slice(0, 3))
    assert gc.stats["eager: live rows past the batch"] == 1
    assert all(torch.equal(c[3], r) for c, r in zip(static.k + static.v, row3))  # row 3 untouched
    gc.release(3)
    out = gc.forward(tokens, start, kv_len=kv_len, rows=slice(0, 3))
    assert gc.stats["static eager"] == 1
    ref = eager.forward(tokens, start, kv_len=kv_len, rows=slice(0, 3))
    torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=1e-5)


def test_last_only_and_early_exit_match_eager(target_lm):
    eager, ids = _prefilled(target_lm, 2, PROMPTS[:2])
    static, _ = _prefilled(target_lm, 2, PROMPTS[:2])
    gc = GraphedCache(static, max_tokens=3, kv_floor=16)
    gc.live = 2
    tokens, start, kv_len = _verify_inputs(ids, 3)
    last = torch.tensor([0, 2])
    a = eager.forward(tokens, start, kv_len=kv_len, last_only=last, layers=1, hidden=(0,))
    b = gc.forward(tokens, start, kv_len=kv_len, last_only=last, layers=1, hidden=(0,))
    assert b.logits.shape == a.logits.shape == (2, 1, target_lm.vocab_size)
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(b.hidden[0], a.hidden[0], atol=ATOL, rtol=1e-5)


def test_eager_fallbacks_run_the_inner_forward(target_lm):
    cache, ids = _prefilled(target_lm, 2, PROMPTS[:2])
    gc = GraphedCache(cache, max_tokens=2, kv_floor=16)
    tokens, start, kv_len = _verify_inputs(ids, 3)  # T = 3 > max_tokens
    gc.forward(tokens, start, kv_len=kv_len)
    gc.forward(tokens[:1], start[:1], kv_len=kv_len, rows=slice(1, 2))  # a prefill appended after row 0
    assert gc.stats == {"eager: tokens per row": 1, "eager: rows offset": 1}
    assert gc.live == 2


def test_capacity_rounds_up_to_a_bucket(target_lm):
    gc = GraphedCache(target_lm.new_cache(3, 16), max_tokens=2)
    assert gc.capacity >= 4 and gc.max_len == 16 and gc.supports_trees  # the inner cache's attributes
    gc.ensure_capacity(7)
    assert gc.capacity >= 8
    gc.ensure_capacity(300)  # past the largest bucket: as asked
    assert gc.capacity >= 300
    assert isinstance(gc.inner, StaticKVCache)


def test_pool_keeps_graphed_caches_between_runs(target_lm):
    """A run's graphed cache goes back to its model's pool when the run's owner is collected; the next
    run that fits takes it (graphs and all); runs alive at the same time never share one."""
    import gc as garbage

    class Run:  # stands for a scheduler
        pass

    a_owner, b_owner = Run(), Run()
    a = cg.graphed(target_lm.new_cache(3, 40), 5, owner=a_owner)
    b = cg.graphed(target_lm.new_cache(3, 40), 5, owner=b_owner)
    assert isinstance(a, GraphedCache) and a is not b
    assert a.capacity >= 4 and a.max_len == cg.SLOT_ROUND  # rounded up: nearby runs share it
    pool = target_lm.native.graph_pool
    a.live = 2
    del a_owner
    garbage.collect()
    assert a in pool.free and a.live == 0
    c_owner = Run()
    c = cg.graphed(target_lm.new_cache(1, 100), 2, owner=c_owner)  # fewer rows, more slots: still fits
    assert c is a and c.max_tokens == 2 and a not in pool.free
    d = cg.graphed(target_lm.new_cache(1, 300), 2)  # more slots than any free cache: a new one
    assert d is not a and d is not b and d.max_len == 2 * cg.SLOT_ROUND
    hf_like = object()
    assert cg.graphed(hf_like, 2) is hf_like  # not a native cache: eager


def test_capture_needs_cuda(target_lm):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match="CUDA"):
        GraphedCache(target_lm.new_cache(1, 8), max_tokens=1, capture=True)


# ---------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("draft,k", [("none", 0), ("draft_close", 3), ("ngram", 4)])
def test_decoder_with_static_graph_path_is_exact(tiny, target_lm, draft, k):
    """Greedy outputs with the graph path (run eagerly on the CPU) equal the eager engine's, on a ragged
    batch (3 rows: bucket 4, one padding row) with a model draft (its cache is wrapped too)."""
    batch = [PROMPTS[0], PROMPTS[3], PROMPTS[2]]
    outs = {}
    for graphs in (False, True):
        drafter = make_drafter(tiny[draft] if draft.startswith("draft") else draft, target_lm)
        dec = SpeculativeDecoder(target_lm, drafter, cuda_graphs=graphs)
        outs[graphs] = dec.generate(batch, k=k, max_new_tokens=16).output_tokens
    assert outs[True] == outs[False]


def test_scheduler_serves_rounds_from_graph_shapes(tiny, target_lm):
    """Continuous batching: requests join and leave; every verification round is a graph shape (static
    path), prefills appended after running rows run eagerly, and outputs equal the eager scheduler's."""
    results = {}
    for graphs in (False, True):
        drafter = make_drafter(tiny["draft_close"], target_lm)
        s = Scheduler(target_lm, drafter, Fixed(3), max_running=3, capacity=3, cuda_graphs=graphs)
        reqs = [Request(target_lm.encode(p), 6 + 3 * i) for i, p in enumerate(PROMPTS[:5])]
        for r in reqs:
            s.submit(r)
        s.run_until_idle()
        results[graphs] = [r.generated for r in reqs]
        if graphs:
            assert isinstance(s.cache, GraphedCache) and isinstance(drafter.cache, GraphedCache)
            st = s.cache.stats
            assert st["static eager"] >= s.round  # every verification round (and the first prefill)
            assert st["eager: rows offset"] >= 1  # later admissions
            assert drafter.cache.stats["static eager"] > 0
        else:
            assert not isinstance(s.cache, GraphedCache)
    assert results[True] == results[False]


def test_buckets_default():
    assert cg.DEFAULT_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ---------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_capture_and_replay_match_eager_on_cuda(tiny):
    from speclab.models import load_model

    lm = load_model(tiny["target"], device="cuda", dtype=torch.float32)
    eager, ids = _prefilled(lm, 3, PROMPTS[:3])
    static, _ = _prefilled(lm, 3, PROMPTS[:3])
    gc = GraphedCache(static, max_tokens=4, kv_floor=16)
    gc.live = 3
    for T in (1, 4, 1):
        tokens, start, kv_len = _verify_inputs(ids, T)
        tokens, start = tokens.cuda(), start.cuda()
        a = eager.forward(tokens, start, kv_len=kv_len, rows=slice(0, 3))
        b = gc.forward(tokens, start, kv_len=kv_len, rows=slice(0, 3))
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    assert gc.stats["captured"] == 2 and gc.stats["replayed"] == 3


def test_compiled_static_forward_matches_eager(target_lm):
    """compile= traces the static forward with torch.compile (here the 'eager' backend: tracing without
    code generation, so the test stays fast); its logits are the eager forward's."""
    eager, ids = _prefilled(target_lm, 2, PROMPTS[:2])
    static, _ = _prefilled(target_lm, 2, PROMPTS[:2])
    gc = GraphedCache(static, max_tokens=3, kv_floor=16, compile="eager")
    gc.live = 2
    tokens, start, kv_len = _verify_inputs(ids, 3)
    a = eager.forward(tokens, start, kv_len=kv_len)
    b = gc.forward(tokens, start, kv_len=kv_len)
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=1e-5)


def test_a_shape_whose_capture_fails_runs_eagerly(target_lm, monkeypatch):
    """Capture raising (an op CUDA graphs refuse) costs that shape its graph, not the run: the forward
    and every later one of that shape run eagerly, and the reason is kept."""
    eager, ids = _prefilled(target_lm, 2, PROMPTS[:2])
    cache, _ = _prefilled(target_lm, 2, PROMPTS[:2])
    gc = GraphedCache(cache, max_tokens=2, kv_floor=16)
    gc.live = 2
    gc.capture = True  # as on CUDA; capture itself is replaced by one that fails

    def fail(key, inp):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gc, "_capture", fail)
    tokens, start, kv_len = _verify_inputs(ids, 2)
    for _ in range(2):
        out = gc.forward(tokens, start, kv_len=kv_len)
        ref = eager.forward(tokens, start, kv_len=kv_len)
        torch.testing.assert_close(out.logits, ref.logits, atol=ATOL, rtol=1e-5)
    assert gc.stats == {"capture failed": 1, "eager: capture failed": 1}
    assert list(gc.failed.values()) == ["RuntimeError: operation not permitted when stream is capturing"]
    assert gc.capture_shapes([2], [2], kv_len) == 0  # live rows: nothing captured ahead


@pytest.mark.slow
def test_cli_refuses_cuda_graphs_on_the_cpu():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "speclab", "generate", "--prompt", "def f", "--device", "cpu",
                        "--cuda-graphs", "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == "speclab: error: --cuda-graphs needs a CUDA device (the target is on cpu)"
