"""Typed events and the one hook registry that metrics, the terminal view, the app and the
notebooks subscribe to.

The decoder asks ``hooks.active`` once per round; with no subscriber it builds no event,
takes no timing and does no host copy for them. It asks ``hooks.wants_probs`` too: the draft's and the
target's probability of every shown token (``TokenRecord.draft_prob`` / ``target_prob``) cost a softmax
over the vocabulary per row and position, so they are computed only while some subscriber asked for them
(``subscribe(fn, probs=False)``: the events come with those fields None; a server that streams tokens
needs none of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

STATUSES = ("accepted", "rejected", "recovered", "bonus", "target")
EMITTED = frozenset({"accepted", "recovered", "bonus", "target"})


@dataclass
class TokenRecord:
    token: int
    status: str  # one of STATUSES; "rejected" tokens are shown but not part of the output
    draft_prob: float | None  # probability the draft gave this token (None: no draft / deterministic)
    target_prob: float | None  # probability the target gave this token (after temperature/top-k/top-p)
    position: int  # 0-based index among the row's generated tokens this round started from
    text: str = ""  # the decoder leaves it empty; Recorder.token_dicts decodes the token when it is


@dataclass
class RowRound:
    row: int  # the request's row: its prompt's index in SpeculativeDecoder.generate
    num_drafted: int  # drafts verified for this row this round (0 for plain decoding)
    num_accepted: int  # drafts kept (before any EOS/length cut)
    tokens: list[TokenRecord]  # display order: accepted..., rejected..., recovered|bonus|target
    finished: bool  # the row ended in this round (EOS, max_new_tokens or a stop string)
    finish_reason: str | None = None  # "eos" | "length" | "stop" | None
    request_id: str = ""
    k: int = 0  # the draft length chosen for this row this round (after the budget cap)
    k_reason: str = ""  # why: the policy's reason, or "budget" when the row's budget capped it
    # a tree round (drafter proposed a token tree; None for a chain): the verified tree for drawing it,
    # {"tokens", "parents" (-1 = the root, the newest committed token), "depth" (1 = the root's children),
    #  "fates" ("accepted" on the path | "rejected" tried and refused | "discarded" under a rejected node),
    #  "path" (accepted node indices, root to leaf), "draft_probs", "target_probs" (per node, None when not
    #  recorded), "next_token", "next_status" ("recovered" | "bonus")}; see speclab.engine.rounds.tree_row_round
    tree: dict | None = None

    @property
    def emitted(self) -> list[TokenRecord]:
        return [t for t in self.tokens if t.status in EMITTED]


@dataclass
class RunStarted:
    run_id: int
    time: float  # perf_counter
    batch_size: int
    k: int
    drafter: str
    target: str
    prompt_lengths: list[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    policy: str = "fixed"
    seeds: list[int] = field(default_factory=list)  # per row: the seed its samples come from


@dataclass
class RoundEvent:
    run_id: int
    round: int  # verification rounds so far (a prefill carries the number of the rounds before it)
    time: float  # perf_counter when this round's tokens were known on the host
    timings: dict[str, float]  # seconds per phase: prefill | draft, verify, accept, bookkeeping, other
    rows: list[RowRound] = field(default_factory=list)  # the rows that took part
    phase: str = "verify"  # "prefill": new requests' prompts and their first tokens; "verify": a round
    running: int = 0  # requests running after this event
    waiting: int = 0  # requests queued after this event
    prefix_queries: int = 0  # a prefill with prefix caching: prompt tokens looked up (vLLM's prefix_cache_queries)
    prefix_hits: int = 0  # of them, copied from the prefix cache instead of run (vLLM's prefix_cache_hits)


@dataclass
class RunFinished:
    run_id: int
    time: float
    wall_s: float
    num_generated: list[int]  # per row
    finish_reasons: list[str]
    cancelled: bool = False


Event = RunStarted | RoundEvent | RunFinished


class HookRegistry:
    """Subscribers are callables taking one event. ``subscribe`` returns an unsubscribe function."""

    def __init__(self) -> None:
        self._subs: list[Callable[[Event], None]] = []
        self._no_probs: list[Callable[[Event], None]] = []  # subscribers that asked for no probabilities

    @property
    def active(self) -> bool:
        return bool(self._subs)

    @property
    def wants_probs(self) -> bool:
        """Some subscriber wants the token probabilities in its events (the default when subscribing)."""
        return len(self._no_probs) < len(self._subs)

    def subscribe(self, fn: Callable[[Event], None], probs: bool = True) -> Callable[[], None]:
        """``probs=False``: this subscriber does not read ``TokenRecord.draft_prob`` / ``target_prob``; when
        no subscriber does, the decoder does not compute them (they are None)."""
        self._subs.append(fn)
        if not probs:
            self._no_probs.append(fn)
        return lambda: self.unsubscribe(fn)

    def unsubscribe(self, fn: Callable[[Event], None]) -> None:
        if fn in self._subs:
            self._subs.remove(fn)
        if fn in self._no_probs:
            self._no_probs.remove(fn)

    def emit(self, event: Event) -> None:
        for fn in list(self._subs):
            fn(event)
