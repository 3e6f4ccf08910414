"""Drafters: anything that proposes up to k next tokens per row.

A drafter is a protocol that returns data (vLLM's contract): ``propose`` gives a
:class:`Proposal` of token ids, per-row lengths, and the distributions the tokens were drawn
from (``None`` for a deterministic drafter such as prompt lookup, scored as one-hot).
The decoder never looks inside a drafter, so self-drafting heads, early exit or tree drafts plug
in by implementing the same three methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .errors import SpeclabError
from .models import LM, check_same_tokenizer, load_model
from .sampling import SamplingParams, logits_to_probs, sample_from_probs


@dataclass
class DraftContext:
    """What a drafter may read. Row b's tokens are ``tokens[b, :lengths[b]]`` (the last one is the
    newest token, whose successor is to be drafted); ``host`` holds the same as Python lists."""

    tokens: torch.Tensor  # (B, S) int64 buffer on the decoder's device
    lengths: torch.Tensor  # (B,) int64 on device
    host_lengths: list[int]
    host: list[list[int]]  # per row, prompt + generated tokens


@dataclass
class Proposal:
    tokens: torch.Tensor  # (B, k) int64, -1 = padding
    lengths: torch.Tensor  # (B,) int64, proposed tokens per row (<= k)
    probs: torch.Tensor | None = None  # (B, k, V) float32: the distributions tokens were drawn from
    token_probs: torch.Tensor | None = None  # (B, k) the draft's probability of each token (display)


@runtime_checkable
class Drafter(Protocol):
    name: str

    def start(self, ctx: DraftContext, max_len: int) -> None:
        """A new batch begins; ``ctx`` holds the prompts and the first generated token."""

    def propose(self, ctx: DraftContext, k: int, params: SamplingParams, uniform: torch.Tensor | None,
                want_probs: bool) -> Proposal:
        """Up to k tokens per row. ``uniform`` (B, k) are the draws to sample with (None if greedy)."""

    def commit(self, ctx: DraftContext) -> None:
        """Verification is done: ``ctx.lengths`` are the rows' new lengths. Roll back what was rejected."""


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer, with its own rollback-by-length cache."""

    def __init__(self, lm: LM, target_vocab: int):
        self.lm = lm
        self.name = lm.name
        self.target_vocab = target_vocab
        self.cache = None
        self.dlen: torch.Tensor | None = None  # (B,) positions < dlen[b] are in this drafter's cache
        self.host_dlen: list[int] = []

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary: padded heads differ in size, not in meaning."""
        V = self.target_vocab
        if logits.shape[-1] > V:
            return logits[..., :V]
        if logits.shape[-1] < V:
            pad = logits.new_full((*logits.shape[:-1], V - logits.shape[-1]), float("-inf"))
            return torch.cat([logits, pad], -1)
        return logits

    def start(self, ctx: DraftContext, max_len: int) -> None:
        B = ctx.tokens.shape[0]
        self.cache = self.lm.new_cache(B, max_len)
        # prefill everything but each row's newest token; the first propose feeds that one
        lens = [n - 1 for n in ctx.host_lengths]
        T = max(lens)
        pos = torch.arange(T, device=ctx.tokens.device)[None].expand(B, T)  # (B, T)
        valid = pos < torch.tensor(lens, device=pos.device)[:, None]
        self.cache.forward(ctx.tokens[:, :T], pos, valid, kv_len=T, last_only=torch.zeros(B, dtype=torch.long,
                                                                                           device=pos.device))
        self.host_dlen = lens
        self.dlen = torch.tensor(lens, device=ctx.tokens.device)

    def propose(self, ctx, k, params, uniform, want_probs):
        L, dlen = ctx.lengths, self.dlen
        dev = L.device
        B = L.shape[0]
        # catch up on tokens the draft has not seen (1, or 2 after a bonus round), right-padded
        w = max(hl - dl for hl, dl in zip(ctx.host_lengths, self.host_dlen))
        pos = dlen[:, None] + torch.arange(w, device=dev)[None]  # (B, w)
        valid = pos < L[:, None]
        inp = ctx.tokens.gather(1, pos.clamp(max=ctx.tokens.shape[1] - 1))  # (B, w)
        kv_len = max(ctx.host_lengths)
        logits = self.cache.forward(inp, pos, valid, kv_len=kv_len, last_only=L - dlen - 1)[:, -1]  # (B, V)
        toks, probs, tprobs, greedy_logits = [], [], [], []
        for i in range(k):
            logits = self._align(logits)
            if params.greedy:
                tok = logits.argmax(-1)  # (B,)
                if want_probs:
                    greedy_logits.append(logits)  # one softmax for all k steps, after the loop
            else:
                p = logits_to_probs(logits, params)  # (B, V)
                tok = sample_from_probs(p, uniform[:, i])
                probs.append(p)
                tprobs.append(p.gather(1, tok[:, None]).squeeze(1))
            toks.append(tok)
            if i < k - 1:  # the last draft token is never fed: the target verifies it
                logits = self.cache.forward(tok[:, None], (L + i)[:, None], None, kv_len=kv_len + i + 1)[:, -1]
        self.dlen = L + k - 1
        self.host_dlen = [hl + k - 1 for hl in ctx.host_lengths]
        tokens = torch.stack(toks, 1) if toks else torch.zeros(B, 0, dtype=torch.long, device=dev)
        if greedy_logits:  # display probabilities of the greedy drafts: (B, k, V) -> (B, k)
            tprobs = [torch.stack(greedy_logits, 1).float().softmax(-1).gather(2, tokens[..., None]).squeeze(-1)]
            tprobs = list(tprobs[0].unbind(1))
        return Proposal(
            tokens=tokens,
            lengths=torch.full((B,), k, dtype=torch.long, device=dev),
            probs=torch.stack(probs, 1) if probs else None,
            token_probs=torch.stack(tprobs, 1) if tprobs else None,
        )

    def commit(self, ctx: DraftContext) -> None:
        # cached draft tokens stay valid up to the row's last accepted token
        self.dlen = torch.minimum(self.dlen, ctx.lengths - 1)
        self.host_dlen = [min(d, hl - 1) for d, hl in zip(self.host_dlen, ctx.host_lengths)]
        self.cache.truncate(self.dlen)


class PromptLookupDrafter:
    """Prompt lookup decoding: find the context's last n-gram earlier in the context and propose
    what followed it. No model; wins when the output copies the input (edits, code refactors)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpeclabError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.name = "ngram"
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, ctx, max_len):
        pass

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """The tokens after the most recent earlier occurrence of the longest matching suffix n-gram.

        e.g. seq = [5, 6, 7, 9, 5, 6], k = 2: suffix [5, 6] occurs at 0, followed by [7, 9].
        """
        arr = np.asarray(seq)
        L = len(arr)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            suffix = arr[L - n:]
            # windows starting at 0..L-n-1 (exclude the suffix itself)
            win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # (L-n, n)
            hits = np.flatnonzero((win == suffix).all(1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start:start + k]
        return []

    def propose(self, ctx, k, params, uniform, want_probs):
        B = len(ctx.host)
        out = torch.full((B, k), -1, dtype=torch.long)
        lens = []
        for b, seq in enumerate(ctx.host):
            cand = self.lookup(seq, k) if k else []
            if cand:
                out[b, :len(cand)] = torch.tensor(cand)
            lens.append(len(cand))
        dev = ctx.tokens.device
        return Proposal(out.to(dev), torch.tensor(lens, device=dev), None, None)

    def commit(self, ctx):
        pass


DRAFTER_ALIASES = {"ngram": "ngram", "prompt-lookup": "ngram", "prompt_lookup": "ngram", "pld": "ngram"}


def make_drafter(spec: str | None, target: LM, load=load_model, **kw) -> Drafter | None:
    """'none' (plain target decoding), 'ngram' (prompt lookup), or a draft model name/path/hub id
    (loaded with ``load``, e.g. a caching loader)."""
    if spec is None or str(spec).lower() in ("", "none", "off", "baseline"):
        return None
    if str(spec).lower() in DRAFTER_ALIASES:
        return PromptLookupDrafter(**kw)
    draft = load(spec, device=target.device, dtype=target.dtype, role="draft")
    check_same_tokenizer(target, draft)
    return ModelDrafter(draft, target.vocab_size)
