"""Loading a causal LM (embedded family name, local Hugging Face directory or hub id) and running it
with a KV cache that the decoder can roll back by bookkeeping alone.

Two backends share one contract, :class:`KVCache`::

    logits = cache.forward(tokens, positions, valid, kv_len)   # (B, T) each -> (B, T, V)
    cache.truncate(lengths)                                     # row b keeps positions < lengths[b]

``kv_len`` is max(positions) + 1, known to the caller on the host; each row's positions are
consecutive and real tokens come before padding, so a single row's are kv_len-T .. kv_len-1.

* ``native`` (Llama-architecture models, the embedded family): our own forward over the model's
  weights (shared, not copied) with a static cache of shape (B, H, S, D) per layer. A token at
  position p lives in slot p of its row, so a query at position p attends to slots <= p.
  Rollback is moving the row's length: stale slots are never visible (they sit after the query)
  and are overwritten by the next round.
* ``hf`` (any ``AutoModelForCausalLM``): the model's own forward and cache; every forward appends
  T slots per row, and a 2-D attention mask hides padding and rolled-back slots. Still no copying.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import SpeclabError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------------------------
# Native Llama forward with a static, per-row-indexed KV cache


class StaticKVCache:
    """Per-layer (B, H_kv, S, D) key/value buffers; row b's token at position p lives in slot p."""

    def __init__(self, model: "NativeLlama", batch_size: int, max_len: int):
        cfg = model.cfg
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        w = model.embed
        self.k = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in range(cfg.n_layers)]
        self.model = model
        self.max_len = max_len
        self.rows = torch.arange(batch_size, device=w.device)[:, None]  # (B, 1)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None,
                kv_len: int | None = None, last_only: torch.Tensor | None = None) -> torch.Tensor:
        # padding (valid=False) sits after a row's real tokens, so no real query ever sees it
        # contract (module docstring): kv_len == max(positions) + 1, known on the host: no sync here
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        return self.model(tokens, positions, self, kv_len, last_only)

    def truncate(self, lengths: torch.Tensor) -> None:
        pass  # bookkeeping lives in the decoder's per-row lengths; stale slots are masked by position


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
    if getattr(config, "model_type", None) not in ("llama",):
        return False
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return False
    return getattr(config, "hidden_act", "silu") == "silu" and not getattr(config, "attention_bias", False) \
        and not getattr(config, "mlp_bias", False)


class NativeLlama:
    """A Llama forward written out (gpt-fast style) over the weights of a Hugging Face LlamaForCausalLM."""

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
        # On the CPU, x @ W^T with W^T stored contiguous is measurably faster than F.linear for the
        # few-row matmuls of decoding (MKL picks a better kernel); on CUDA F.linear is already optimal
        # and a transposed copy would double weight memory.
        self.pretransposed = self.embed.device.type == "cpu"
        prep = (lambda w: w.t().contiguous()) if self.pretransposed else (lambda w: w)
        self.lm_head = prep(hf_model.lm_head.weight)  # (C, V) on CPU, (V, C) elsewhere; tied or not
        self.final_norm = m.norm.weight
        self.layers = []
        for layer in m.layers:
            a, f = layer.self_attn, layer.mlp
            # fuse q/k/v and gate/up into one matmul each: fewer kernel launches per token
            wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)  # (Hq*D + 2*Hkv*D, C)
            w13 = torch.cat([f.gate_proj.weight, f.up_proj.weight], 0)  # (2F, C)
            self.layers.append((layer.input_layernorm.weight, prep(wqkv), prep(a.o_proj.weight),
                                layer.post_attention_layernorm.weight, prep(w13), prep(f.down_proj.weight)))
        d = self.cfg.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (D/2,)
        # + headroom: a round may verify up to k+1 <= 33 positions past the last real token
        pos = torch.arange(self.cfg.max_pos + 64, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
        emb = torch.cat([freqs, freqs], -1)  # (P, D)
        dt, dev = self.embed.dtype, self.embed.device
        sin = emb.sin()
        sin[:, : d // 2] = -sin[:, : d // 2]  # pre-signed for _rope
        self.cos, self.sin = emb.cos().to(dev, dt), sin.to(dev, dt)
        self._causal = torch.ones(0, 0, dtype=torch.bool, device=dev)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        if dt == torch.float32:  # the fused op is bit-identical to HF's formula in fp32, and faster
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

    def _lin(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w if self.pretransposed else F.linear(x, w)

    def __call__(self, tokens, positions, cache: StaticKVCache, kv_len: int, last_only=None):
        c = self.cfg
        lin = self._lin
        B, T = tokens.shape
        H, Hkv, D = c.n_heads, c.n_kv_heads, c.head_dim
        x = F.embedding(tokens, self.embed)  # (B, T, C)
        # A single row's positions are always kv_len-T .. kv_len-1 (the caller's contract): slices
        # (views, no kernels) replace the gathers and scatters a ragged batch needs.
        single = B == 1
        p0 = kv_len - T
        if single:
            cos, sin = self.cos[p0:kv_len], self.sin[p0:kv_len]  # (T, D)
            mask = None if T == 1 else self._causal_rows(p0, kv_len)  # (T, S)
        else:
            cos = self.cos[positions][:, None]  # (B, 1, T, D)
            sin = self.sin[positions][:, None]
            slots = torch.arange(kv_len, device=tokens.device)
            mask = (slots[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, S)
        for i, (ln1, wqkv, wo, ln2, w13, w2) in enumerate(self.layers):
            h = self._norm(x, ln1)
            qkv = lin(h, wqkv)  # (B, T, (H + 2 Hkv) D)
            # rotate q and k together: one set of rope kernels per layer
            qk = self._rope(qkv[..., : (H + Hkv) * D].view(B, T, H + Hkv, D).transpose(1, 2), cos, sin)
            q, k = qk[:, :H], qk[:, H:]  # (B, H, T, D), (B, Hkv, T, D)
            v = qkv[..., (H + Hkv) * D :].view(B, T, Hkv, D)  # (B, T, Hkv, D)
            kc, vc = cache.k[i], cache.v[i]
            if single:
                kc[:, :, p0:kv_len] = k
                vc[:, :, p0:kv_len] = v.transpose(1, 2)
            else:  # each row's new keys at its own positions: cache[b, :, positions[b, t]] = k[b, :, t]
                kc[cache.rows, :, positions] = k.transpose(1, 2)
                vc[cache.rows, :, positions] = v
            kk, vv = kc[:, :, :kv_len], vc[:, :, :kv_len]  # (B, Hkv, S, D)
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=Hkv != H)  # (B, H, T, D)
            x = x + lin(y.transpose(1, 2).reshape(B, T, H * D), wo)
            h = self._norm(x, ln2)
            g, u = lin(h, w13).chunk(2, -1)  # (B, T, F) each
            x = x + lin(F.silu(g) * u, w2)
        if last_only is not None:  # prefill: only the logits at each row's last real token
            x = x[torch.arange(B, device=x.device), last_only][:, None]  # (B, 1, C)
        return lin(self._norm(x, self.final_norm), self.lm_head)  # (B, T or 1, V)


# ----------------------------------------------------------------------------------------------
# Generic Hugging Face backend


class HFKVCache:
    """Any AutoModelForCausalLM: append-only slots, stale ones hidden by the attention mask."""

    def __init__(self, model, batch_size: int, max_len: int):
        from transformers import DynamicCache

        self.model = model
        self.max_len = max_len
        self.cache = DynamicCache(config=model.config)
        # transformers renamed past_key_values -> cache; pass whichever this version takes
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        dev = model.device
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long, device=dev)  # (B, slots)
        self.slot_pos = torch.zeros(batch_size, 0, dtype=torch.long, device=dev)  # (B, slots)

    @torch.inference_mode()
    def forward(self, tokens, positions, valid=None, kv_len=None, last_only=None):
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        self.mask = torch.cat([self.mask, valid.long()], 1)
        self.slot_pos = torch.cat([self.slot_pos, positions], 1)
        out = self.model(input_ids=tokens, position_ids=positions, attention_mask=self.mask,
                         use_cache=True, **{self.cache_kw: self.cache})
        logits = out.logits
        if last_only is not None:
            logits = logits[torch.arange(tokens.shape[0], device=logits.device), last_only][:, None]
        return logits

    def truncate(self, lengths: torch.Tensor) -> None:
        self.mask = self.mask * (self.slot_pos < lengths[:, None])


# ----------------------------------------------------------------------------------------------
# The loaded model


class LM:
    """A causal LM with its tokenizer, ready for the decoder."""

    def __init__(self, name: str, path: str, hf_model, tokenizer, backend: str):
        self.name = name
        self.path = path
        self.hf_model = hf_model
        self.tokenizer = tokenizer
        self.config = hf_model.config
        self.device = hf_model.device
        self.dtype = hf_model.dtype
        self.backend = backend
        self.native = NativeLlama(hf_model) if backend == "native" else None
        self.vocab_size = hf_model.get_output_embeddings().weight.shape[0]
        self.max_context = int(getattr(self.config, "max_position_embeddings", 0) or
                               getattr(tokenizer, "model_max_length", 0) or 2048)
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else self.config.eos_token_id
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self._vocab_key = None
        self._token_text: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"LM({self.name!r}, backend={self.backend}, params={self.num_parameters():,})"

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf_model.parameters())

    def new_cache(self, batch_size: int, max_len: int):
        if self.native is not None:
            return StaticKVCache(self.native, batch_size, max_len)
        return HFKVCache(self.hf_model, batch_size, max_len)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        s = self._token_text.get(token)
        if s is None:
            s = self._token_text[token] = self.tokenizer.decode([token])
        return s

    def vocab_map(self) -> dict[str, int]:
        if self._vocab_key is None:
            self._vocab_key = self.tokenizer.get_vocab()
        return self._vocab_key


def _resolve_family(name: str) -> Path | None:
    try:
        from . import family
    except ImportError:
        return None
    try:
        return family.resolve(name)
    except Exception:
        return None


def _family_names() -> list[str]:
    try:
        from . import family

        return [m["name"] for m in family.list_models()]
    except Exception:
        return []


def _check_hub_reachable(spec: str, role: str, timeout: float = 3.0) -> None:
    """Fail in seconds, in one line, when the hub cannot be reached (instead of minutes of retries)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise SpeclabError(f"cannot load {role} model '{spec}': not a shipped model or local directory, not in the "
                           f"local cache, and HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import constants

        url = urlparse(constants.ENDPOINT)
    except Exception:  # noqa: BLE001
        url = urlparse("https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        raise SpeclabError(f"cannot load {role} model '{spec}': not a shipped model or local directory, not in the "
                           f"local cache, and the hub ({host}) is unreachable from here") from None


def load_model(spec: str, *, device: str | torch.device | None = None, dtype: torch.dtype | str | None = None,
               backend: str = "auto", role: str = "model") -> LM:
    """Load an embedded family model by short name, a local HF directory, or a hub id.

    Safetensors only, ``trust_remote_code`` off. Any failure is a one-line :class:`SpeclabError`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a loading bar per model is noise in a CLI, an app and a notebook

    if not spec or not str(spec).strip():
        raise SpeclabError(f"no {role} model given")
    spec = str(spec)
    device = torch.device(device) if device is not None else default_device()
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    fam = _resolve_family(spec)
    if fam is not None:
        source, local, name = str(fam), True, spec
    elif os.path.isdir(os.path.expanduser(spec)):
        source, local, name = os.path.expanduser(spec), True, os.path.basename(os.path.normpath(spec))
    elif HUB_ID.match(spec) and not spec.startswith((".", "/", "~")):
        source, local, name = spec, False, spec
    else:
        known = ", ".join(_family_names()) or "none shipped yet"
        raise SpeclabError(f"unknown {role} model '{spec}': not a shipped model ({known}), "
                           f"not a local directory, not a hub id")
    kw = dict(trust_remote_code=False)
    try:
        try:  # a hub id may already be in the local cache: never touch the network for it
            tok = AutoTokenizer.from_pretrained(source, local_files_only=True, **kw)
            model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, use_safetensors=True,
                                                         dtype=dtype, **kw)
        except Exception:
            if local:
                raise
            _check_hub_reachable(spec, role)
            tok = AutoTokenizer.from_pretrained(source, **kw)
            model = AutoModelForCausalLM.from_pretrained(source, use_safetensors=True, dtype=dtype, **kw)
    except SpeclabError:
        raise
    except Exception as e:  # noqa: BLE001 - any loader failure becomes one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpeclabError(f"cannot load {role} model '{spec}' from {source}: {msg[:300]}") from None
    model.to(device).eval()
    model.requires_grad_(False)
    if backend == "auto":
        backend = "native" if native_supported(model.config) else "hf"
    elif backend == "native" and not native_supported(model.config):
        raise SpeclabError(f"{role} model '{spec}' ({model.config.model_type}) has no native backend; use backend='hf'")
    return LM(name, source, model, tok, backend)


def check_same_tokenizer(target: LM, draft: LM) -> None:
    """Same tokenizer means the same token -> id map; vocab_size alone says nothing (padded heads)."""
    if target.vocab_map() != draft.vocab_map():
        a, b = target.vocab_map(), draft.vocab_map()
        differing = len(set(a.items()) ^ set(b.items()))
        raise SpeclabError(
            f"draft '{draft.name}' and target '{target.name}' use different tokenizers "
            f"({len(b)} vs {len(a)} tokens, {differing} token->id entries differ); "
            f"a draft must share the target's tokenizer")


def context_needed(prompt_len: int, max_new_tokens: int, k: int) -> int:
    """Cache slots a row needs: the prompt, the new tokens, and k+1 slots of headroom for a round."""
    return prompt_len + max_new_tokens + k + 1

