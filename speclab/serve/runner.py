"""The HTTP side's engine: it starts the engine core (:mod:`.core`) in its own process (or a thread) and hands
each request's output to the asyncio task serving it.

* **The core's place.** On a CPU the core runs in a child process forked when the app starts (vLLM's
  API-server / EngineCore split): the model's Python work and the HTTP side's (parsing, detokenising,
  formatting chunks) then run at once on two cores instead of taking turns at one interpreter lock, and a
  stream's chunks are not held up behind a forward. Where a fork is unsafe (CUDA) or when asked, it runs on a
  thread of this process. Either way the two sides share no objects: they exchange messages over a
  :mod:`.channel`, and the core works on its own copy of each request.
* **Admission.** Checked here, synchronously, so that a refused request gets its 400 or 429 before any
  response starts: the request limits, and the bound on requests in flight (``max_running +
  max_waiting``, the scheduler's own bound).
* **Delivery.** Messages are handled on the event loop as they arrive: a request's tokens go onto its
  asyncio queue as ``(TOKENS, ids, time)`` (streamed requests) and its end as ``(FINAL, ids, request)`` or
  ``(ERROR, message, request)``. The request object here mirrors the core's: ``generated`` grows with
  every delivery, and its end state is copied over when it finishes.
* **Clocks.** A request's clock starts when its HTTP handler starts (``Request.arrival``, as vLLM's arrival
  time), and its first-token, inter-token and finish times are when its tokens reach this side: what a
  client sees, less the network and the chunk's writing. Both sides read the same monotonic clock.
* **Faults.** A step that raises fails only its requests (the core rebuilds its scheduler). If the core
  itself dies, every request in flight fails and ``/health`` turns 503.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Callable

from ..engine.request import Request
from ..engine.scheduler import QueueFull
from .channel import LoopChannel
from .core import CANCEL, ENGINE_ERROR, ERROR, FINAL, ROUND, STOP, STOPPED, SUBMIT, TOKENS, apply_final, run_core

log = logging.getLogger("speclab.serve")

__all__ = ["ERROR", "FINAL", "TOKENS", "Engine", "Handle"]


class Handle:
    """One request's link from the engine to the asyncio task serving it."""

    __slots__ = ("req", "stream", "queue", "last_time", "done", "cancelled", "status")

    def __init__(self, req: Request, stream: bool):
        self.req = req
        self.stream = stream  # False: only the FINAL item is delivered
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_time: float | None = None  # when this request's latest tokens arrived here
        self.done = False  # its FINAL/ERROR item is queued
        self.cancelled = False
        self.status: str | None = None  # how it ended: stop | length | abort | error

    async def get(self):
        return await self.queue.get()


def plan_cpus(binding: str) -> tuple[set[int], set[int]] | None:
    """``binding`` "auto": the engine core on one CPU and the HTTP side on the others, as vLLM's CPU build binds
    its worker to a core and leaves the rest to its API server (None: fewer than 2 CPUs, or "none")."""
    if binding != "auto" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return None
    return {allowed[0]}, set(allowed[1:])


def fork_ok(device) -> bool:
    """A child process can be forked with the model in it: not on CUDA (a forked CUDA context is unusable)."""
    return hasattr(os, "fork") and getattr(device, "type", "cpu") == "cpu"


class Engine:
    """Runs ``make_scheduler(hooks)`` in the engine core and serves its outputs to the running event loop.

    ``process``: the core in a child process (True), on a thread (False). ``max_in_flight``: requests
    running and waiting at most (more: QueueFull). ``observer``: the metrics (speclab.serve.prom), called on
    the event loop."""

    def __init__(self, make_scheduler: Callable, observer=None, *, process: bool = True, max_in_flight: int = 320,
                 threads: int | None = None, cpus: tuple[set[int], set[int]] | None = None):
        self._make = make_scheduler
        self.observer = observer
        self.process = process
        self.max_in_flight = max_in_flight
        self.threads = threads
        self.cpus = cpus if process else None  # (engine core's CPUs, this process's), see plan_cpus
        self.handles: dict[str, Handle] = {}
        self.running = self.waiting = 0  # as the core last reported
        self.channel: LoopChannel | None = None
        self.worker: multiprocessing.Process | threading.Thread | None = None
        self._dead = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the core (from the event loop that will serve the requests)."""
        ours, theirs = socket.socketpair()
        if self.process:
            ctx = multiprocessing.get_context("fork")
            self.worker = ctx.Process(target=_core_process, args=(self._make, theirs, ours, self.threads,
                                                                  self.cpus[0] if self.cpus else None),
                                      name="speclab-engine", daemon=True)
            self.worker.start()
            theirs.close()
            if self.cpus:
                os.sched_setaffinity(0, self.cpus[1])
        else:
            self.worker = threading.Thread(target=run_core, args=(self._make, theirs), kwargs={"own_process": False},
                                           name="speclab-engine", daemon=True)
            self.worker.start()
        ours.setblocking(False)
        self.channel = await LoopChannel.open(ours, self._on_messages, self._on_lost)

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.is_alive() and not self._dead

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the core after its current step (the server has drained by then); blocks: call it off the loop."""
        if self.worker is None:
            return
        self.worker.join(timeout)
        if self.process and self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(5)

    def request_stop(self) -> None:
        if self.channel is not None:
            self.channel.send((STOP,))

    # ------------------------------------------------------------------ requests (on the event loop)
    def submit(self, req: Request, stream: bool) -> Handle:
        """Send ``req`` to the core; QueueFull when the bound on requests in flight is reached."""
        if len(self.handles) >= self.max_in_flight:
            raise QueueFull(f"the queue is full ({self.running} running, {self.waiting} waiting; at most "
                            f"{self.max_in_flight} in flight)")
        h = Handle(req, stream)
        self.handles[req.request_id] = h
        if self.channel is None or not self.channel.send((SUBMIT, req)):
            self._end(h, error="the engine is not running")
        return h

    def cancel(self, h: Handle) -> None:
        """The client went away: the request leaves before the next round and frees its slot."""
        if h.done or h.cancelled:
            return
        h.cancelled = True
        if self.channel is not None:
            self.channel.send((CANCEL, h.req.request_id))

    def counts(self) -> tuple[int, int]:
        """(running, waiting), as of the core's latest report."""
        return self.running, self.waiting

    # ------------------------------------------------------------------ what the core sends
    def _on_messages(self, msgs: list) -> None:
        now = time.perf_counter()
        for items, self.running, self.waiting in msgs:
            for item in items:
                kind = item[0]
                if kind == ROUND:
                    self._observe("on_round", item[1], item[2], item[3], item[4], self.handles)
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
                        self._end(h, error=item[2])
                elif kind == ENGINE_ERROR:
                    self._observe("engine_error")

    def _tokens(self, h: Handle, ids: list[int], now: float) -> None:
        req = h.req
        req.generated.extend(ids)
        if req.first_token_time is None:
            req.first_token_time = now
            self._observe("first_token", req, now)
        else:
            self._observe("inter_token", now - h.last_time)
        h.last_time = now

    def _end(self, h: Handle, new: list[int] | None = None, error: str | None = None) -> None:
        h.done = True
        self.handles.pop(h.req.request_id, None)
        req = h.req
        if error is not None:
            h.status = "error"
            h.queue.put_nowait((ERROR, error, req))
        else:
            h.status = "abort" if req.finish_reason == "cancelled" else \
                ("length" if req.finish_reason == "length" else "stop")
            h.queue.put_nowait((FINAL, new or [], req))
        self._observe("finished", req, h.status)

    def _on_lost(self) -> None:
        """The core's end closed: it stopped, or died."""
        self._dead = True
        for h in list(self.handles.values()):
            self._end(h, error=STOPPED if self.worker is None or not self.worker.is_alive() else
                      "the engine stopped")

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
