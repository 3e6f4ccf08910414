"""The HTTP side's engine: it starts the engine cores (:mod:`.core`) in their own processes (or one on a thread)
and hands each request's output to the asyncio task serving it.

* **The core's place.** On a CPU the core runs in a child process forked when the app starts (vLLM's
  API-server / EngineCore split): the model's Python work and the HTTP side's (parsing, detokenising,
  formatting chunks) then run at once on two cores instead of taking turns at one interpreter lock, and a
  stream's chunks are not held up behind a forward. Where a fork is unsafe (CUDA) or when asked, it runs on a
  thread of this process. Either way the two sides share no objects: they exchange messages over a
  :mod:`.channel`, and the core works on its own copy of each request.
* **Data parallelism.** Several cores (processes only; by default one per CPU), as vLLM's
  ``--data-parallel-size``: each has its own scheduler, caches and share of the running rows, and takes the
  requests sent to it. A request goes to the core with the fewest in flight for its share, the first of
  equals, so that a light load stays on the first core and its CPU. On a CPU a small model's step is mostly
  one core's Python and kernel work: two cores running half the rows each are faster than one running all.
* **Admission.** Checked here, synchronously, so that a refused request gets its 400 or 429 before any
  response starts: the request limits, and the bound on requests in flight (``max_running +
  max_waiting``, the scheduler's own bound).
* **Delivery.** Messages are handled on the event loop as they arrive: a request's tokens go onto its
  asyncio queue as ``(TOKENS, ids, time)`` (streamed requests) and its end as ``(FINAL, ids, request)`` or
  ``(ERROR, message, request)``. The request object here mirrors the core's: ``generated`` grows with
  every delivery, and its end state is copied over when it finishes.
* **Clocks.** A request's clock starts when its first bytes reach the machine (``Request.arrival``: the kernel's
  receive time, see :mod:`.arrival`; vLLM's arrival time is when its API server reads the request). A streamed
  request's TTFT ends when its first chunk with output has been handed to the connection (:meth:`Engine.first_written`,
  from the stream's handler); its first-token, inter-token and finish times are when its tokens reach this side.
  Both sides read the same monotonic clock.
* **Faults.** A step that raises fails only its requests (the core rebuilds its scheduler). If a core itself
  dies (any cause: a SIGKILL, the OOM killer, a crash in native code), its requests in flight fail with a 503,
  new requests go to the cores still serving, and a replacement is forked from this process (which holds the
  models and the calibrated step costs) and takes requests once it says READY. ``/health`` says 503 only while
  no core can serve. Cores that keep dying (:data:`MAX_DEATHS` within :data:`DEATH_WINDOW` seconds) are a fault
  a restart will not fix: the engine calls ``on_fatal(reason)`` and the server exits non-zero, as vLLM's does
  when its engine dies, so that whatever runs it can act.
* **Deadlines.** With ``request_timeout``, a request still in flight that long after it arrived is cancelled
  (its slot is free before the next round) and ends with a 504.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ..engine.request import Request
from ..engine.scheduler import QueueFull
from .channel import LoopChannel
from .core import CANCEL, ENGINE_ERROR, ERROR, FINAL, READY, ROUND, STOP, STOPPED, SUBMIT, TOKENS, apply_final, run_core

log = logging.getLogger("speclab.serve")

__all__ = ["ERROR", "FINAL", "TOKENS", "Engine", "Failure", "Handle", "NoCore"]

MAX_DEATHS, DEATH_WINDOW = 3, 60.0  # cores dying this often (deaths, seconds) end the server
WATCH_EVERY = 0.25  # seconds between deadline checks


@dataclass(frozen=True)
class Failure:
    """Why a request ended without output: the HTTP status, a one-line message and the OpenAI error ``code``."""

    status: int
    message: str
    code: str


class NoCore(Exception):
    """No engine core can take a request now (all are starting or dead): a 503, never a 500."""


def core_failure(message: str) -> Failure:
    """A core's own ERROR: the server stopping under the request (503), or its step raising (500)."""
    if message == STOPPED:
        return Failure(503, message, "server_shutting_down")
    return Failure(500, message, "engine_error")


class Handle:
    """One request's link from the engine to the asyncio task serving it."""

    __slots__ = ("req", "stream", "queue", "last_time", "done", "cancelled", "status", "deadline", "tag")

    def __init__(self, req: Request, stream: bool, tag: str | None = None):
        self.req = req
        self.tag = tag  # its workload tag (metrics per tag), or None
        self.stream = stream  # False: only the FINAL item is delivered
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_time: float | None = None  # when this request's latest tokens arrived here
        self.done = False  # its FINAL/ERROR item is queued
        self.cancelled = False
        self.status: str | None = None  # how it ended: stop | length | abort | error
        self.deadline: float | None = None  # perf_counter time after which it is cancelled (request_timeout)

    async def get(self):
        return await self.queue.get()


def plan_cpus(binding: str, cores: int = 1) -> tuple[set[int], set[int]] | None:
    """``binding`` "auto" with one engine core: (the core's CPUs, the HTTP side's), the core on the first CPU and
    the HTTP side on the others, as vLLM's CPU build binds its worker to a core and leaves the rest to its API
    server. None (the OS places every process): several engine cores (bound, the HTTP side and the load shared
    one core's CPU with an engine and made it the laggard; unbound measured 1.08-1.10x tokens/s at concurrency
    1 and 32, docs/serving.md), fewer than 2 CPUs, or "none"."""
    if binding != "auto" or cores > 1 or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return {allowed[0]}, set(allowed[1:])


def fork_ok(device) -> bool:
    """A child process can be forked with the model in it: not on CUDA (a forked CUDA context is unusable)."""
    return hasattr(os, "fork") and getattr(device, "type", "cpu") == "cpu"


def fork_hazards() -> list[str]:
    """Names of the Python threads alive beside the calling one, other than asyncio's executor workers (idle on
    their queue between calls). A fork copies only the calling thread: a lock another thread holds at that moment
    (OpenSSL's, logging's, an HTTP client's) stays held in the child for good, and the child hangs on it."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate()
            if t is not me and t.is_alive() and not t.name.startswith("asyncio_")]


def auto_cores(process: bool) -> int:
    """Engine cores by default: one per CPU this process may use where they can be processes, else 1 (measured:
    docs/serving.md, "Data parallelism")."""
    if not process or not hasattr(os, "sched_getaffinity"):
        return 1
    return max(1, len(os.sched_getaffinity(0)))


def core_share(total: int, cores: int, core: int) -> int:
    """Core ``core``'s share of ``total`` running rows split over ``cores`` (the first ones take the remainder)."""
    return total // cores + (core < total % cores)


class _Core:
    """One engine core as this side sees it: its worker, its channel, its latest counts, its requests."""

    __slots__ = ("index", "rows", "worker", "channel", "running", "waiting", "in_flight", "submitted", "ready",
                 "starts")

    def __init__(self, index: int, rows: int):
        self.index = index
        self.rows = rows  # its share of the running rows
        self.worker: multiprocessing.Process | threading.Thread | None = None
        self.channel: LoopChannel | None = None
        self.running = self.waiting = 0  # as the core last reported
        self.ready = False  # it has built its scheduler (its READY came)
        self.in_flight = 0  # requests sent to it and not yet ended, counted here (its reports lag)
        self.submitted = 0  # requests sent to it in all
        self.starts = 0  # workers started for it: 1 + its replacements

    @property
    def serving(self) -> bool:
        """It takes requests: its worker said READY and its channel is open."""
        return self.ready and self.channel is not None


class Engine:
    """Runs ``make_scheduler(hooks, core=i)`` in ``cores`` engine cores and serves their outputs to the running
    event loop.

    ``process``: the cores in child processes (True), or on threads of this process (False; the server runs
    one: several would take turns at the interpreter lock). ``cores`` > 1 is data parallelism, as vLLM's
    ``--data-parallel-size``: each core has its own scheduler and its own copy of the model's caches and runs
    its share of ``max_running`` rows (:func:`core_share`), and each request goes to the core with the fewest
    requests in flight for its share.
    ``max_in_flight``: requests running and waiting at most, over all cores (more: QueueFull). ``observer``:
    the metrics (speclab.serve.prom), called on the event loop. ``request_timeout``: seconds a request may stay in
    flight (None: no limit). ``on_fatal(reason)``: called once when cores keep dying (see the module)."""

    def __init__(self, make_scheduler: Callable, observer=None, *, process: bool = True, max_in_flight: int = 320,
                 threads: int | None = None, cpus: tuple[set[int], set[int]] | None = None, cores: int = 1,
                 max_running: int = 64, request_timeout: float | None = None,
                 on_fatal: Callable[[str], None] | None = None):
        self._make = make_scheduler
        self.observer = observer
        self.process = process
        self.max_in_flight = max_in_flight
        self.threads = threads
        self.cpus = cpus if process else None  # (the one engine core's CPUs, this process's), see plan_cpus
        self.handles: dict[str, Handle] = {}
        cores = max(1, cores)
        self.cores = [_Core(i, max(1, core_share(max_running, cores, i))) for i in range(cores)]
        self._where: dict[str, _Core] = {}  # request id -> the core serving it
        self.request_timeout = request_timeout
        self.on_fatal = on_fatal
        self.started = False  # every core said READY once: start-up is over
        self.stopping = False  # request_stop was called: a core that ends now is not replaced
        self.fatal: str | None = None  # why the engine gave up (cores kept dying)
        self.deaths: deque[float] = deque()  # when cores died (time.monotonic), the last DEATH_WINDOW seconds
        self.restarts = 0
        self._watch: asyncio.Task | None = None

    @property
    def workers(self) -> list:
        return [c.worker for c in self.cores]

    @property
    def running(self) -> int:
        return sum(c.running for c in self.cores)

    @property
    def waiting(self) -> int:
        return sum(c.waiting for c in self.cores)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the cores (from the event loop that will serve the requests)."""
        for core in self.cores:
            await self._launch(core)
        if self.process and self.cpus:
            os.sched_setaffinity(0, self.cpus[1])
        if self.request_timeout is not None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_deadlines())

    async def _launch(self, core: _Core) -> None:
        """Start a worker for ``core`` (its first, or a replacement) and open its channel."""
        ours, theirs = socket.socketpair()
        make = functools.partial(self._make, core=core.index)
        core.ready, core.running, core.waiting = False, 0, 0
        if self.process:
            hazards = fork_hazards()
            if hazards:
                log.warning("forking engine core %d beside other threads (%s): a lock one of them holds now stays held "
                            "in the core; a program with threads of its own should run the engine on a thread "
                            "(engine_process=False)", core.index, ", ".join(hazards))
            ctx = multiprocessing.get_context("fork")
            core.worker = ctx.Process(target=_core_process, args=(make, theirs, ours, self.threads,
                                                                  self.cpus[0] if self.cpus else None),
                                      name=f"speclab-engine-{core.index}", daemon=True)
            core.worker.start()
            theirs.close()
        else:
            core.worker = threading.Thread(target=run_core, args=(make, theirs), kwargs={"own_process": False},
                                           name=f"speclab-engine-{core.index}", daemon=True)
            core.worker.start()
        core.starts += 1
        ours.setblocking(False)
        core.channel = await LoopChannel.open(ours, functools.partial(self._on_messages, core),
                                              functools.partial(self._on_lost, core))

    @property
    def ready(self) -> bool:
        """Start-up is over (every core said READY once) and at least one core takes requests now."""
        return self.started and self.serving

    @property
    def serving(self) -> bool:
        return self.fatal is None and any(c.serving for c in self.cores)

    @property
    def alive(self) -> bool:
        """Some core's worker is running (a replacement that is still starting counts)."""
        return self.fatal is None and any(c.channel is not None and c.worker is not None and c.worker.is_alive()
                                          for c in self.cores)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the cores after their current step (the server has drained by then); blocks: call it off the loop."""
        deadline = time.monotonic() + timeout
        for core in self.cores:
            if core.worker is None:
                continue
            core.worker.join(max(0.0, deadline - time.monotonic()))
            if self.process and core.worker.is_alive():
                core.worker.terminate()
                core.worker.join(5)

    def request_stop(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()
        for core in self.cores:
            if core.channel is not None:
                core.channel.send((STOP,))

    # ------------------------------------------------------------------ requests (on the event loop)
    def submit(self, req: Request, stream: bool, tag: str | None = None) -> Handle:
        """Send ``req`` to the core with the fewest requests in flight for its share of the rows (the first of
        equals, so a light load stays on the first core); QueueFull when the bound on requests in flight is
        reached."""
        core = self._pick()
        if len(self.handles) >= self.max_in_flight:
            raise QueueFull(f"the queue is full ({self.running} running, {self.waiting} waiting; at most "
                            f"{self.max_in_flight} in flight)")
        h = Handle(req, stream, tag)
        if self.request_timeout is not None:
            h.deadline = req.arrival + self.request_timeout
        self.handles[req.request_id] = h
        self._where[req.request_id] = core
        core.in_flight += 1
        core.submitted += 1
        if not core.channel.send((SUBMIT, req)):  # (its end closed since: _on_lost runs next)
            self._end(h, error=Failure(503, "the engine core serving this request stopped", "engine_core_died"))
        return h

    def _pick(self) -> _Core:
        """The core for a new request: of those serving, the one with the fewest in flight for its share of the
        rows (the first of equals, so a light load stays on the first core and its CPU). While none serves, one
        still starting takes it (it runs once the core is READY: a request sent during start-up waits rather than
        fails); with none at all, NoCore."""
        if self.fatal is not None or self.stopping:
            raise NoCore(self.fatal or "the server is shutting down")
        cores = [c for c in self.cores if c.serving] or [c for c in self.cores if c.channel is not None]
        if not cores:
            raise NoCore("no engine core is running (a replacement is starting); retry shortly")
        return min(cores, key=lambda c: c.in_flight / c.rows)

    def cancel(self, h: Handle) -> None:
        """The client went away: the request leaves before the next round and frees its slot."""
        if h.done or h.cancelled:
            return
        h.cancelled = True
        core = self._where.get(h.req.request_id)
        if core is not None and core.channel is not None:
            core.channel.send((CANCEL, h.req.request_id))

    def counts(self) -> tuple[int, int]:
        """(running, waiting) over the cores, as of their latest reports."""
        return self.running, self.waiting

    # ------------------------------------------------------------------ what the core sends
    def _on_messages(self, core: _Core, msgs: list) -> None:
        now = time.perf_counter()
        for items, core.running, core.waiting in msgs:
            for item in items:
                kind = item[0]
                if kind == READY:
                    core.ready = True
                    self.started = self.started or all(c.ready for c in self.cores)
                    if core.starts > 1:
                        log.warning("engine core %d: replacement ready (pid %s)", core.index,
                                    getattr(core.worker, "pid", None))
                elif kind == ROUND:
                    self._observe("on_round", item[1], item[2], item[3], item[4], self.handles, item[5], item[6])
                elif kind == TOKENS:
                    h = self.handles.get(item[1])
                    if h is not None:
                        self._tokens(h, item[2], now)
                        if h.stream:
                            h.queue.put_nowait((TOKENS, item[2], now))
                elif kind == FINAL:
                    h = self.handles.get(item[1])
                    if h is not None:
                        if item[2]:
                            self._tokens(h, item[2], now)
                        apply_final(h.req, item[3])
                        h.req.finish_time = now
                        self._end(h, new=item[2])
                elif kind == ERROR:
                    h = self.handles.get(item[1])
                    if h is not None:
                        self._end(h, error=core_failure(item[2]))
                elif kind == ENGINE_ERROR:
                    self._observe("engine_error")

    def _tokens(self, h: Handle, ids: list[int], now: float) -> None:
        req = h.req
        req.generated.extend(ids)
        if req.first_token_time is None:
            req.first_token_time = now
            if not h.stream:  # a stream's TTFT ends when its first chunk is written (first_written)
                self._observe("first_token", req, now)
        else:
            self._observe("inter_token", now - h.last_time)
        h.last_time = now

    def first_written(self, h: Handle, now: float) -> None:
        """A streamed request's first chunk with output has been handed to its connection: its TTFT ends."""
        self._observe("first_token", h.req, now)

    def _end(self, h: Handle, new: list[int] | None = None, error: Failure | None = None) -> None:
        h.done = True
        self.handles.pop(h.req.request_id, None)
        core = self._where.pop(h.req.request_id, None)
        if core is not None:
            core.in_flight -= 1
        req = h.req
        if error is not None:
            h.status = "error"
            h.queue.put_nowait((ERROR, error, req))
        else:
            h.status = "abort" if req.finish_reason == "cancelled" else \
                ("length" if req.finish_reason == "length" else "stop")
            h.queue.put_nowait((FINAL, new or [], req))
        self._observe("finished", req, h.status, h.tag)

    def _on_lost(self, core: _Core) -> None:
        """A core's end closed: it stopped, or died. Its requests fail; the other cores' go on and take the new
        ones. Unless the server is stopping, a replacement starts (or, when cores keep dying, the engine gives up)."""
        core.channel, core.ready, core.running, core.waiting = None, False, 0, 0
        if self.process and core.worker is not None and not self.stopping:
            core.worker.join(0.2)  # its socket closes just before it can be reaped: wait that moment for its status
        if self.stopping:
            failure = core_failure(STOPPED)
        else:
            failure = Failure(503, f"the engine core serving this request died ({self._exit_of(core)}); retry",
                              "engine_core_died")
        for rid, where in list(self._where.items()):
            h = self.handles.get(rid)
            if where is core and h is not None:
                self._end(h, error=failure)
        if self.stopping or self.fatal is not None:
            return
        now = time.monotonic()
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > DEATH_WINDOW:
            self.deaths.popleft()
        log.error("engine core %d died (%s)", core.index, self._exit_of(core))
        self._observe("core_died")
        if len(self.deaths) >= MAX_DEATHS:
            self._give_up(f"engine cores died {len(self.deaths)} times within {DEATH_WINDOW:.0f} s (last: core "
                          f"{core.index}, {self._exit_of(core)})")
            return
        self.restarts += 1
        asyncio.get_running_loop().create_task(self._replace(core))

    async def _replace(self, core: _Core) -> None:
        if core.worker is not None and self.process:
            await asyncio.to_thread(core.worker.join, 5)  # reap it (its exit code names the cause)
        if self.stopping or self.fatal is not None:
            return
        try:
            await self._launch(core)
        except Exception as e:  # noqa: BLE001 - a fork that fails (no memory) is as fatal as a crash loop
            self._give_up(f"could not start a replacement for engine core {core.index}: {type(e).__name__}: {e}")

    def _give_up(self, reason: str) -> None:
        """Fail every request in flight, stop the cores left, and tell the server (``on_fatal``) to exit."""
        self.fatal = reason
        log.error("engine failed: %s", reason)
        for h in list(self.handles.values()):
            self._end(h, error=Failure(503, f"the engine failed: {reason}", "engine_dead"))
        self.request_stop()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    @staticmethod
    def _exit_of(core: _Core) -> str:
        """How a core's worker ended, in words: 'killed by SIGKILL', 'exit status 1', or 'its thread ended'."""
        w = core.worker
        code = getattr(w, "exitcode", None)
        if code is None:
            return "its thread ended" if isinstance(w, threading.Thread) else "its channel closed"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    async def _watch_deadlines(self) -> None:
        """Cancel the requests past their deadline: each ends with a 504 and leaves its core before the next round."""
        while True:
            await asyncio.sleep(WATCH_EVERY)
            now = time.perf_counter()
            late = [h for h in self.handles.values() if h.deadline is not None and now > h.deadline]
            for h in late:
                self.cancel(h)
                self._end(h, error=Failure(504, f"the request ran past its deadline ({self.request_timeout:g} s "
                                                "after it arrived)", "request_timeout"))

    def _observe(self, what: str, *args) -> None:
        """A metrics failure is logged, never allowed to fail the requests."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, what)(*args)
        except Exception:  # noqa: BLE001
            log.exception("metrics observer failed in %s", what)


def _core_process(make_scheduler, sock, parent_end, threads, cpus) -> None:
    parent_end.close()  # the child keeps only its own end: when the parent goes, the core sees EOF
    if cpus:
        os.sched_setaffinity(0, cpus)
    run_core(make_scheduler, sock, own_process=True, threads=threads)
