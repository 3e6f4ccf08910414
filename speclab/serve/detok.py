"""Incremental detokenisation for streaming, with stop-string hold-back.

Two things can make text that is already decoded change or vanish later, so neither may be sent yet:

* **An incomplete character.** Byte-level BPE tokens are bytes; a character can span tokens, and until
  its last byte arrives the decoder renders U+FFFD. Text ending in U+FFFD is held back.
* **A possible stop string.** If the text ends with the first few characters of a stop string, the
  next token may complete it, and nothing at or after a stop string may ever be sent. The longest
  such tail is held back until it is resolved; a complete stop string cuts the text there.

Decoding uses a window (vLLM's prefix/read offsets): the new text is ``decode(ids[prefix:]) minus
decode(ids[prefix:read])``, so each push costs a few tokens, not the whole output. When the request
ends, :meth:`IncrementalText.finish` takes the engine's verdict (the full decode cut at ``stop_at``)
and returns what is left to send: the text sent over the whole stream equals ``decode(generated)[:stop_at]``.

Worked example, stop "END", tokens arriving as "ab", "cE", "N", "Dx"::

    push "ab"  -> "ab"   (no tail of "ab" starts "END")
    push "cE"  -> "c"    ("E" could start "END": held)
    push "N"   -> ""     ("EN" held)
    push "Dx"  -> ""     ("END" found at 3: nothing from there on is ever sent)
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..engine.request import find_stop

REPLACEMENT = "\ufffd"


def held_tail(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Length of the longest tail of ``text[start:]`` that is a proper prefix of a stop string (0: none)."""
    longest = max((len(s) for s in stops), default=0)
    for h in range(min(longest - 1, len(text) - start), 0, -1):
        tail = text[len(text) - h:]
        if any(s.startswith(tail) for s in stops):
            return h
    return 0


class IncrementalText:
    """One request's output text, released as it becomes final. ``decode(ids) -> str``."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already: context for the next window
        self.read = 0  # ids[:read] are in self.text
        self.text = ""  # decode(ids[:read])
        self.sent = 0  # characters of self.text released
        self.stopped = False  # a stop string was found: nothing more is released

    @property
    def released(self) -> str:
        return self.text[:self.sent]

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became final (often "", never text that could change)."""
        self.ids.extend(ids)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT) and after.startswith(before):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stops:
            at = find_stop(self.text, self.stops, search_from=self.sent)
            if at is not None:
                end, self.stopped = at, True
            else:
                end -= held_tail(self.text, self.stops, self.sent)
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out

    def finish(self, generated: Sequence[int], stop_at: int | None) -> str:
        """The rest of the output once the request is over: :func:`output_text` minus what was released.
        (Released text is always a prefix of it for prefix-stable decoders such as byte-level BPE; were it
        not, what was sent stands and nothing more is sent.)"""
        final = output_text(self.decode, generated, stop_at)
        done = self.released
        self.text, self.sent, self.stopped = final, len(final), True
        return final[len(done):] if final.startswith(done) else ""


def output_text(decode: Callable[[list[int]], str], generated: Sequence[int], stop_at: int | None) -> str:
    """A finished request's text: its tokens decoded, cut where a stop string begins."""
    full = decode(list(generated))
    return full[:stop_at] if stop_at is not None else full


def fast_decoder(lm) -> Callable[[list[int]], str]:
    """``lm.decode``, or the very same function called straight on the Rust tokenizer when that is exactly
    what ``lm.decode`` does (no clean-up of spaces): streaming decodes a few tokens per chunk, and the
    Python layers around the Rust call cost ten times the call itself."""
    tk = getattr(lm, "tokenizer", None)
    backend = getattr(tk, "backend_tokenizer", None)
    if backend is None or getattr(tk, "clean_up_tokenization_spaces", True):
        return lm.decode
    return lambda ids: backend.decode(ids, skip_special_tokens=True)

