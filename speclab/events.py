"""Typed events and the one hook registry that metrics, the terminal view, the app and the
notebooks subscribe to.

The decoder asks ``hooks.active`` once per round; with no subscriber it builds no event,
takes no timing and does no host copy for them.
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
    timings: dict[str, float]  # seconds per phase: prefill | draft, verify, accept, other
    rows: list[RowRound] = field(default_factory=list)  # the rows that took part
    phase: str = "verify"  # "prefill": new requests' prompts and their first tokens; "verify": a round
    running: int = 0  # requests running after this event
    waiting: int = 0  # requests queued after this event


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

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        self._subs.append(fn)
        return lambda: self.unsubscribe(fn)

    def unsubscribe(self, fn: Callable[[Event], None]) -> None:
        if fn in self._subs:
            self._subs.remove(fn)

    def emit(self, event: Event) -> None:
        for fn in list(self._subs):
            fn(event)
