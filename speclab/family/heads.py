"""Train the self-drafting heads (:mod:`speclab.drafters.heads`) on the shipped, frozen target.

    speclab train --heads                       # every head in HEAD_SPECS
    speclab train --heads --only eagle          # one of them
    speclab train --heads --only eagle --minutes-scale 0.5

Data: the family corpus and its token streams (``train.corpus_data``, cached in ``--runs``), batches
drawn like the drafts' (a quarter copy-heavy rows, a third code rows), encoded with the target's own
tokenizer. Labels: the target's own soft next-token distributions (distillation, KL(target || head)),
computed by a frozen target forward on the same batch, which also gives the features the heads read.
Every number (steps, batches, initial weights) derives from the spec and the seed: a rerun with the same
seed reproduces the shipped heads (up to float non-associativity across machines). Checkpoints go to
``runs/heads/<name>/`` and an interrupted run resumes from them.

* **medusa**: 4 heads; head i's loss is KL to the target's distribution i+1 positions later, weighted 0.8^i.
* **eagle**: the training-time test of EAGLE-3 over ``ttt`` steps: step 1 reads the target's true
  features of the previous position; step j reads the head's own step j-1 output there and attends to
  what the drafting chain will have (true keys up to p-j+1, its own earlier steps' keys at p-j+2 .. p);
  step j's loss (weight 0.8^(j-1)) is KL to the target's distribution at p.
* **eagle3**: the same training-time test for EAGLE-3's own layer (:class:`~speclab.drafters.speculators.Eagle3Head`:
  attention straight from [norm(embedding); norm(g)], g the residual, each target feature RMS-normalised before
  fc), on the raw outputs of layers 1, 3 and 5 (vLLM's auxiliary hidden states 2, 4 and 6), with the target's
  LM head frozen as its own. It is written in the ``speculators`` format, so vLLM serves the family with it too.
* **exit-m**: the early-exit adapter on the output of the target's first m layers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import FAMILY_DIR, MANIFEST
from .data import batch_at, corpus_data
from .model_dir import load_model_dir
from .specs import DRAFT_CODE, DRAFT_COPY, RunSettings, bf16_setting, fraction_at, lr_at
from .tokenizer import load_tokenizer_file

RUNS = Path("runs/heads")


@dataclass(frozen=True)
class HeadSpec:
    name: str  # directory under speclab/family/heads/
    kind: str  # medusa | eagle | eagle3 | exit
    tokens: int  # training tokens
    lr: float
    batch: int = 8
    seq: int = 256
    warmup: int = 50
    weight_decay: float = 0.0
    n_heads: int = 4  # medusa
    feature_layers: tuple[int, ...] = (1, 3, -1)  # eagle: low, mid and final (normed) features
    ttt: int = 3  # eagle: training-time-test steps
    exit_layer: int = 3  # exit
    copy_schedule: tuple = DRAFT_COPY
    code_schedule: tuple = DRAFT_CODE
    # installed packages whose sources are the code rows instead of the corpus's standard library (code the
    # target never saw, as users' code is)
    code_packages: tuple[str, ...] = ()
    # rows of the target's own greedy text (speclab.family.selfgen): their share of a batch by step, and how
    # many distinct rows; their prompts come from the corpus's general and code streams and, in turn, from the
    # sources of ``prompt_packages``
    self_schedule: tuple = ()
    self_rows: int = 0
    prompt_packages: tuple[str, ...] = ()
    chars_per_package: int = 1_500_000

    def _fields(self) -> dict:
        """The spec as hashed: the data options at their defaults are left out, so the keys of heads trained
        before those options existed still name the same recipe."""
        d = asdict(self)
        for f in ("code_packages", "self_schedule", "self_rows", "prompt_packages", "chars_per_package"):
            if d[f] == HeadSpec.__dataclass_fields__[f].default:
                d.pop(f)
        return d

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self._fields(), sort_keys=True).encode()).hexdigest()[:12]

    def resume_key(self) -> str:
        d = self._fields()
        d.pop("tokens")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


# Code the target never saw, for the recipes below: widely used pure-Python projects that a speclab installation
# carries, none of them a source of the held-out workloads (scripts/build_heldout.py) or a validation package.
HEAD_CODE_PACKAGES = ("numpy", "pandas", "sympy", "networkx", "torch", "transformers", "huggingface_hub",
                      "gradio", "fastapi", "pydantic", "tornado", "IPython", "jedi", "parso", "setuptools", "pip",
                      "rich", "typer", "uvicorn", "prompt_toolkit", "psutil", "yaml", "playwright")
# code that no head trains on and no evaluation reports: where a head's choices are compared
VALIDATION_PACKAGES = ("tqdm", "jupyter_client", "prometheus_client", "platformdirs")

HEAD_SPECS: list[HeadSpec] = [
    HeadSpec("eagle", "eagle", tokens=2_000_000, lr=2e-3),
    HeadSpec("eagle3", "eagle3", tokens=2_000_000, lr=2e-3, feature_layers=(1, 3, 5)),
    HeadSpec("medusa", "medusa", tokens=1_500_000, lr=2e-3),
    HeadSpec("exit-3", "exit", tokens=600_000, lr=2e-3, exit_layer=3),
]


# Other recipes for the EAGLE head, trained only when named (``--only``), never by a bare ``--heads``; each
# accepted less than ``eagle`` on the family's and the held-out workloads (docs/heads.md, "Other recipes").
RECIPE_SPECS: list[HeadSpec] = [
    # half the rows code from other projects
    HeadSpec("eagle-packages", "eagle", tokens=2_000_000, lr=2e-3, code_schedule=((0, 0.5),),
             code_packages=HEAD_CODE_PACKAGES),
    # half the rows the target's own greedy text, prompted from the corpus and from other projects' code
    HeadSpec("eagle-selfgen", "eagle", tokens=2_000_000, lr=2e-3, code_schedule=((0, 0.125),),
             self_schedule=((0, 0.5),), self_rows=3072, prompt_packages=HEAD_CODE_PACKAGES),
]


@dataclass
class HeadTrainConfig(RunSettings):
    threads: int = 1
    eval_tokens: int = 60_000
    target: str = "target"
    out_dir: Path = FAMILY_DIR / "heads"
    runs_dir: Path = RUNS
    data_dir: Path = Path("runs/family")
    log_every: int = 50
    specs: list[HeadSpec] = field(default_factory=lambda: list(HEAD_SPECS))


# ----------------------------------------------------------------------------------------------- losses
def kl(t_logp: torch.Tensor, logits: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Mean KL(target || head) over positions; t_logp, logits (..., V); keep (...) bool."""
    s_logp = F.log_softmax(logits.float(), -1)
    per = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # (...,)
    return per[keep].mean() if keep is not None else per.mean()


def ttt_mask(T: int, j: int, device=None) -> torch.Tensor:
    """(T, j*T) bool: which keys step j's query at position p sees (keys laid out [step 1 | ... | step j]).

    Step 1 keys (true features) at positions <= p - j + 1, and step i's key (2 <= i <= j) at p - (j - i):
    the keys the drafting chain has when its j-th draft step runs at position p. e.g. j = 2, p = 5: true
    keys 0..4 and its own step-2 key at 5."""
    p = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(T, device=device)[None]  # (1, T)
    blocks = [s <= p - j + 1] + [s == p - (j - i) for i in range(2, j + 1)]
    return torch.cat(blocks, 1)


def shift(x: torch.Tensor) -> torch.Tensor:
    """Position p reads x at p - 1 (zeros at 0): (B, T, C)."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)


def eagle_losses(head, emb: torch.Tensor, feats: list[torch.Tensor], lm_w: torch.Tensor, t_logp: torch.Tensor,
                 steps: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, list[float], list[float]]:
    """The training-time test. emb (B, T, C) token embeddings, feats the target's features (B, T, C) per
    fused layer, t_logp (B, T, V) the target's log-distributions. Returns the weighted loss, per-step
    losses and per-step top-1 agreement with the target."""
    B, T, _ = emb.shape
    g = shift(head.fuse(feats))  # (B, T, C): position p reads the true g_{p-1}
    keys, vals = [], []
    total, losses, agree = 0.0, [], []
    t_arg = t_logp.argmax(-1)  # (B, T)
    h = None
    for j in range(1, steps + 1):
        x, q, k, v = head.qkv(emb, g if j == 1 else shift(h), cos, sin)
        keys.append(k)
        vals.append(v)
        mask = ttt_mask(T, j, emb.device)[None, None]  # (1, 1, T, j*T)
        h = head.finish(x, q, torch.cat(keys, 2), torch.cat(vals, 2), mask)  # (B, T, C)
        logits = F.linear(head.out(h), lm_w)  # (B, T, V)
        keep = torch.zeros(B, T, dtype=torch.bool, device=emb.device)
        keep[:, j - 1:] = True  # a chain of j steps starts from a true position >= 0
        loss = kl(t_logp, logits, keep)
        total = total + 0.8 ** (j - 1) * loss
        losses.append(loss.item())
        agree.append((logits.argmax(-1) == t_arg)[keep].float().mean().item())
    return total, losses, agree


def medusa_losses(heads, f: torch.Tensor, lm_w: torch.Tensor, t_logp: torch.Tensor):
    """f (B, T, C) final features; head i (0-based) at t is scored against the target's distribution at
    t + 1 + i (the token after the next i+1 ones)."""
    T = f.shape[1]
    hs = heads(f)  # (B, T, H, C)
    total, losses, agree = 0.0, [], []
    for i in range(hs.shape[2]):
        logits = F.linear(hs[:, : T - 1 - i, i], lm_w)  # (B, T-1-i, V)
        tl = t_logp[:, 1 + i:]
        loss = kl(tl, logits)
        total = total + 0.8 ** i * loss
        losses.append(loss.item())
        agree.append((logits.argmax(-1) == tl.argmax(-1)).float().mean().item())
    return total, losses, agree


def exit_losses(adapter, x: torch.Tensor, lm_w: torch.Tensor, t_logp: torch.Tensor):
    logits = F.linear(adapter(x), lm_w)
    loss = kl(t_logp, logits)
    return loss, [loss.item()], [(logits.argmax(-1) == t_logp.argmax(-1)).float().mean().item()]


# ----------------------------------------------------------------------------------------------- training
def hf_feature(hidden_states, layer: int):
    """HF's hidden_states[i] is the input of layer i (hidden_states[-1]: the final normed output); the
    drafters' layer index i is the output of layer i (-1: final, normed)."""
    return hidden_states[-1] if layer == -1 else hidden_states[layer + 1]


def _head_config(spec: HeadSpec, target, fingerprint: str, name: str):
    from ..drafters.heads import HeadConfig

    c = target.config
    kind = "eagle" if spec.kind == "eagle3" else spec.kind  # an EAGLE-3 layer drafts through the EAGLE drafter
    return HeadConfig(kind=kind, hidden=c.hidden_size, vocab=target.lm_head.weight.shape[0], eps=c.rms_norm_eps,
                      n_heads=spec.n_heads, feature_layers=tuple(spec.feature_layers),
                      attn_heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                      head_dim=c.hidden_size // c.num_attention_heads, ffn=c.intermediate_size,
                      rope_theta=float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
                      exit_layer=spec.exit_layer, target=name, target_fingerprint=fingerprint)


def _new_eagle3(hcfg, target):
    """EAGLE-3's layer over the whole vocabulary, its LM head the target's (frozen): vLLM reads the head's own."""
    from ..drafters.speculators import Eagle3Head

    module = Eagle3Head(hcfg, hcfg.vocab, fc_norm=True)
    with torch.no_grad():
        module.lm_head.weight.copy_(target.lm_head.weight.detach().float())
        module.t2d.fill_(True)
        module.norm.copy_(target.model.norm.weight.detach().float())
        module.o_proj.weight.mul_(0.1)  # the residual branches start small
        module.down_proj.weight.mul_(0.1)
    module.lm_head.weight.requires_grad_(False)
    return module


def _new_module(spec: HeadSpec, hcfg, target, seed: int):
    from ..drafters.heads import MODULES

    torch.manual_seed(seed)
    if spec.kind == "eagle3":
        return _new_eagle3(hcfg, target)
    module = MODULES[spec.kind](hcfg)
    final_norm = target.model.norm.weight.detach().float()
    with torch.no_grad():
        if spec.kind == "exit":
            module.norm.copy_(final_norm)  # start as the plain early exit (final norm + LM head)
        elif spec.kind == "eagle":
            module.norm.copy_(final_norm)
            module.wo.weight.mul_(0.1)  # the residual branches start small
            module.w2.weight.mul_(0.1)
    return module


def _step_loss(spec: HeadSpec, module, target, x: torch.Tensor, cos, sin, bf16: bool):
    """One batch: the frozen target's forward (features, soft labels), then the head's losses."""
    lm_w = target.lm_head.weight.detach()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = target(input_ids=x, output_hidden_states=True)
    t_logp = F.log_softmax(out.logits.float(), -1)  # (B, T, V)
    hs = [h.float() for h in out.hidden_states]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        if spec.kind in ("eagle", "eagle3"):
            emb = target.model.embed_tokens.weight.detach()[x]  # (B, T, C)
            feats = [hf_feature(hs, layer) for layer in spec.feature_layers]
            return eagle_losses(module, emb, feats, lm_w, t_logp, spec.ttt, cos, sin)
        if spec.kind == "medusa":
            return medusa_losses(module, hf_feature(hs, -1), lm_w, t_logp)
        return exit_losses(module, hf_feature(hs, spec.exit_layer - 1), lm_w, t_logp)


def _batch(spec: HeadSpec, data, seed: int, step: int) -> torch.Tensor:
    x = batch_at(data.train, seed, step, spec.batch, spec.seq)
    n_copy = n_code = 0
    frac = fraction_at(spec.copy_schedule, step)
    if frac > 0 and data.copy is not None:
        n_copy = max(1, round(spec.batch * frac))
        x[:n_copy] = batch_at(data.copy, seed + 1, step, n_copy, spec.seq)
    frac = fraction_at(spec.code_schedule, step)
    if frac > 0 and data.code is not None:
        n_code = max(1, round(spec.batch * frac))
        x[n_copy:n_copy + n_code] = batch_at(data.code, seed + 2, step, n_code, spec.seq)
    frac = fraction_at(spec.self_schedule, step)
    if frac > 0 and data.selfgen is not None:
        n_self = min(spec.batch - n_copy - n_code, max(1, round(spec.batch * frac)))
        pick = np.random.default_rng([seed + 3, step]).integers(0, len(data.selfgen), size=n_self)
        x[spec.batch - n_self:] = torch.from_numpy(data.selfgen[pick, :spec.seq + 1].astype(np.int64))
    return x[:, :-1]  # the heads' labels come from the target: no next-token column needed


@torch.no_grad()
def evaluate(spec: HeadSpec, module, target, data, cos, sin, max_tokens: int, bf16: bool) -> dict:
    """KL and top-1 agreement with the target per head / TTT step (agreement of step j ~ the chance draft j
    is accepted greedily once drafts < j were) on the corpus's held-out split and, where the data has one,
    on the validation packages' code."""
    module.eval()
    out = {}
    for label, stream in (("heldout", data.heldout), ("validation_code", data.validation)):
        if stream is None:
            continue
        kl, agree = _stream_scores(spec, module, target, stream, cos, sin, max_tokens, bf16)
        out.update({f"{label}_kl": kl, f"{label}_top1_agreement": agree})
    module.train()
    return out


def _stream_scores(spec: HeadSpec, module, target, stream, cos, sin, max_tokens: int, bf16: bool):
    n_rows = max(1, max_tokens // spec.seq)
    starts = np.linspace(0, len(stream) - spec.seq - 2, n_rows).astype(int)
    x = torch.from_numpy(np.stack([stream[s:s + spec.seq] for s in starts]).astype(np.int64))
    losses, agree, n = None, None, 0
    for i in range(0, len(x), spec.batch):
        _, lo, ag = _step_loss(spec, module, target, x[i:i + spec.batch], cos, sin, bf16)
        losses = lo if losses is None else [a + b for a, b in zip(losses, lo)]
        agree = ag if agree is None else [a + b for a, b in zip(agree, ag)]
        n += 1
    return [round(v / n, 4) for v in losses], [round(v / n, 4) for v in agree]


def train_head(spec: HeadSpec, cfg: HeadTrainConfig, target, data, fingerprint: str, log=print) -> dict:
    """Train (or resume) one head; returns its manifest entry."""
    from ..drafters.heads import rope_tables

    tokens = max(spec.batch * spec.seq, int(spec.tokens * cfg.minutes_scale))
    total = max(1, tokens // (spec.batch * spec.seq))
    seed = cfg.seed * 1000 + sum(map(ord, spec.name))
    hcfg = _head_config(spec, target, fingerprint, cfg.target)
    module = _new_module(spec, hcfg, target, seed)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay)
    cos, sin = rope_tables(hcfg.head_dim, hcfg.rope_theta, spec.seq)
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, T, D)
    run = Path(cfg.runs_dir) / spec.name
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / "state.ckpt"
    ident = {"spec": spec.resume_key(), "seed": cfg.seed, "target": fingerprint}
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state.get("ident") == ident and state["step"] <= total:
            module.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step = state["step"]
            log(f"[{spec.name}] resuming at step {step}/{total}")
    t0, s0, last = time.time(), step, time.time()
    ema = None
    while step < total:
        x = _batch(spec, data, seed, step)
        T = x.shape[1]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, spec)
        loss, losses, agree = _step_loss(spec, module, target, x, cos[:, :, :T], sin[:, :, :T], cfg.bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = losses if ema is None else [0.95 * a + 0.05 * b for a, b in zip(ema, losses)]
        if step % cfg.log_every == 0 or step == total:
            rate = (step - s0) * spec.batch * spec.seq / max(1e-6, time.time() - t0)
            log(f"[{spec.name}] step {step}/{total} kl {' '.join(f'{v:.3f}' for v in ema)} "
                f"top1 {' '.join(f'{v:.2f}' for v in agree)} {rate:.0f} tok/s")
        if time.time() - last > cfg.ckpt_every_s or step == total:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"ident": ident, "model": module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            last = time.time()
    seconds = round(time.time() - t0, 1)
    metrics = evaluate(spec, module, target, data, cos, sin, cfg.eval_tokens, cfg.bf16)
    hcfg.meta = {"tokens_seen": total * spec.batch * spec.seq, "steps": total, "seed": cfg.seed,
                 "spec_key": spec.key(), "parameters": sum(p.numel() for p in module.parameters()),
                 "train_seconds_this_run": seconds, "threads": torch.get_num_threads(),
                 "command": f"speclab train --heads --only {spec.name} --seed {cfg.seed}"
                            + (f" --minutes-scale {cfg.minutes_scale}" if cfg.minutes_scale != 1.0 else ""),
                 **metrics}
    _save(spec, module, hcfg, Path(cfg.out_dir) / spec.name, target)
    (run / "done.json").write_text(json.dumps(hcfg.meta, indent=2))
    log(f"[{spec.name}] done: {hcfg.meta['parameters']:,} params, {hcfg.meta['tokens_seen']:,} tokens, "
        f"{seconds:.0f} s; held-out {metrics}")
    return {"name": spec.name, "kind": spec.kind, "path": f"heads/{spec.name}", **hcfg.meta}


def _save(spec: HeadSpec, module, hcfg, directory: Path, target) -> None:
    from ..drafters.heads import save_head
    from ..drafters.speculators import save_speculators

    if spec.kind != "eagle3":
        save_head(module, hcfg, directory)
        return
    save_speculators(module, hcfg, directory, verifier=hcfg.target,
                     verifier_architectures=list(getattr(target.config, "architectures", None) or []),
                     num_target_layers=int(target.config.num_hidden_layers))
    (directory / "speclab.json").write_text(json.dumps({"target_fingerprint": hcfg.target_fingerprint,
                                                        **hcfg.meta}, indent=2) + "\n")


def _record_manifest(entries: list[dict]) -> None:
    """Heads are listed in family.json under "heads" (the models list is untouched)."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        manifest = {"models": []}
    heads = {h["name"]: h for h in manifest.get("heads", []) if isinstance(h, dict) and "name" in h}
    for e in entries:
        heads[e["name"]] = e
    manifest["heads"] = [heads[k] for k in sorted(heads)]
    MANIFEST.write_text(json.dumps(manifest, indent=2) + "\n")


@functools.lru_cache(maxsize=2)
def heldout_windows(window: int = 32, stride: int = 16) -> tuple[str, ...]:
    """Every ``window``-character stretch of the held-out prompts at ``stride``: a text that shares
    ``window + stride - 1`` characters with a prompt contains one of them."""
    from ..workloads import HELDOUT_WORKLOADS, load_workload

    out = {p.prompt[i:i + window] for name in HELDOUT_WORKLOADS for p in load_workload(name)
           for i in range(0, max(1, len(p.prompt) - window + 1), stride)}
    return tuple(sorted(w for w in out if len(w) == window and w.isascii()))


def package_code(tok, packages: tuple[str, ...], chars_per_package: int, runs_dir: Path, log=print) -> np.ndarray:
    """The token stream of ``packages``' sources, none of its files sharing a window with a held-out prompt
    (cached in ``runs_dir`` by the files' names and contents)."""
    from .corpus import package_code_documents
    from .data import cached_stream, encode_docs
    from .tokenizer import tokenizer_id

    docs = package_code_documents(packages, chars_per_package, exclude=heldout_windows())
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode())
        h.update(hashlib.sha256(d.text.encode()).digest())
    stream = cached_stream(Path(runs_dir) / f"pkgcode-{h.hexdigest()[:16]}-{tokenizer_id(tok)}.npy",
                            lambda: encode_docs(tok, docs))
    log(f"package code {','.join(packages)}: {len(docs)} files, {sum(len(d.text) for d in docs):,} chars, "
        f"{len(stream):,} tokens")
    return stream


def _head_data(spec: HeadSpec, cfg: HeadTrainConfig, data, target, tok, fingerprint: str, log=print):
    """The corpus streams (with the validation code) and what this head's recipe adds: other code, self-generated
    rows."""
    from .selfgen import self_generated

    runs = Path(cfg.data_dir)
    if spec.code_packages:
        data = replace(data, code=package_code(tok, spec.code_packages, spec.chars_per_package, runs, log))
    selfgen = None
    if spec.self_rows:
        sources = [data.train, data.code]
        if spec.prompt_packages:
            sources.append(package_code(tok, spec.prompt_packages, spec.chars_per_package, runs, log))
        selfgen = self_generated(target, [s for s in sources if s is not None], spec.self_rows, spec.seq,
                                 cfg.seed, runs, fingerprint, log=log)
    return replace(data, selfgen=selfgen)


def train_heads(cfg: HeadTrainConfig, log=print) -> list[dict]:
    from ..drafters.heads import target_fingerprint
    from .corpus import build_corpus

    torch.set_num_threads(cfg.threads)
    tdir = FAMILY_DIR / "models" / cfg.target
    if not (tdir / "model.safetensors").exists():
        raise SystemExit(f"the heads are trained on the shipped target: {tdir} has no weights (run `speclab train`)")
    target = load_model_dir(tdir).eval().requires_grad_(False)
    fingerprint = target_fingerprint(target)
    tok = load_tokenizer_file(tdir / "tokenizer.json")
    corpus = build_corpus(cfg.seed)
    Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
    data = corpus_data(corpus, tok, "main", Path(cfg.data_dir), cfg.seed, cfg.copy_chars, log)
    data.validation = package_code(tok, VALIDATION_PACKAGES, HeadSpec.chars_per_package, Path(cfg.data_dir), log)
    entries = []
    for spec in cfg.specs:
        if cfg.only and spec.name not in cfg.only:
            continue
        t = time.time()
        entry = train_head(spec, cfg, target, _head_data(spec, cfg, data, target, tok, fingerprint, log),
                           fingerprint, log)
        entry["train_seconds"] = round(time.time() - t, 1)
        entries.append(entry)
        if Path(cfg.out_dir).resolve() == (FAMILY_DIR / "heads").resolve():
            _record_manifest(entries)
    return entries


def specs_to_train(only: list[str] | None) -> list[HeadSpec]:
    """The shipped heads' specs (all, or those named) and any other recipe named in ``only``."""
    names = [s.name for s in HEAD_SPECS + RECIPE_SPECS]
    if only and any(o not in names for o in only):
        raise SystemExit(f"speclab train --heads: unknown head(s) {only}; known: {', '.join(names)}")
    return [s for s in HEAD_SPECS if not only or s.name in only] + [s for s in RECIPE_SPECS if only and s.name in only]


def run_from_args(args) -> int:
    cfg = HeadTrainConfig(specs=specs_to_train(args.only), seed=args.seed, minutes_scale=args.minutes_scale,
                          only=args.only,
                          threads=args.threads, bf16=bf16_setting(args.no_bf16),
                          out_dir=Path(args.out) / "heads" if getattr(args, "out", None) else FAMILY_DIR / "heads",
                          runs_dir=Path(args.runs).parent / "heads" if args.runs else RUNS,
                          data_dir=Path(args.runs) if args.runs else Path("runs/family"))
    train_heads(cfg, log=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m speclab.family.heads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes-scale", type=float, default=1.0)
    p.add_argument("--only", action="append", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-bf16", action="store_true")
    p.add_argument("--runs", type=Path, default=Path("runs/family"))
    p.add_argument("--out", type=Path, default=FAMILY_DIR, help="family directory: heads go to OUT/heads")
    sys.exit(run_from_args(p.parse_args()))
