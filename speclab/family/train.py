"""Rebuild the embedded model family from a seed: corpus -> tokenizer -> models -> manifest.

    python -m speclab.family.train              # everything, into speclab/family/
    speclab train --only draft-s --minutes-scale 0.5

Checkpoints go to ``runs/family/`` (ignored by git); an interrupted run resumes from them.
Every number that matters (steps, batch, learning rate) is derived from the spec and the seed,
so two runs with the same seed see the same batches in the same order.

The pieces: ``specs`` (what each model is), ``tokenizer``, ``data`` (token streams and batches), ``model_dir``
(a model as a Hugging Face directory), ``quality`` (the target's samples checked); this file trains.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import FAMILY_DIR
from .args import add_train_arguments
from .corpus import Corpus, build_corpus
from .data import Data, batch_at, corpus_data
from .model_dir import load_model_dir, n_params, new_model, save_model_dir
from .quality import prompts_for_quality, quality_report
from .specs import (
    LARGE_COPY_CHARS,
    LARGE_CORPUS,
    LARGE_TOKENIZER_CHARS,
    ModelSpec,
    TrainConfig,
    bf16_setting,
    lr_at,
    scale_batches,
)
from .tokenizer import EOT, load_tokenizer_file, tokenizer_id, train_tokenizer


def _capped(texts, max_chars: int | None):
    total = 0
    for t in texts:
        if max_chars is not None and total >= max_chars:
            return
        total += len(t)
        yield t


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
        other, code = prompts_for_quality()
        q = quality_report(cfg.out_dir / "models" / "target", other, code)
        report["quality"] = q
        manifest = json.loads(manifest_path.read_text())
        manifest["quality"] = {k: v for k, v in q.items() if k != "samples"}
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        (cfg.runs_dir / "quality_samples.json").write_text(json.dumps(q, indent=2))
    if cfg.acceptance and cfg.out_dir.resolve() == FAMILY_DIR.resolve():
        # measuring acceptance runs the engine over the new family with every drafter: an analysis above the family,
        # which the family does not import; the command says how
        log("acceptance of the new family: speclab bench acceptance --workload all --k 4 --out results")
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
    lines.append(f"wall time {report.get('wall_seconds', 0) / 60:.1f} min")
    return "\n".join(lines)


def run_from_args(args) -> int:
    """Train the models (``speclab train``; its ``--heads`` goes to :mod:`.heads` instead, from the command)."""
    if args.batch_scale < 1:
        raise SystemExit(f"speclab train: --batch-scale must be a whole number >= 1, not {args.batch_scale}")
    large = dict(corpus_kwargs=dict(LARGE_CORPUS), copy_chars=LARGE_COPY_CHARS,
                 tokenizer_chars=LARGE_TOKENIZER_CHARS) if args.large_corpus else {}
    cfg = TrainConfig(seed=args.seed, out_dir=args.out, runs_dir=args.runs, minutes_scale=args.minutes_scale,
                      only=args.only, threads=args.threads, bf16=bf16_setting(args.no_bf16, args.device),
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
