"""What the embedded family is made of: each model's spec (size, token budget, learning rate, data mixture),
the settings every training run takes, and the larger corpus of the GPU-trained family."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import FAMILY_DIR


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


def bf16_runs_fast(device: str = "cpu") -> bool:
    """Whether bf16 autocast speeds training up on ``device``: a GPU with bf16, or a CPU with bf16 instructions
    (AVX512-BF16, AMX). Elsewhere torch emulates bf16 matmuls, many times slower than fp32."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_setting(no_bf16: bool, device: str = "cpu", log=print) -> bool:
    """``--no-bf16`` or, by default, bf16 autocast where it runs fast (said in one line where it does not)."""
    if no_bf16:
        return False
    if not bf16_runs_fast(device):
        log(f"training in fp32: this {device.split(':')[0].upper()} has no bf16 instructions, where bf16 autocast "
            f"runs many times slower")
        return False
    return True


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


def scale_batches(specs: list[ModelSpec], factor: int) -> list[ModelSpec]:
    """``factor`` x every spec's batch and tokens: the same number of steps, so learning-rate and mixing
    schedules (given in steps) stay as they are, each step seeing ``factor`` x the rows."""
    if factor == 1:
        return list(specs)
    return [replace(s, batch=s.batch * factor, tokens=s.tokens * factor) for s in specs]


def lr_at(step: int, total: int, spec: ModelSpec) -> float:
    """Linear warm-up over ``spec.warmup`` steps, then a cosine from ``spec.lr`` down to a tenth of it at ``total``."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    prog = (step - spec.warmup) / max(1, total - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))
