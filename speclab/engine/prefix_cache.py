"""Prefix caching: the target's keys and values of prompts already prefilled, kept so that a prompt starting
with one of them is prefilled from where the stored part ends (vLLM's automatic prefix caching, on by
default in its V1 engine; here ``speclab serve --enable-prefix-caching``, also on by default).

What is stored: after a prompt's prefill, every layer's K/V for its positions ``0 .. P-1``, copied out of
the row's cache slots, where ``P`` is the prompt length less one. At least the prompt's last token is always
run, because its logits give the first output token.

How a prompt is matched:
* its whole prompt but the last token, exactly: a repeated prompt reuses everything but one token;
* otherwise the longest prefix on a block boundary (every ``block`` tokens, 16 as vLLM's default): prompts
  that share a system prompt or few-shot examples.

For a drafter that reads the target's hidden features at every prompt position (EAGLE), an entry also keeps
those features for its positions, and a prompt reuses an entry only when it holds the layers the drafter reads.

Every stored entry is registered under its exact key and under each block-aligned prefix of it. The store is
an LRU bounded in bytes. Keys are token-id tuples: a hit is an exact token match, never a hash collision.

Exactness: the reused keys and values are the ones the prompt's own prefill wrote, so the outputs are those
of a prefill split in two. The floating-point sums can differ from one whole prefill's (as between batch
sizes, about 1e-6), and greedy outputs stay the target's own. The tests compare served outputs with solo
generation (greedy and seeded sampling).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per block: prefixes match on multiples of this (vLLM's default block size)
DEFAULT_BYTES = 256 << 20  # the store's bound


@dataclass
class Entry:
    """One stored prefix: per layer (H_kv, P, D) keys and values of positions 0..P-1, and the target's hidden
    features at those positions that a drafter reads ({layer: (P, C)}; empty when none was asked for)."""

    tokens: tuple[int, ...]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    nbytes: int
    keys: list[tuple[int, ...]] = field(default_factory=list)  # the lookup keys that point at it
    features: dict = field(default_factory=dict)


class PrefixCache:
    """An LRU of prompts' K/V, bounded in bytes (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES, block: int = BLOCK):
        self.max_bytes = int(max_bytes)
        self.block = max(1, int(block))
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # by full key, oldest first
        self.index: dict[tuple[int, ...], Entry] = {}  # every lookup key -> its newest entry
        self.nbytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, served from the store (vLLM's prefix_cache_hits)

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, prompt: list[int], features: tuple = ()) -> tuple[int, Entry | None]:
        """(P, entry): the first P positions of ``prompt`` can be copied from ``entry`` (P <= len(prompt) - 1;
        0 and None when nothing matches). ``features``: the layers whose hidden features the entry must hold too.
        Counts the prompt's tokens as queried and the P as hits."""
        n = len(prompt)
        self.queries += n
        if n < 2 or not self.index:
            return 0, None
        e = self.index.get(tuple(prompt[:n - 1]))
        p = n - 1
        if e is None:
            p = ((n - 1) // self.block) * self.block
            while p > 0:
                e = self.index.get(tuple(prompt[:p]))
                if e is not None:
                    break
                p -= self.block
        if e is None or p <= 0 or any(layer not in e.features for layer in features):
            return 0, None
        self.entries.move_to_end(e.tokens)
        self.hits += p
        return p, e

    def unused(self, p: int) -> None:
        """A hit of ``p`` tokens that the caller could not use after all: counted as a miss."""
        self.hits -= p

    def store(self, prompt: list[int], k: list[torch.Tensor], v: list[torch.Tensor],
              features: dict | None = None) -> None:
        """Keep ``k``/``v`` (per layer (H_kv, >= P, D), copied here) for the first P = len(prompt) - 1 positions, and
        ``features`` ({layer: (>= P, C)}, copied) when a drafter reads them."""
        P = len(prompt) - 1
        if P < 1:
            return
        key = tuple(prompt[:P])
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        ks = [t[:, :P].clone() for t in k]
        vs = [t[:, :P].clone() for t in v]
        feats = {layer: f[:P].clone() for layer, f in (features or {}).items()}
        nbytes = sum(t.numel() * t.element_size() for t in ks + vs + list(feats.values()))
        if nbytes > self.max_bytes:
            return
        while self.nbytes + nbytes > self.max_bytes and self.entries:
            self._evict()
        e = Entry(key, ks, vs, nbytes, features=feats)
        e.keys = [key] + [key[:p] for p in range(self.block, P, self.block)]
        for kk in e.keys:
            self.index[kk] = e
        self.entries[key] = e
        self.nbytes += nbytes

    def _evict(self) -> None:
        _, e = self.entries.popitem(last=False)
        self.nbytes -= e.nbytes
        for kk in e.keys:
            if self.index.get(kk) is e:
                del self.index[kk]
                # a shorter prefix may still be held by another entry
                for other in reversed(self.entries.values()):
                    if len(other.tokens) >= len(kk) and other.tokens[:len(kk)] == kk:
                        self.index[kk] = other
                        break
