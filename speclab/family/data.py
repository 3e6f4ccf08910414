"""The token streams the family trains on: documents encoded once and cached beside the checkpoints, and the
batches drawn from them by seed and step (the same seed, the same batches in the same order)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import Corpus, copy_documents
from .tokenizer import EOT, tokenizer_id


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
    validation: np.ndarray | None = None  # text no model trains on, for choices between runs
    selfgen: np.ndarray | None = None  # (rows, seq + 1): the target's own greedy text (selfgen.py)


def cached_stream(path: Path, build) -> np.ndarray:
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
    data.copy = cached_stream(Path(runs_dir) / f"copy2-{kind}-{fp}-{tid}.npy", lambda: encode_docs(
        tok, copy_documents(corpus.train, seed, copy_chars)))
    data.code = cached_stream(Path(runs_dir) / f"code-{kind}-{fp}-{tid}.npy", lambda: encode_docs(
        tok, [d for d in corpus.train if d.source == "code"]))
    log(f"data {kind}: {len(data.train):,} train tokens, {len(data.heldout):,} held-out, "
        f"{len(data.copy):,} copy-heavy, {len(data.code):,} code")
    return data


def batch_at(data: np.ndarray, seed: int, step: int, batch: int, seq: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    x = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(x)
