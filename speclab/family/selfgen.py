"""Rows of the target's own greedy text, for training the heads on what they will be asked to predict.

A head is judged on the target's outputs, not on the corpus: a drafted token is accepted when it is the
target's next greedy token given the target's own earlier tokens. A small target's continuations differ from
the text it was trained on (they repeat, drift and close blocks in their own way), so a head trained on corpus
text alone learns the target's next-token choices on inputs unlike those it will see. EAGLE and Medusa train
on the target's regenerated responses for the same reason ("self-distillation").

Each row is a prompt cut from a training stream (a seeded start and length) followed by the target's greedy
continuation, ``seq + 1`` tokens in all, generated in batches with one prompt length per batch (no padding)
and without stopping at the end-of-text token, as a row of the family's batches may cross a document's end.
Rows are cached beside the checkpoints, named by everything that decides them.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import numpy as np
import torch

PROMPT_TOKENS = (16, 128)  # a row's prompt length, uniform in this range (inclusive)


@torch.no_grad()
def greedy_rows(target, prompts: torch.Tensor, total: int) -> torch.Tensor:
    """``prompts`` (B, P) continued greedily to ``total`` tokens per row with the target's KV cache."""
    # transformers renamed past_key_values -> cache: pass and read whichever this version has
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    out = target(input_ids=prompts, use_cache=True)
    rows = [prompts]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(total - prompts.shape[1]):
        rows.append(nxt)
        out = target(input_ids=nxt, use_cache=True, **{name: out[name]})
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(rows, 1)


def self_generated(target, sources: list[np.ndarray], n_rows: int, seq: int, seed: int, runs_dir: Path,
                   fingerprint: str, batch: int = 64, log=print) -> np.ndarray:
    """(n_rows, seq + 1) uint16: prompts drawn from ``sources`` in turn (one source per batch), each continued
    by the target's greedy tokens; built once per (target, sources, sizes, seed) and loaded after."""
    h = hashlib.sha256(json.dumps([fingerprint, n_rows, seq, seed, batch, PROMPT_TOKENS]).encode())
    for s in sources:
        h.update(hashlib.sha256(s.tobytes()).digest())
    path = Path(runs_dir) / f"selfgen-{h.hexdigest()[:16]}.npy"
    if path.exists():
        return np.load(path)
    rng = np.random.default_rng([seed, 7919])
    out = np.zeros((n_rows, seq + 1), dtype=np.uint16)
    was_training = target.training
    target.eval()
    for i in range(0, n_rows, batch):
        b = min(batch, n_rows - i)
        src = sources[(i // batch) % len(sources)]
        plen = int(rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        starts = rng.integers(0, len(src) - plen - 1, size=b)
        prompts = torch.from_numpy(np.stack([src[s:s + plen] for s in starts]).astype(np.int64))
        out[i:i + b] = greedy_rows(target, prompts, seq + 1).numpy().astype(np.uint16)
        if log and (i // batch) % 8 == 0:
            log(f"self-generated rows: {i + b}/{n_rows}")
    target.train(was_training)
    np.save(path, out)
    return out
