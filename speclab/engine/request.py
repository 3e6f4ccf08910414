"""A request: what was asked (prompt, sampling settings, seed, budget, stops) and what has happened
to it (tokens so far, its random generator, its speculation counters). The scheduler owns the state;
everything a request's output depends on lives here, never in its batch-mates."""

from __future__ import annotations

import itertools
import secrets
import time
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams

_ids = itertools.count(1)

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


def fresh_seed() -> int:
    """A new random seed (reported back, so the run can be repeated)."""
    return secrets.randbelow(2**31 - 1)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None  # None: a fresh seed is drawn (see ``seed_used``)
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one
    ignore_eos: bool = False
    request_id: str = ""
    row: int = 0  # where it is shown: the prompt's index for SpeculativeDecoder.generate
    arrival: float = field(default_factory=time.perf_counter)

    # ---- state, owned by the scheduler
    status: str = WAITING
    generated: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)  # prompt + generated (kept as one list for drafters)
    finish_reason: str | None = None
    seed_used: int = 0
    rng: torch.Generator | None = None
    stop_at: int | None = None  # character index where a stop string begins in the decoded output
    draft_pending: bool = False  # the drafter has not taken this row in yet (it does before the row's first draft)
    # speculation counters (raw; ratios are derived when read)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    history: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per round, newest last
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self):
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        self.seed_used = fresh_seed() if self.seed is None else int(self.seed)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    @property
    def finished(self) -> bool:
        return self.status == FINISHED

    def start_rng(self, device) -> None:
        """One generator per request: its draws depend on its seed and its own rounds only."""
        if not self.params.greedy and self.rng is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed_used)
            self.rng = g

    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.history.append((drafted, accepted))
        while len(self.pos_drafted) < drafted:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for i in range(drafted):
            self.pos_drafted[i] += 1
            if i < accepted:
                self.pos_accepted[i] += 1

    def spec_stats(self) -> dict:
        """Per-request speculation figures (OpenAI responses carry them next to ``usage``)."""
        return {
            "rounds": self.rounds,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_acceptance_length": self.accepted / self.rounds + 1 if self.rounds else None,
            "per_position_acceptance": [a / d for a, d in zip(self.pos_accepted, self.pos_drafted) if d],
        }


def find_stop(text: str, stops: tuple[str, ...], search_from: int = 0) -> int | None:
    """Index of the earliest stop string in ``text`` at or after ``search_from`` (None: none there)."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, search_from))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
