"""CUDA graphs for the native forward's decode and verify steps.

A decode step of a small model, or of a 1B model at batch 1, is bound by kernel launches, not by the
GPU: a graph captures the forward's few hundred kernels once and replays them with one launch. A graph
replays fixed shapes and fixed addresses, so a forward is served by a captured shape
(:class:`GraphKey`):

- rows: the batch rounded up to a bucket (1, 2, 4, ... 256). The extra rows are dummy rows (token 0 at
  position 0) that write into cache rows past the batch: rows nobody holds (see ``live`` below);
- tokens per row: T as asked (1 for plain decoding, k+1 to verify k drafts), up to ``max_tokens``;
- attended slots: the smallest power of two >= the longest row (at least ``kv_floor``), capped at the
  cache length. Attention runs over all of them with the position mask (gpt-fast's static cache), so
  the same graph serves every position (:meth:`~speclab.models.native_llama.StaticKVCache.forward`
  with ``static=True``);
- the hidden states a drafter reads and the early-exit depth (part of what the graph computes).

Inputs are copied into static buffers, the graph replays, and the real rows' outputs are copied out
(never views: the next replay overwrites the graph's outputs). Anything else runs eagerly: trees,
rows not starting at 0 (a prefill appended after running rows), more tokens per row than
``max_tokens`` (prefills), more rows than the largest bucket, or live rows past the batch.

Rows past the batch are free only if nobody holds them: the wrapper follows the cache contract
(``forward`` on rows a..b-1 makes them live; ``move_row`` makes its destination live; ``release(n)``
frees rows n and up) and pads only when no live row sits past the batch.

Graphs belong to the cache buffers they were captured on, and a scheduler lives for one run
(``SpeculativeDecoder.generate`` makes one per call), so graphed caches are kept between runs in a
:class:`GraphPool` per model: the next run of the same model takes a free cache that fits (rows and
slots rounded up: a bucket of rows, a multiple of 256 slots) with its graphs already captured, and gives
it back when its scheduler is collected.

The pure layer (:func:`row_bucket`, :func:`kv_bucket`, :func:`graph_key`, :class:`StaticInputs`) is
tested on the CPU; so is the padded static forward, which on the CPU runs eagerly (``capture=False``:
the same computation a replay performs). Capture and replay are the thin CUDA-only part.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass

import torch

from .native_llama import StaticKVCache, StepOut

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV_FLOOR = 256
MAX_GRAPHS = 512  # each graph keeps its output buffers; beyond this, forwards run eagerly
SLOT_ROUND = 256  # pooled caches have a multiple of this many slots, so runs of nearby lengths share them
POOL_KEEP = 4  # free graphed caches kept per model


def use_cuda_graphs(flag: bool | None, device) -> bool:
    """The setting in force: ``None`` means on for CUDA devices, off elsewhere."""
    return bool(flag) if flag is not None else torch.device(device).type == "cuda"


def row_bucket(n: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket holding n rows; None when n is past the largest.
    e.g. 1 -> 1, 3 -> 4, 17 -> 32, 256 -> 256, 257 -> None."""
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def kv_bucket(kv_len: int, max_len: int, floor: int = KV_FLOOR) -> int:
    """The slots a static forward attends over: the smallest power of two >= kv_len (at least ``floor``),
    capped at the cache length. e.g. (300, 1000) -> 512, (600, 1000) -> 1000, (10, 1000) -> 256,
    (10, 100) -> 100."""
    s = max(floor, 1 << max(0, kv_len - 1).bit_length())
    return min(s, max_len)


@dataclass(frozen=True)
class GraphKey:
    """One captured shape."""

    rows: int  # the row bucket
    tokens: int  # T, tokens per row
    kv: int  # attended slots
    hidden: tuple[int, ...] = ()  # hidden states returned (layer indices, -1 = final normed)
    layers: int | None = None  # early exit: the first m layers


def graph_key(n: int, T: int, kv_len: int, *, rows_start: int, tree: bool, capacity: int, live: int,
              max_tokens: int, max_len: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
              hidden: tuple[int, ...] = (), layers: int | None = None,
              kv_floor: int = KV_FLOOR) -> tuple[GraphKey | None, str]:
    """The captured shape that serves a forward of n rows x T tokens (rows rows_start..rows_start+n-1,
    longest row kv_len slots), or None and why it runs eagerly. ``capacity``: cache rows that exist;
    ``live``: rows 0..live-1 hold caches (padding may only write at rows >= max(n, live))."""
    if tree:
        return None, "tree"
    if rows_start != 0:
        return None, "rows offset"
    if T > max_tokens:
        return None, "tokens per row"
    b = row_bucket(n, buckets)
    if b is None:
        return None, "batch past the largest bucket"
    if b > capacity:
        return None, "capacity"
    if b > n and live > n:
        return None, "live rows past the batch"
    if kv_len > max_len:
        return None, "past the cache"
    return GraphKey(b, T, kv_bucket(kv_len, max_len, kv_floor), tuple(hidden), layers), ""


class StaticInputs:
    """The fixed-address inputs of every graph with ``rows`` x ``tokens`` inputs: tokens and start
    positions. Rows past the batch are dummy rows: token 0 at position 0."""

    def __init__(self, rows: int, tokens: int, device):
        self.tokens = torch.zeros(rows, tokens, dtype=torch.long, device=device)  # (R, T)
        self.start = torch.zeros(rows, dtype=torch.long, device=device)  # (R,)
        self.filled = 0  # real rows of the last fill: rows past it are already dummy rows

    def fill(self, tokens: torch.Tensor, start: torch.Tensor) -> None:
        n = tokens.shape[0]
        self.tokens[:n].copy_(tokens)
        self.start[:n].copy_(start)
        if self.filled > n:  # rows that were real last time become dummy rows again
            self.tokens[n:self.filled].zero_()
            self.start[n:self.filled].zero_()
        self.filled = n


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    out: StepOut  # the graph's output buffers, overwritten by every replay


class GraphedCache:
    """A :class:`~speclab.models.native_llama.StaticKVCache` whose chain forwards run as CUDA graphs
    (captured on first use of each shape), with the same contract. ``capture=False`` runs the same padded
    static forward eagerly (the CPU; tests). ``stats`` counts replays, captures and eager forwards by reason.
    """

    def __init__(self, cache: StaticKVCache, *, max_tokens: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 capture: bool | None = None, kv_floor: int = KV_FLOOR, warmup: int = 2,
                 compile: str | None = None):
        self.inner = cache
        self.max_tokens = max(1, int(max_tokens))
        self.buckets = tuple(sorted(buckets))
        self.device = cache.model.embed.device
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.kv_floor = kv_floor
        self.warmup = warmup
        self.live = 0  # rows 0..live-1 hold caches
        self.graphs: dict[GraphKey, _Graph] = {}
        self.failed: dict[GraphKey, str] = {}  # shapes whose capture raised (they run eagerly), and why
        self.inputs: dict[tuple[int, int], StaticInputs] = {}
        self.pool = None
        self.stats: Counter = Counter()
        # compile = a torch.compile backend ("inductor": fuses the static forward's small kernels, norms,
        # rope, residuals, before capture; "eager": traces only, for tests). Opt-in (benchmarks): every new
        # shape compiles anew, seconds to a minute each
        self.compiled = None
        if compile:
            import torch._dynamo

            cfg = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):  # the newer name, the older one
                if hasattr(cfg, name):
                    setattr(cfg, name, max(getattr(cfg, name), MAX_GRAPHS))
                    break
            self.compiled = torch.compile(cache.model.__call__, backend=compile, dynamic=False)
        self.ensure_capacity(cache.capacity)

    # ------------------------------------------------------------------ the cache contract
    def __getattr__(self, name):  # k, v, capacity, max_len, model, supports_trees, ...
        if "inner" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def ensure_capacity(self, rows: int) -> None:
        """Room for ``rows`` rows, rounded up to a bucket so that padding always has rows to write into.
        Growing reallocates the buffers, so graphs captured on the old ones are dropped."""
        before = self.inner.capacity
        self.inner.ensure_capacity(row_bucket(rows, self.buckets) or rows)
        if self.inner.capacity != before:
            self.graphs.clear()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *, kv_len: int, rows: slice | None = None,
                depth: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, last_only: torch.Tensor | None = None,
                hidden: tuple[int, ...] = (), layers: int | None = None) -> StepOut:
        n, T = tokens.shape
        rows = rows if rows is not None else slice(0, n)
        key, why = graph_key(n, T, kv_len, rows_start=rows.start or 0,
                             tree=tree_mask is not None or depth is not None, capacity=self.inner.capacity,
                             live=self.live, max_tokens=self.max_tokens, max_len=self.inner.max_len,
                             buckets=self.buckets, hidden=tuple(hidden), layers=layers, kv_floor=self.kv_floor)
        if key is not None and self.capture and key not in self.graphs:
            if key in self.failed:
                key, why = None, "capture failed"
            elif len(self.graphs) >= MAX_GRAPHS:
                key, why = None, "graph limit"
        self.live = max(self.live, rows.stop)
        if key is None:
            self.stats[f"eager: {why}"] += 1
            return self.inner.forward(tokens, start, kv_len=kv_len, rows=rows, depth=depth, tree_mask=tree_mask,
                                      valid=valid, last_only=last_only, hidden=hidden, layers=layers)
        inp = self.inputs.get((key.rows, key.tokens))
        if inp is None:
            inp = self.inputs[(key.rows, key.tokens)] = StaticInputs(key.rows, key.tokens, self.device)
        inp.fill(tokens, start)
        if self.capture:
            g = self.graphs.get(key)
            if g is None:
                try:
                    g = self._capture(key, inp)
                except Exception as e:  # noqa: BLE001 - a shape that cannot be captured runs eagerly from now on
                    self.failed[key] = f"{type(e).__name__}: {e}"
                    self.stats["capture failed"] += 1
                    return self.inner.forward(tokens, start, kv_len=kv_len, rows=rows, valid=valid,
                                              last_only=last_only, hidden=hidden, layers=layers)
                self.graphs[key] = g
                self.stats["captured"] += 1
            g.graph.replay()
            out = g.out
            self.stats["replayed"] += 1
        else:
            out = self._static_forward(key, inp)
            self.stats["static eager"] += 1
        # copies of the real rows: the graph's buffers belong to the next replay
        logits = out.logits[:n]  # (n, T, V)
        if last_only is not None:
            logits = logits[torch.arange(n, device=logits.device), last_only][:, None]  # (n, 1, V)
        else:
            logits = logits.clone()
        return StepOut(logits, {i: h[:n].clone() for i, h in out.hidden.items()})

    def commit(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        self.inner.commit(lengths, rows)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.inner.move_row(src, dst, length)
        self.live = max(self.live, dst + 1)

    def move_slots(self, rows: slice, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.inner.move_slots(rows, src, dst)

    def release(self, n: int) -> None:
        self.inner.release(n)
        self.live = n

    # ------------------------------------------------------------------ static forward, capture
    def _static_forward(self, key: GraphKey, inp: StaticInputs) -> StepOut:
        if self.compiled is not None:  # NativeLlama.__call__(tokens, start, cache, rows, kv_len, depth, tree_mask,
            # last_only, hidden, layers, static)
            return self.compiled(inp.tokens, inp.start, self.inner, slice(0, key.rows), key.kv, None, None, None,
                                 key.hidden, key.layers, True)
        return self.inner.forward(inp.tokens, inp.start, kv_len=key.kv, rows=slice(0, key.rows),
                                  hidden=key.hidden, layers=key.layers, static=True)

    def _capture(self, key: GraphKey, inp: StaticInputs) -> _Graph:
        """Warm up on a side stream (as PyTorch asks), then capture. The warm-up forwards run on the
        current inputs and write the same keys and values the replay will: the cache ends up as if the
        forward had run once."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # one pool: graphs never run at the same time
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._static_forward(key, inp)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may touch CUDA while this one captures
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._static_forward(key, inp)
        return _Graph(graph, out)

    @torch.inference_mode()
    def capture_shapes(self, rows: list[int], tokens: list[int], kv_len: int) -> int:
        """Capture ahead of time (benchmarks keep capture out of their timings) for every row bucket in
        ``rows`` and T in ``tokens``, with dummy inputs on free rows. Only while no row is live."""
        if self.live or not self.capture:
            return 0
        done = 0
        for n in rows:
            for T in tokens:
                key, _ = graph_key(n, T, kv_len, rows_start=0, tree=False, capacity=self.inner.capacity, live=0,
                                   max_tokens=self.max_tokens, max_len=self.inner.max_len, buckets=self.buckets,
                                   kv_floor=self.kv_floor)
                if key is None or key in self.graphs or key in self.failed:
                    continue
                inp = self.inputs.get((key.rows, key.tokens))
                if inp is None:
                    inp = self.inputs[(key.rows, key.tokens)] = StaticInputs(key.rows, key.tokens, self.device)
                inp.fill(inp.tokens[:0], inp.start[:0])  # every row a dummy row
                try:
                    self.graphs[key] = self._capture(key, inp)
                except Exception as e:  # noqa: BLE001
                    self.failed[key] = f"{type(e).__name__}: {e}"
                    continue
                done += 1
        return done


class GraphPool:
    """The free graphed caches of one model, kept between runs (see the module docstring)."""

    def __init__(self, model, keep: int = POOL_KEEP):
        self.model = model
        self.keep = keep
        self.free: list[GraphedCache] = []
        self.lock = threading.Lock()

    def acquire(self, capacity: int, max_len: int, max_tokens: int, owner=None) -> GraphedCache:
        """A graphed cache with at least ``capacity`` rows and ``max_len`` slots, no row live: the smallest
        free one that fits, else a new one. It comes back to the pool when ``owner`` is collected."""
        rows = row_bucket(capacity) or capacity
        with self.lock:
            fits = [c for c in self.free if c.inner.capacity >= rows and c.inner.max_len >= max_len]
            cache = min(fits, key=lambda c: (c.inner.capacity, c.inner.max_len), default=None)
            if cache is not None:
                self.free.remove(cache)
        if cache is None:
            slots = -(-max_len // SLOT_ROUND) * SLOT_ROUND
            cache = GraphedCache(self.model.new_cache(rows, slots), max_tokens=max_tokens)
        cache.live = 0
        cache.max_tokens = max(1, int(max_tokens))
        if owner is not None:
            weakref.finalize(owner, self.release, cache)
        return cache

    def release(self, cache: GraphedCache) -> None:
        cache.live = 0
        with self.lock:
            self.free.append(cache)
            del self.free[:-self.keep]  # the longest-free first out


def graphed(cache, max_tokens: int, owner=None):
    """A pooled graphed cache in place of ``cache`` (same model, at least its rows and slots) when it is
    a native cache; else ``cache`` itself (the Hugging Face backend's caches run eagerly). ``owner``: the
    object whose collection gives the graphed cache back to its model's pool (the scheduler)."""
    if not isinstance(cache, StaticKVCache):
        return cache
    model = cache.model
    if getattr(model, "graph_pool", None) is None:
        model.graph_pool = GraphPool(model)
    return model.graph_pool.acquire(cache.capacity, cache.max_len, max_tokens, owner)
