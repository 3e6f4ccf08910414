"""The engine thread: it owns the :class:`~speclab.engine.Scheduler` and hands each request's output to
the asyncio task serving it.

* **Stepping.** The thread sleeps on a condition while the scheduler is idle (no polling) and steps it
  while any request is running or waiting. ``submit`` and ``cancel`` come from the event loop; they take
  the condition's lock and wake the thread.
* **Delivery.** The thread subscribes to the scheduler's events. A prefill event carries each new
  request's first token; a verify event carries the tokens that one round committed for each row. Each
  event's outputs go to the loop in one ``loop.call_soon_threadsafe`` call, onto per-request asyncio
  queues: ``(TOKENS, ids, time)`` while it runs (streamed requests only), then one ``(FINAL, ids, request)``
  with the last round's tokens (or ``(ERROR, message, request)``). Nothing per token crosses threads.
* **Faults.** If a step raises, the requests that were in it (running or being admitted) fail with an
  error; the scheduler is rebuilt with the same settings and the requests still waiting move to it, so
  the server keeps serving. (A failure mid-round may leave the caches inconsistent, so every row of that
  round is affected; waiting requests never touched them.)
* **Metrics.** An observer (``speclab.serve.prom.ServerMetrics``) sees every event on this thread, with the
  requests of its rows, and every request's end. Subscribing makes the scheduler build its events (a
  few percent per round for a tiny model, the same price ``speclab generate`` pays for its recorder).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

from ..engine.request import WAITING, Request
from ..engine.scheduler import Scheduler
from ..events import HookRegistry, RoundEvent

log = logging.getLogger("speclab.serve")

TOKENS, FINAL, ERROR = "tokens", "final", "error"


class Handle:
    """One request's link from the engine thread to the asyncio task serving it."""

    __slots__ = ("req", "stream", "queue", "seen", "last_time", "done", "cancelled", "status")

    def __init__(self, req: Request, stream: bool):
        self.req = req
        self.stream = stream  # False: only the FINAL item is delivered
        self.queue: asyncio.Queue = asyncio.Queue()
        self.seen = 0  # tokens of req.generated already handled by the engine thread
        self.last_time: float | None = None  # when this request's latest tokens became known
        self.done = False  # set by the engine thread when the FINAL/ERROR item is queued
        self.cancelled = False
        self.status: str | None = None  # how it ended: stop | length | abort | error

    async def get(self):
        return await self.queue.get()


class Engine:
    """Runs ``make_scheduler(hooks)`` on its own thread and serves its outputs to one asyncio loop."""

    def __init__(self, make_scheduler: Callable[[HookRegistry], Scheduler], observer=None):
        self.hooks = HookRegistry()
        self.hooks.subscribe(self._on_event)
        self._make = make_scheduler
        self.sched = make_scheduler(self.hooks)
        self.observer = observer
        self.cond = threading.Condition()
        self.handles: dict[str, Handle] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self._stop = False
        self._out: list = []  # (handle, item) produced by the current event, delivered together

    # ------------------------------------------------------------------ from the event loop
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.Thread(target=self._run, name="speclab-engine", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def submit(self, req: Request, stream: bool) -> Handle:
        """Queue ``req``; raises QueueFull or SpeclabError (the request is then not queued)."""
        h = Handle(req, stream)
        with self.cond:
            self.handles[req.request_id] = h
            try:
                self.sched.submit(req)
            except BaseException:
                del self.handles[req.request_id]
                raise
            self.cond.notify()
        return h

    def cancel(self, h: Handle) -> None:
        """The client went away: the request leaves before the next round and frees its slot."""
        if h.done or h.cancelled:
            return
        h.cancelled = True
        with self.cond:
            self.sched.cancel(h.req.request_id)
            self.cond.notify()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) right now."""
        return self.sched.counts()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; anything still queued fails (the server has drained by then)."""
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._stop and self.sched.idle:
                    self.cond.wait()
                if self._stop:
                    break
                sched = self.sched
            try:
                done = sched.step()
            except Exception as exc:  # noqa: BLE001 - fail the affected requests, keep serving
                self._recover(exc)
                continue
            for r in done:  # cancelled requests end without an event
                h = self.handles.get(r.request_id)
                if h is not None and not h.done:
                    self._final(h, [])
            self._flush()
        for h in list(self.handles.values()):
            self._final(h, [], error="the server stopped before this request finished")
        self._flush()

    def _on_event(self, ev) -> None:
        if not isinstance(ev, RoundEvent):
            return
        reqs, news, gaps, finals = [], [], [], []
        for rr in ev.rows:
            h = self.handles.get(rr.request_id)
            if h is None:  # not ours (cannot happen: the scheduler is private to this engine)
                reqs.append(None)
                news.append(0)
                gaps.append(None)
                continue
            gen = h.req.generated
            new = gen[h.seen:]
            h.seen = len(gen)
            gaps.append(ev.time - h.last_time if new and h.last_time is not None else None)
            if new:
                h.last_time = ev.time
            reqs.append(h.req)
            news.append(len(new))
            if rr.finished:
                finals.append((h, new))
            elif new and h.stream:
                self._out.append((h, (TOKENS, new, ev.time)))
        self._observe("on_event", ev, reqs, news, gaps)
        for h, new in finals:
            self._final(h, new)
        self._flush()  # now: a prefill's first tokens go out while the round that follows runs

    def _final(self, h: Handle, new: list[int], error: str | None = None) -> None:
        h.done = True
        self.handles.pop(h.req.request_id, None)
        if error is not None:
            h.status = "error"
            self._out.append((h, (ERROR, error, h.req)))
        else:
            h.status = "abort" if h.req.finish_reason == "cancelled" else \
                ("length" if h.req.finish_reason == "length" else "stop")
            self._out.append((h, (FINAL, new, h.req)))
        self._observe("finished", h.req, h.status)

    def _observe(self, what: str, *args) -> None:
        """A metrics failure is logged, never allowed to fail the requests of the step."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, what)(*args)
        except Exception:  # noqa: BLE001
            log.exception("metrics observer failed in %s", what)

    def _flush(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        try:
            self.loop.call_soon_threadsafe(_deliver, out)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _recover(self, exc: Exception) -> None:
        log.error("engine step failed (%s: %s); failing the requests in that step", type(exc).__name__, exc,
                  exc_info=exc)
        self._observe("engine_error")
        with self.cond:
            keep = [r for r in self.sched.waiting if r.status == WAITING]
            self.sched = self._make(self.hooks)
            kept = set()
            for r in keep:
                h = self.handles.get(r.request_id)
                if h is None or h.cancelled:
                    continue
                try:
                    self.sched.submit(r)
                    kept.add(r.request_id)
                except Exception:  # noqa: BLE001 - it fails below with the others
                    pass
        msg = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        for rid, h in list(self.handles.items()):
            if rid not in kept:
                if h.cancelled:
                    h.req.finish_reason = "cancelled"
                    self._final(h, [])
                else:
                    self._final(h, [], error=msg)
        self._flush()


def _deliver(batch: list) -> None:
    for h, item in batch:
        h.queue.put_nowait(item)
