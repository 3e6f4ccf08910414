"""Rebuild the embedded model family from a seed: corpus -> tokenizer -> models -> manifest.

    python -m speclab.family.train              # everything, into speclab/family/
    speclab train --only draft-s --minutes-scale 0.5

Checkpoints go to ``runs/family/`` (ignored by git); an interrupted run resumes from them.
Every number that matters (steps, batch, learning rate) is derived from the spec and the seed,
so two runs with the same seed see the same batches in the same order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import FAMILY_DIR
from .args import add_train_arguments
from .corpus import Corpus, build_corpus, copy_documents

EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------
# specs


@dataclass(frozen=True)
class ModelSpec:
    name: str
    role: str  # target | draft | distilled-draft | mismatched
    hidden: int
    layers: int
    heads: int
    ffn: int
    tokens: int  # training tokens
    lr: float
    batch: int = 12
    seq: int = 384
    tokenizer: str = "main"  # "main" or "alt"
    teacher: str | None = None  # name of the model whose soft distributions are the labels
    init_from: str | None = None  # start from this trained model's weights (same architecture)
    warmup: int = 100
    weight_decay: float = 0.1
    # ((from_step, fraction), ...): share of each batch drawn from copy-heavy documents
    # (corpus.copy_documents) from that step on
    copy_schedule: tuple = ()
    # the same for extra rows drawn from the code documents only (code is the hardest source)
    code_schedule: tuple = ()
    # models with the same seed_name start from the same weights and see the same batches
    seed_name: str | None = None

    def copy_fraction_at(self, step: int) -> float:
        return fraction_at(self.copy_schedule, step)

    def code_fraction_at(self, step: int) -> float:
        return fraction_at(self.code_schedule, step)

    def key(self) -> str:
        d = asdict(self)
        for k in ("copy_schedule", "code_schedule", "seed_name"):
            if not d[k]:  # fields added later: absent means () / None
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def resume_key(self) -> str:
        """Like :meth:`key` but without the token budget: a checkpoint survives a changed budget
        (the cosine schedule then stretches or shrinks over the remaining steps)."""
        d = asdict(self)
        for k in ("tokens", "copy_schedule", "code_schedule"):  # budget and data mixture, not the model
            d.pop(k)
        for k in ("init_from", "seed_name"):
            if d.get(k) is None:  # fields added later; absent means the same as None
                d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def fraction_at(schedule: tuple, step: int) -> float:
    """The share a mixing schedule ((start step, share), ...) gives at ``step``: the last entry started."""
    frac = 0.0
    for start, f in schedule:
        if step >= start:
            frac = f
    return frac


DRAFT_COPY = ((0, 0.25),)  # the target's late mixture, from the first step
DRAFT_CODE = ((0, 0.34),)

DEFAULT_SPECS: list[ModelSpec] = [
    # the target: ~7M general tokens, then copy-heavy and code-only rows mixed in so it learns to copy from
    # its context and spends more of its budget on code (records are learned early: held-out loss < 1)
    ModelSpec("target", "target", hidden=256, layers=6, heads=4, ffn=688, tokens=17_000_000, lr=1.5e-3,
              copy_schedule=((976, 0.25), (1193, 0.5), (1519, 0.25)), code_schedule=((1519, 0.34),)),
    # Drafts: two sizes, each trained twice on the same data mixture and token budget, once on the
    # corpus's next tokens (cross-entropy) and once distilled: KL(target || draft) on the target's full
    # soft distributions (DistillSpec-style). Same size, initial weights, batches and token budget (a
    # shared seed_name): only the labels differ.
    ModelSpec("draft-s", "draft", hidden=160, layers=4, heads=4, ffn=432, tokens=4_000_000, lr=3e-3,
              copy_schedule=DRAFT_COPY, code_schedule=DRAFT_CODE),
    ModelSpec("draft-distill", "distilled-draft", hidden=160, layers=4, heads=4, ffn=432, tokens=4_000_000,
              lr=3e-3, teacher="target", copy_schedule=DRAFT_COPY, code_schedule=DRAFT_CODE, seed_name="draft-s"),
    ModelSpec("draft-xs", "draft", hidden=96, layers=2, heads=2, ffn=256, tokens=4_000_000, lr=4e-3,
              copy_schedule=DRAFT_COPY, code_schedule=DRAFT_CODE),
    ModelSpec("draft-xs-distill", "distilled-draft", hidden=96, layers=2, heads=2, ffn=256, tokens=4_000_000,
              lr=4e-3, teacher="target", copy_schedule=DRAFT_COPY, code_schedule=DRAFT_CODE,
              seed_name="draft-xs"),
    ModelSpec("mismatch", "mismatched", hidden=96, layers=2, heads=2, ffn=256, tokens=500_000, lr=4e-3,
              tokenizer="alt"),
]


@dataclass
class RunSettings:
    """What every training run of the family takes (the models here, the heads in :mod:`.heads`): its seed, a
    scale on every token budget, which items to train, CPU threads and bf16 autocast, the held-out tokens of
    its evaluation, how often it checkpoints, and the copy-heavy text it mixes in."""

    seed: int = 0
    minutes_scale: float = 1.0
    only: list[str] | None = None
    threads: int = 2
    bf16: bool = True
    eval_tokens: int = 150_000
    ckpt_every_s: float = 90.0
    copy_chars: int = 2_000_000


@dataclass
class TrainConfig(RunSettings):
    out_dir: Path = FAMILY_DIR
    runs_dir: Path = Path("runs/family")
    vocab_size: int = 2048
    alt_vocab_size: int = 1024
    corpus_kwargs: dict = field(default_factory=dict)
    specs: list[ModelSpec] = field(default_factory=lambda: list(DEFAULT_SPECS))
    wait_for_init_s: float = 3600.0
    quality: bool = True
    acceptance: bool = True
    progress: bool = True
    device: str = "cpu"  # "cuda" trains on a GPU (bf16 autocast there too); the weights are saved the same way
    # every model's batch and token budget times this (same steps, learning rates and mixing schedules):
    # a GPU's way to train on more tokens in the same number of steps (the stronger family: 10)
    batch_scale: int = 1
    # tokenizers are trained on at most this many characters of the (shuffled) training documents (None: all)
    tokenizer_chars: int | None = None


# The GPU-trained family's corpus (speclab train --large-corpus): the standard library plus the sources of
# torch, transformers and numpy (code and docstrings), more records and more copy-heavy text, so that 10x the
# tokens (--batch-scale 10) are about 5 passes over the data, not 30 over the standard library alone (which
# overfits: the target's held-out prose loss rose from 2.43 to 3.31 and it stopped copying from its context).
LARGE_CORPUS = dict(code_chars=60_000_000, prose_chars=20_000_000, record_chars=25_000_000,
                    packages=("torch", "transformers", "numpy"))
LARGE_COPY_CHARS = 20_000_000
LARGE_TOKENIZER_CHARS = 40_000_000


def _capped(texts, max_chars: int | None):
    total = 0
    for t in texts:
        if max_chars is not None and total >= max_chars:
            return
        total += len(t)
        yield t


def scale_batches(specs: list[ModelSpec], factor: int) -> list[ModelSpec]:
    """``factor`` x every spec's batch and tokens: the same number of steps, so learning-rate and mixing
    schedules (given in steps) stay as they are, each step seeing ``factor`` x the rows."""
    if factor == 1:
        return list(specs)
    return [replace(s, batch=s.batch * factor, tokens=s.tokens * factor) for s in specs]


# ----------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_id(tok) -> str:
    """Identity of a tokenizer: a hash of its token->id map and special tokens."""
    vocab = tok.get_vocab(with_added_tokens=True)
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=True)
    return "bpe%d-%s" % (len(vocab), hashlib.sha256(blob.encode()).hexdigest()[:10])


def hf_tokenizer(tok, max_length: int = 1024):
    """The ``transformers`` tokenizer around a trained one: EOT is BOS, EOS and PAD."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, unk_token=None,
                                   pad_token=EOT, model_max_length=max_length)


def save_hf_tokenizer(tok, directory: Path, max_length: int = 1024) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    hf_tokenizer(tok, max_length).save_pretrained(str(directory))


def load_tokenizer_file(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


# ----------------------------------------------------------------------------------------------
# data


def encode_docs(tok, docs) -> np.ndarray:
    eot = tok.token_to_id(EOT)
    enc = tok.encode_batch([d.text for d in docs])
    parts = []
    for e in enc:
        parts.append(np.asarray(e.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


@dataclass
class Data:
    train: np.ndarray
    heldout: np.ndarray
    heldout_by_source: dict[str, np.ndarray]
    copy: np.ndarray | None = None
    code: np.ndarray | None = None


def _cached_stream(path: Path, build) -> np.ndarray:
    """A token stream saved beside the checkpoints: built once, loaded after."""
    if path.exists():
        return np.load(path)
    arr = build()
    np.save(path, arr)
    return arr


def encode_corpus(tok, corpus: Corpus) -> Data:
    by_src = {}
    for src in sorted({d.source for d in corpus.heldout}):
        by_src[src] = encode_docs(tok, [d for d in corpus.heldout if d.source == src])
    return Data(encode_docs(tok, corpus.train), encode_docs(tok, corpus.heldout), by_src)


def corpus_data(corpus: Corpus, tok, kind: str, runs_dir: Path, seed: int, copy_chars: int, log=print) -> Data:
    """The token streams every model trains on (general, held-out per source, copy-heavy, code only),
    encoded once and cached in ``runs_dir`` (also used by the self-drafting heads, speclab.family.heads)."""
    fp, tid = corpus.fingerprint(), tokenizer_id(tok)
    path = Path(runs_dir) / f"data-{kind}-{fp}-{tid}.npz"
    if path.exists():
        z = np.load(path)
        data = Data(z["train"], z["heldout"], {k[3:]: z[k] for k in z.files if k.startswith("ho_")})
    else:
        data = encode_corpus(tok, corpus)
        np.savez(path, train=data.train, heldout=data.heldout,
                 **{"ho_" + k: v for k, v in data.heldout_by_source.items()})
    data.copy = _cached_stream(Path(runs_dir) / f"copy2-{kind}-{fp}-{tid}.npy", lambda: encode_docs(
        tok, copy_documents(corpus.train, seed, copy_chars)))
    data.code = _cached_stream(Path(runs_dir) / f"code-{kind}-{fp}-{tid}.npy", lambda: encode_docs(
        tok, [d for d in corpus.train if d.source == "code"]))
    log(f"data {kind}: {len(data.train):,} train tokens, {len(data.heldout):,} held-out, "
        f"{len(data.copy):,} copy-heavy, {len(data.code):,} code")
    return data


def batch_at(data: np.ndarray, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    x = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x)


# ----------------------------------------------------------------------------------------------
# models


def make_config(spec: ModelSpec, vocab_size: int, eot_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.heads, intermediate_size=spec.ffn,
        max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu", initializer_range=0.02,
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
    )


def new_model(spec: ModelSpec, vocab_size: int, eot_id: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(spec, vocab_size, eot_id))
    model.config._attn_implementation = "sdpa"
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def lr_at(step: int, total: int, spec: ModelSpec) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    prog = (step - spec.warmup) / max(1, total - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


@torch.no_grad()
def heldout_loss(model, data: np.ndarray, seq: int, max_tokens: int) -> float:
    model.eval()
    n = min(len(data) - 1, max_tokens)
    chunks = n // seq
    tot, cnt = 0.0, 0
    for i in range(0, chunks, 8):
        rows = [data[j * seq : j * seq + seq + 1].astype(np.int64) for j in range(i, min(i + 8, chunks))]
        x = torch.from_numpy(np.stack(rows)).to(next(model.parameters()).device)
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(1, cnt)


def save_model_dir(model, tok, directory: Path) -> None:
    """HF directory: config.json (fp32 compute dtype), model.safetensors (fp16 storage), tokenizer."""
    import copy

    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    m = copy.deepcopy(model).to("cpu", torch.float16)
    m.save_pretrained(str(tmp), safe_serialization=True)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for k in ("dtype", "torch_dtype"):
        if k in cfg:
            cfg[k] = "float32"
    cfg.pop("_attn_implementation", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_hf_tokenizer(tok, tmp)
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)


def load_model_dir(directory: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def train_one(spec: ModelSpec, cfg: TrainConfig, data: Data, tok, teacher=None, init_state=None,
              log=print) -> dict:
    """Train (or resume) one model; returns its manifest entry (without path)."""
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eot = tok.token_to_id(EOT)
    tokens = max(spec.batch * spec.seq, int(spec.tokens * cfg.minutes_scale))
    total_steps = max(1, tokens // (spec.batch * spec.seq))
    run = cfg.runs_dir / spec.name
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / "state.ckpt"
    seed = cfg.seed * 1000 + sum(map(ord, spec.seed_name or spec.name))
    dev = torch.device(cfg.device)
    model = new_model(spec, vocab, eot, seed)
    if init_state is not None:
        model.load_state_dict(init_state)
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=spec.weight_decay, fused=dev.type == "cuda")
    step = 0
    ident = {"spec": spec.resume_key(), "seed": cfg.seed, "tokenizer": tokenizer_id(tok)}
    if teacher is not None:  # a checkpoint distilled from another teacher is not resumable
        ident["teacher"] = hashlib.sha256(b"".join(
            p.detach().float().cpu().numpy().tobytes()[:4096] for p in teacher.parameters())).hexdigest()[:12]
    if ckpt.exists():
        state = torch.load(ckpt, map_location=dev, weights_only=False)
        if state.get("ident") == ident and state["step"] <= total_steps:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            step = state["step"]
            log(f"[{spec.name}] resuming at step {step}/{total_steps}")
        else:
            log(f"[{spec.name}] checkpoint is for a different spec; starting over")
    model.train()
    if teacher is not None:
        teacher.to(dev).eval()

    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=step, desc=spec.name, unit="step", disable=not cfg.progress,
               mininterval=5.0, file=sys.stderr)
    last_ckpt = time.time()
    t0, tok0 = time.time(), step
    ema = None
    while step < total_steps:
        x = batch_at(data.train, seed, step, spec.batch, spec.seq)
        # rows 0..n_copy-1 from the copy-heavy stream, the next n_code from code only, the rest general
        n_copy = n_code = 0
        if spec.copy_fraction_at(step) > 0 and data.copy is not None:
            n_copy = max(1, round(spec.batch * spec.copy_fraction_at(step)))
            x[:n_copy] = batch_at(data.copy, seed + 1, step, n_copy, spec.seq)
        if spec.code_fraction_at(step) > 0 and data.code is not None:
            n_code = max(1, round(spec.batch * spec.code_fraction_at(step)))
            x[n_copy : n_copy + n_code] = batch_at(data.code, seed + 2, step, n_code, spec.seq)
        x = x.to(dev, non_blocking=True)
        inp, tgt = x[:, :-1], x[:, 1:]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total_steps, spec)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=inp).logits
        logits = logits.float().reshape(-1, vocab)
        if teacher is not None:
            with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                t_logits = teacher(input_ids=inp).logits
            t_logp = F.log_softmax(t_logits.float().reshape(-1, vocab), dim=-1)
            s_logp = F.log_softmax(logits, dim=-1)
            # KL(teacher || student): cross-entropy to the target's soft distribution minus its entropy
            loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        else:
            loss = F.cross_entropy(logits, tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.update(1)
        if step % 20 == 0:
            rate = (step - tok0) * spec.batch * spec.seq / max(1e-6, time.time() - t0)
            bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{rate:.0f}")
        if step % 100 == 0 and not cfg.progress:
            log(f"[{spec.name}] step {step}/{total_steps} loss {ema:.3f}")
        if time.time() - last_ckpt > cfg.ckpt_every_s or step == total_steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"ident": ident, "model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
            last_ckpt = time.time()
    bar.close()
    loss_all = heldout_loss(model, data.heldout, spec.seq, cfg.eval_tokens)
    by_src = {k: round(heldout_loss(model, v, spec.seq, cfg.eval_tokens // 3), 4)
              for k, v in data.heldout_by_source.items()}
    out = cfg.out_dir / "models" / spec.name
    save_model_dir(model, tok, out)
    entry = {
        "name": spec.name, "role": spec.role, "parameters": n_params(model), "tokenizer": tokenizer_id(tok),
        "path": f"models/{spec.name}", "heldout_loss": round(loss_all, 4), "heldout_loss_by_source": by_src,
        "tokens_seen": total_steps * spec.batch * spec.seq, "steps": total_steps,
        "architecture": {"hidden": spec.hidden, "layers": spec.layers, "heads": spec.heads, "ffn": spec.ffn,
                         "vocab": vocab, "seq": spec.seq},
        "teacher": spec.teacher, "init_from": spec.init_from, "spec_key": spec.key(), "seed": cfg.seed,
    }
    (run / "done.json").write_text(json.dumps(entry, indent=2))
    log(f"[{spec.name}] done: {entry['parameters']:,} params, {entry['tokens_seen']:,} tokens, "
        f"held-out loss {loss_all:.4f} {by_src}")
    return entry


# ----------------------------------------------------------------------------------------------
# quality


def distinct_2(ids: list[int]) -> float:
    grams = list(zip(ids, ids[1:]))
    return len(set(grams)) / max(1, len(grams))


def looks_like_python(text: str) -> bool:
    """Heuristic: the prompt+continuation, cut at its last complete line, parses after dropping up to
    four trailing lines and closing an open block with ``pass``."""
    import ast

    lines = text.split("\n")[:-1] if "\n" in text else [text]
    for drop in range(0, 5):
        cand = lines[: len(lines) - drop] if drop else lines
        if not cand:
            break
        src = "\n".join(cand)
        for suffix in ("", "\n" + " " * (len(cand[-1]) - len(cand[-1].lstrip()) + 4) + "pass"):
            try:
                ast.parse(src + suffix)
                return True
            except SyntaxError:
                pass
            except Exception:
                break
    return False


def python_line_rate(text: str) -> float:
    """Share of non-blank lines that are valid Python on their own: statements that parse (a block
    opener gets a ``pass`` body, ``else``/``except``/... get their head, an unclosed call its closers),
    comments, and lines inside a triple-quoted string (docstrings)."""
    import ast

    closers = {"(": ")", "[": "]", "{": "}"}
    ok = total = 0
    in_str = False
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            continue
        total += 1
        quotes = line.count('"""') + line.count("'''")
        if in_str or quotes:
            ok += 1
            if quotes % 2:
                in_str = not in_str
            continue
        if line.startswith("#"):
            ok += 1
            continue
        cand = line
        for head, prefix in (("elif ", "if 0: pass\n"), ("else", "if 0: pass\n"), ("except", "try: pass\n"),
                             ("finally", "try: pass\n")):
            if cand.startswith(head):
                cand = prefix + cand
                break
        if cand.endswith(":"):
            cand += " pass"
        stack = []
        for ch in line:
            if ch in closers:
                stack.append(closers[ch])
            elif stack and ch == stack[-1]:
                stack.pop()
        cand = cand.rstrip(",") + "".join(reversed(stack))
        if cand.startswith(("return", "yield", "await")):
            cand = "def f():\n " + cand
        elif cand.startswith(("break", "continue")):
            cand = "while 1:\n " + cand
        try:
            ast.parse(cand)
            ok += 1
        except (SyntaxError, ValueError):
            pass
    return ok / total if total else 0.0


def quality_report(model_dir: Path, prompts: list[str], code_prompts: list[str] | None = None,
                   max_new_tokens: int = 128, temperature: float = 0.8, seed: int = 0) -> dict:
    """Samples ``max_new_tokens`` at ``temperature`` with HF ``generate`` and reports the mean fraction
    of distinct 2-grams, the share of samples above 0.5, and (code prompts) how many parse as Python."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model_dir(model_dir).eval()
    d2, samples, parsed = [], [], []
    code_prompts = code_prompts or []
    for i, p in enumerate(list(prompts) + list(code_prompts)):
        torch.manual_seed(seed + i)
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=tok.eos_token_id)
        new = out[0, enc["input_ids"].shape[1]:].tolist()
        d2.append(distinct_2(new))
        text = tok.decode(new)
        samples.append({"prompt": p[-200:], "continuation": text, "distinct_2": round(d2[-1], 3)})
        if i >= len(prompts):
            parsed.append(looks_like_python(p + text))
            samples[-1]["python_line_rate"] = round(python_line_rate(text), 3)
    return {
        "temperature": temperature, "max_new_tokens": max_new_tokens, "n": len(d2),
        "distinct_2_mean": round(float(np.mean(d2)), 4), "distinct_2_min": round(float(np.min(d2)), 4),
        "share_distinct_2_ge_0.5": round(float(np.mean([x >= 0.5 for x in d2])), 4),
        "code_parse_rate": round(float(np.mean(parsed)), 4) if parsed else None,
        "code_python_line_rate": round(float(np.mean([s["python_line_rate"] for s in samples
                                                      if "python_line_rate" in s])), 4) if parsed else None,
        "samples": samples,
    }


# ----------------------------------------------------------------------------------------------
# driver


def _prompts_for_quality() -> tuple[list[str], list[str]]:
    try:
        from speclab.workloads import load_workload

        code = [p.prompt for p in load_workload("code")][:12]
        other = []
        for w in ("json", "tech_prose", "creative"):
            other += [p.prompt for p in load_workload(w)][:4]
        return other, code
    except Exception:
        code = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
                "class Stack:\n    def __init__(self):\n"]
        return ["The following example shows", '{"id": 1, "name": "'], code


def train_family(cfg: TrainConfig, log=print, after_each=None) -> dict:
    """Corpus, tokenizers, then every model in order; ``after_each(entry)`` is called as each model is saved
    (the GPU check packs the weights so far, so a run stopped at its time limit still returns them)."""
    torch.set_num_threads(cfg.threads)
    t_start = time.time()
    cfg.out_dir = Path(cfg.out_dir)
    cfg.runs_dir = Path(cfg.runs_dir)
    cfg.runs_dir.mkdir(parents=True, exist_ok=True)
    (cfg.out_dir / "models").mkdir(parents=True, exist_ok=True)

    log(f"building corpus (seed {cfg.seed}) ...")
    corpus = build_corpus(cfg.seed, **cfg.corpus_kwargs)
    log(f"corpus {corpus.fingerprint()}: " + ", ".join(f"{k}={v['chars'] / 1e6:.2f}MB"
                                                        for k, v in corpus.stats().items()))
    toks = {}
    tok_dir = cfg.runs_dir / "tokenizers"
    tok_dir.mkdir(exist_ok=True)
    fp = corpus.fingerprint()
    for kind, vs in (("main", cfg.vocab_size), ("alt", cfg.alt_vocab_size)):
        # a tokenizer trained on capped input is another tokenizer: the cap is part of its cache name
        cap = f"-c{cfg.tokenizer_chars}" if cfg.tokenizer_chars is not None else ""
        path = tok_dir / f"{kind}-{fp}-{vs}{cap}.json"
        if path.exists():
            toks[kind] = load_tokenizer_file(path)
        else:
            if kind == "main":
                texts = _capped((d.text for d in corpus.train), cfg.tokenizer_chars)
            else:  # a different vocabulary: smaller, trained on a different subset (every 3rd document)
                texts = _capped((d.text for i, d in enumerate(corpus.train) if i % 3 == 0), cfg.tokenizer_chars)
            toks[kind] = train_tokenizer(texts, vs)
            toks[kind].save(str(path))
        log(f"tokenizer {kind}: {tokenizer_id(toks[kind])}")

    data: dict[str, Data] = {}

    def get_data(kind: str) -> Data:
        if kind not in data:
            data[kind] = corpus_data(corpus, toks[kind], kind, cfg.runs_dir, cfg.seed, cfg.copy_chars, log)
        return data[kind]

    manifest_path = cfg.out_dir / "family.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {"models": []}
    entries = {m["name"]: m for m in manifest.get("models", [])}

    specs = scale_batches(cfg.specs, cfg.batch_scale)
    for spec in specs:
        if cfg.only and spec.name not in cfg.only:
            continue
        run = cfg.runs_dir / spec.name
        done = run / "done.json"
        if done.exists() and (cfg.out_dir / "models" / spec.name / "model.safetensors").exists():
            prev = json.loads(done.read_text())
            want_steps = max(1, max(spec.batch * spec.seq, int(spec.tokens * cfg.minutes_scale))
                             // (spec.batch * spec.seq))
            if prev.get("spec_key") == spec.key() and prev.get("steps") == want_steps \
                    and prev.get("seed") == cfg.seed:
                log(f"[{spec.name}] already trained, skipping")
                entries[spec.name] = prev
                continue
            done.unlink()
        init_state = None
        if spec.init_from:
            idir = cfg.out_dir / "models" / spec.init_from
            idone = cfg.runs_dir / spec.init_from / "done.json"
            waited = 0
            while not (idone.exists() and (idir / "model.safetensors").exists()):
                if waited == 0:
                    log(f"[{spec.name}] waiting for {spec.init_from} (trained by another process?)")
                if waited > cfg.wait_for_init_s:
                    raise RuntimeError(f"{spec.name} starts from {spec.init_from!r}; train it first")
                time.sleep(10)
                waited += 10
            init_state = load_model_dir(idir).state_dict()
        teacher = None
        if spec.teacher:
            tdir = cfg.out_dir / "models" / spec.teacher
            if not (tdir / "model.safetensors").exists():
                raise RuntimeError(f"{spec.name} needs its teacher {spec.teacher!r} trained first")
            teacher = load_model_dir(tdir)
        t = time.time()
        entry = train_one(spec, cfg, get_data(spec.tokenizer), toks[spec.tokenizer], teacher=teacher,
                          init_state=init_state, log=log)
        entry["train_seconds"] = round(time.time() - t, 1)
        (run / "done.json").write_text(json.dumps(entry, indent=2))
        entries[spec.name] = entry
        write_manifest(cfg, entries, corpus)
        if after_each is not None:
            after_each(entry)

    write_manifest(cfg, entries, corpus)
    report = {"models": [entries[s.name] for s in specs if s.name in entries]}
    if cfg.quality and "target" in entries:
        log("quality check of the target (temperature 0.8, 128 tokens) ...")
        other, code = _prompts_for_quality()
        q = quality_report(cfg.out_dir / "models" / "target", other, code)
        report["quality"] = q
        manifest = json.loads(manifest_path.read_text())
        manifest["quality"] = {k: v for k, v in q.items() if k != "samples"}
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        (cfg.runs_dir / "quality_samples.json").write_text(json.dumps(q, indent=2))
    if cfg.acceptance and cfg.out_dir.resolve() == FAMILY_DIR.resolve():
        try:  # the report runs the engine over the new family (speclab.analysis, which sits above the family)
            from ..analysis.report import acceptance_report

            acc = acceptance_report(workloads="all", prompts_per_workload=8, max_new_tokens=64)
            report["acceptance"] = acc
            (cfg.runs_dir / "acceptance.json").write_text(json.dumps(acc, indent=2))
        except Exception as e:  # the engine may not exist yet
            log(f"acceptance report skipped: {type(e).__name__}: {e}")
    report["wall_seconds"] = round(time.time() - t_start, 1)
    log(format_training_report(report))
    return report


def write_manifest(cfg: TrainConfig, entries: dict, corpus: Corpus) -> None:
    order = [s.name for s in cfg.specs]
    models = [entries[n] for n in order if n in entries] + [e for n, e in entries.items() if n not in order]
    path = cfg.out_dir / "family.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {}
    # keep entries another training process (e.g. `--only draft-s`) wrote meanwhile
    on_disk = {m["name"]: m for m in old.get("models", []) if isinstance(m, dict) and "name" in m}
    merged = {**on_disk, **entries}
    models = [merged[n] for n in order if n in merged] + [e for n, e in merged.items() if n not in order]
    for m in models:  # a model started from another one has also seen that one's tokens
        base = merged.get(m.get("init_from") or "")
        if base:
            m["tokens_seen_total"] = m["tokens_seen"] + base.get("tokens_seen_total", base["tokens_seen"])
    old.update({
        "format": 1, "seed": cfg.seed, "corpus": corpus.fingerprint(),
        "corpus_stats": corpus.stats(), "models": models,
    })
    path.write_text(json.dumps(old, indent=2) + "\n")


def format_training_report(report: dict) -> str:
    lines = ["", "model            role              params            tokens seen   held-out loss"
                 "  (code/prose/records)"]
    for m in report["models"]:
        src = m.get("heldout_loss_by_source", {})
        seen = f"{m['tokens_seen']:,}" + (f" (+{m['init_from']})" if m.get("init_from") else "")
        lines.append(f"{m['name']:<16} {m['role']:<16} {m['parameters'] / 1e6:6.2f}M {seen:>22}"
                     f"   {m['heldout_loss']:.3f}          "
                     + "/".join(f"{src.get(k, float('nan')):.2f}" for k in ("code", "prose", "records")))
    q = report.get("quality")
    if q:
        lines.append(f"target quality @T={q['temperature']}, {q['max_new_tokens']} tokens: distinct-2 mean "
                     f"{q['distinct_2_mean']:.3f} (min {q['distinct_2_min']:.3f}, share>=0.5 "
                     f"{q['share_distinct_2_ge_0.5']:.2f}), code continuations: whole-snippet parse rate "
                     f"{q['code_parse_rate']}, valid-Python line rate {q.get('code_python_line_rate')}")
    acc = report.get("acceptance")
    if acc:
        from ..analysis.report import format_report

        lines.append(format_report(acc))
    lines.append(f"wall time {report.get('wall_seconds', 0) / 60:.1f} min")
    return "\n".join(lines)


def run_from_args(args) -> int:
    """Train the models (``speclab train``; its ``--heads`` goes to :mod:`.heads` instead, from the command)."""
    if args.batch_scale < 1:
        raise SystemExit(f"speclab train: --batch-scale must be a whole number >= 1, not {args.batch_scale}")
    large = dict(corpus_kwargs=dict(LARGE_CORPUS), copy_chars=LARGE_COPY_CHARS,
                 tokenizer_chars=LARGE_TOKENIZER_CHARS) if args.large_corpus else {}
    cfg = TrainConfig(seed=args.seed, out_dir=args.out, runs_dir=args.runs, minutes_scale=args.minutes_scale,
                      only=args.only, threads=args.threads, bf16=not args.no_bf16,
                      quality=not args.no_quality, acceptance=not args.no_acceptance,
                      progress=not args.no_progress, device=args.device, batch_scale=args.batch_scale, **large)
    train_family(cfg, log=lambda s: print(s, flush=True))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speclab.family.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p, heads=False)  # the heads: `speclab train --heads` or `python -m speclab.family.heads`
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
