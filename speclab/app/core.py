"""The app's logic, free of Gradio: configuration, input validation, and the three runs
(a streamed decode with its k = 0 baseline, a sweep, a timing comparison).

Nothing here keeps per-run state at module level: every run builds its own decoder and drafter
(a model drafter keeps a KV cache, so sharing one between two users' runs would mix them up).
Only loaded models are shared, read-only, through :func:`speclab.analysis.sweep.cached_model`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import SpeclabError
from ..limits import check_float, check_int
from ..metrics import speedup

# the app's own ranges (what its controls offer); the checks themselves are speclab.limits'
MAX_K = 16
MAX_BATCH = 256  # far enough for speculation to stop paying on a 2-core CPU (see the README's crossover)
MAX_NEW_TOKENS = 256
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 2048
MAX_SEED = 2**31 - 1
MAX_PROMPT_CHARS = 8000
MAX_SWEEP_CELLS = 120  # (workload, batch, draft, policy, k) cells incl. baselines
SWEEP_KS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16]
SWEEP_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# what the first screen runs: chosen by measurement (README, "Defaults"): a workload and settings where
# speculation pays on the embedded family on a CPU
DEFAULT_WORKLOAD = "json"
DEFAULT_K = 4
DEFAULT_POLICY = "fixed"
FILL_COPIES = "copies of the prompt"
FILL_WORKLOAD = "other prompts of the workload"
BUILTIN_DRAFTS = ("ngram", "none")
SELF_DRAFTS = ("eagle", "medusa", "early-exit")  # drafters from the target itself (offered when shipped)
DRAFT_LABELS = {"ngram": "ngram (prompt lookup, no model)", "none": "none (baseline, k = 0)",
                "eagle": "eagle (a head on the target's features)", "medusa": "medusa (heads on the target)",
                "early-exit": "early-exit (the target's first layers)"}
TREE_SHAPES = ("chain", "static", "dynamic")
MAX_NODES = 16


def self_drafts() -> tuple[str, ...]:
    """The self-drafting heads shipped with the family (early exit needs no weights)."""
    try:
        from ..drafters.heads import list_heads

        have = {x for h in list_heads() for x in (h["kind"], h["name"])}
    except Exception:  # noqa: BLE001 - no heads: none offered
        have = set()
    return tuple(d for d in SELF_DRAFTS if d in have or d == "early-exit")


# --------------------------------------------------------------------------------- configuration
def _family() -> list[dict]:
    try:
        from ..family import list_models

        return list_models()
    except Exception:
        return []


def _family_defaults() -> tuple[str, str]:
    try:
        from ..family import DEFAULT_DRAFT, DEFAULT_TARGET

        return DEFAULT_TARGET, DEFAULT_DRAFT
    except Exception:
        return "target", "draft-distill"


def _truthy(v: str | None) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class AppConfig:
    """What the server offers. ``targets``/``drafts`` are the only model choices users get, unless
    ``allow_custom_models`` (then any local directory or hub id may be typed in)."""

    targets: tuple[str, ...]
    drafts: tuple[str, ...]  # model drafts, then "ngram", "none"
    default_target: str | None
    default_draft: str
    allow_custom_models: bool = False
    device: str | None = None
    family_present: bool = False
    allow_remote_servers: bool = False  # the Load tab may measure a server at a URL (off: only its own)

    @classmethod
    def build(cls, target: str | None = None, draft: str | None = None, extra_drafts: list[str] | None = None,
              allow_custom_models: bool = False, device: str | None = None,
              allow_remote_servers: bool = False) -> "AppConfig":
        fam = _family()
        fam_target, fam_draft = _family_defaults()
        names = [m["name"] for m in fam]
        fam_targets = [m["name"] for m in fam if m.get("role") == "target"]
        if fam_target in names and fam_target in fam_targets:
            fam_targets.remove(fam_target)
            fam_targets.insert(0, fam_target)
        order = {"distilled-draft": 0, "draft": 1, "mismatched": 3}
        fam_drafts = sorted((m for m in fam if m.get("role") != "target"),
                            key=lambda m: (order.get(m.get("role"), 2), -(m.get("parameters") or 0), m["name"]))
        fam_drafts = [m["name"] for m in fam_drafts]
        targets = ([target] if target else []) + [t for t in fam_targets if t != target]
        drafts: list[str] = []
        offered = fam_drafts + (list(self_drafts()) if fam else []) + list(BUILTIN_DRAFTS)
        for d in ([draft] if draft else []) + list(extra_drafts or []) + offered:
            if d and d not in drafts:
                drafts.append(d)
        if draft:
            default_draft = draft
        elif fam_draft in fam_drafts:
            default_draft = fam_draft
        else:
            default_draft = next((d for d in drafts if d not in BUILTIN_DRAFTS), "ngram")
        return cls(tuple(targets), tuple(drafts), targets[0] if targets else None, default_draft,
                   allow_custom_models, device, bool(fam), allow_remote_servers)

    @classmethod
    def from_env(cls, **overrides) -> "AppConfig":
        """SPECLAB_TARGET, SPECLAB_DRAFT, SPECLAB_DRAFTS (comma list), SPECLAB_ALLOW_CUSTOM_MODELS,
        SPECLAB_DEVICE; keyword arguments (from command-line flags) win when not None."""
        env = os.environ
        kw = dict(target=env.get("SPECLAB_TARGET") or None, draft=env.get("SPECLAB_DRAFT") or None,
                  extra_drafts=[d.strip() for d in env.get("SPECLAB_DRAFTS", "").split(",") if d.strip()],
                  allow_custom_models=_truthy(env.get("SPECLAB_ALLOW_CUSTOM_MODELS")),
                  allow_remote_servers=_truthy(env.get("SPECLAB_ALLOW_REMOTE_SERVERS")),
                  device=env.get("SPECLAB_DEVICE") or None)
        for k, v in overrides.items():
            if v is not None and v != [] and v is not False:
                kw[k] = v
        return cls.build(**kw)

    def draft_choices(self) -> list[tuple[str, str]]:
        return [(DRAFT_LABELS.get(d, d), d) for d in self.drafts]


# --------------------------------------------------------------------------------- validation
def check_model_choice(cfg: AppConfig, value, role: str) -> str:
    choices = cfg.targets if role == "target" else cfg.drafts
    if not isinstance(value, str) or not value.strip():
        if role == "target" and not choices:
            raise SpeclabError("no target model: the embedded family is not trained yet; start the app with "
                               "--target PATH (or set SPECLAB_TARGET)")
        raise SpeclabError(f"no {role} chosen")
    value = value.strip()
    if value in choices or (role == "draft" and value.lower() in BUILTIN_DRAFTS + SELF_DRAFTS):
        return value.lower() if value.lower() in BUILTIN_DRAFTS else value
    if cfg.allow_custom_models:
        return value
    offered = ", ".join(choices) or "none"
    raise SpeclabError(f"unknown {role} '{value}': choose one of {offered} (custom models need the app to be "
                       f"started with --allow-custom-models)")


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


def policy_names() -> list[str]:
    """Every draft-length policy the engine knows (``speclab.engine.policies.POLICIES``)."""
    from ..engine.policies import POLICIES

    return list(POLICIES)


def check_policy(policy) -> str:
    names = policy_names()
    if not isinstance(policy, str) or policy.strip().lower() not in names:
        raise SpeclabError(f"unknown policy {policy!r} (known: {', '.join(names)})")
    return policy.strip().lower()


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


# --------------------------------------------------------------------------------- models
_WARM: set = set()
_WARM_LOCK = threading.Lock()


def get_target(cfg: AppConfig, spec: str):
    from ..analysis.sweep import cached_model

    lm = cached_model(spec, device=cfg.device, role="target")
    _setup_threads(lm)
    return lm


def _setup_threads(lm) -> None:
    try:
        from ..defaults import setup_threads

        if not os.environ.get("OMP_NUM_THREADS"):
            setup_threads(None, lm)
    except Exception:
        pass


def warm_up(target, drafter_spec: str) -> None:
    """One tiny run per (target, draft) the first time they are used: the first forward of a
    process is slow and would distort the first measurement."""
    key = (id(target), drafter_spec)
    with _WARM_LOCK:
        if key in _WARM:
            return
    from ..analysis.sweep import new_drafter
    from ..engine import SpeculativeDecoder

    prompt = "Hello world. " * 4
    for spec in ("none", drafter_spec):
        d = new_drafter(spec, target)
        SpeculativeDecoder(target, d).generate([prompt, prompt], k=2 if d else 0, max_new_tokens=6, record=True)
    with _WARM_LOCK:
        _WARM.add(key)


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


# --------------------------------------------------------------------------------- streamed runs
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


# --------------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class SweepSettings:
    target: str
    workloads: tuple[str, ...]
    drafts: tuple[str, ...]
    ks: tuple[int, ...]
    batches: tuple[int, ...]
    prompts_per_workload: int
    max_new_tokens: int
    temperature: float
    seed: int = 0

    @property
    def cells(self) -> int:
        return len(self.workloads) * len(self.batches) * (1 + len(self.drafts) * len(self.ks))


def _as_list(name: str, v) -> list:
    if v is None:
        return []
    if isinstance(v, (str, int, float)):
        v = [v]
    if not isinstance(v, (list, tuple)):
        raise SpeclabError(f"{name} must be a list, got {type(v).__name__}")
    return list(v)


def validate_sweep(cfg: AppConfig, target, workloads, drafts, ks, batches, prompts_per_workload, max_new_tokens,
                   temperature, seed=0) -> SweepSettings:
    from ..workloads import list_workloads

    target = check_model_choice(cfg, target, "target")
    known = list_workloads()
    wl = []
    for w in _as_list("workloads", workloads):
        if w not in known:
            raise SpeclabError(f"unknown workload {w!r} (known: {', '.join(known) or 'none'})")
        if w not in wl:
            wl.append(w)
    if not wl:
        raise SpeclabError("pick at least one workload")
    ds = []
    for d in _as_list("drafts", drafts):
        d = check_model_choice(cfg, d, "draft")
        if d != "none" and d not in ds:
            ds.append(d)
    if not ds:
        raise SpeclabError("pick at least one draft (the k = 0 baseline is always measured)")
    kl = sorted({check_int("k", k, 1, MAX_K) for k in _as_list("k values", ks)})
    if not kl:
        raise SpeclabError("pick at least one k")
    bl = sorted({check_int("batch size", b, 1, MAX_BATCH) for b in _as_list("batch sizes", batches)})
    if not bl:
        raise SpeclabError("pick at least one batch size")
    s = SweepSettings(target, tuple(wl), tuple(ds), tuple(kl), tuple(bl),
                      check_int("prompts per workload", prompts_per_workload, 1, 32),
                      check_int("max new tokens", max_new_tokens, 1, 128),
                      check_float("temperature", temperature, 0.0, MAX_TEMPERATURE),
                      check_int("seed", seed, 0, MAX_SEED))
    if s.cells > MAX_SWEEP_CELLS:
        raise SpeclabError(f"this sweep has {s.cells} cells (at most {MAX_SWEEP_CELLS}): pick fewer workloads, "
                           f"drafts, k values or batch sizes")
    return s


class StopGate:
    """A page's Stop button and the run it stops.

    Gradio's own cancel races the update a run has already sent on its way, which can land after the
    page says "stopped" and overwrite it. So Stop also sets this gate: the run checks ``stopping``
    before and after each update and ends, and ``stop()`` waits until it has (``end()``) before the
    page is told. One gate per page and tab, kept in a ``gr.State``; a copy is a fresh gate (Gradio
    deep-copies a State's initial value for each page).

    Gradio also keeps, in the page, the last control change that arrived while a run was going
    (``trigger_mode="always_last"``) and sends it as soon as the cancelled run's stream closes, that
    is, right after Stop. That run was asked for *before* Stop, so the gate refuses any run that begins
    while a stop is waiting or within ``QUIET_S`` after it: it ends at once with an update that changes
    nothing (see :meth:`guard`), and the page keeps saying "stopped"."""

    QUIET_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stops_waiting = 0
        self._quiet_until = 0.0

    def __deepcopy__(self, memo) -> "StopGate":
        return StopGate()

    def begin(self) -> bool:
        """Start a run; False (and nothing changed) if it was asked for before a Stop just pressed."""
        with self._lock:
            if self._stops_waiting or time.monotonic() < self._quiet_until:
                return False
            self._stop.clear()
            self._idle.clear()
            return True

    def end(self) -> None:
        self._idle.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def idle(self) -> bool:
        """No run is going."""
        return self._idle.is_set()

    @staticmethod
    def guard(updates: Iterator, gate: "StopGate | None", refused=None):
        """Pass a run's page updates through, ending the run as soon as Stop has set ``gate`` (checked
        before and after each update), and tell the gate when it has ended. A run the gate refuses
        (``begin()``) yields only ``refused`` (if given: an update that changes nothing; a generator that
        yields nothing at all would blank its outputs)."""
        gate = gate or StopGate()
        close = getattr(updates, "close", None)  # a generator: closed between its updates
        if not gate.begin():
            if close is not None:
                close()
            if refused is not None:
                yield refused
            return
        try:
            for update in updates:
                if gate.stopping:
                    return
                yield update
                if gate.stopping:
                    return
        finally:
            if close is not None:
                close()
            gate.end()

    def stop(self, timeout: float = 20.0) -> bool:
        """Ask the running run to end; True once it has (or none was running), False after ``timeout``.
        Runs that begin meanwhile, or within ``QUIET_S`` after, are refused."""
        with self._lock:
            self._stop.set()
            self._stops_waiting += 1
        try:
            return self._idle.wait(timeout)
        finally:
            with self._lock:
                self._stops_waiting -= 1
                self._quiet_until = time.monotonic() + self.QUIET_S


class Job:
    """Work on a worker thread that the UI polls (``progress``, ``desc``), can ``cancel()`` (honoured
    between steps) and reads ``error`` from when it is done."""

    def __init__(self, cfg: AppConfig, s, desc: str = "starting"):
        self.cfg, self.s = cfg, s
        self.progress, self.desc = 0.0, desc
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._guarded, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def _run(self) -> None:
        raise NotImplementedError

    def _progress(self, frac: float, desc: str) -> None:
        self.progress, self.desc = frac, desc

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()


class SweepJob(Job):
    """``run_sweep`` on a worker thread, so the caller can poll progress and cancel it."""

    def __init__(self, cfg: AppConfig, s: SweepSettings):
        super().__init__(cfg, s, "loading models")
        self.df = None

    def _run(self) -> None:
        from ..analysis.sweep import SweepSpec, run_sweep

        target = get_target(self.cfg, self.s.target)
        for d in self.s.drafts:  # check tokenizers and warm up before measuring anything
            if self._cancel.is_set():
                return
            warm_up(target, d)
        spec = SweepSpec(list(self.s.workloads), list(self.s.drafts), list(self.s.ks), list(self.s.batches),
                         temperature=self.s.temperature, max_new_tokens=self.s.max_new_tokens,
                         prompts_per_workload=self.s.prompts_per_workload, seed=self.s.seed)
        self.df = run_sweep(target, spec, progress=self._progress, cancel=self._cancel.is_set)


def sweep_table(df):
    """The sweep DataFrame for display and CSV: lists as text, floats rounded."""
    if df is None or not len(df):
        return df
    out = df.copy()
    if "per_position_acceptance" in out:
        out["per_position_acceptance"] = out["per_position_acceptance"].map(
            lambda v: " ".join(f"{x:.2f}" for x in v) if isinstance(v, (list, tuple)) else v)
    for c in out.columns:
        if out[c].dtype.kind == "f":
            out[c] = out[c].round(4)
    return out


# --------------------------------------------------------------------------------- timing
TIMING_REPEATS = 5


def run_timing(cfg: AppConfig, s: DecodeSettings, repeats: int = TIMING_REPEATS) -> dict:
    """Baseline and speculative runs of the same prompt (one row), each warmed up, then interleaved
    (baseline, speculative, baseline, ...) ``repeats`` times: the table holds the medians, the gap
    charts the run whose tokens/s is its method's median. Neither method pays the process's first,
    slow forwards, and a burst of load on a shared machine hits both alike."""
    import statistics

    import pandas as pd

    from ..analysis.sweep import new_drafter
    from ..engine import SpeculativeDecoder
    from ..metrics import Recorder

    target = get_target(cfg, s.target)
    warm_up(target, s.drafter_spec if s.speculative else "none")
    prompts = [s.prompt]
    runs = [("baseline (k=0)", None, 0)]
    if s.speculative:
        runs.append((f"{s.drafter_spec} k={s.k}" + (f" ({s.policy})" if s.policy != "fixed" else ""),
                     s.drafter_spec, s.k))
    for _, spec, k in runs:  # warm both paths on this very prompt
        SpeculativeDecoder(target, new_drafter(spec, target) if spec else None).generate(
            prompts, k=k, max_new_tokens=min(8, s.max_new_tokens), record=False)
    per: dict[str, list] = {name: [] for name, _, _ in runs}
    for _ in range(max(1, repeats)):
        for name, spec, k in runs:
            rec = Recorder(target)
            dec = SpeculativeDecoder(target, new_drafter(spec, target) if spec else None)
            for _ev in timed_stream(dec, prompts, s, k, rec):
                pass
            per[name].append(rec)
    gaps, rows, summaries = [], [], {}
    for name, recs in per.items():
        ms = [r.summary() for r in recs]
        tps = [m["tokens_per_s"] or 0.0 for m in ms]
        mid = sorted(range(len(ms)), key=lambda i: tps[i])[len(ms) // 2]  # the median run, for the charts
        med = {key: statistics.median([m[key] for m in ms if m[key] is not None])
               for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "itl_p50_ms", "itl_max_ms")
               if any(m[key] is not None for m in ms)}
        summaries[name] = dict(ms[mid], **med, repeats=len(ms))
        g = recs[mid].gaps_frame()
        g["method"] = name
        gaps.append(g)
        rows.append(dict(method=name, **{key: med.get(key) for key in ("ttft_ms", "tpot_ms", "tokens_per_s",
                                                                      "itl_p50_ms", "itl_max_ms")},
                         repeats=len(ms)))
    names = [n for n, _, _ in runs]
    sp = speedup(summaries[names[-1]], summaries[names[0]]) if len(names) == 2 else None
    return {"gaps": pd.concat(gaps, ignore_index=True), "ttft": pd.DataFrame(rows), "metrics": summaries,
            "speedup": sp}


# --------------------------------------------------------------------------------- advisor
ACCEPTANCE_SHIPPED = "the embedded family's acceptance report"
ACCEPTANCE_TYPED = "typed rates"
ACCEPTANCE_FILES = "lab or load results (JSON/CSV)"
DRAFT_BY_COST = "a draft step as a fraction of the target's"


@dataclass(frozen=True)
class AdviceSettings:
    source: str
    rates: str
    files: tuple[str, ...]
    hardware: str
    target_model: str
    draft_model: str
    draft_cost: float
    concurrency: int
    k_max: int
    ttft_ms: float | None
    tpot_ms: float | None
    output_tokens: float


def advisor_choices() -> dict:
    """What the Advisor tab offers: hardware presets, named model shapes."""
    from ..analysis.roofline import SHAPES, preset_names

    return {"hardware": preset_names(), "shapes": list(SHAPES)}


def validate_advice(source, rates, files, hardware, target_model, draft_model, draft_cost, concurrency, k_max,
                    ttft_ms=0, tpot_ms=0, output_tokens=256) -> AdviceSettings:
    ch = advisor_choices()
    if source not in (ACCEPTANCE_SHIPPED, ACCEPTANCE_TYPED, ACCEPTANCE_FILES):
        raise SpeclabError(f"unknown acceptance source {source!r}")
    if hardware not in ch["hardware"]:
        raise SpeclabError(f"unknown hardware {hardware!r} (known: {', '.join(ch['hardware'])})")
    if target_model not in ch["shapes"]:
        raise SpeclabError(f"unknown target model {target_model!r} (known: {', '.join(ch['shapes'])})")
    if draft_model != DRAFT_BY_COST and draft_model not in ch["shapes"]:
        raise SpeclabError(f"unknown draft model {draft_model!r}")
    paths = tuple(str(getattr(f, "name", f)) for f in (files or []) if f)
    if source == ACCEPTANCE_FILES and not paths:
        raise SpeclabError("upload at least one result file (speclab bench --json, a sweep, speclab load --json)")
    if source == ACCEPTANCE_TYPED and not (isinstance(rates, str) and rates.strip()):
        raise SpeclabError("type acceptance rates, e.g. json:0.7,code:0.35")

    def opt(name, v):
        v = check_float(name, v or 0, 0.0, 1e6)
        return v or None

    return AdviceSettings(source, rates or "", paths, hardware, target_model, draft_model,
                          check_float("draft cost", draft_cost if draft_cost is not None else 0.05, 0.0, 1.0),
                          check_int("expected concurrency", concurrency, 1, 4096), check_int("k max", k_max, 1, MAX_K),
                          opt("TTFT ms", ttft_ms), opt("TPOT ms", tpot_ms),
                          check_float("output tokens", output_tokens, 1.0, 1e6))


def run_advice(s: AdviceSettings):
    """The advisor (speclab.analysis.advisor) on the tab's inputs: an Advice (rubric rows, verdicts, notes,
    what it does not cover, speedup vs batch curves)."""
    from ..analysis.advisor import advise, make_deployment, parse_acceptance, read_inputs
    from ..family import FAMILY_DIR

    if s.source == ACCEPTANCE_SHIPPED:
        inp = read_inputs([FAMILY_DIR / "acceptance.json"])
    elif s.source == ACCEPTANCE_FILES:
        inp = read_inputs(list(s.files))
    else:
        from ..analysis.advisor import Inputs

        inp = Inputs(workloads=parse_acceptance(s.rates))
    if s.ttft_ms is not None:
        inp.ttft_ms, inp.ttft_source = s.ttft_ms, "assumed"
    if s.tpot_ms is not None:
        inp.tpot_ms, inp.tpot_source, inp.tpot_is_plain = s.tpot_ms, "assumed", True
    inp.output_tokens, inp.output_source = s.output_tokens, "assumed"
    inp.concurrency, inp.concurrency_source = s.concurrency, "assumed"
    draft = dict(draft_model=s.draft_model) if s.draft_model != DRAFT_BY_COST else dict(draft_cost=s.draft_cost)
    dep = make_deployment(s.hardware, inputs=inp, target_model=s.target_model, k_max=s.k_max,
                          concurrency=s.concurrency, **draft)
    return advise(inp, dep, s.concurrency)


# --------------------------------------------------------------------------------- load
LOAD_LEVELS = [1, 2, 4, 8, 16, 32]
LOAD_IN_PROCESS = "a speclab serve started by this tab"
LOAD_REMOTE = "a server at a URL"
MAX_LOAD_CELLS = 30  # (policy, level) cells per run


@dataclass(frozen=True)
class LoadSettings:
    server: str
    url: str | None
    target: str
    draft: str
    policies: tuple[str, ...]  # for the in-process server: "off" = plain decoding
    k: int
    levels: tuple[int, ...]
    workload: str
    requests: int  # per level
    max_tokens: int
    split: bool  # one token per SSE chunk

    @property
    def cells(self) -> int:
        return len(self.levels) * (len(self.policies) if self.server == LOAD_IN_PROCESS else 1)


def validate_load(cfg: AppConfig, server, url, target, draft, policies, k, levels, workload, requests, max_tokens,
                  split=False) -> LoadSettings:
    from ..load.runner import base_url
    from ..workloads import list_workloads

    if server not in (LOAD_IN_PROCESS, LOAD_REMOTE):
        raise SpeclabError(f"unknown server choice {server!r}")
    if server == LOAD_REMOTE:
        if not cfg.allow_remote_servers:
            raise SpeclabError("measuring a server at a URL needs the app started with --allow-remote-servers")
        if not isinstance(url, str) or not url.strip():
            raise SpeclabError("type the server's URL, e.g. http://127.0.0.1:8000")
        url = base_url(url)
    else:
        url = None
    target = check_model_choice(cfg, target, "target")
    draft = check_model_choice(cfg, draft, "draft")
    pols = []
    for p in _as_list("policies", policies):
        p = check_policy(p)
        if p not in pols:
            pols.append(p)
    if server == LOAD_IN_PROCESS and not pols:
        raise SpeclabError("pick at least one policy (off = plain decoding)")
    if server == LOAD_IN_PROCESS and draft == "none" and any(p != "off" for p in pols):
        raise SpeclabError("pick a draft for the speculative policies (or only 'off')")
    lv = sorted({check_int("load level", v, 1, 256) for v in _as_list("load levels", levels)})
    if not lv:
        raise SpeclabError("pick at least one load level")
    if workload not in list_workloads():
        raise SpeclabError(f"unknown workload {workload!r}")
    s = LoadSettings(server, url, target, draft, tuple(pols), check_int("k", k, 1, MAX_K), tuple(lv), workload,
                     check_int("requests per level", requests, 1, 256), check_int("max tokens", max_tokens, 1, 512),
                     bool(split))
    if s.cells > MAX_LOAD_CELLS:
        raise SpeclabError(f"this run has {s.cells} cells (at most {MAX_LOAD_CELLS}): pick fewer policies or levels")
    return s


class LoadJob(Job):
    """``speclab load`` over rising concurrency against each policy's ``speclab serve`` (started in this
    process, one after another) or a server at a URL, on a worker thread; ``cancel()`` stops after the
    current level."""

    def __init__(self, cfg: AppConfig, s: LoadSettings):
        super().__init__(cfg, s)
        self.results: dict[str, dict] = {}  # series name -> speclab load result

    def _server(self, policy: str):
        from ..analysis.sweep import new_drafter
        from ..engine import make_policy
        from ..serve.app import Server
        from ..serve.inprocess import InProcessServer

        target = get_target(self.cfg, self.s.target)
        pol = make_policy(policy, self.s.k)
        drafter = new_drafter(self.s.draft, target) if policy != "off" else None
        name = f"{self.s.target}"
        srv = Server(target, drafter, pol, served_name=name, stream_split_tokens=self.s.split,
                     method="draft_model" if drafter is not None else "none",
                     draft_name=self.s.draft if drafter is not None else "none")
        return InProcessServer(srv), name

    def _run(self) -> None:
        from ..load.client import Endpoint
        from ..load.prompts import load_prompts
        from ..load.runner import LoadSpec, run
        from ..load.shapes import LoadLevel

        prompts = load_prompts(self.s.workload)
        series = self.s.policies if self.s.server == LOAD_IN_PROCESS else ("remote",)
        total, done = self.s.cells, 0
        for name in series:
            if self._cancel.is_set():
                return
            self.desc = f"starting speclab serve ({name})" if name != "remote" else "contacting the server"
            ctx, model = self._server(name) if name != "remote" else (None, None)
            url = ctx.start().url if ctx is not None else self.s.url
            try:
                ep = Endpoint(url, model=model, max_tokens=self.s.max_tokens, timeout=60.0)
                levels = []
                for i, c in enumerate(self.s.levels):
                    if self._cancel.is_set():
                        break
                    self.desc = f"{name}: concurrency {c}"
                    spec = LoadSpec([LoadLevel("concurrency", c)], prompts, num_requests=max(self.s.requests, c),
                                    quiet=True, warmup=1 if i == 0 else 0, tokenizer=None)
                    r = run(ep, spec)
                    if all(lv["summary"]["completed"] == 0 for lv in r["levels"]):
                        why = r["levels"][0]["summary"].get("failure_examples") or ["no request completed"]
                        raise SpeclabError(f"{url}: every request failed ({why[0]})")
                    levels += r["levels"]
                    done += 1
                    self.progress = done / total
                if levels:
                    from ..load import fingerprint

                    r["levels"] = levels
                    r["verdict"] = fingerprint.verdict([(lv["level"]["label"], lv["level"]["value"],
                                                         lv["fingerprint"]) for lv in levels])
                    self.results[name] = r
            finally:
                if ctx is not None:
                    ctx.stop()


def load_tables(results: dict[str, dict]):
    """(rows per series and level, acceptance rows from /metrics) as DataFrames."""
    import pandas as pd

    from ..load.report import level_rows

    rows, acc = [], []
    for name, r in results.items():
        for row in level_rows(r):
            rows.append(dict(policy=name, verdict=r["verdict"]["verdict"], **row))
        for lv in r["levels"]:
            sd = (lv.get("server") or {}).get("spec_decode") or {}
            if sd:
                acc.append(dict(policy=name, load=lv["level"]["label"],
                                acceptance_rate=sd.get("acceptance_rate"),
                                mean_acceptance_length=sd.get("mean_acceptance_length"),
                                per_position=" ".join(f"{x:.2f}" for x in (sd.get("per_position_acceptance") or []))))
    return pd.DataFrame(rows), pd.DataFrame(acc)
