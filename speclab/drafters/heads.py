"""Self-drafting heads on the target's own features (trained by ``speclab train --heads``,
:mod:`speclab.family.heads`), and the drafters that use them.

Every head ends in the target's frozen LM head (and reads the target's frozen token embedding), so a
head adds a few hundred thousand parameters, not a model. The features come from the verification
forward the scheduler runs anyway (``Drafter.features``), so no extra target forward is spent.

* :class:`MedusaHeads` (Medusa, Cai et al. 2024): n residual blocks on the final normed feature f_t of
  the last committed position; head i predicts token t+1+i (the LM head itself gives t+1, which is
  already the row's newest token). One pass gives every draft: no sequential draft steps.
* :class:`EagleHead` (EAGLE, Li et al. 2024, with EAGLE-3's fused features and training-time test): one
  Llama decoder layer, autoregressive over (feature of the previous position, embedding of the current
  token). Position p's input is g_{p-1} (the target's fused features at p-1: RMS-normalised mid and final
  layers through a linear map) and x_p; its output h_p stands in for the target's f_p and, through the
  head's norm and the LM head, predicts x_{p+1}. Drafting feeds its own h as the next g. It keeps a
  one-layer KV cache of its own (slot = position, rolled back by length like a draft model's).
* :class:`ExitAdapter`: a residual block and its own norm on the output of the target's layer m, for
  early-exit drafting (:mod:`.early_exit`).

Heads live in ``speclab/family/heads/<name>/`` (``head.json``: config and provenance; ``head.safetensors``:
fp16 weights), and are tied to the target they were trained on (a fingerprint of its weights).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..engine.sampling import logits_to_probs, sample_from_probs
from ..errors import SpeclabError
from ..kernels import few_rows
from .base import DraftContext, Proposal, Verified
from .chain import ChainDraft, greedy_display
from .trees import RowTree, TreeShape, grow_trees, pack_trees

HEADS_DIR = Path(__file__).resolve().parents[1] / "family" / "heads"
KINDS = ("medusa", "eagle", "exit")


@dataclass
class HeadConfig:
    kind: str  # medusa | eagle | exit
    hidden: int
    vocab: int
    eps: float = 1e-5
    n_heads: int = 4  # medusa: heads (tokens t+2 .. t+1+n_heads)
    feature_layers: tuple[int, ...] = (-1,)  # eagle: target layers fused (i = output of layer i, -1 = final)
    attn_heads: int = 4  # eagle's decoder layer
    kv_heads: int = 4
    head_dim: int = 64
    ffn: int = 688
    rope_theta: float = 10000.0
    exit_layer: int = 0  # exit: the adapter reads the output of the target's first ``exit_layer`` layers
    target: str = ""  # name of the target it was trained on
    target_fingerprint: str = ""
    meta: dict = field(default_factory=dict)  # provenance: tokens, steps, seconds, command, metrics

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "HeadConfig":
        d = dict(d)
        d["feature_layers"] = tuple(d.get("feature_layers", (-1,)))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def target_fingerprint(target) -> str:
    """A short hash of the target's weights (embedding, first and last layer norms): a head is only
    valid on the target it was trained against."""
    m = target.hf_model if hasattr(target, "hf_model") else target
    sd = m.state_dict()
    h = hashlib.sha256()
    keys = ("embed_tokens.weight", "norm.weight", "layers.0.mlp.down_proj.weight")
    for key in sorted(k for k in sd if k.endswith(keys)):
        h.update(key.encode())
        h.update(sd[key].detach().float().cpu().numpy().tobytes()[:65536])
    return h.hexdigest()[:16]


def rms(x: torch.Tensor, eps: float, w: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm in float32 (as the target's), optionally scaled by ``w``."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)  # fused
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y * w if w is not None else y


def rope_tables(head_dim: int, theta: float, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and pre-signed sin (P, D) for x * cos + roll(x) * sin: the target's RoPE (native_llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None]  # (P, D/2)
    emb = torch.cat([freqs, freqs], -1)  # (P, D)
    sin = emb.sin()
    sin[:, : head_dim // 2] = -sin[:, : head_dim // 2]
    return emb.cos(), sin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised: the head starts as the identity (Medusa's block)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``n_heads`` residual blocks on final normed features; block i's output goes through the target's
    LM head and predicts the token i+1 places after the one the LM head predicts."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(ResBlock(cfg.hidden) for _ in range(cfg.n_heads))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        """f (..., C) -> (..., n_heads, C) features for the LM head."""
        return torch.stack([blk(f) for blk in self.blocks], -2)


class ExitAdapter(nn.Module):
    """A residual block on the output of the target's layer m, then its own RMSNorm (initialised by
    training from the target's final norm), giving features for the target's LM head."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.block = ResBlock(cfg.hidden)
        self.norm = nn.Parameter(torch.ones(cfg.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(self.block(x), self.cfg.eps, self.norm)


class FrozenMatmuls:
    """The bias-free matmuls of a drafting head, prepared for inference on a CPU by :meth:`_freeze_matmuls`: each
    weight transposed and contiguous (x @ W^T runs faster than F.linear for the few-row matmuls of drafting, as for
    the target's own forward), and packed for the few-row kernel where it runs (kernels/few_rows.c). Unfrozen
    (training, or off the CPU), :meth:`_lin` is ``F.linear``. ``_weight(name)`` gives a matmul's weight (N, K)."""

    _wt: dict[str, torch.Tensor]
    _panels: dict[str, torch.Tensor]

    def _weight(self, name: str) -> torch.Tensor:
        return getattr(self, name).weight

    def _freeze_matmuls(self, names) -> None:
        if self._weight(names[0]).device.type != "cpu":
            return
        self._wt = {name: self._weight(name).t().contiguous() for name in names}
        if few_rows.load() is not None:
            self._panels = {name: few_rows.pack(self._weight(name)) for name in names
                            if few_rows.packable(self._weight(name))}

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        p = self._panels.get(name)
        if p is not None and few_rows.takes(x):
            return few_rows.matmul(x, p)
        wt = self._wt.get(name)
        return x @ wt if wt is not None else F.linear(x, self._weight(name))


class EagleHead(FrozenMatmuls, nn.Module):
    """One decoder layer over [embedding of x_p, g_{p-1}] (see the module docstring). The attention is
    given its keys, values and mask from outside: the training-time test and the drafter's cache (and
    its trees) differ only in which keys a query may see."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        C, H, Hkv, D = cfg.hidden, cfg.attn_heads, cfg.kv_heads, cfg.head_dim
        self.fc_feat = nn.Linear(len(cfg.feature_layers) * C, C, bias=False)
        self.norm_emb = nn.Parameter(torch.ones(C))
        self.norm_feat = nn.Parameter(torch.ones(C))
        self.fc_in = nn.Linear(2 * C, C, bias=False)
        self.ln1 = nn.Parameter(torch.ones(C))
        self.wqkv = nn.Linear(C, (H + 2 * Hkv) * D, bias=False)
        self.wo = nn.Linear(H * D, C, bias=False)
        self.ln2 = nn.Parameter(torch.ones(C))
        self.w13 = nn.Linear(C, 2 * cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, C, bias=False)
        self.norm = nn.Parameter(torch.ones(C))
        self._wt: dict[str, torch.Tensor] = {}
        self._panels: dict[str, torch.Tensor] = {}

    def freeze(self) -> None:
        """Inference on a CPU (:class:`FrozenMatmuls`)."""
        self._freeze_matmuls(("fc_feat", "fc_in", "wqkv", "wo", "w13", "w2"))

    def fuse(self, feats: list[torch.Tensor]) -> torch.Tensor:
        """The target's features at one position, one (..., C) per ``feature_layers`` -> g (..., C)."""
        eps = self.cfg.eps
        return self._lin(torch.cat([rms(f, eps) for f in feats], -1), "fc_feat")

    def qkv(self, emb: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """emb, g (n, T, C), cos/sin broadcastable to (n, 1, T, D) -> residual x (n, T, C), q (n, H, T, D),
        k, v (n, Hkv, T, D) (k rotated)."""
        c = self.cfg
        n, T, _ = emb.shape
        x = self._lin(torch.cat([rms(emb, c.eps, self.norm_emb), rms(g, c.eps, self.norm_feat)], -1), "fc_in")
        qkv = self._lin(rms(x, c.eps, self.ln1), "wqkv")  # (n, T, (H + 2 Hkv) D)
        H, Hkv, D = c.attn_heads, c.kv_heads, c.head_dim
        qk = rope(qkv[..., : (H + Hkv) * D].view(n, T, H + Hkv, D).transpose(1, 2), cos, sin)  # q and k at once
        v = qkv[..., (H + Hkv) * D:].view(n, T, Hkv, D).transpose(1, 2)
        return x, qk[:, :H], qk[:, H:], v  # x (n, T, C), q (n, H, T, D), k, v (n, Hkv, T, D)

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention of q over (k, v) under mask (n or 1, 1, T, S) bool (None: every key), then the MLP ->
        h (n, T, C)."""
        c = self.cfg
        n, _, T, _ = q.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c.kv_heads != c.attn_heads)
        x = x + self._lin(y.transpose(1, 2).reshape(n, T, -1), "wo")
        g, u = self._lin(rms(x, c.eps, self.ln2), "w13").chunk(2, -1)
        return x + self._lin(F.silu(g) * u, "w2")

    def out(self, h: torch.Tensor) -> torch.Tensor:
        """Features for the LM head."""
        return rms(h, self.cfg.eps, self.norm)


MODULES = {"medusa": MedusaHeads, "eagle": EagleHead, "exit": ExitAdapter}


# ----------------------------------------------------------------------------------------------- storage
def save_head(module: nn.Module, cfg: HeadConfig, directory: Path) -> None:
    """``head.json`` + fp16 ``head.safetensors`` (small: shipped in the package)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()},
              str(directory / "head.safetensors"))
    (directory / "head.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")


def head_dir(name: str) -> Path | None:
    """The directory of a shipped head (``heads-eagle``...) or of a head at a path; None if absent."""
    for d in (HEADS_DIR / name, Path(name).expanduser()):
        if (d / "head.json").is_file() and (d / "head.safetensors").is_file():
            return d
    return None


def list_heads() -> list[dict]:
    """Shipped heads: name, kind, parameters, target, and their provenance (an EAGLE-3 head in the speculators
    format: kind "eagle3", its provenance from the directory's speclab.json)."""
    out = []
    if HEADS_DIR.is_dir():
        for d in sorted(HEADS_DIR.iterdir()):
            if (d / "head.json").is_file():
                cfg = HeadConfig.from_json(json.loads((d / "head.json").read_text()))
                out.append({"name": d.name, "kind": cfg.kind, "target": cfg.target, "path": str(d), **cfg.meta})
            elif (d / "config.json").is_file() and (d / "speclab.json").is_file():
                conf, meta = (json.loads((d / f).read_text()) for f in ("config.json", "speclab.json"))
                target = ((conf.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", "")
                out.append({"name": d.name, "kind": conf.get("speculators_model_type", "?"), "target": target,
                            "path": str(d), **{k: v for k, v in meta.items() if k != "target_fingerprint"}})
    return out


def load_head(name: str, target) -> tuple[nn.Module, HeadConfig]:
    """A trained head, checked against ``target`` (same weights it was trained on), on the target's
    device and dtype, frozen."""
    from safetensors.torch import load_file

    d = head_dir(name)
    if d is None:
        have = ", ".join(h["name"] for h in list_heads()) or "none shipped"
        raise SpeclabError(f"no trained head '{name}' (shipped: {have}; train with `speclab train --heads`)")
    cfg = HeadConfig.from_json(json.loads((d / "head.json").read_text()))
    if cfg.kind not in MODULES:
        raise SpeclabError(f"head '{name}' has unknown kind '{cfg.kind}'")
    if cfg.hidden != target.hidden_size or cfg.vocab != target.vocab_size:
        raise SpeclabError(f"head '{name}' was trained for a target with hidden size {cfg.hidden} and vocabulary "
                           f"{cfg.vocab}; '{target.name}' has {target.hidden_size} and {target.vocab_size}")
    if cfg.target_fingerprint and cfg.target_fingerprint != target_fingerprint(target):
        raise SpeclabError(f"head '{name}' was trained on target '{cfg.target}', not on these weights of "
                           f"'{target.name}' (retrain it with `speclab train --heads`)")
    module = MODULES[cfg.kind](cfg)
    module.load_state_dict({k: v.float() for k, v in load_file(str(d / "head.safetensors")).items()})
    module.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
    return module, cfg


def _native(target, what: str):
    if getattr(target, "native", None) is None:
        raise SpeclabError(f"{what} needs the native backend; target '{target.name}' runs on '{target.backend}'")
    return target.native


# ----------------------------------------------------------------------------------------------- Medusa
class MedusaDrafter:
    """Drafts from the final feature of each row's last committed position: head i gives draft i (a
    chain of up to ``n_heads``), or a tree over the heads' top candidates (static: cartesian top-k per
    depth; dynamic: by cumulative probability)."""

    features = (-1,)

    def __init__(self, target, heads: MedusaHeads, cfg: HeadConfig, tree: TreeShape | None = None, name="medusa"):
        self.native = _native(target, "Medusa drafting")
        self.heads, self.cfg = heads, cfg
        self.tree = tree if tree is not None else TreeShape()
        depth = min(self.tree.depth or cfg.n_heads, cfg.n_heads)  # no head beyond the last
        self.tree = dataclasses.replace(self.tree, depth=depth)
        self.name = name + (":" + self.tree.label() if self.tree.is_tree else "")
        self.last: torch.Tensor | None = None  # (R, C) the feature of each row's last committed position

    def reset(self, capacity: int, max_len: int) -> None:
        self.last = torch.zeros(capacity, self.cfg.hidden, dtype=self.native.embed.dtype,
                                device=self.native.embed.device)

    def _room(self, rows: int) -> None:
        if rows > self.last.shape[0]:
            self.last = torch.cat([self.last, self.last.new_zeros(rows - self.last.shape[0], self.last.shape[1])])

    def admit(self, ctx: DraftContext, rows: range, features) -> None:
        self._room(rows.stop)
        f = features[-1]  # (m, T, C)
        last = torch.tensor([ctx.host_lengths[b] - 2 for b in rows], device=f.device)  # the prompt's last token
        self.last[rows.start:rows.stop] = f[torch.arange(len(rows), device=f.device), last]

    def commit(self, ctx: DraftContext, verified: Verified) -> None:
        n = ctx.n
        f = verified.features[-1]  # (n, T, C) over the block
        at = verified.kept - 1  # (n,) the last committed token's index among the kept ones
        if verified.path is not None:
            at = verified.path.gather(1, at[:, None]).squeeze(1)
        self.last[:n] = f[torch.arange(n, device=f.device), at]

    def move_row(self, src: int, dst: int) -> None:
        self.last[dst] = self.last[src]

    def release(self, n: int) -> None:
        pass

    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n = ctx.n
        logits = self.native.head(self.heads(self.last[:n]))  # (n, n_heads, V)
        if self.tree.is_tree:
            probs = logits_to_probs(logits, params)  # (n, H, V)

            def expand(pools: list[RowTree], frontier: list[list[int]]) -> torch.Tensor:
                # head d's distribution for the children of any node at depth d (Medusa's trees are cartesian)
                F_ = max(len(f) for f in frontier)
                at = torch.zeros(n, F_, dtype=torch.long)
                for b in range(n):
                    for j, node in enumerate(frontier[b]):
                        at[b, j] = pools[b].depth[node]
                return probs.gather(1, at.to(probs.device)[..., None].expand(-1, -1, probs.shape[-1]))

            budgets = [self.tree.budget(k) for k in ks]
            pools, chosen = grow_trees(self.tree, budgets, probs[:, 0], expand)
            tokens, parents, lengths, tp = pack_trees(pools, chosen, ctx.tokens.device)
            return Proposal(tokens, lengths, None, tp, parents)
        k = min(max(ks), self.cfg.n_heads)
        logits = logits[:, :k]
        tokens = logits.argmax(-1)  # (n, k)
        probs = tprobs = None
        if not params.all_greedy:
            probs = logits_to_probs(logits, params)  # (n, k, V): head i's distribution, draft i's
            drawn = sample_from_probs(probs, uniform[:, :k])
            tokens = torch.where(params.greedy[:, None], tokens, drawn)
            tprobs = probs.gather(2, tokens[..., None]).squeeze(-1)
        elif want_probs:
            tprobs = greedy_display(list(logits.unbind(1)), tokens)
        lengths = torch.tensor([min(kb, k) for kb in ks], device=tokens.device)
        if stop is not None:  # a policy may end a row's draft before token i (checked in order, as a chain)
            dist = probs if probs is not None else logits_to_probs(logits, params)  # (n, k, V)
            for i in range(k):
                halt = stop(i, dist[:, i]) & (lengths > i)
                lengths = torch.where(halt, torch.full_like(lengths, i), lengths)
        return Proposal(tokens, lengths, probs, tprobs)


# ----------------------------------------------------------------------------------------------- EAGLE
class EagleDrafter:
    """The EAGLE head as a drafter. Per row (slot p of its cache = position p; ``hlen`` positions hold
    keys computed from the target's true features):

        admit     positions 0 .. P-1 of the prompt (g_{-1} = 0); g_{P-1} is kept pending
        propose   catch up positions hlen .. L-1 with the pending true features, then draft from h_{L-1}:
                  a chain (one step per token, its keys above L, stale afterwards) or a tree (each level
                  one step over the expanded candidates, their keys above L, seen only by descendants)
        commit    the target's features of the committed tokens become the pending g's; ``hlen`` stays L:
                  positions >= L were computed from the head's own (predicted) features

    so the head re-reads every accepted token with the target's real features one round later, the rule
    EAGLE uses."""

    def __init__(self, target, head: EagleHead, cfg: HeadConfig, tree: TreeShape | None = None, name="eagle"):
        self.native = _native(target, "EAGLE drafting")
        self.head, self.cfg = head, cfg
        head.freeze()
        self.features = tuple(cfg.feature_layers)
        self.tree = tree if tree is not None else TreeShape()
        self.name = name + (":" + self.tree.label() if self.tree.is_tree else "")
        self.k = self.v = None
        self.hlen: list[int] = []
        self.pend: torch.Tensor | None = None  # (R, W, C) fused features g for positions hlen-1 ...
        self.pend_len: list[int] = []
        self.cos = self.sin = None

    # ---- state
    def reset(self, capacity: int, max_len: int) -> None:
        c, dev, dt = self.cfg, self.native.embed.device, self.native.embed.dtype
        grow = (self.tree.nodes or 32) * (self.tree.width if self.tree.kind == "dynamic" else 1) + 34
        self.slots = max_len + grow  # + the scratch room of a chain or a tree above the row's length
        shape = (capacity, c.kv_heads, self.slots, c.head_dim)
        self.k = torch.zeros(shape, dtype=dt, device=dev)
        self.v = torch.zeros(shape, dtype=dt, device=dev)
        self.hlen = [0] * capacity
        self.pend = torch.zeros(capacity, 8, c.hidden, dtype=dt, device=dev)
        self.pend_len = [0] * capacity
        cos, sin = rope_tables(c.head_dim, c.rope_theta, self.slots + 1)
        self.cos, self.sin = cos.to(dev, dt), sin.to(dev, dt)

    def _room(self, rows: int, width: int = 0) -> None:
        R = self.k.shape[0]
        if rows > R:
            grow = rows - R
            self.k = torch.cat([self.k, self.k.new_zeros(grow, *self.k.shape[1:])])
            self.v = torch.cat([self.v, self.v.new_zeros(grow, *self.v.shape[1:])])
            self.pend = torch.cat([self.pend, self.pend.new_zeros(grow, *self.pend.shape[1:])])
            self.hlen += [0] * grow
            self.pend_len += [0] * grow
        if width > self.pend.shape[1]:
            self.pend = torch.cat([self.pend, self.pend.new_zeros(self.pend.shape[0], width - self.pend.shape[1],
                                                                  self.pend.shape[2])], 1)

    def move_row(self, src: int, dst: int) -> None:
        h = self.hlen[src]
        self.k[dst, :, :h] = self.k[src, :, :h]
        self.v[dst, :, :h] = self.v[src, :, :h]
        self.pend[dst] = self.pend[src]
        self.hlen[dst], self.pend_len[dst] = h, self.pend_len[src]

    def release(self, n: int) -> None:
        pass

    def _fuse(self, features: dict, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Fused g over the block (n, T, C), or at block indices ``idx`` (n, m)."""
        fs = []
        for layer in self.cfg.feature_layers:
            f = features[layer]
            if idx is not None:
                f = f.gather(1, idx.clamp(min=0)[..., None].expand(-1, -1, f.shape[-1]))
            fs.append(f)
        return self.head.fuse(fs)

    # ---- one head step over Q new positions per row
    def _step(self, tokens: torch.Tensor, g: torch.Tensor, pos: torch.Tensor | None, slots: torch.Tensor | None,
              mask: torch.Tensor | None, kv_len: int, r0: int = 0, slot0: int | None = None,
              pos0: int | None = None) -> torch.Tensor:
        """Rows r0 .. r0+n-1: tokens (n, Q), g (n, Q, C), positions (n, Q) for RoPE, cache slots (n, Q) to
        write, mask (n, Q, kv_len) bool over cache slots (None: every slot < kv_len) -> h (n, Q, C).
        One row whose slots (positions) are slot0 .. slot0+Q-1 (pos0 ..), known on the host: slices, no
        gathers or scatters (the chain's steps: a draft step costs a few dozen small ops, each one counts)."""
        n, Q = tokens.shape
        if pos0 is not None and n == 1:
            cos, sin = self.cos[pos0:pos0 + Q], self.sin[pos0:pos0 + Q]  # (Q, D) views
        else:
            cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # (n, 1, Q, D)
        x, q, k, v = self.head.qkv(self.native.embed_tokens(tokens), g, cos, sin)
        kc, vc = self.k[r0:r0 + n], self.v[r0:r0 + n]  # views
        if slot0 is not None and n == 1:
            kc[:, :, slot0:slot0 + Q] = k
            vc[:, :, slot0:slot0 + Q] = v
        else:
            r = torch.arange(n, device=tokens.device)[:, None]  # (n, 1)
            kc[r, :, slots] = k.transpose(1, 2)  # (n, Q, Hkv, D) into (n, Hkv, S, D) at each row's slots
            vc[r, :, slots] = v.transpose(1, 2)
        return self.head.finish(x, q, kc[:, :, :kv_len], vc[:, :, :kv_len], None if mask is None else mask[:, None])

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        own = getattr(self.head, "logits", None)  # a head with its own LM head (EAGLE-3's draft vocabulary)
        return own(h) if own is not None else self.native.head(self.head.out(h))

    # ---- protocol
    @torch.inference_mode()
    def admit(self, ctx: DraftContext, rows: range, features) -> None:
        self._room(rows.stop)
        m, dev = len(rows), ctx.tokens.device
        P = [ctx.host_lengths[b] - 1 for b in rows]  # prompt lengths: the newest token is the first generated
        T = max(P)
        g = self._fuse(features)[:, :T]  # (m, T, C) g_p for p < T
        g_in = torch.cat([g.new_zeros(m, 1, g.shape[-1]), g[:, :T - 1]], 1)  # position p reads g_{p-1}
        pos = torch.arange(T, device=dev)[None].expand(m, T)  # (m, T)
        mask = pos[:, :, None] >= torch.arange(T, device=dev)[None, None]  # (m, T, T) causal
        self._step(ctx.tokens[rows.start:rows.stop, :T], g_in, pos, pos, mask, T, r0=rows.start)
        self._room(rows.stop, 1)
        for i, b in enumerate(rows):
            self.hlen[b] = P[i]
            self.pend[b, 0] = g[i, P[i] - 1]
            self.pend_len[b] = 1

    @torch.inference_mode()
    def commit(self, ctx: DraftContext, verified: Verified) -> None:
        n = ctx.n
        kept = verified.kept.tolist()
        m = max(kept)
        if verified.path is not None:  # a tree: the committed tokens' block indices
            g = self._fuse(verified.features, verified.path[:, :m])  # (n, m, C)
        else:  # a chain: the block's first m tokens
            g = self.head.fuse([verified.features[layer][:, :m] for layer in self.cfg.feature_layers])
        start = verified.start.tolist()
        offs = [start[b] - (self.hlen[b] - 1) for b in range(n)]  # 0 unless this row skipped a propose
        self._room(n, max(o + kb for o, kb in zip(offs, kept)))
        for b in range(n):
            self.pend[b, offs[b]:offs[b] + kept[b]] = g[b, :kept[b]]
            self.pend_len[b] = offs[b] + kept[b]

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, ks, params, uniform, want_probs, stop=None) -> Proposal:
        n, dev = ctx.n, ctx.tokens.device
        L = ctx.host_lengths
        # catch up: positions hlen .. L-1 with the pending true features (right-padded to the widest row)
        w = [L[b] - self.hlen[b] for b in range(n)]
        if any(w[b] != self.pend_len[b] for b in range(n)):
            raise SpeclabError("EAGLE drafter out of step with the scheduler (features missing for a round)")
        W = max(w)
        kv = max(L)
        one = n == 1
        if one:  # one row: slices
            pos = torch.arange(self.hlen[0], L[0], device=dev)[None]  # (1, W)
            toks, g = ctx.tokens[:1, self.hlen[0]:L[0]], self.pend[:1, :W]
        else:
            hl = torch.tensor(self.hlen[:n], device=dev)
            # a shorter row's padding repeats its last real entry (same slot, same inputs, same K/V written)
            j = torch.minimum(torch.arange(W, device=dev)[None], torch.tensor(w, device=dev)[:, None] - 1)  # (n, W)
            pos = hl[:, None] + j  # (n, W)
            toks = ctx.tokens[:n].gather(1, pos)  # (n, W)
            g = self.pend[:n].gather(1, j[..., None].expand(-1, -1, self.pend.shape[-1]))  # (n, W, C)
        # causal by position (one row catching up one token sees every slot < kv: no mask)
        mask = None if one and W == 1 else torch.arange(kv, device=dev)[None, None] <= pos[:, :, None]  # (n, W, kv)
        h0 = self.hlen[0] if one else None
        h = self._step(toks, g, pos, pos, mask, kv, slot0=h0, pos0=h0)[:, -1]  # (n, C) h_{L-1}
        for b in range(n):
            self.hlen[b], self.pend_len[b] = L[b], 0
        h_root = h
        root_logits = self._logits(h_root)  # (n, V) for position L
        if self.tree.is_tree:
            return self._tree(ctx, ks, params, h_root, root_logits)
        return self._chain(ctx, ks, params, uniform, want_probs, stop, h_root, root_logits)

    def _chain(self, ctx, ks, params, uniform, want_probs, stop, h, logits) -> Proposal:
        dev = ctx.tokens.device
        k = max(ks)
        kv0 = max(ctx.host_lengths)
        one = ctx.n == 1
        L = None if one else torch.tensor(ctx.host_lengths, device=dev)
        chain = ChainDraft(ks, params, uniform, want_probs, stop, dev)
        for i in range(k):
            tok, go_on = chain.step(logits)
            if i == k - 1 or not go_on:
                break
            # position L+i: (h_{L-1+i}, d_{i+1}); it sees the row's committed slots and the draft's own above L
            if one:  # one row: every slot below kv is its own
                h = self._step(tok[:, None], h[:, None], None, None, None, kv0 + i + 1, slot0=kv0 + i,
                               pos0=kv0 + i)[:, 0]
            else:
                p_i = (L + i)[:, None]  # (n, 1)
                mask = torch.arange(kv0 + i + 1, device=dev)[None, None] <= p_i[:, :, None]  # (n, 1, S)
                h = self._step(tok[:, None], h[:, None], p_i, p_i, mask, kv0 + i + 1)[:, 0]
            logits = self._logits(h)
        return chain.proposal()

    def _tree(self, ctx, ks, params, h_root, root_logits) -> Proposal:
        n, dev = ctx.n, ctx.tokens.device
        L = ctx.host_lengths
        hs: list[dict[int, torch.Tensor]] = [{} for _ in range(n)]  # pool index -> h of an expanded candidate
        slot_of: list[dict[int, int]] = [{} for _ in range(n)]  # pool index -> scratch slot (L + order)

        def expand(pools: list[RowTree], frontier: list[list[int]]) -> torch.Tensor:
            # built on the host in lists, then one tensor each (per-element tensor writes cost more than the step)
            Fm = max(len(f) for f in frontier)
            used = [len(s) for s in slot_of]  # scratch slots taken so far per row (L + 0, L + 1, ...)
            kv = max(L[b] + used[b] for b in range(n)) + Fm
            toks, pos, slots, gsrc = [], [], [], []
            mask = np.zeros((n, Fm, kv), dtype=bool)
            for b in range(n):
                pool = pools[b]
                mask[b, :, :L[b]] = True  # the row's committed positions
                for j in range(Fm):
                    sl = L[b] + used[b] + j
                    slots.append(sl)
                    if j >= len(frontier[b]):  # padding: its own scratch slot, seen by nothing real
                        toks.append(0)
                        pos.append(L[b])
                        gsrc.append(h_root[b])
                        mask[b, j, sl] = True
                        continue
                    node = frontier[b][j]
                    par = pool.parents[node]
                    toks.append(pool.tokens[node])
                    gsrc.append(hs[b][par] if par >= 0 else h_root[b])
                    pos.append(L[b] - 1 + pool.depth[node])
                    slot_of[b][node] = sl
                    a = node
                    while a >= 0:  # itself and its ancestors (all expanded before it)
                        mask[b, j, slot_of[b][a]] = True
                        a = pool.parents[a]
            shape = (n, Fm)
            h = self._step(torch.tensor(toks, device=dev).view(shape), torch.stack(gsrc).view(n, Fm, -1),
                           torch.tensor(pos, device=dev).view(shape), torch.tensor(slots, device=dev).view(shape),
                           torch.from_numpy(mask).to(dev), kv, slot0=L[0] + used[0] if n == 1 else None)  # (n, Fm, C)
            for b in range(n):
                for j, node in enumerate(frontier[b]):
                    hs[b][node] = h[b, j]
            return logits_to_probs(self._logits(h), params)  # (n, Fm, V)

        budgets = [self.tree.budget(k) for k in ks]
        pools, chosen = grow_trees(self.tree, budgets, logits_to_probs(root_logits, params), expand)
        tokens, parents, lengths, tp = pack_trees(pools, chosen, dev)
        return Proposal(tokens, lengths, None, tp, parents)
