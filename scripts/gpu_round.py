"""A greedy speculative round with every step on the device, for the GPU check (``scripts/gpu_check.py``):
k draft steps, one verify forward, greedy acceptance and the bookkeeping, on static KV caches (the slot is the
position, rollback is moving a length), with no host sync anywhere in the round. So the whole round can be
captured as ONE CUDA graph (gpt-fast's static-cache loop, with the draft steps inside the graph too), and each
phase can be captured and timed on its own: the round taken apart against its floor.

The state per row is L (tokens committed), ``last`` (the token at L-1, not yet in the target's cache) and
``prev`` (the token at L-2). A round:

    draft    d_1 = argmax draft([prev, last] at L-2, L-1); d_j = argmax draft(d_{j-1} at L+j-2), j = 2..k
    verify   target([last, d_1..d_k] at L-1 .. L+k-1) -> argmax a_0..a_k
    accept   n = leading j with d_{j+1} = a_j; next = a_n (greedy: the target's own choice)
    book     emit d_1..d_n, next at L..L+n; prev = token at L+n-1; last = next; L += n + 1

The draft's first step re-reads the token at L-2: when the previous round accepted all k drafts, d_k was
never fed to the draft, and this one fixed shape covers both cases (a re-read slot gets the same keys).
Stale slots past a row's length are masked by position (the static forward), never cleared.

k = 0 with no draft is plain greedy decoding through the same code: the decode step as one graph.
"""

from __future__ import annotations

import time

import torch

from speclab.engine.acceptance import greedy_accept

PHASES = ("draft", "verify", "accept", "bookkeeping")


def weight_bytes(lm) -> int:
    """Bytes a decode step reads from weights: everything but the embedding table (one row is read);
    a tied LM head is counted once, as the head."""
    m = lm.hf_model
    seen, total = set(), 0
    emb = m.model.embed_tokens.weight
    for p in m.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    if m.lm_head.weight.data_ptr() != emb.data_ptr():
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes(lm, rows: int, slots: int) -> int:
    """Bytes of keys and values ``rows`` rows hold over ``slots`` positions."""
    c = lm.native.cfg
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * slots * rows * lm.native.embed.element_size()


def forward_floor_s(lm, rows: int, T: int, slots: int, bandwidth_gbs: float, peak_tflops: float) -> dict:
    """The least time one forward of T tokens per row can take: its weights and the rows' KV cache read
    once from HBM, or its matmuls at rows x T at the peak rate, whichever is longer."""
    read = weight_bytes(lm) + kv_bytes(lm, rows, slots)
    flops = 2 * (weight_bytes(lm) // lm.native.embed.element_size()) * rows * T
    hbm, mm = read / (bandwidth_gbs * 1e9), flops / (peak_tflops * 1e12)
    return {"hbm_s": hbm, "matmul_s": mm, "floor_s": max(hbm, mm), "bytes": read, "flops": flops}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round emits when each draft is accepted with probability alpha, independently:
    1 + alpha + ... + alpha^k (the accepted run, plus the recovered or bonus token)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class DeviceRound:
    """``rows`` rows of one prompt length, run round by round on the device (see the module's docstring)."""

    def __init__(self, target, draft, rows: int, k: int, max_len: int, compile: str | None = None):
        if k > 0 and draft is None:
            raise ValueError("k > 0 needs a draft model")
        # the static forwards, through torch.compile when asked (a backend: "inductor" fuses the small kernels
        # between the matmuls; every (rows, T) shape compiles once)
        self.fwd = {}
        for role, lm in (("target", target), ("draft", draft if k > 0 else None)):
            if lm is not None:
                f = lm.native.__call__
                self.fwd[role] = torch.compile(f, backend=compile, dynamic=False) if compile else f
        self.target, self.draft, self.rows, self.k, self.max_len = target, draft, rows, k, max_len
        dev = self.dev = target.device
        self.tc = target.native.new_cache(rows, max_len)
        self.dc = draft.native.new_cache(rows, max_len) if k > 0 else None
        self.length = torch.zeros(rows, dtype=torch.long, device=dev)  # (B,) L
        self.last = torch.zeros_like(self.length)  # (B,) token at L-1
        self.prev = torch.zeros_like(self.length)  # (B,) token at L-2
        self.n = torch.zeros_like(self.length)  # (B,) drafts accepted in the last round
        self.next = torch.zeros_like(self.length)  # (B,) the target's token after them
        self.drafts = torch.zeros(rows, k, dtype=torch.long, device=dev)  # (B, k)
        self.argmax = torch.zeros(rows, k + 1, dtype=torch.long, device=dev)  # (B, k+1)
        self.num_draft = torch.full((rows,), k, dtype=torch.long, device=dev)
        self.out = torch.zeros(rows, max_len + k + 1, dtype=torch.long, device=dev)  # (B, S) tokens by position
        self.cols = torch.arange(k + 1, device=dev)  # (k+1,)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.accepted = torch.zeros((), dtype=torch.long, device=dev)  # drafts accepted, all rows and rounds

    # ------------------------------------------------------------------ state
    @torch.inference_mode()
    def prefill(self, prompts: torch.Tensor) -> None:
        """prompts (B, P), P >= 2: the caches hold positions 0..P-2; ``last`` is the prompt's last token."""
        B, P = prompts.shape
        zero = torch.zeros(B, dtype=torch.long, device=self.dev)
        self.tc.forward(prompts[:, : P - 1], zero, kv_len=P - 1)
        if self.dc is not None:
            self.dc.forward(prompts[:, : P - 1], zero, kv_len=P - 1)
        self.length.fill_(P)
        self.last.copy_(prompts[:, -1])
        self.prev.copy_(prompts[:, -2])
        self.out.zero_()
        self.out[:, :P] = prompts
        self.accepted.zero_()

    def snapshot(self) -> tuple:
        return tuple(t.clone() for t in (self.length, self.last, self.prev, self.out, self.accepted))

    def restore(self, snap: tuple) -> None:
        """Back to a snapshot: the small state only. Cache slots written since lie past the restored lengths,
        where the position mask hides them until the next round writes them again."""
        for t, s in zip((self.length, self.last, self.prev, self.out, self.accepted), snap):
            t.copy_(s)

    def tokens(self) -> list[list[int]]:
        """Every row's tokens (prompt and generated) up to its length."""
        return [row[:n] for row, n in zip(self.out.tolist(), self.length.tolist())]

    # ------------------------------------------------------------------ phases
    def _forward(self, role: str, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of a static forward (attends over the whole cache, masked by position):
        NativeLlama.__call__(tokens, start, cache, rows, kv_len, depth, tree_mask, last_only, hidden, layers,
        static), as StaticKVCache.forward(static=True) calls it."""
        cache = self.tc if role == "target" else self.dc
        return self.fwd[role](tokens, start, cache, slice(0, self.rows), self.max_len, None, None, None, (), None,
                              True).logits

    def _draft(self) -> None:
        if self.k == 0:
            return
        L = self.length
        toks = torch.stack([self.prev, self.last], 1)  # (B, 2) at L-2, L-1
        d = self._forward("draft", toks, L - 2)[:, -1].argmax(-1)  # (B,)
        self.drafts[:, 0] = d
        for j in range(1, self.k):  # d_j at position L + j - 1 proposes d_{j+1}
            d = self._forward("draft", d[:, None], L + j - 1)[:, -1].argmax(-1)
            self.drafts[:, j] = d

    def _verify(self) -> None:
        toks = torch.cat([self.last[:, None], self.drafts], 1)  # (B, k+1) at L-1 .. L+k-1
        self.argmax.copy_(self._forward("target", toks, self.length - 1).argmax(-1))  # (B, k+1)

    def _accept(self) -> None:
        r = greedy_accept(self.drafts, self.argmax, self.num_draft)
        self.n.copy_(r.num_accepted)
        self.next.copy_(r.next_token)

    def _bookkeeping(self) -> None:
        n, j = self.n[:, None], self.cols[None]  # (B, 1), (1, k+1)
        seq = torch.cat([self.last[:, None], self.drafts], 1)  # (B, k+1): the tokens at L-1 .. L+k-1
        padded = torch.cat([self.drafts, self.next[:, None]], 1)  # (B, k+1)
        emitted = torch.where(j < n, padded, self.next[:, None])  # d_1..d_n, next, then filler
        # filler lands past the new length, where the next round writes again
        self.out.scatter_(1, self.length[:, None] + j, emitted)
        self.prev.copy_(seq.gather(1, n).squeeze(1))  # the token at L + n - 1: d_n, or last when n = 0
        self.last.copy_(self.next)
        self.length.add_(self.n + 1)
        self.accepted.add_(self.n.sum())

    def phase(self, name: str) -> None:
        {"draft": self._draft, "verify": self._verify, "accept": self._accept,
         "bookkeeping": self._bookkeeping}[name]()

    @torch.inference_mode()
    def round(self) -> None:
        for p in PHASES:
            self.phase(p)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per phase and one for the whole round. The warm-up and capture advance the state, so
        it is restored afterwards (the graphs read and write the same tensors on every replay)."""
        snap = self.snapshot()
        self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.round()
        torch.cuda.current_stream(self.dev).wait_stream(side)
        for name in PHASES + ("round",):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.round() if name == "round" else self.phase(name)
            self.graphs[name] = g
        self.restore(snap)

    def replay(self, name: str) -> None:
        self.graphs[name].replay()

    # ------------------------------------------------------------------ timing
    def _clock(self):
        cuda = self.dev.type == "cuda"
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _elapsed_ms(self, a, b) -> float:
        if self.dev.type == "cuda":
            return a.elapsed_time(b)
        return (b - a) * 1e3

    @torch.inference_mode()
    def time_phases(self, rounds: int, graphs: bool) -> dict:
        """Mean ms per round of each phase (events between phases, one sync at the end), run eagerly or as the
        per-phase graphs. Phase times include the gaps a launch-bound phase leaves on the GPU."""
        marks = []
        for _ in range(rounds):
            m = [self._clock()]
            for p in PHASES:
                self.replay(p) if graphs else self.phase(p)
                m.append(self._clock())
            marks.append(m)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        out = {p: sum(self._elapsed_ms(m[i], m[i + 1]) for m in marks) / rounds for i, p in enumerate(PHASES)}
        out["round"] = sum(out[p] for p in PHASES)
        return out

    @torch.inference_mode()
    def time_whole(self, rounds: int, graphs: bool) -> float:
        """Mean ms per round of ``rounds`` rounds back to back: one graph replay each, or eagerly."""
        a = self._clock()
        for _ in range(rounds):
            self.replay("round") if graphs else self.round()
        b = self._clock()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        return self._elapsed_ms(a, b) / rounds


def kernel_breakdown(fn, dev, reps: int = 10) -> list[dict]:
    """Where a call's device time goes, by kind of kernel (matmul, attention, norm, copy and index, elementwise
    and the rest): torch.profiler over ``reps`` calls, each kernel's device time summed by kind (kernels inside a
    CUDA graph replay are traced one by one), with the kernels per call. On the CPU: each leaf operator's self
    time (kernels then counts operators, views included). A busy time well under the call's wall time means the
    device waits between kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(dev).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    kinds: dict[str, list[float]] = {}
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.time_range.elapsed_us()
        else:
            if not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total  # self time: a nested operator's time is counted once
        acc = kinds.setdefault(kernel_kind(e.name), [0.0, 0])
        acc[0] += us
        acc[1] += 1
    total = sum(v[0] for v in kinds.values()) or 1.0
    rows = [dict(kind=k, busy_ms=v[0] / reps / 1e3, share=v[0] / total, kernels=v[1] / reps) for k, v in kinds.items()]
    return sorted(rows, key=lambda r: -r["busy_ms"])


KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
         ("matmul", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "sm90_", "sm80_", "aten::mm", "aten::addmm",
                     "aten::bmm", "linear", "matmul")),
         ("norm", ("norm", "rsqrt")),
         ("copy/index", ("index", "copy", "memcpy", "memset", "scatter", "gather", "cat", "stack", "roll",
                         "embedding", "clone", "fill")))


def kernel_kind(name: str) -> str:
    n = name.lower()
    return next((kind for kind, keys in KINDS if any(x in n for x in keys)), "elementwise/other")
