"""Counting tokens from outside, never by counting chunks (under speculation one chunk carries a round).

Per request, N (output tokens) comes from the server's ``usage.completion_tokens``; without it, from the
model's tokenizer applied to the text.

Per chunk (what the pacing fingerprint needs), in order of preference:

1. what the server reported: token ids in the chunk (vLLM's ``return_token_ids``) or a running usage
   count on every chunk (``stream_options.continuous_usage_stats``), recorded by :mod:`.client`;
2. the tokenizer: the whole output text is tokenised once, and each token is assigned to the chunk in
   which its last character arrived (the chunk that completed it). This equals count(prefix after chunk
   i) - count(prefix before) except where a token straddles a chunk boundary, where it counts once, in
   the chunk that finished it, instead of twice or as a negative difference; the counts are never
   negative and add up to the token count of the whole text.

Why the tokenizer by default and not the server: the per-chunk server figures need request fields that
only some servers accept (an OpenAI-compatible server may refuse unknown fields), while a tokenizer
works against any server. Its cost: re-tokenising text can differ from the tokens the model produced
(a byte-level BPE model may emit a non-canonical split); the difference between the text's count and
``usage`` is kept per request (``token_mismatch``) so it is visible, and is usually zero.
"""

from __future__ import annotations

import os
from bisect import bisect_left

from ..errors import SpeclabError


def load_tokenizer(spec: str | None):
    """A tokenizer from a family name (:func:`speclab.family.resolve`) or a local directory; never from
    the network. ``None`` for ``None``; a :class:`SpeclabError` when ``spec`` names nothing local."""
    if not spec:
        return None
    from ..family import resolve

    path = resolve(spec)
    if path is None and os.path.isdir(os.path.expanduser(spec)):
        path = os.path.expanduser(spec)
    if path is None:
        raise SpeclabError(f"tokenizer {spec!r}: not a family model name or a local directory "
                           f"(the load tool never downloads one)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is one line
        raise SpeclabError(f"cannot load tokenizer from {path}: {str(e).splitlines()[0][:200]}") from None


def guess_tokenizer(model: str | None):
    """The tokenizer for a served model id when it can be found locally (a family name, or a path, as
    vLLM reports a model served from a directory); otherwise None."""
    if not model:
        return None
    try:
        return load_tokenizer(model)
    except SpeclabError:
        return None


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chunk_counts_from_ends(token_ends: list[int], chunk_ends: list[int]) -> list[int]:
    """Tokens completed in each chunk: token j belongs to the first chunk whose end (character offset,
    exclusive) is at or past the token's end. Pure; ``chunk_ends`` ascending.

    Example: chunks "ab" | "c" | "de" end at 2, 3, 5; tokens "abc", "d", "e" end at 3, 4, 5 -> [0, 1, 2]."""
    counts = [0] * len(chunk_ends)
    for end in token_ends:
        i = bisect_left(chunk_ends, end)
        counts[min(i, len(chunk_ends) - 1)] += 1
    return counts


def chunk_token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Tokens each chunk completed (see the module docstring), by tokenising the joined text once."""
    full = "".join(texts)
    chunk_ends, pos = [], 0
    for t in texts:
        pos += len(t)
        chunk_ends.append(pos)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        token_ends = [end for _, end in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets: prefix counts
        counts, before = [], 0
        for end in chunk_ends:
            now = max(before, len(encode(tokenizer, full[:end])))
            counts.append(now - before)
            before = now
        return counts
    return chunk_counts_from_ends(token_ends, chunk_ends)


def count_tokens(records, tokenizer=None) -> None:
    """Fill ``output_tokens`` / ``token_source`` / ``prompt_tokens`` / ``token_mismatch`` and, where the
    server did not report them, ``chunk_tokens`` of each successful record."""
    for rec in records:
        if not rec.ok:
            continue
        usage = rec.usage or {}
        if isinstance(usage.get("completion_tokens"), int):
            rec.output_tokens, rec.token_source = usage["completion_tokens"], "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
        if tokenizer is None:
            continue
        if rec.chunk_tokens is None:
            rec.chunk_tokens = chunk_token_counts(tokenizer, rec.chunk_texts)
            rec.chunk_token_source = "tokenizer"
        text_count = len(encode(tokenizer, rec.text))
        if rec.output_tokens is None:
            rec.output_tokens, rec.token_source = text_count, "tokenizer"
        else:
            rec.token_mismatch = text_count - rec.output_tokens
