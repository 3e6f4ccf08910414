"""Step costs measured online: how the target's forward time grows with rows x tokens, what a round's
draft phase costs, and the per-round host work around the forwards. The scheduler feeds every round
it times (:mod:`.cost_sampler`); policies read predictions (:meth:`OnlineCosts.round_time`).

The cost of a round has one home, :func:`round_time`: a draft phase, one target forward over the verify block, and
the host work around them. The live policies weigh with it, and so do the user-facing cost model
(:mod:`speclab.analysis.costmodel`, over the roofline's or timed step costs) and the synthetic benchmark's
prediction from a round's parts (:mod:`speclab.analysis.round_plan`).

Tables, all in seconds:

* ``target[(n, T)]``: one target forward of n rows x T tokens per row (T = k + 1 in a round of k drafts).
* ``draft[(n, s)]``: a round's whole draft phase for n rows and s draft steps (catch-up forward,
  the s steps, the policy's own decision: everything between the round's start and the verify).
* ``overhead[n]``: the rest of a round of n rows (acceptance, bookkeeping, events), by load level
  (n rounded up to a power of two).
* the draft model's prefill, in seconds per token (the median of its recent admissions): what taking a row
  into the draft costs (the scheduler puts that off until the row first drafts).

Each entry is the median of the last ``window`` measurements at exactly that shape (a calibrated shape
adds its calibrated value twice): on a shared machine a round now and then takes several times its
usual time (the process was descheduled), and a median ignores those bursts where a mean would follow
them; it still follows a lasting change within half a window.
A shape never run is predicted by linear interpolation, first along the rows among shapes with the same T, then along T
(beyond the measured range: along the nearest two points, never decreasing; from one point:
proportionally when growing, flat when shrinking). Beyond the rows known for its T, a shape borrows the
growth with rows of another T known over them (in a server, plain steps at every row count the load
passed through): a verify width tried only at 2 rows is predicted at 16 rows by how plain steps grew from
2 to 16, not by a straight line, which would make speculation look several times dearer under load than
it is and keep an adaptive policy from ever trying it there. So a cost table learnt at 37 rows answers for
36 rows at once, and a policy never needs every shape to have been run.

**Cold start.** Until something is measured, policies that weigh costs need numbers:
:meth:`OnlineCosts.calibrate` times a grid of shapes (target forwards of rows x tokens; a model draft's whole
draft phase of 1..K steps per row count, run through the drafter as a round runs it) in a timing loop before any
timed work. Calibrated values are a prior: a shape
measured online replaces its calibrated value, and the ratio of online to calibrated predictions
(forwards inside the decode loop run slower than in a timing loop) rescales the calibrated values of
shapes not yet run, so that measured and calibrated shapes compare fairly. The ratio is kept per load
level (row count rounded up to a power of two; the nearest level measured answers for one not yet
measured): the per-round work a timing loop leaves out weighs most at one row, so a ratio learnt at 64
rows would make one row's untried draft lengths look cheaper than they are, and one learnt at one row
would make 64 rows' look dearer. Calibrations are cached
per process and (target, draft, grid), so a benchmark pays for one once, outside its timed region.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from bisect import bisect_left, insort
from collections import deque

import torch

from .drafting import DraftContext
from .sampling import RowParams, SamplingParams


def round_time(costs, rows: int, k: int, *, verify_tokens: int | None = None, draft_steps: int | None = None,
               overhead: float | None = None) -> float | None:
    """Seconds of one round of ``rows`` rows drafting k tokens: ``draft_steps`` (default k) draft steps, one target
    forward over ``verify_tokens`` (default k + 1; a tree verifies more) tokens per row, and ``overhead``, the host
    work per round outside the forwards (default: what ``costs`` measured for such a round, else 0). k = 0 is a plain
    decode step: one target forward of one token a row.

    ``costs`` is any source of step costs with ``target_time(rows, tokens)`` and either ``draft_total(rows, steps)``
    (a whole draft phase, as :class:`OnlineCosts` measures it) or ``draft_time(rows)`` (seconds per draft step, as
    the roofline and timed forwards give it). None when a part is not known yet."""
    steps = 0 if k == 0 else (k if draft_steps is None else draft_steps)
    t = costs.target_time(rows, 1 if k == 0 else (verify_tokens or k + 1))
    if steps == 0:
        d = 0.0
    elif hasattr(costs, "draft_total"):
        d = costs.draft_total(rows, steps)
    else:
        d = steps * costs.draft_time(rows)
    if t is None or d is None:
        return None
    if overhead is None:
        measured = getattr(costs, "overhead_time", None)
        overhead = measured(rows, k > 0) if measured is not None else 0.0
    return d + t + overhead


_CALIBRATIONS: dict[tuple, tuple[dict, dict, float]] = {}  # (models, grid) -> (target, draft per step, seconds)


# Calibration at start-up: the fastest of 5 runs of each shape. A run preempted by another process only gets slower,
# so the fastest is the run nearest the shape's own cost; a median of a few runs can take a preempted one, misprice
# one draft length against the others, and keep a cost-weighing policy from drafting where it pays.
ROBUST_STAT, ROBUST_REPS = "min", 5
PLAIN_SAMPLES = 3  # plain steps timed online at a load level before a policy trusts its plain estimate there
STALE = 24  # samples of a kind at a row count after which a shape of that kind not sampled since is forgotten


def calibration_clock(device, threads: int):
    """What start-up calibration times forwards with: on a CPU with one torch thread, the thread's own CPU time
    (``time.thread_time``), which another process taking the core cannot stretch; else the wall clock (a GPU's work
    and other torch threads' do not show in the calling thread's CPU time).

    On a machine shared with other busy processes, even the fastest of several wall-clock runs can stretch some widths
    and not others, which skews the ratios a policy weighs. Thread CPU time slows every width alike when the machine
    is slower, and a uniform factor is what the online samples correct (each load level's shapes are rescaled by the
    online / calibrated ratio of their kind, or of the other kind until theirs is measured: ``_scale_of``)."""
    return time.thread_time if device.type == "cpu" and threads == 1 else time.perf_counter


def row_level(n: int) -> int:
    """The load level n rows belong to: n rounded up to a power of two (the cost table and the policies keep
    their per-level state by it; CUDA graphs bucket rows by their own :func:`speclab.models.cuda_graphs.row_bucket`)."""
    return 1 << max(0, (max(1, n) - 1).bit_length())


def calibration_rows(*levels: int) -> tuple[int, ...]:
    """The row counts to calibrate for runs at ``levels`` rows: the levels and every power of two below the
    largest (rows finish and leave, so a run passes through every smaller count)."""
    top = max(levels)
    return tuple(sorted(set(levels) | {1 << i for i in range(top.bit_length()) if 1 << i <= top}))


def interpolate(xs: list, f, x: float, below_proportional: bool = False) -> float | None:
    """f at ``x`` from its values at the sorted points ``xs`` (``f(xs[i])`` evaluated lazily):
    exact, linear between neighbours, linear along the nearest two beyond the range (slope >= 0;
    below the range never under the proportional value), proportional above / flat below one point
    (proportional below too with ``below_proportional``: a draft phase of fewer steps).

    e.g. xs = [1, 4], f(1) = 2, f(4) = 5: x = 2 -> 3; x = 8 -> 9; x = 0.5 -> max(1.5, 1) = 1.5.
    """
    if not xs:
        return None
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return f(xs[i])
    if 0 < i < len(xs):
        x0, x1 = xs[i - 1], xs[i]
        y0, y1 = f(x0), f(x1)
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if len(xs) == 1:
        y0 = f(xs[0])
        return y0 * x / xs[0] if (x > xs[0] or below_proportional) else y0
    if i == len(xs):  # above the range
        x0, x1 = xs[-2], xs[-1]
        y0, y1 = f(x0), f(x1)
        return y1 + max((y1 - y0) / (x1 - x0), 0.0) * (x - x1)
    x0, x1 = xs[0], xs[1]  # below the range
    y0, y1 = f(x0), f(x1)
    return max(y0 - max((y1 - y0) / (x1 - x0), 0.0) * (x0 - x), y0 * x / x0)


class _Grid:
    """Values at (n, T) points: measured online (``val``) and calibrated (``cal``, multiplied by
    ``scale_of(n, T)`` when read), with an index by T of the row counts known, for interpolation."""

    def __init__(self, scale_of=lambda n, T: 1.0, below_proportional: bool = False):
        self.below_proportional = below_proportional
        self.val: dict[tuple[int, int], float] = {}
        self.cal: dict[tuple[int, int], float] = {}
        self.by_T: dict[int, list[int]] = {}
        self.scale_of = scale_of

    def _index(self, n: int, T: int) -> None:
        if (n, T) not in self.val and (n, T) not in self.cal:
            insort(self.by_T.setdefault(T, []), n)

    def set(self, n: int, T: int, v: float) -> None:
        self._index(n, T)
        self.val[(n, T)] = v

    def set_cal(self, n: int, T: int, v: float) -> None:
        self._index(n, T)
        self.cal[(n, T)] = v

    def get(self, n: int, T: int) -> float:
        v = self.val.get((n, T))
        return v if v is not None else self.cal[(n, T)] * self.scale_of(n, T)

    def _rows(self, n: int, t: int) -> float | None:
        return interpolate(self.by_T[t], lambda m: self.get(m, t), n)

    def along_rows(self, n: int, t: int) -> float | None:
        """The value at (n, t) along the rows: interpolated where t's row counts bracket n; outside them, the
        nearest known row count m of t scaled by how another width ``u`` whose row counts bracket n grows
        from m to n, value(m, t) x value(n, u) / value(m, u) (the widest-known rows' growth, transferred);
        by :func:`interpolate` alone when no width brackets n.

        e.g. t = 3 known at 1 row only (3 ms), t = 1 at 1, 2 and 4 rows (2, 2.5 and 3 ms): (4, 3) ->
        3 x 3 / 2 = 4.5 ms, where growing in proportion to the rows would say 12 ms (a forward of few rows
        costs its weights' reads, which do not grow with the rows)."""
        ms = self.by_T[t]
        if ms[0] <= n <= ms[-1]:
            return self._rows(n, t)
        m = ms[0] if n < ms[0] else ms[-1]
        refs = [u for u, us in self.by_T.items() if u != t and us[0] <= n <= us[-1]]
        if refs:
            u = min(refs, key=lambda x: (abs(x - t), x))
            base, there = self._rows(m, u), self._rows(n, u)
            if base and there is not None:
                return self.get(m, t) * there / base
        return self._rows(n, t)

    def predict(self, n: int, T: int) -> float | None:
        """Along n within each known T (:meth:`along_rows`), then along T."""
        if (n, T) in self.val:
            return self.val[(n, T)]
        if not self.by_T:
            return None
        Ts = sorted(self.by_T)
        return interpolate(Ts, lambda t: self.along_rows(n, t), T, self.below_proportional)

    def near(self, n: int, which) -> bool:
        """Some T with ``which(T)`` known at a row count within 2x of n."""
        return any(which(t) and any(n / 2 <= m <= 2 * n for m in ms) for t, ms in self.by_T.items())


class OnlineCosts:
    def __init__(self, window: int = 9):
        self.window = window
        # online / calibrated, for shapes only calibrated: table -> (load level, one token or step?) -> median of the
        # recent ratios (a plain step and a verify block drift from their calibration apart, most at many rows)
        self._scales: dict[str, dict[tuple[int, bool], float]] = {"target": {}, "draft": {}}
        self._target = _Grid(self._scale_of("target"))  # (n, T) -> s
        self._draft = _Grid(self._scale_of("draft"), below_proportional=True)  # (n, steps) -> s for a draft phase
        self._over = _Grid()  # (load level, 1) -> s of per-round work outside the forwards, drafting rounds
        self._over_plain = _Grid()  # the same for rounds without drafts (less to accept, nothing to roll back)
        self._recent: dict[tuple, deque] = {}  # (table, n, T) -> the last `window` samples
        self._ratios: dict[tuple, deque] = {}  # (table, load level, one token?) -> recent online / calibrated ratios
        self._prefill: deque = deque(maxlen=window)  # draft prefill: recent seconds per token
        # (table, n, one token or step?) -> T -> how many samples of that kind at n rows there were when (n, T) was
        # last sampled (the newest entry is the kind's count)
        self._at: dict[tuple, dict[int, int]] = {}
        self._plain_seen: dict[int, int] = {}  # row_level -> plain steps timed online there
        self.version = 0  # bumped by every record: policies may cache predictions per version
        self.calibration_s = 0.0  # time spent calibrating (outside any timed region)
        # what the online samples are timed with: the calibration's clock (:meth:`calibrate`), so that each sample's
        # ratio to its calibration compares like with like, and on a CPU with one torch thread, the thread's CPU time
        # (:func:`calibration_clock`), which another process taking the core cannot stretch
        self.clock = time.perf_counter
        self.frozen = False  # True: records are ignored (a fixed, hand-built table: tests and what-if runs)
        self.lock = threading.Lock()

    def copy(self) -> "OnlineCosts":
        """An independent copy, calibration and online samples included (its own lock and scales): each of several
        policies run side by side learns its own table from its own rounds, as each server would."""
        with self.lock:
            lock, self.lock = self.lock, None
            try:
                new = copy.deepcopy(self)
            finally:
                self.lock = lock
        new.lock = threading.Lock()
        new._target.scale_of = new._scale_of("target")  # the closures read the copy's scales, not these
        new._draft.scale_of = new._scale_of("draft")
        return new

    def _scale_of(self, name: str):
        levels = self._scales[name]

        def scale(n: int, T: int) -> float:
            """The online / calibrated ratio of shapes of T's kind (one token or step, or more) at n's load level, or
            at the nearest level where that kind was measured; the other kind's only when that kind never was (1:
            nothing measured)."""
            if not levels:
                return 1.0
            b, one = row_level(n), T == 1
            if (b, one) in levels:
                return levels[(b, one)]
            same = [key for key in levels if key[1] == one] or list(levels)
            near = min(same, key=lambda key: (abs(key[0].bit_length() - b.bit_length()), key[0], key[1] != one))
            return levels[near]

        return scale

    @property
    def scale(self) -> dict[str, float]:
        """Per table, the median online / calibrated ratio over its load levels (1: none measured)."""
        return {k: statistics.median(v.values()) if v else 1.0 for k, v in self._scales.items()}

    # ------------------------------------------------------------------ recording
    def _record(self, name: str, grid: _Grid, n: int, T: int, seconds: float) -> None:
        if self.frozen:
            return
        cal = grid.cal.get((n, T))
        # a calibrated shape counts as two samples, at the online/calibrated scale the other samples set (taken before
        # this one's ratio joins it): the first one or two online samples, maybe taken in a burst of load or on cold
        # caches, cannot alone become the estimate. Scaled after, the first sample at a level would set its own prior,
        # and one slow verify on cold caches would price every draft length at a level
        prior = [cal * grid.scale_of(n, T)] * 2 if cal else []
        if cal:  # online vs calibrated at the same shape: rescale this load level's shapes of its kind only calibrated
            key = (row_level(n), T == 1)
            ratios = self._ratios.setdefault((name, *key), deque(maxlen=3 * self.window))
            ratios.append(seconds / cal)
            self._scales[name][key] = statistics.median(ratios)
        key = (name, n, T)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque(maxlen=self.window)
        recent.append(seconds)
        grid.set(n, T, statistics.median([*recent, *prior]))
        self._expire(name, grid, n, T)
        self.version += 1

    def _expire(self, name: str, grid: _Grid, n: int, T: int) -> None:
        """Forget the online samples of each calibrated shape of T's kind at n rows that :data:`STALE` samples of that
        kind at n rows have passed by: it falls back to its calibration at the load level's current online /
        calibrated scale, which follows the machine's drift, until it is timed again. A policy times only the draft
        lengths it chooses, and a length it stopped choosing would keep the price it had then: a slow spell that
        priced the best k high would leave the policy on shorter drafts for the rest of the run. Expiring the stale
        samples lets it return to that k once the spell has passed."""
        at = self._at.setdefault((name, n, T == 1), {})
        count = at[T] = max(at.values(), default=0) + 1
        for t in [t for t, c in at.items() if count - c >= STALE and (n, t) in grid.cal]:
            del at[t]
            self._recent.pop((name, n, t), None)
            grid.val.pop((n, t), None)

    def record_target(self, n: int, T: int, seconds: float) -> None:
        with self.lock:
            self._record("target", self._target, n, T, seconds)
            if T == 1 and not self.frozen:
                b = row_level(n)
                self._plain_seen[b] = self._plain_seen.get(b, 0) + 1

    def record_draft(self, n: int, steps: int, seconds: float) -> None:
        """The whole draft phase of a round: ``steps`` draft steps for ``n`` rows took ``seconds``."""
        if steps > 0:
            with self.lock:
                self._record("draft", self._draft, n, steps, seconds)

    def record_overhead(self, n: int, seconds: float, drafted: bool = True) -> None:
        """Per-round work around the forwards (acceptance, bookkeeping, events) for ``n`` rows; ``drafted``: a
        drafting round (acceptance, rollback and the drafter's commit over k+1 tokens a row), or a plain one."""
        with self.lock:  # by load level: a few samples per level, not one per row count
            if drafted:
                self._record("overhead", self._over, row_level(n), 1, seconds)
            else:
                self._record("overhead_plain", self._over_plain, row_level(n), 1, seconds)

    def record_draft_prefill(self, tokens: int, seconds: float) -> None:
        """The draft model took in rows of ``tokens`` tokens in all (their prompts and what they generated)."""
        if tokens > 0 and not self.frozen:
            with self.lock:
                self._prefill.append(seconds / tokens)
                self.version += 1

    # ------------------------------------------------------------------ predictions
    def measured(self, n: int, T: int) -> bool:
        """A target forward of n rows x T tokens was timed online (not only calibrated, nor predicted from other
        shapes)."""
        with self.lock:
            return (n, T) in self._target.val

    def target_time(self, n: int, T: int) -> float | None:
        """Seconds for a target forward of n rows x T tokens (None: nothing measured yet)."""
        with self.lock:
            return self._target.predict(n, T)

    def draft_total(self, n: int, steps: int) -> float | None:
        """Seconds of a round's draft phase with ``steps`` steps for ``n`` rows (None: unknown)."""
        if steps <= 0:
            return 0.0
        with self.lock:
            return self._draft.predict(n, steps)

    def draft_time(self, n: int) -> float | None:
        """Seconds per draft step for ``n`` rows (the draft phase of a one-step round)."""
        return self.draft_total(n, 1)

    def draft_prefill_time(self, tokens: int) -> float:
        """Seconds for the draft model to take in ``tokens`` tokens (0: nothing measured yet)."""
        with self.lock:
            return statistics.median(self._prefill) * tokens if self._prefill else 0.0

    def overhead_time(self, n: int, drafted: bool = True) -> float:
        """Seconds of per-round work outside the forwards at ``n`` rows, for a drafting round or a plain one (the
        other kind's when only that was measured; 0 when neither was). A plain round's is at most a drafting
        round's at the same rows (a plain overhead known only at a far row count, extrapolated, can read several
        times a drafting round's)."""
        with self.lock:
            first, other = (self._over, self._over_plain) if drafted else (self._over_plain, self._over)
            v, w = first.predict(n, 1), other.predict(n, 1)
        if v is None:
            return w or 0.0
        if not drafted and w is not None:  # a plain round does a part of a drafting round's work (nothing to roll
            v = min(v, w)  # back, one token a row to accept): never more, whatever a far load level extrapolates to
        return v

    def round_time(self, n: int, k: int) -> float | None:
        """Expected seconds of a round of n rows drafting k tokens (k = 0: a plain decode step):
        the draft phase of k steps + a target forward over k + 1 tokens + the per-round overhead
        (:func:`round_time`)."""
        return round_time(self, n, k)

    def coverage(self, n: int) -> tuple[bool, bool, bool]:
        """(plain step, some verify width, draft) measured or calibrated at a row count within 2x of n:
        what a cost-weighing policy needs before it trusts the predictions at n rows."""
        with self.lock:
            return (self._target.near(n, lambda t: t == 1), self._target.near(n, lambda t: t > 1),
                    self._draft.near(n, lambda t: True))

    def plain_samples(self, n: int) -> int:
        """Plain steps timed online (not only calibrated) at n's load level (row counts rounded up to a power of
        two). A policy that drafts from the start never times one, and its plain-step estimate is then the
        calibration scaled by what other load levels or the verify blocks drifted to, which can be far off; one
        sample alone sets the estimate at its shape (the calibrated prior is rescaled by it), so a policy wants
        :data:`PLAIN_SAMPLES` of them (:class:`~speclab.engine.policies.PlainCheck`; the scheduler times every
        steady plain round until a level has them)."""
        return self._plain_seen.get(row_level(n), 0)

    def snapshot(self) -> dict:
        with self.lock:
            return {"target": {f"{n}x{t}": s for (n, t), s in sorted(self._target.val.items())},
                    "draft": {f"{n}x{t}": s for (n, t), s in sorted(self._draft.val.items())},
                    "overhead": {str(n): s for (n, _), s in sorted(self._over.val.items())},
                    "overhead_plain": {str(n): s for (n, _), s in sorted(self._over_plain.val.items())},
                    "draft_prefill_per_token": statistics.median(self._prefill) if self._prefill else None,
                    "calibrated_target": {f"{n}x{t}": s for (n, t), s in sorted(self._target.cal.items())},
                    "calibrated_draft": {f"{n}x{t}": s for (n, t), s in sorted(self._draft.cal.items())},
                    "scale": self.scale,
                    "scale_by_level": {k: {f"{n}x{'1' if one else 'more'}": r for (n, one), r in sorted(v.items())}
                                       for k, v in self._scales.items()},
                    "calibration_s": self.calibration_s}

    # ------------------------------------------------------------------ calibration
    def set_calibrated(self, target: dict[tuple[int, int], float], draft_step: dict[int, float] | None = None,
                       max_steps: int = 8, draft_phase: dict[tuple[int, int], float] | None = None) -> None:
        """Calibrated values: target seconds by (rows, tokens); draft seconds per step by rows (a draft phase
        of s steps, for s up to ``max_steps``, is calibrated as s steps), or ``draft_phase``: whole draft phases
        by (rows, steps), timed as they run (:func:`time_draft_phases`)."""
        with self.lock:
            for (n, T), sec in target.items():
                self._target.set_cal(n, T, sec)
            for n, sec in (draft_step or {}).items():
                for steps in range(1, max(max_steps, 1) + 1):
                    self._draft.set_cal(n, steps, sec * steps)
            for (n, steps), sec in (draft_phase or {}).items():
                self._draft.set_cal(n, steps, sec)
            self.version += 1

    def calibrate(self, target, draft=None, rows=(1, 2, 4, 8, 16, 32, 64), tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9),
                  context: int = 96, reps: int = 3, clock=time.perf_counter, fresh: bool = False,
                  stat: str = "median") -> float:
        """Time target forwards of every (rows x tokens) shape and the draft (``draft``: a drafter, an LM or None; a
        drafter without a model, such as prompt lookup, counts as None) per row count, each against a cache of
        ``context`` positions, ``stat`` of ``reps`` timed runs after one warm-up (see :func:`time_shapes`). The
        results are a prior (see the module docstring). A drafter with a model: its whole draft phase of s = 1..K steps
        as a round runs it (:func:`time_draft_phases`); an LM: one draft step, a phase of s steps calibrated as s steps
        (leaves out the catch-up forward and the host work around each step: at 64 rows a one-step phase runs about
        twice that). Cached per process for the same models and grid: returns the seconds spent *now* (about 0 when
        cached). Call it before any timed work. ``clock``: what the forwards are timed with (``time.process_time`` when
        the runs they are compared with are timed by CPU time); ``fresh``: time them again even if cached; ``stat``:
        "median" of the timed runs, or "min", which a preempted run cannot move (:data:`ROBUST_STAT`)."""
        phases = hasattr(draft, "propose")  # a drafter: its draft phases timed as they run
        if phases and getattr(draft, "lm", None) is None:  # a drafter without a model: its costs are learnt online
            draft, phases = None, False
        key = (id(target), id(draft) if draft is not None else None, tuple(rows), tuple(tokens), context, reps,
               clock, stat)
        t0 = time.perf_counter()
        if fresh or key not in _CALIBRATIONS:
            tt = time_shapes(target, rows, tokens, context, reps, clock=clock, stat=stat)
            if phases:
                dd = time_draft_phases(draft, rows, max(1, max(tokens) - 1), context, reps, target.vocab_size, clock,
                                       stat=stat)
            else:
                dd = time_shapes(draft, rows, (1,), context, reps, vocab=target.vocab_size, clock=clock, stat=stat) \
                    if draft is not None else {}
            _CALIBRATIONS[key] = (tt, dd, time.perf_counter() - t0)
        tt, dd, _ = _CALIBRATIONS[key]
        self.clock = clock
        if phases:
            self.set_calibrated(tt, draft_phase=dd)
        else:
            self.set_calibrated(tt, {n: s for (n, _), s in dd.items()}, max(tokens) - 1)
        spent = time.perf_counter() - t0
        self.calibration_s += spent
        return spent


def _reduce(stat: str):
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    return min if stat == "min" else statistics.median


def time_shapes(lm, rows, tokens, context: int, reps: int, vocab: int | None = None, clock=time.perf_counter,
                stat: str = "median", plain_apart: bool = True) -> dict:
    """Seconds of a cached forward of T new tokens per row after ``context`` positions (``stat``: the median or the
    fastest of ``reps`` timed runs after one warm-up), for every n in ``rows`` and T in ``tokens``. One cache per row
    count; every call writes the same slots. One-token forwards (plain decode steps) are timed one after another, as
    plain decoding runs them, and the wider ones round-robin among themselves: on the CPU a one-row step reads the
    other layout of the weights (see ``FEW_ROWS`` in ``speclab.models.native_llama``), so a step timed right after a
    wider forward runs with those weights cold (timed round-robin with the verify widths, a plain step reads slower
    than a forward of two tokens, and slower than plain decoding runs it).
    ``plain_apart=False``: every width round-robin (``speclab bench synthetic``, whose cost
    model is validated with forwards timed that way)."""
    reduce = _reduce(stat)
    dev = lm.device
    V = min(lm.vocab_size, vocab or lm.vocab_size)
    cuda = dev.type == "cuda"
    out = {}
    with torch.inference_mode():
        for n in rows:
            cache = lm.new_cache(n, context + max(tokens))
            zero = torch.zeros(n, dtype=torch.long, device=dev)
            cache.forward(torch.randint(0, V, (n, context), device=dev), zero, kv_len=context)
            cache.commit(zero + context)
            toks = {T: torch.randint(0, V, (n, T), device=dev) for T in tokens}
            times = {T: [] for T in tokens}
            groups = ([T for T in tokens if T == 1], [T for T in tokens if T != 1]) if plain_apart else \
                ([], list(tokens))
            for group in groups:
                for i in range(reps + 1 if group else 0):
                    for T in group:
                        if cuda:
                            torch.cuda.synchronize(dev)
                        t = clock()
                        cache.forward(toks[T], zero + context, kv_len=context + T)
                        if cuda:
                            torch.cuda.synchronize(dev)
                        if i:  # the first pass warms up
                            times[T].append(clock() - t)
            for T in tokens:
                out[(n, T)] = reduce(times[T])
            del cache
    return out


def time_draft_phases(drafter, rows, max_steps: int, context: int, reps: int, vocab: int,
                      clock=time.perf_counter, stat: str = "median") -> dict:
    """Seconds of a model drafter's whole draft phase (``stat`` of the timed runs), as the scheduler runs it
    (``drafter.propose``: the catch-up forward, every step, the host work around them), for n in ``rows`` and
    s = 1..``max_steps`` steps, greedy, at ``context`` positions. Half the timed phases catch up on one token (after
    a rejection), half on two (after a round whose drafts were all accepted: the bonus token). Runs on a shallow copy
    of ``drafter`` (its own cache; the weights shared), so a drafter in use keeps its state. One warm-up pass, then
    ``reps`` passes round-robin. ``stat`` "min": the mean of the two catch-ups' fastest runs."""
    reduce = _reduce(stat)
    d = copy.copy(drafter)
    dev = drafter.lm.device
    out = {}
    with torch.inference_mode():
        for n in rows:
            d.reset(n, context + max_steps + 4)
            buf = torch.randint(0, vocab, (n, context + max_steps + 4), device=dev)
            host = buf[:, :context + 2].tolist()

            at = {w: DraftContext(buf, torch.full((n,), context + w - 1, dtype=torch.long, device=dev),
                                  [context + w - 1] * n, [h[:context + w - 1] for h in host], None,
                                  [f"calibrate-{b}" for b in range(n)])
                  for w in (1, 2)}  # catching up on 1 or 2 tokens (the draft holds context - 1 positions)
            d.admit(at[1], range(n), None)
            params = RowParams([SamplingParams()] * n, dev)
            times = {(s, w): [] for s in range(1, max_steps + 1) for w in (1, 2)}
            for i in range(reps + 1):
                for s in range(1, max_steps + 1):
                    for w in (1, 2):
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        t = clock()
                        d.propose(at[w], [s] * n, params, None, want_probs=False)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        if i:
                            times[(s, w)].append(clock() - t)
                        d.commit(at[1])  # back to holding context - 1 positions
            for s in range(1, max_steps + 1):
                if stat == "min":
                    out[(n, s)] = (min(times[(s, 1)]) + min(times[(s, 2)])) / 2
                else:
                    out[(n, s)] = reduce(times[(s, 1)] + times[(s, 2)])
    return out
