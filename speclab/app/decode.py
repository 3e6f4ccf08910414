"""The Decode tab's run, free of Gradio: its settings checked, then the speculative run streamed as views
(each round's tokens and fates) and its k = 0 baseline with the same settings.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import SpeclabError
from ..limits import check_float, check_int
from ..metrics import speedup
from .config import (
    MAX_BATCH,
    MAX_K,
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_TEMPERATURE,
    AppConfig,
    check_model_choice,
    check_policy,
)
from .models import get_target, warm_up

MAX_TOP_K = 2048
MAX_PROMPT_CHARS = 8000
FILL_COPIES = "copies of the prompt"
FILL_WORKLOAD = "other prompts of the workload"
TREE_SHAPES = ("chain", "static", "dynamic")
MAX_NODES = 16


@dataclass(frozen=True)
class DecodeSettings:
    """A decode run's settings, captured (frozen) when the run starts."""

    prompt: str
    target: str
    draft: str
    k: int
    batch: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    fill: str = FILL_WORKLOAD
    workload: str | None = None
    pace_ms: int = 0
    top_k: int = 0
    policy: str = "fixed"
    tree: str = "chain"  # chain | static | dynamic
    nodes: int = 8  # a tree's node budget (the round's k caps it too)

    @property
    def speculative(self) -> bool:
        return self.draft != "none" and self.k > 0 and self.policy != "off"

    @property
    def drafter_spec(self) -> str:
        """The spec make_drafter reads: the draft, and the tree options when it proposes trees."""
        return self.draft if self.tree == "chain" else f"{self.draft}:tree={self.tree}:nodes={self.nodes}"


def validate_decode(cfg: AppConfig, prompt, target, draft, k, batch, temperature, top_p, max_new_tokens, seed,
                    fill=FILL_WORKLOAD, workload=None, pace_ms=0, top_k=0, policy="fixed", tree="chain",
                    nodes=8) -> DecodeSettings:
    if not isinstance(prompt, str) or not prompt.strip():
        raise SpeclabError("the prompt is empty: type one or pick an example")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise SpeclabError(f"the prompt is too long ({len(prompt)} characters, at most {MAX_PROMPT_CHARS})")
    target = check_model_choice(cfg, target, "target")
    draft = check_model_choice(cfg, draft, "draft")
    k = check_int("k (draft length)", k, 0, MAX_K)
    batch = check_int("batch size", batch, 1, MAX_BATCH)
    temperature = check_float("temperature", temperature, 0.0, MAX_TEMPERATURE)
    top_p = check_float("top-p", top_p, 0.0, 1.0, lo_open=True)
    top_k = check_int("top-k", top_k if top_k is not None else 0, 0, MAX_TOP_K)
    max_new_tokens = check_int("max new tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    seed = check_int("seed", seed, 0, MAX_SEED)
    pace_ms = check_int("pause per round (ms)", pace_ms or 0, 0, 2000)
    policy = check_policy(policy or "fixed")
    tree = tree or "chain"
    if tree not in TREE_SHAPES:
        raise SpeclabError(f"tree shape must be one of {', '.join(TREE_SHAPES)}, got {tree!r}")
    nodes = check_int("tree nodes", nodes if nodes is not None else 8, 2, MAX_NODES)
    if tree != "chain" and draft in ("none", "early-exit"):
        raise SpeclabError(f"'{draft}' drafts chains only: pick the chain shape, or another draft for a tree")
    fill = fill if fill in (FILL_COPIES, FILL_WORKLOAD) else FILL_WORKLOAD
    workload = workload if isinstance(workload, str) and workload else None
    return DecodeSettings(prompt, target, draft, k, batch, temperature, top_p, max_new_tokens, seed, fill,
                          workload, pace_ms, top_k, policy, tree, nodes)


def batch_prompts(s: DecodeSettings) -> list[str]:
    """Row 0 is the user's prompt; other rows are copies or the workload's other prompts."""
    if s.batch == 1:
        return [s.prompt]
    others: list[str] = []
    if s.fill == FILL_WORKLOAD:
        try:
            from ..workloads import list_workloads, load_workload

            names = [s.workload] if s.workload else list_workloads()[:1]
            for n in names:
                others += [p.prompt for p in load_workload(n) if p.prompt != s.prompt]
        except Exception:
            others = []
    if not others:
        others = [s.prompt]
    return [s.prompt] + [others[i % len(others)] for i in range(s.batch - 1)]


def _shift(ev, dt: float):
    """The event as if the consumer had taken no time (the UI's time is not the decoder's)."""
    from ..events import RunFinished

    if dt == 0.0:
        return ev
    if isinstance(ev, RunFinished):
        return dataclasses.replace(ev, time=ev.time - dt, wall_s=max(ev.wall_s - dt, 1e-9))
    return dataclasses.replace(ev, time=ev.time - dt)


@dataclass
class RunView:
    """A run in progress or done: what the UI shows."""

    phase: str  # "speculative" | "baseline" | "done"
    settings: DecodeSettings
    prompts: list[str]
    tokens: list[list[dict]] = field(default_factory=list)
    metrics: dict | None = None
    baseline: dict | None = None
    finish_reasons: list[str] = field(default_factory=list)
    round: int = 0
    cancelled: bool = False
    rounds: list[dict] = field(default_factory=list)  # per (round, row): the chosen k and why (speculative run)
    trees: list[dict] = field(default_factory=list)  # tree rounds: {round, row, tree} (RowRound.tree)

    @property
    def speedup(self) -> float | None:
        return speedup(self.metrics, self.baseline)

    def to_dict(self) -> dict:
        return {"settings": dataclasses.asdict(self.settings), "prompts": self.prompts, "tokens": self.tokens,
                "metrics": self.metrics, "baseline_metrics": self.baseline, "speedup": self.speedup,
                "finish_reasons": self.finish_reasons, "rounds": self.rounds, "trees": self.trees, "error": None}


def timed_stream(dec, prompts, s: DecodeSettings, k: int, recorder) -> Iterator:
    """``dec.stream`` with the consumer's time taken out of every event's clock; each event is fed
    to ``recorder`` and yielded. Closing this generator cancels the run between rounds."""
    it = dec.stream(prompts, k=k, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, seed=s.seed, policy=s.policy if k > 0 else None)
    overhead = 0.0
    try:
        while True:
            try:
                ev = next(it)
            except StopIteration:
                return
            got = time.perf_counter()
            ev = _shift(ev, overhead)
            recorder(ev)
            yield ev
            overhead += time.perf_counter() - got
    finally:
        it.close()


def run_decode(cfg: AppConfig, s: DecodeSettings, min_interval: float = 0.08) -> Iterator[RunView]:
    """The speculative run, streamed (a view at most every ``min_interval`` s, or every round with a
    pace), then the k = 0 baseline with the same settings; the last view has phase "done"."""
    from ..analysis.sweep import new_drafter
    from ..engine import SpeculativeDecoder
    from ..events import RoundEvent, RunFinished
    from ..metrics import Recorder

    target = get_target(cfg, s.target)
    drafter = new_drafter(s.drafter_spec, target) if s.speculative else None
    warm_up(target, s.drafter_spec if s.speculative else "none")
    prompts = batch_prompts(s)
    view = RunView("speculative" if s.speculative else "baseline", s, prompts)
    rec = Recorder(target)
    last = 0.0
    k = s.k if s.speculative else 0
    for ev in timed_stream(SpeculativeDecoder(target, drafter), prompts, s, k, rec):
        if isinstance(ev, RunFinished):
            view.finish_reasons = list(ev.finish_reasons)
            view.cancelled = ev.cancelled
        if not isinstance(ev, RoundEvent):
            continue
        view.round = ev.round
        now = time.perf_counter()
        if s.pace_ms or now - last >= min_interval:
            view.tokens, view.metrics = rec.token_dicts(), rec.summary()
            yield view
            last = time.perf_counter()
            if s.pace_ms:
                time.sleep(s.pace_ms / 1000)
    view.tokens, view.metrics = rec.token_dicts(), rec.summary()
    if s.speculative:
        view.trees = [{"round": ev.round, "row": rr.row, "tree": rr.tree} for ev in rec.rounds for rr in ev.rows
                      if rr.tree is not None]
        df = rec.rounds_frame()
        if len(df):
            keep = ["round", "row", "k", "k_reason", "drafted", "accepted"]
            view.rounds = df[df["phase"] == "verify"][keep].to_dict("records")
    if not s.speculative:  # this run is the baseline
        view.baseline = view.metrics
    else:
        view.phase = "baseline"
        yield view
        base = Recorder(target)
        for _ in timed_stream(SpeculativeDecoder(target, None), prompts, s, 0, base):
            pass
        view.baseline = base.summary()
    view.phase = "done"
    yield view
