"""The generic Hugging Face backend: any architecture of the exactness suite, through the model's
own forward, with a cache the decoder can roll back exactly and that never outgrows its rows.

The model appends every forward's keys and values at the end of its cache (``DynamicCache`` with
plain, non-sliding layers, so nothing is dropped behind our back). We keep, per row, the position
held by every slot (``slot_pos``, -1 = empty) and hand the model a 4-D additive attention mask built
from positions, never from slot indices::

    visible(b, t, s) = slot_pos[b, s] >= 0 and slot_pos[b, s] <= pos[b, t]
                       and (sliding layers) pos[b, t] - slot_pos[b, s] < window

so padding, a ragged batch's gaps and rolled-back slots are invisible, and a sliding window counts
positions (HF's own masks count slots, which is what broke windows under speculation).
:meth:`HFKVCache.commit` then compacts each row: the slots it keeps move down to slot = position and
the cache is cropped to the longest row, so a row holds at most its context plus one round's block.

Trees and early exit are native-only: this backend refuses them with one line.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import SpeclabError
from .native_llama import StepOut

# Architectures the exactness suite (tests/test_architectures.py) covers on this backend.
TESTED_MODEL_TYPES = ("llama", "gpt2", "qwen2", "mistral", "phi3", "gemma2")
# Attention layer types whose cache is a plain list of (key, value) per position.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
_RECURRENT_HINTS = ("ssm", "mamba", "conv_kernel", "linear_conv", "recurrent", "lru_width", "time_step",
                    "attn_layer_indices", "layers_block_type", "hybrid", "linear_num_")


def rollback_problem(config) -> str | None:
    """Why this architecture's cache cannot be rolled back exactly by this backend (None: it can)."""
    mt = getattr(config, "model_type", "?")
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if odd:
        return (f"its layers include {', '.join(odd)}: only attention layers ({', '.join(ATTENTION_LAYER_TYPES)}) "
                f"keep a per-position cache that can be rolled back by length")
    hints = sorted({k for k in vars(config) for h in _RECURRENT_HINTS if h in k.lower()})
    if hints:
        return (f"it has recurrent or hybrid state ({', '.join(hints[:3])}): a recurrent state cannot be rolled "
                f"back to an earlier position without recomputation")
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; speclab decodes causal LMs"
    if mt not in TESTED_MODEL_TYPES:
        return (f"model type '{mt}' is not in speclab's exactness suite (tested: {', '.join(TESTED_MODEL_TYPES)}); "
                f"untested attention variants (chunked, local, cross-layer KV sharing) could decode wrongly")
    return None


def _window(config) -> int | None:
    w = getattr(config, "sliding_window", None)
    return int(w) if w else None


class HFKVCache:
    """A rollback-exact cache over an ``AutoModelForCausalLM`` (see the module docstring)."""

    supports_trees = False
    supports_early_exit = False

    def __init__(self, model, capacity: int, max_len: int):
        from transformers import DynamicCache

        self.model = model
        self.max_len = max_len
        self._new_cache = DynamicCache
        self.cache = None  # DynamicCache over rows 0..n-1
        self.n = 0  # rows held
        params = inspect.signature(model.forward).parameters
        # transformers renamed past_key_values -> cache in some versions: pass whichever it takes
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        cfg = model.config
        self.layer_types = list(getattr(cfg, "layer_types", None) or [])
        self.window = _window(cfg)
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
        windowed = self._additive(causal & (q - sp < self.window))[:, None]
        if self.layer_types:  # per-layer-type masks (Qwen2, Gemma-2: sliding and full layers mixed)
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
        out = self.model(input_ids=tokens, position_ids=pos, attention_mask=self._mask(slot_pos, pos),
                         use_cache=True, output_hidden_states=bool(hidden), **{self.cache_kw: cache})
        if fresh:
            self._append_rows(cache, slot_pos)
        else:
            self.cache, self.slot_pos, self.n = cache, slot_pos, n
        logits = out.logits
        hid = {}
        if hidden:
            hs = out.hidden_states  # (embeddings, layer 0, ..., last layer normed)
            hid = {i: (hs[-1] if i == -1 else hs[i + 1]) for i in hidden}
        if last_only is not None:
            logits = logits[torch.arange(n, device=logits.device), last_only][:, None]
        return StepOut(logits, hid)

    def _layers(self, cache=None):
        return (cache or self.cache).layers

    def _append_rows(self, cache, slot_pos: torch.Tensor) -> None:
        """Rows prefilled in their own cache join the running ones (slot dimensions padded to match)."""
        S = max(self.slot_pos.shape[1], slot_pos.shape[1])

        def pad(x, dim_len, value=0.0):
            if x.shape[-2 if x.dim() == 4 else -1] == dim_len:
                return x
            if x.dim() == 4:
                extra = x.new_zeros(x.shape[0], x.shape[1], dim_len - x.shape[2], x.shape[3])
                return torch.cat([x, extra], 2)
            return torch.cat([x, x.new_full((x.shape[0], dim_len - x.shape[1]), int(value))], 1)

        for mine, theirs in zip(self._layers(), self._layers(cache)):
            mine.keys = torch.cat([pad(mine.keys, S), pad(theirs.keys, S)], 0)
            mine.values = torch.cat([pad(mine.values, S), pad(theirs.values, S)], 0)
        self.slot_pos = torch.cat([pad(self.slot_pos, S, -1), pad(slot_pos, S, -1)], 0)
        self.n = self.slot_pos.shape[0]

    # ------------------------------------------------------------------ bookkeeping
    def commit(self, lengths: torch.Tensor, rows: slice | None = None) -> None:
        """Row b keeps positions < lengths[b]; kept slots move to slot = position; crop to the longest row.

        e.g. a row that held positions 0..9 in slots 0..9 verified 5 tokens appended at slots 12..16
        (positions 10..14; slots 10, 11 were another row's padding) and keeps 2 of them: slots 12, 13
        move to 10, 11, and the cache is cropped to max over rows of lengths.
        """
        if self.cache is None or self.n == 0:
            return
        n = self.n
        lengths = lengths[:n]
        keep = (self.slot_pos >= 0) & (self.slot_pos < lengths[:, None])  # (n, S)
        S_new = int(lengths.max())
        b, s = keep.nonzero(as_tuple=True)
        dst = self.slot_pos[b, s]
        for layer in self._layers():
            for name in ("keys", "values"):
                x = getattr(layer, name)  # (n, H, S, D)
                y = x.new_zeros(x.shape[0], x.shape[1], S_new, x.shape[3])
                y[b, :, dst] = x[b, :, s]
                setattr(layer, name, y)
        sp = torch.arange(S_new, device=self.dev)[None].expand(n, S_new)
        self.slot_pos = torch.where(sp < lengths[:, None], sp, torch.full_like(sp, -1))

    def move_row(self, src: int, dst: int, length: int) -> None:
        for layer in self._layers():
            layer.keys[dst] = layer.keys[src]
            layer.values[dst] = layer.values[src]
        self.slot_pos[dst] = self.slot_pos[src]

    def release(self, n: int) -> None:
        """Keep rows 0..n-1 only (rows past n have left)."""
        if self.cache is None or n >= self.n:
            return
        for layer in self._layers():
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
