"""A Llama forward written out (gpt-fast style) over the weights of a Hugging Face
``LlamaForCausalLM``, with a static KV cache that the decoder rolls back by bookkeeping alone.

The cache contract (shared with :mod:`speclab.models.hf_backend`): a forward writes a *block* of T
new tokens per row into slots ``start[b] .. start[b] + T - 1`` of that row. Everything the row has
below ``start[b]`` is visible to every token of the block; inside the block, visibility is causal
(a chain) or given by a tree mask (a token sees its ancestors and itself). Positions, for RoPE, are
``start[b] + t`` for a chain and ``start[b] + depth[b, t]`` for a tree. A row's slot p holds its token
at position p, except inside a tree block, where slot = start + node index; after acceptance
:meth:`StaticKVCache.move_slots` copies the accepted path down to slot = position.

Rollback is moving the row's length (owned by the decoder): stale slots sit above it, are never
visible to a real query, and are overwritten by the next block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels import few_rows


@dataclass
class StepOut:
    """What one cached forward returns."""

    logits: torch.Tensor  # (n, T, V), or (n, 1, V) with last_only
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n, T, C); -1 = final, normed


@dataclass
class LlamaDims:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    eps: float
    rope_theta: float
    max_pos: int


def native_supported(config) -> bool:
    """Plain Llama: default RoPE, SiLU MLP, no biases (the embedded family and most Llama checkpoints)."""
    if getattr(config, "model_type", None) not in ("llama",):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return False
    return getattr(config, "hidden_act", "silu") == "silu" and not getattr(config, "attention_bias", False) \
        and not getattr(config, "mlp_bias", False)


class StaticKVCache:
    """Per-layer (R, H_kv, S, D) key/value buffers for up to R rows; row r's token at position p lives
    in slot p. ``forward(rows=slice(a, b))`` runs rows a..b-1 on views of the buffers (no copies)."""

    supports_trees = True
    supports_early_exit = True

    def __init__(self, model: "NativeLlama", capacity: int, max_len: int):
        self.model = model
        self.max_len = max_len
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure_capacity(capacity)

    def ensure_capacity(self, rows: int) -> None:
        """Room for at least ``rows`` rows (grows by reallocating; rows 0..capacity-1 are kept)."""
        if rows <= self.capacity:
            return
        cfg, w = self.model.cfg, self.model.embed
        new = max(rows, 2 * self.capacity)
        shape = (new, cfg.n_kv_heads, self.max_len, cfg.head_dim)
        k = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(cfg.n_layers)]
        v = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(cfg.n_layers)]
        for i in range(len(self.k)):
            k[i][: self.capacity].copy_(self.k[i])
            v[i][: self.capacity].copy_(self.v[i])
        self.k, self.v, self.capacity = k, v, new

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *, kv_len: int, rows: slice | None = None,
                depth: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, last_only: torch.Tensor | None = None,
                hidden: tuple[int, ...] = (), layers: int | None = None, static: bool = False) -> StepOut:
        """tokens (n, T) written at slots start[b] + t; ``kv_len`` = max(start) + T, known on the host
        (no device sync here). ``valid`` is ignored: padding sits after a row's real tokens, so no real
        query sees it. ``layers`` = m runs only the first m layers (early exit) before the final norm
        and LM head. ``static``: the shapes and kernels depend on (n, T, kv_len) only, never on where a
        row's block sits (any ``kv_len`` >= max(start) + T, e.g. the whole cache): what a CUDA graph
        captures once and replays at every position (:mod:`speclab.models.cuda_graphs`)."""
        rows = rows if rows is not None else slice(0, tokens.shape[0])
        return self.model(tokens, start, self, rows, kv_len, depth, tree_mask, last_only, hidden, layers, static)

    def commit(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        """Row b keeps positions < lengths[b]: bookkeeping only (the decoder owns the lengths)."""

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Row ``src``'s first ``length`` slots become row ``dst``'s (a leaving row's place is reused)."""
        for kc, vc in zip(self.k, self.v):
            kc[dst, :, :length] = kc[src, :, :length]
            vc[dst, :, :length] = vc[src, :, :length]

    def release(self, n: int) -> None:
        """Rows past n left: nothing to free (the buffers are reused by the next rows admitted)."""

    def row_kv(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row ``row``'s keys and values, per layer (H_kv, S, D) views (prefix caching stores a slice of them)."""
        return [kc[row] for kc in self.k], [vc[row] for vc in self.v]

    def load_prefix(self, row: int, k: list[torch.Tensor], v: list[torch.Tensor], length: int) -> None:
        """Slots 0..length-1 of row ``row`` from stored per-layer (H_kv, >= length, D) keys and values."""
        for kc, vc, ks, vs in zip(self.k, self.v, k, v):
            kc[row, :, :length] = ks[:, :length]
            vc[row, :, :length] = vs[:, :length]

    def move_slots(self, rows: slice, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row, copy slots src[b, j] to dst[b, j] (n, m): the accepted path of a tree block moves
        down to slot = position. Reads happen before writes, so overlapping ranges are safe."""
        n = src.shape[0]
        r = torch.arange(n, device=src.device)[:, None]  # (n, 1)
        for kc, vc in zip(self.k, self.v):
            kv, vv = kc[rows], vc[rows]
            kv[r, :, dst] = kv[r, :, src]  # (n, m, H, D) gathered first, then scattered
            vv[r, :, dst] = vv[r, :, src]


# Which kernel a CPU matmul takes depends on the rows M of the activations, the threads and the weights' size:
# * the few-row kernel (kernels/few_rows.c) for M <= its MAX_ROWS on one thread, where the system has a C
#   compiler and AVX2: it reads the weights once for all M rows, and a row's result does not depend on M, so a
#   plain step and a verify compute the same logits for a position (docs/engine.md "Matmuls on the CPU");
# * otherwise x @ W^T with W^T stored contiguous: MKL's fastest at M = 1 and from M = 16 on;
# * without the kernel, F.linear(x, W) with W as given at M = 2..10 once the weights come from memory:
#   MKL's kernel for that layout is faster there;
# * a model whose weights fit in the cache (the drafts, at most 1.7 MB) gains nothing from the second layout.
FEW_ROWS = (2, 10)  # activation rows for which F.linear(x, W) is used, when the model keeps both layouts
# a single row's verify block of up to this many tokens takes the written-out attention (_block_attention) on the
# CPU; longer blocks (prefills) keep SDPA, whose flash kernel does not materialise the (T, S) scores
BLOCK_ATTENTION_MAX = 16
CACHE_RESIDENT_BYTES = 8 << 20  # matmul weights up to this size stay in the cache: one layout (W^T)
BOTH_LAYOUTS_MAX_BYTES = 2 << 30  # above this, a second copy of the weights costs too much memory


@dataclass(frozen=True)
class Weight:
    """A matmul weight on the CPU: ``t`` (in, out) contiguous; ``w`` (out, in) or None (see FEW_ROWS); ``p`` the
    few-row kernel's panels or None."""

    t: torch.Tensor
    w: torch.Tensor | None = None
    p: torch.Tensor | None = None


class NativeLlama:
    """The forward. Weights are shared with the Hugging Face model (views), except on the CPU where the
    matmul weights are stored transposed, and for models that do not stay in the cache also as given
    (:class:`Weight`: each matmul takes the layout whose kernel is faster for its number of rows)."""

    def __init__(self, hf_model):
        cfg = hf_model.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cfg = LlamaDims(cfg.num_hidden_layers, cfg.num_attention_heads,
                             cfg.num_key_value_heads or cfg.num_attention_heads, head_dim,
                             cfg.hidden_size, cfg.rms_norm_eps, theta, cfg.max_position_embeddings)
        m = hf_model.model
        self.embed = m.embed_tokens.weight  # (V, C)
        # Matmul weights on the CPU (see Weight): stored transposed, and for a model whose weights do not stay
        # in the cache, also as given, for the few-row matmuls where MKL's kernel for that layout is faster.
        # On CUDA F.linear is already optimal and a second copy would double weight memory.
        self.cpu = self.embed.device.type == "cpu"
        wqkvs, w13s = [], []
        for layer in m.layers:
            a, f = layer.self_attn, layer.mlp
            # fuse q/k/v and gate/up into one matmul each: fewer kernel launches per token
            wqkvs.append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0))  # (Hq*D + 2*Hkv*D, C)
            w13s.append(torch.cat([f.gate_proj.weight, f.up_proj.weight], 0))  # (2F, C)
        mats = [hf_model.lm_head.weight] + wqkvs + w13s + [w for layer in m.layers
                                                             for w in (layer.self_attn.o_proj.weight,
                                                                       layer.mlp.down_proj.weight)]
        nbytes = sum(w.numel() * w.element_size() for w in mats)
        self.few_rows = self.cpu and nbytes <= BOTH_LAYOUTS_MAX_BYTES and few_rows.load() is not None
        self.both_layouts = self.cpu and CACHE_RESIDENT_BYTES < nbytes <= BOTH_LAYOUTS_MAX_BYTES and not self.few_rows
        prep = (lambda w: Weight(w.t().contiguous(), w.contiguous() if self.both_layouts else None,
                                 few_rows.pack(w) if self.few_rows and few_rows.packable(w) else None)) \
            if self.cpu else (lambda w: w)
        self.lm_head = prep(hf_model.lm_head.weight)  # tied or not
        self.final_norm = m.norm.weight
        self.layers = []
        for layer, wqkv, w13 in zip(m.layers, wqkvs, w13s):
            self.layers.append((layer.input_layernorm.weight, prep(wqkv), prep(layer.self_attn.o_proj.weight),
                                layer.post_attention_layernorm.weight, prep(w13), prep(layer.mlp.down_proj.weight)))
        d = self.cfg.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (D/2,)
        # + headroom: a round may verify up to K+1 positions past the last real token
        pos = torch.arange(self.cfg.max_pos + 1024, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat([freqs, freqs], -1)  # (P, D)
        dt, dev = self.embed.dtype, self.embed.device
        sin = emb.sin()
        sin[:, : d // 2] = -sin[:, : d // 2]  # pre-signed for _rope
        self.cos, self.sin = emb.cos().to(dev, dt), sin.to(dev, dt)
        self._causal = torch.ones(0, 0, dtype=torch.bool, device=dev)
        self._bias = torch.zeros(0, 0, dtype=dt, device=dev)
        self.graph_pool = None  # speclab.models.cuda_graphs.GraphPool: graphed caches kept between runs

    def new_cache(self, capacity: int, max_len: int) -> StaticKVCache:
        return StaticKVCache(self, capacity, max_len)

    def _norm(self, x: torch.Tensor, w: torch.Tensor, fused: bool = False) -> torch.Tensor:
        dt = x.dtype
        # the fused op is bit-identical to HF's formula in fp32, and faster; in bf16 it rounds once where
        # HF rounds twice (``fused``: the static path, where one kernel instead of eight matters)
        if dt == torch.float32 or fused:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return w * x.to(dt)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # HF's x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the same products, bit for
        # bit, as x * cos + [x2, x1] * [-sin1, sin2] (a roll and a pre-signed sin: 4 ops instead of 6)
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def _causal_rows(self, p0: int, kv_len: int) -> torch.Tensor:
        """causal[q, s] = slot s is visible from position q, for q in p0..kv_len-1: a slice of a
        lower-triangular table grown on demand (powers of two), not one built per call."""
        if self._causal.shape[0] < kv_len:
            n = 1 << max(8, (kv_len - 1).bit_length())
            self._causal = torch.ones(n, n, dtype=torch.bool, device=self._causal.device).tril()
        return self._causal[p0:kv_len, :kv_len]  # (T, S)

    def _causal_bias(self, p0: int, kv_len: int, dtype) -> torch.Tensor:
        """The same rows as an additive bias (0 visible, -inf hidden), from a table kept between calls."""
        if self._bias.shape[0] < kv_len or self._bias.dtype != dtype:
            n = 1 << max(8, (kv_len - 1).bit_length())
            full = torch.full((n, n), float("-inf"), dtype=dtype, device=self._causal.device)
            self._bias = full.triu(1)
        return self._bias[p0:kv_len, :kv_len]  # (T, S)

    def _block_attention(self, q, kk, vv, p0: int, kv_len: int) -> torch.Tensor:
        """One row's block of T > 1 queries (positions p0 .. kv_len-1) over its kv_len cached keys, written out:
        q (1, H, T, D), kk / vv (1, Hkv, S, D) -> (1, H, T, D). SDPA's CPU kernel with a mask pays for the mask
        (converted on every call, then applied block by block) more than the few rows of arithmetic cost: a
        verify block spent most of its attention time there. Query head j*G + g reads KV head j (as repeat_kv)."""
        n, H, T, D = q.shape
        Hkv = kk.shape[1]
        G = H // Hkv
        qg = q.reshape(n, Hkv, G * T, D)  # (1, Hkv, G*T, D): the G query heads of a KV head as rows
        bias = self._causal_bias(p0, kv_len, q.dtype)  # (T, S)
        if G > 1:
            bias = bias.repeat(G, 1)  # (G*T, S)
        att = torch.baddbmm(bias, qg[0], kk[0].transpose(1, 2), alpha=D ** -0.5)  # (Hkv, G*T, S)
        y = torch.bmm(att.softmax(-1), vv[0])  # (Hkv, G*T, D)
        return y.reshape(n, H, T, D)

    @staticmethod
    def _lin(x: torch.Tensor, w) -> torch.Tensor:
        if isinstance(w, Weight):
            if w.p is not None and few_rows.takes(x):
                return few_rows.matmul(x, w.p)
            if w.w is not None and FEW_ROWS[0] <= x.numel() // x.shape[-1] <= FEW_ROWS[1]:
                return F.linear(x, w.w)
            return x @ w.t
        return F.linear(x, w)

    def _mask(self, start, T, kv_len, tree_mask):
        """(n, 1, T, S) bool: slot s is visible from block token t of row b.

        Chain: s <= start[b] + t. Tree: s < start[b], or s = start[b] + j with j an ancestor of t (or t).
        e.g. start = [5], tree parents [-1, 0, 0] (t0 the root token, t1 and t2 its children):
             t2 sees slots 0..4 (the row), 5 (t0) and 7 (itself), not 6 (its sibling t1).
        """
        dev = start.device
        slots = torch.arange(kv_len, device=dev)  # (S,)
        if tree_mask is None:
            pos = start[:, None] + torch.arange(T, device=dev)[None]  # (n, T)
            return (slots[None, None, :] <= pos[:, :, None])[:, None]
        n = start.shape[0]
        mask = (slots[None, :] < start[:, None])[:, None, :].expand(n, T, kv_len).clone()  # (n, T, S)
        cols = (start[:, None] + torch.arange(T, device=dev)[None])[:, None, :].expand(n, T, T)  # (n, T, T)
        mask.scatter_(2, cols, tree_mask)
        return mask[:, None]

    def __call__(self, tokens, start, cache: StaticKVCache, rows: slice, kv_len: int, depth=None, tree_mask=None,
                 last_only=None, hidden=(), layers=None, static=False) -> StepOut:
        c = self.cfg
        lin = self._lin
        n, T = tokens.shape
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        x = F.embedding(tokens, self.embed)  # (n, T, C)
        # A single row's chain block is always slots kv_len-T .. kv_len-1 (the caller's contract): slices
        # (views, no kernels) replace the gathers and scatters a ragged batch or a tree needs. A static
        # forward takes the gather path even for one row: positions come from `start`, on the device.
        fast = n == 1 and tree_mask is None and not static
        p0 = kv_len - T
        if fast:
            cos, sin = self.cos[p0:kv_len], self.sin[p0:kv_len]  # (T, D)
            mask = None if T == 1 else self._causal_rows(p0, kv_len)  # (T, S)
        else:
            steps = depth if depth is not None else torch.arange(T, device=tokens.device)[None]
            positions = start[:, None] + steps  # (n, T) for RoPE
            slot_idx = start[:, None] + torch.arange(T, device=tokens.device)[None]  # (n, T) where K/V go
            cos = self.cos[positions][:, None]  # (n, 1, T, D)
            sin = self.sin[positions][:, None]
            mask = self._mask(start, T, kv_len, tree_mask)  # (n, 1, T, S)
            r = torch.arange(n, device=tokens.device)[:, None]  # (n, 1)
        # static + GQA: the G = H / Hkv query heads of each KV head attend as G*T query rows of one head
        # (no K/V repeat, one attention kernel with the mask); the mask repeats per group, once per forward
        grouped = static and Hkv != H
        if grouped:
            G = H // Hkv
            gmask = mask[:, :, None].expand(n, 1, G, T, kv_len).reshape(n, 1, G * T, kv_len)  # (n, 1, G*T, S)
        want = set(hidden)
        out_hidden: dict[int, torch.Tensor] = {}
        n_layers = len(self.layers) if layers is None else layers
        for i, (ln1, wqkv, wo, ln2, w13, w2) in enumerate(self.layers[:n_layers]):
            h = self._norm(x, ln1, static)
            qkv = lin(h, wqkv)  # (n, T, (H + 2 Hkv) D)
            # rotate q and k together: one set of rope kernels per layer
            qk = self._rope(qkv[..., : (H + Hkv) * D].view(n, T, H + Hkv, D).transpose(1, 2), cos, sin)
            q, k = qk[:, :H], qk[:, H:]  # (n, H, T, D), (n, Hkv, T, D)
            v = qkv[..., (H + Hkv) * D :].view(n, T, Hkv, D)  # (n, T, Hkv, D)
            kc, vc = cache.k[i][rows], cache.v[i][rows]  # views (n, Hkv, S_max, D)
            if fast:
                kc[:, :, p0:kv_len] = k
                vc[:, :, p0:kv_len] = v.transpose(1, 2)
            else:  # each row's new keys at its own slots: cache[b, :, slot_idx[b, t]] = k[b, :, t]
                kc[r, :, slot_idx] = k.transpose(1, 2)
                vc[r, :, slot_idx] = v
            kk, vv = kc[:, :, :kv_len], vc[:, :, :kv_len]  # (n, Hkv, S, D)
            if fast and 1 < T <= BLOCK_ATTENTION_MAX and self.cpu:
                y = self._block_attention(q, kk, vv, p0, kv_len)
            elif grouped:  # query head j*G + g reads KV head j, as HF's repeat_kv has it
                y = F.scaled_dot_product_attention(q.reshape(n, Hkv, G * T, D), kk, vv, attn_mask=gmask)
                y = y.reshape(n, H, T, D)
            else:
                y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=Hkv != H)  # (n, H, T, D)
            x = x + lin(y.transpose(1, 2).reshape(n, T, H * D), wo)
            h = self._norm(x, ln2, static)
            g, u = lin(h, w13).chunk(2, -1)  # (n, T, F) each
            x = x + lin(F.silu(g) * u, w2)
            if i in want:
                out_hidden[i] = x
        x = self._norm(x, self.final_norm, static)
        if -1 in want:
            out_hidden[-1] = x  # (n, T, C): the features an LM head reads
        if last_only is not None:  # prefill: only the logits at each row's last real token
            x = x[torch.arange(n, device=x.device), last_only][:, None]  # (n, 1, C)
        return StepOut(lin(x, self.lm_head), out_hidden)  # (n, T or 1, V)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on final-normed features (n, ..., C) -> logits (n, ..., V) (self-drafting heads)."""
        return self._lin(x, self.lm_head)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.embed)
