"""EAGLE-3 heads in the ``speculators`` format (vLLM's and SGLang's), both ways.

A speculators directory holds ``config.json`` (``speculators_model_type: "eagle3"``, the decoder layer's Llama
config under ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual``, the target layers
read under ``eagle_aux_hidden_state_layer_ids``, the verifier under ``speculators_config``) and safetensors
weights::

    [fc_norm.{0,1,2}.weight]              optional (``fc_norm``): an RMSNorm per target feature before fc
    fc.weight (C, 3 C) [fc.bias]          the three target features, concatenated, to one (g)
    layers.0.input_layernorm.weight       RMSNorm of the token's embedding
    layers.0.hidden_norm.weight           RMSNorm of g
    layers.0.self_attn.{q,k,v}_proj       on [norm(embedding); norm(g)] (2 C wide), o_proj back to C
    layers.0.post_attention_layernorm, layers.0.mlp.{gate,up,down}_proj
    norm.weight, lm_head.weight (Vd, C)   the head's own LM head over a draft vocabulary of Vd tokens
    d2t (Vd,)                             draft id -> target id offset: target = draft + d2t[draft]
    t2d (V,) bool                         which target ids the draft vocabulary has
                                          (both absent when the draft vocabulary is the target's: vLLM
                                          refuses a d2t there, and the mapping is the identity)
    embed_tokens.weight (V, C)            optional; EAGLE-3 trains with the target's frozen embedding

The residual stream of the layer is g (``norm_before_residual``: the normed g). :class:`Eagle3Head` computes
exactly that and plugs into speclab's :class:`~speclab.drafters.heads.EagleDrafter` (the same fuse / qkv / finish
steps as the family's head, its own LM head), so a published head drafts for a native Llama target here.

The head's rotary embedding is the plain one at its ``rope_theta`` (a ``rope_scaling`` in its layer config is not
applied: that changes how well it drafts, never the output, which the target verifies). The head reads the
target's own token embedding; a shipped ``embed_tokens`` that differs from it is refused.

``eagle_aux_hidden_state_layer_ids`` count as vLLM does: id i is the hidden state *entering* decoder layer i,
i.e. the output of layer i - 1 (speclab's feature index i - 1); without the field, vLLM's default (2, L/2, L-3).

The family's own EAGLE head is not this architecture: it maps [norm(embedding); norm(g)] through a linear layer
to the layer's residual stream and normalises that before attention, where EAGLE-3 attends from the 2 C concat
directly with g as the residual. RMS normalisation is not linear, so no choice of EAGLE-3 weights computes the
family head's function: :func:`save_speculators` refuses it in one line instead of writing a lossy copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SpeclabError
from .heads import HEADS_DIR, EagleHead, FrozenMatmuls, HeadConfig, rms, rope, target_fingerprint

SPECULATORS_VERSION = "0.1.0"


def is_speculators_dir(path) -> bool:
    p = Path(str(path)).expanduser() / "config.json"
    if not p.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(p.read_text())
    except (OSError, ValueError):
        return False


def speculators_dir(spec: str) -> Path | None:
    """The speculators directory a drafter spec names: a shipped head of the family (``eagle3``) or a path."""
    if "/" not in spec and is_speculators_dir(HEADS_DIR / spec):
        return HEADS_DIR / spec
    return Path(spec).expanduser() if is_speculators_dir(spec) else None


def default_aux_ids(num_layers: int) -> list[int]:
    """vLLM's default for EAGLE-3: the states entering layers 2, L // 2 and L - 3."""
    return [2, num_layers // 2, num_layers - 3]


class Eagle3Head(FrozenMatmuls, nn.Module):
    """EAGLE-3's decoder layer with the interface of the family's :class:`EagleHead` (``fuse``, ``qkv``, ``finish``,
    ``out``) and its own LM head (``logits``: draft vocabulary scattered into the target's, -inf elsewhere)."""

    def __init__(self, cfg: HeadConfig, draft_vocab: int, fc_bias: bool = False, norm_before_residual: bool = False,
                 fc_norm: bool = False):
        super().__init__()
        self.cfg = cfg
        C, H, Hkv, D = cfg.hidden, cfg.attn_heads, cfg.kv_heads, cfg.head_dim
        self.norm_before_residual = norm_before_residual
        n = len(cfg.feature_layers)
        self.fc_norm = nn.ParameterList([nn.Parameter(torch.ones(C)) for _ in range(n)]) if fc_norm else None
        self.fc = nn.Linear(len(cfg.feature_layers) * C, C, bias=fc_bias)
        self.input_layernorm = nn.Parameter(torch.ones(C))
        self.hidden_norm = nn.Parameter(torch.ones(C))
        self.q_proj = nn.Linear(2 * C, H * D, bias=False)
        self.k_proj = nn.Linear(2 * C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(2 * C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(C))
        self.gate_proj = nn.Linear(C, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(C, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, C, bias=False)
        self.norm = nn.Parameter(torch.ones(C))
        self.lm_head = nn.Linear(C, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab, dtype=torch.bool))
        self._wt: dict[str, torch.Tensor] = {}
        self._panels: dict[str, torch.Tensor] = {}
        self._identity = False

    def freeze(self) -> None:
        """Inference on a CPU (:class:`~speclab.drafters.heads.FrozenMatmuls`; q, k and v as one matmul, gate and up
        as one); a whole-vocabulary head's identity mapping skips the scatter into the target's vocabulary."""
        self._identity = self.lm_head.weight.shape[0] == self.cfg.vocab and not bool(self.d2t.any())
        self._freeze_matmuls(_MATMULS)

    def _weight(self, name: str) -> torch.Tensor:
        ws = [getattr(self, part).weight for part in _FUSED.get(name, (name,))]
        return ws[0] if len(ws) == 1 else torch.cat(ws, 0)

    def fuse(self, feats: list[torch.Tensor]) -> torch.Tensor:
        """The target's features, one (..., C) per layer -> g (..., C); each feature RMS-normalised first where the
        head has ``fc_norm`` (the target's layers differ in scale), else raw, as most published heads read them."""
        if self.fc_norm is not None:
            feats = [rms(f, self.cfg.eps, w) for f, w in zip(feats, self.fc_norm)]
        g = self._lin(torch.cat(feats, -1), "fc")
        return g if self.fc.bias is None else g + self.fc.bias

    def qkv(self, emb: torch.Tensor, g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """As :meth:`EagleHead.qkv`: -> residual (n, T, C), q (n, H, T, D), k, v (n, Hkv, T, D) (k rotated)."""
        c = self.cfg
        n, T, _ = emb.shape
        H, Hkv, D = c.attn_heads, c.kv_heads, c.head_dim
        g_normed = rms(g, c.eps, self.hidden_norm)
        residual = g_normed if self.norm_before_residual else g
        x = torch.cat([rms(emb, c.eps, self.input_layernorm), g_normed], -1)  # (n, T, 2C)
        qkv = self._lin(x, "qkv")  # (n, T, (H + 2 Hkv) D)
        qk = rope(qkv[..., : (H + Hkv) * D].view(n, T, H + Hkv, D).transpose(1, 2), cos, sin)  # q and k at once
        v = qkv[..., (H + Hkv) * D:].view(n, T, Hkv, D).transpose(1, 2)
        return residual, qk[:, :H], qk[:, H:], v

    def finish(self, x, q, k, v, mask) -> torch.Tensor:
        c = self.cfg
        n, _, T, _ = q.shape
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c.kv_heads != c.attn_heads)
        x = x + self._lin(y.transpose(1, 2).reshape(n, T, -1), "o_proj")
        gate, up = self._lin(rms(x, c.eps, self.post_attention_layernorm), "gate_up").chunk(2, -1)
        return x + self._lin(F.silu(gate) * up, "down_proj")

    def out(self, h: torch.Tensor) -> torch.Tensor:
        return rms(h, self.cfg.eps, self.norm)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., C) -> (..., V) over the target's vocabulary: the draft vocabulary's logits at their target ids."""
        small = self._lin(self.out(h), "lm_head")  # (..., Vd)
        if self._identity:
            return small
        full = small.new_full((*small.shape[:-1], self.cfg.vocab), float("-inf"))
        ids = torch.arange(small.shape[-1], device=small.device) + self.d2t  # (Vd,) target ids
        full[..., ids] = small
        return full


_FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
_MATMULS = ("fc", "qkv", "o_proj", "gate_up", "down_proj", "lm_head")


# ------------------------------------------------------------------------------------------------ load
_NAMES = {  # speculators name -> Eagle3Head name
    "fc.weight": "fc.weight", "fc.bias": "fc.bias",
    "layers.0.input_layernorm.weight": "input_layernorm", "layers.0.hidden_norm.weight": "hidden_norm",
    "layers.0.self_attn.q_proj.weight": "q_proj.weight", "layers.0.self_attn.k_proj.weight": "k_proj.weight",
    "layers.0.self_attn.v_proj.weight": "v_proj.weight", "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm",
    "layers.0.mlp.gate_proj.weight": "gate_proj.weight", "layers.0.mlp.up_proj.weight": "up_proj.weight",
    "layers.0.mlp.down_proj.weight": "down_proj.weight", "norm.weight": "norm", "lm_head.weight": "lm_head.weight",
    "d2t": "d2t", "t2d": "t2d",
}
_NAMES.update({f"fc_norm.{i}.weight": f"fc_norm.{i}" for i in range(3)})
_OPTIONAL = ("fc.bias", "embed_tokens.weight", "d2t", "t2d", *(f"fc_norm.{i}.weight" for i in range(3)))


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise SpeclabError(f"speculators head '{d}' has no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def read_speculators(path, num_target_layers: int) -> tuple[HeadConfig, dict, dict]:
    """config.json -> (HeadConfig, the raw config, the weights); every problem one line."""
    d = Path(str(path)).expanduser()
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SpeclabError(f"cannot read speculators head '{path}': {e}") from None
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise SpeclabError(f"speculators head '{path}' is '{kind}'; speclab loads eagle3 heads")
    layer = raw.get("transformer_layer_config") or {}
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SpeclabError(f"speculators head '{path}' has {layer['num_hidden_layers']} decoder layers; "
                           f"EAGLE-3 has one")
    if raw.get("norm_before_fc"):
        raise SpeclabError(f"speculators head '{path}' normalises its features before fc (norm_before_fc), which "
                           f"speclab does not implement")
    C, H = int(layer["hidden_size"]), int(layer["num_attention_heads"])
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or default_aux_ids(num_target_layers)
    if len(aux) != 3 or min(aux) < 1 or max(aux) > num_target_layers:
        raise SpeclabError(f"speculators head '{path}' reads target layers {aux}; the target has {num_target_layers}")
    rope_theta = float(layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    cfg = HeadConfig(kind="eagle", hidden=C, vocab=int(layer["vocab_size"]), eps=float(layer.get("rms_norm_eps", 1e-5)),
                     feature_layers=tuple(int(i) - 1 for i in aux), attn_heads=H,
                     kv_heads=int(layer.get("num_key_value_heads") or H),
                     head_dim=int(layer.get("head_dim") or C // H), ffn=int(layer["intermediate_size"]),
                     rope_theta=rope_theta,
                     target=((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", ""),
                     meta={"format": "speculators", "draft_vocab_size": int(raw.get("draft_vocab_size") or 0)})
    return cfg, raw, _read_weights(d)


def load_speculators(path, target) -> tuple[Eagle3Head, HeadConfig]:
    """A speculators-format EAGLE-3 head for ``target`` (checked: hidden size, vocabulary, embedding), frozen on
    the target's device and dtype."""
    n_layers = int(getattr(target.config, "num_hidden_layers", 0))
    cfg, raw, w = read_speculators(path, n_layers)
    if raw.get("target_hidden_size") not in (None, cfg.hidden):
        raise SpeclabError(f"speculators head '{path}' has target_hidden_size {raw['target_hidden_size']} and hidden "
                           f"size {cfg.hidden}; speclab runs heads as wide as their target")
    if cfg.hidden != target.hidden_size or cfg.vocab != target.vocab_size:
        raise SpeclabError(f"speculators head '{path}' is for a target with hidden size {cfg.hidden} and vocabulary "
                           f"{cfg.vocab}; '{target.name}' has {target.hidden_size} and {target.vocab_size}")
    _check_fingerprint(path, target)
    missing = [k for k in _NAMES if k not in w and k not in _OPTIONAL]
    if missing:
        raise SpeclabError(f"speculators head '{path}' lacks {', '.join(missing[:4])}")
    emb = w.get("embed_tokens.weight")
    if emb is not None and target.native is not None:
        rows = torch.linspace(0, cfg.vocab - 1, 64).long()
        mine = target.native.embed.weight if hasattr(target.native.embed, "weight") else target.native.embed
        if not torch.allclose(emb[rows].float(), mine[rows].detach().float().cpu(), atol=1e-2, rtol=1e-2):
            raise SpeclabError(f"speculators head '{path}' was trained with an embedding that is not "
                               f"'{target.name}''s (speclab drafts with the target's own embedding)")
    if raw.get("fc_norm") and any(f"fc_norm.{i}.weight" not in w for i in range(3)):
        raise SpeclabError(f"speculators head '{path}' says fc_norm but lacks fc_norm.0-2.weight")
    head = Eagle3Head(cfg, int(w["lm_head.weight"].shape[0]), fc_bias="fc.bias" in w,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      fc_norm=bool(raw.get("fc_norm", False)))
    state = {mine: w[theirs] for theirs, mine in _NAMES.items() if theirs in w}
    if "d2t" not in state:
        if head.lm_head.weight.shape[0] != cfg.vocab:
            raise SpeclabError(f"speculators head '{path}' has a draft vocabulary of {head.lm_head.weight.shape[0]} "
                               f"tokens and no d2t mapping into the target's {cfg.vocab}")
        state["d2t"] = torch.zeros(cfg.vocab, dtype=torch.long)
    state.setdefault("t2d", torch.zeros(cfg.vocab, dtype=torch.bool).index_fill_(
        0, torch.arange(state["d2t"].numel()) + state["d2t"], True))
    head.load_state_dict({k: (v if k in ("d2t", "t2d") else v.float()) for k, v in state.items()})
    head.to(device=target.device, dtype=target.dtype)
    head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
    return head.eval().requires_grad_(False), cfg


def _check_fingerprint(path, target) -> None:
    """A head speclab trained records the target weights it read (the fingerprint in its speclab.json file); other
    weights are refused."""
    try:
        want = json.loads((Path(str(path)).expanduser() / "speclab.json").read_text()).get("target_fingerprint")
    except (OSError, ValueError):
        return
    if want and want != target_fingerprint(target):
        raise SpeclabError(f"speculators head '{path}' was trained on other weights than '{target.name}''s "
                           f"(retrain it with `speclab train --heads`)")


# ------------------------------------------------------------------------------------------------ save
def save_speculators(head, cfg: HeadConfig, directory, verifier: str = "", verifier_architectures=(),
                     num_target_layers: int | None = None, speculative_tokens: int = 3) -> Path:
    """Write an :class:`Eagle3Head` as a speculators directory (config.json + model.safetensors) that
    :func:`load_speculators`, vLLM and SGLang read. The family's own EAGLE head is refused (module docstring)."""
    from safetensors.torch import save_file

    if isinstance(head, EagleHead):
        raise SpeclabError("the family's EAGLE head cannot be written as an EAGLE-3 speculators head without changing "
                           "what it computes: it passes [norm(embedding); norm(g)] through a linear layer and "
                           "normalises the result before attention, where EAGLE-3 attends from that concat directly "
                           "with g as the residual (RMS normalisation is not linear, so no EAGLE-3 weights equal it)")
    if not isinstance(head, Eagle3Head):
        raise SpeclabError(f"save_speculators writes EAGLE-3 heads, not {type(head).__name__}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    inv = {mine: theirs for theirs, mine in _NAMES.items()}
    sd = head.state_dict()
    if head.lm_head.weight.shape[0] == cfg.vocab and not head.d2t.any():  # the identity: vLLM refuses a d2t here
        sd = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    save_file({inv[k]: v.detach().cpu().contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    n_layers = num_target_layers or (max(cfg.feature_layers) + 4)
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden,
             "intermediate_size": cfg.ffn, "num_attention_heads": cfg.attn_heads, "num_key_value_heads": cfg.kv_heads,
             "head_dim": cfg.head_dim, "num_hidden_layers": 1, "rms_norm_eps": cfg.eps, "rope_theta": cfg.rope_theta,
             "vocab_size": cfg.vocab, "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
             "max_position_embeddings": 2048}
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "draft_vocab_size": int(head.lm_head.weight.shape[0]),
        "norm_before_residual": head.norm_before_residual, "fc_norm": head.fc_norm is not None,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.feature_layers],
        "transformer_layer_config": layer, "num_target_layers": n_layers,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier or cfg.target, "architectures": list(verifier_architectures)},
        },
    }
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d


def random_eagle3(target, feature_layers: tuple[int, ...], draft_vocab: int | None = None, ffn: int | None = None,
                  seed: int = 0, scale: float = 0.2) -> tuple[Eagle3Head, HeadConfig]:
    """An untrained EAGLE-3 head shaped for ``target`` (tests, and the step-time benchmark at real shapes): the
    draft vocabulary is the target's first ``draft_vocab`` ids."""
    c = target.config
    H = int(c.num_attention_heads)
    cfg = HeadConfig(kind="eagle", hidden=target.hidden_size, vocab=target.vocab_size,
                     eps=float(getattr(c, "rms_norm_eps", 1e-5)), feature_layers=tuple(feature_layers), attn_heads=H,
                     kv_heads=int(getattr(c, "num_key_value_heads", H) or H),
                     head_dim=int(getattr(c, "head_dim", None) or target.hidden_size // H),
                     ffn=int(ffn or c.intermediate_size), rope_theta=float(getattr(c, "rope_theta", 10000.0) or 1e4),
                     target=target.name)
    Vd = int(draft_vocab or target.vocab_size)
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg, Vd)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
        head.d2t.zero_()
        head.t2d.zero_()
        head.t2d[:Vd] = True
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False), cfg
