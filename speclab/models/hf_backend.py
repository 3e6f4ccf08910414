"""The generic Hugging Face backend: the architectures of the exactness suite, through the model's own
forward, with a cache the decoder can roll back exactly and that never outgrows its rows.

The model appends every forward's keys and values at the end of its cache (``DynamicCache`` with
plain, non-sliding layers, so nothing is dropped behind our back). We keep, per row, the position
held by every slot (``slot_pos``, -1 = empty) and hand the model a 4-D additive attention mask built
from positions, never from slot indices::

    visible(b, t, s) = slot_pos[b, s] >= 0 and slot_pos[b, s] <= pos[b, t]
                       and (sliding layers) pos[b, t] - slot_pos[b, s] < window

so padding, a ragged batch's gaps and rolled-back slots are invisible, and a sliding window counts
positions (HF's own masks count slots, which is what broke windows under speculation). Models that
mix sliding and full layers (``config.layer_types``: Qwen2/3, Gemma-2/3) get one mask per layer type.
:meth:`HFKVCache.commit` then compacts each row: the slots it keeps move down to slot = position and
the cache is cropped to the longest row, so a row holds at most its context plus one round's block.

Padding and not-yet-verified draft tokens may sit at positions past the model's position table (a
row near its end in a batch whose widest row drafts k = 8). Those tokens are never visible to a real
query, but a learned position table (GPT-2) cannot even embed them: the model is called with
positions clamped to its table, while the mask is built from the true ones.

Trees and early exit are native-only: this backend refuses them with one line.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import SpeclabError
from .native_llama import StepOut

# Exactly the model types tests/test_architectures.py checks on this backend (greedy == a cache-free loop).
TESTED_MODEL_TYPES = ("llama", "gpt2", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text")
# Attention layer types whose cache is a plain list of (key, value) per position.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config keys that betray a recurrent state (Mamba, RWKV, RecurrentGemma, Jamba, Falcon-H1, ...).
_RECURRENT_HINTS = ("ssm", "mamba", "conv_kernel", "linear_conv", "recurrent", "lru_width", "time_step",
                    "attn_layer_indices", "layers_block_type", "hybrid", "linear_num_")
# Rotary scalings whose frequencies follow the longest position in the batch (padding included), so a
# row's logits would depend on its batch-mates; every other rotary type is a fixed function of position.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
# Attention implementations that honour a 4-D additive mask (flash attention takes 2-D padding only).
MASKED_ATTENTION = ("sdpa", "eager")


def _rope_types(config) -> set[str]:
    found = set()
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, key, None) or {}
        # one dict, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
        for d in ([rope] if "rope_type" in rope or "type" in rope else list(rope.values())):
            if isinstance(d, dict):
                found.add(str(d.get("rope_type", d.get("type", "default"))))
    return found


def rollback_problem(config) -> str | None:
    """Why this backend cannot decode this architecture exactly (None: it can)."""
    mt = getattr(config, "model_type", "?")
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if odd:
        return (f"its layers include {', '.join(odd)}: recurrent or linear-attention state cannot be rolled back "
                f"to an earlier position (only {' and '.join(ATTENTION_LAYER_TYPES)} layers keep a per-position "
                f"cache)")
    hints = sorted({k for k in vars(config) for h in _RECURRENT_HINTS if h in k.lower()})
    if hints:
        return (f"it has recurrent or hybrid state ({', '.join(hints[:3])}): a recurrent state cannot be rolled "
                f"back to an earlier position without recomputation")
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; speclab decodes causal LMs"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional; speculative decoding needs a causal LM"
    if mt not in TESTED_MODEL_TYPES:
        return (f"model type '{mt}' is not in speclab's exactness suite (tested: {', '.join(TESTED_MODEL_TYPES)}); "
                f"untested attention variants (chunked, local, cross-layer KV sharing) could decode wrongly")
    dyn = sorted(_rope_types(config) & set(_BATCH_DEPENDENT_ROPE))
    if dyn:
        return (f"its rotary scaling '{dyn[0]}' switches frequencies with the longest position in a batch, so a "
                f"row's output would depend on its batch-mates")
    return None


def _window(config) -> int | None:
    w = getattr(config, "sliding_window", None)
    return int(w) if w else None


def _decoder_layers(model) -> list:
    """The model's decoder blocks, in order (``model.layers`` in Llama-likes, ``transformer.h`` in GPT-2)."""
    base = model.base_model
    n = getattr(model.config, "num_hidden_layers", None)
    for name in ("layers", "h", "blocks"):
        mods = getattr(base, name, None)
        if isinstance(mods, torch.nn.ModuleList) and (n is None or len(mods) == n):
            return list(mods)
    raise SpeclabError(f"the generic backend cannot find the decoder layers of '{model.config.model_type}' "
                       f"(target features need them)")


class HFKVCache:
    """A rollback-exact cache over an ``AutoModelForCausalLM`` (see the module docstring)."""

    supports_trees = False
    supports_early_exit = False

    def __init__(self, model, capacity: int, max_len: int):
        from transformers import DynamicCache

        cfg = model.config
        attn = getattr(cfg, "_attn_implementation", None)
        if attn not in MASKED_ATTENTION:
            raise SpeclabError(f"the generic backend needs sdpa or eager attention (it passes 4-D position masks); "
                               f"'{cfg.model_type}' was loaded with '{attn}'")
        self.model = model
        self._new_cache = DynamicCache
        self.cache = None  # DynamicCache over rows 0..n-1
        self.n = 0  # rows held
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values -> cache: pass whichever this version takes
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keeps_logits = "logits_to_keep" in params
        self.layer_types = list(getattr(cfg, "layer_types", None) or [])
        self.window = _window(cfg)
        # the last position the model can embed (learned tables have no row past it)
        self.max_pos = int(getattr(cfg, "max_position_embeddings", 0) or getattr(cfg, "n_positions", 0) or 0) - 1
        self.dev = model.device
        self.slot_pos = torch.zeros(0, 0, dtype=torch.long, device=self.dev)  # (n, S)
        self.dtype = next(model.parameters()).dtype

    def ensure_capacity(self, rows: int) -> None:
        pass  # rows are added by prefilling them (forward on rows n..)

    # ------------------------------------------------------------------ masks
    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(visible.shape, dtype=self.dtype, device=self.dev)
        return m.masked_fill_(~visible, torch.finfo(self.dtype).min)

    def _mask(self, slot_pos: torch.Tensor, pos: torch.Tensor):
        """slot_pos (n, S) over the cache after this forward's append, pos (n, T) -> 4-D additive mask(s)."""
        sp = slot_pos[:, None, :]  # (n, 1, S)
        q = pos[:, :, None]  # (n, T, 1)
        causal = (sp >= 0) & (sp <= q)  # (n, T, S)
        full = self._additive(causal)[:, None]  # (n, 1, T, S)
        if self.window is None:
            return full
        windowed = self._additive(causal & (q - sp < self.window))[:, None]  # (n, 1, T, S)
        if self.layer_types:  # one mask per layer type (Qwen2/3, Gemma-2/3: sliding and full layers mixed)
            return {"full_attention": full, "sliding_attention": windowed}
        return windowed  # every layer slides (Mistral, Phi-3)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, *, kv_len: int, rows: slice | None = None,
                depth: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, last_only: torch.Tensor | None = None,
                hidden: tuple[int, ...] = (), layers: int | None = None) -> StepOut:
        if tree_mask is not None or depth is not None:
            raise SpeclabError(f"tree drafts need the native backend; '{self.model.config.model_type}' runs on "
                               f"the generic Hugging Face backend, which verifies chains only")
        if layers is not None:
            raise SpeclabError("early-exit drafting needs the native backend (the generic backend runs whole models)")
        n, T = tokens.shape
        rows = rows if rows is not None else slice(0, n)
        fresh = rows.start == self.n and self.n > 0  # new rows prefilled beside the running ones
        if rows.start not in (0, self.n) or (rows.start == 0 and self.n not in (0, n)):
            raise SpeclabError("internal: the HF backend runs either all rows or newly added ones")
        pos = start[:, None] + torch.arange(T, device=tokens.device)[None]  # (n, T)
        new_pos = pos if valid is None else torch.where(valid, pos, torch.full_like(pos, -1))
        if fresh or self.cache is None:
            cache, old = self._new_cache(), torch.zeros(n, 0, dtype=torch.long, device=self.dev)
        else:
            cache, old = self.cache, self.slot_pos
        slot_pos = torch.cat([old, new_pos], 1)  # (n, S + T)
        model_pos = pos.clamp(max=self.max_pos) if self.max_pos >= 0 else pos  # only junk positions move
        kw = {self.cache_kw: cache}
        # a prefill wants each row's last real token only: the LM head on those n columns, (n, n, V), beats
        # (n, T, V) when T > n (and -1 features need the head's input at every position)
        diagonal = last_only is not None and self.keeps_logits and T > n and -1 not in hidden
        if diagonal:
            kw["logits_to_keep"] = last_only  # (n,) sequence indices, the same for every row
        with _Features(self.model, hidden) as feats:
            out = self.model(input_ids=tokens, position_ids=model_pos, attention_mask=self._mask(slot_pos, pos),
                             use_cache=True, **kw)
        if fresh:
            self._append_rows(cache, slot_pos)
        else:
            self.cache, self.slot_pos, self.n = cache, slot_pos, n
        logits = out.logits  # (n, T, V), or (n, n, V) with logits_to_keep
        r = torch.arange(n, device=logits.device)
        if diagonal:
            logits = logits[r, r][:, None]  # (n, 1, V): row b at its own last_only[b]
        elif last_only is not None:
            logits = logits[r, last_only][:, None]  # (n, 1, V)
        return StepOut(logits, feats)

    def _append_rows(self, cache, slot_pos: torch.Tensor) -> None:
        """Rows prefilled in their own cache join the running ones (slot dimensions padded to match)."""
        S = max(self.slot_pos.shape[1], slot_pos.shape[1])

        def pad_kv(x):  # (n, H, s, D) -> (n, H, S, D)
            if x.shape[2] == S:
                return x
            return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], S - x.shape[2], x.shape[3])], 2)

        def pad_pos(p):  # (n, s) -> (n, S), empty slots -1
            return torch.cat([p, p.new_full((p.shape[0], S - p.shape[1]), -1)], 1)

        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([pad_kv(mine.keys), pad_kv(theirs.keys)], 0)
            mine.values = torch.cat([pad_kv(mine.values), pad_kv(theirs.values)], 0)
        self.slot_pos = torch.cat([pad_pos(self.slot_pos), pad_pos(slot_pos)], 0)
        self.n = self.slot_pos.shape[0]

    # ------------------------------------------------------------------ bookkeeping
    @torch.inference_mode()
    def commit(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        """Row b keeps positions < lengths[b]; kept slots move to slot = position; crop to the longest row.

        e.g. a row that held positions 0..9 in slots 0..9 verified 5 tokens appended at slots 12..16
        (positions 10..14; slots 10, 11 were another row's padding) and keeps 2 of them: slots 12, 13
        move to 10, 11, and the cache is cropped to max over rows of lengths (slots past a shorter row's
        length keep stale values under slot_pos = -1: invisible, overwritten or cropped later).
        Only the slots that move are copied: after the previous commit every kept slot already sat at
        slot = position, so that is this round's kept block tokens, at most k + 1 per row.
        """
        if self.cache is None or self.n == 0:
            return
        n = self.n
        lengths = lengths[:n]
        sp = self.slot_pos  # (n, S)
        slots = torch.arange(sp.shape[1], device=self.dev)[None]  # (1, S)
        move = (sp >= 0) & (sp < lengths[:, None]) & (sp != slots)  # (n, S) kept, not yet at slot = position
        S_new = int(lengths.max())
        b, s = move.nonzero(as_tuple=True)  # (m,) each
        dst = sp[b, s]  # (m,) a slot's position is its new slot; dst <= s always (slots only ever append)
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                x = getattr(layer, name)  # (n, H, S, D)
                if b.numel():
                    x[b, :, dst] = x[b, :, s]  # gathered first, then scattered: overlaps are safe
                setattr(layer, name, x[:, :, :S_new])  # (n, H, S_new, D) a view; the next append copies
        kept = slots[:, :S_new].expand(n, S_new)  # (n, S_new)
        self.slot_pos = torch.where(kept < lengths[:, None], kept, torch.full_like(kept, -1))

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        for layer in self.cache.layers:
            layer.keys[dst] = layer.keys[src]
            layer.values[dst] = layer.values[src]
        self.slot_pos[dst] = self.slot_pos[src]

    def release(self, n: int) -> None:
        """Keep rows 0..n-1 only (rows past n have left)."""
        if self.cache is None or n >= self.n:
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:n], layer.values[:n]
        self.slot_pos = self.slot_pos[:n]
        self.n = n
        if n == 0:
            self.cache = None

    def slots_held(self) -> list[int]:
        """Per row, the cache slots it occupies (the bound a test checks)."""
        return [self.slot_pos.shape[1]] * self.n

    def move_slots(self, rows, src, dst) -> None:
        raise SpeclabError("tree drafts need the native backend")


class _Features:
    """Records the requested features of one forward (a context manager): layer i's output, by a hook on
    decoder block i, and -1, the final normed states, by a hook on the LM head's input. HF's
    ``hidden_states`` cannot serve: its last entry is already normed, so the last layer's own output
    (what the native backend returns for it) is not in it."""

    def __init__(self, model, hidden: tuple[int, ...]):
        self.model, self.hidden, self.out, self.handles = model, hidden, {}, []

    def __enter__(self) -> dict[int, torch.Tensor]:
        if not self.hidden:
            return self.out
        blocks = _decoder_layers(self.model) if any(i >= 0 for i in self.hidden) else []
        for i in self.hidden:
            if i == -1:
                head = self.model.get_output_embeddings()
                self.handles.append(head.register_forward_pre_hook(self._keep(-1, first_arg=True)))
            else:
                self.handles.append(blocks[i].register_forward_hook(self._keep(i)))
        return self.out

    def _keep(self, i: int, first_arg: bool = False):
        def pre(module, args):
            self.out[i] = args[0]  # (n, T, C)

        def post(module, args, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output  # (n, T, C)

        return pre if first_arg else post

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
