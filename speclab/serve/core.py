"""The engine core: it owns the :class:`~speclab.engine.Scheduler`, steps it while there is work, and reports
what each step produced. It runs in a process of its own (as vLLM's EngineCore), so the model's Python work
and the HTTP side's never wait for each other's turn at the interpreter lock and use a core each; or, where
a fork is not possible (CUDA), in a thread. It talks to the HTTP side (:mod:`.runner`) only through a
:mod:`.channel`, the same way in both cases.

Messages in: ``(SUBMIT, Request)``, ``(CANCEL, request id)``, ``(STOP,)``. The core sleeps on the channel
while the scheduler is idle and, between steps, takes what has arrived without waiting.

Messages out, one per scheduler event (so a prefill's first tokens leave while the round after it runs),
``(items, running, waiting)``, items in order:

* ``(READY,)``: first, alone, once the scheduler is built (its calibration included): the HTTP side's ``/health``
  says 200 only after every core sent it;
* ``(ROUND, phase, time, prefill_s, rows, prefix queries, prefix hits)``: the event, for metrics; rows
  ``(request id, new tokens, k, k capped by the budget, drafted, accepted)``;
* ``(TOKENS, request id, token ids)``: what one round committed for a request still running;
* ``(FINAL, request id, token ids, state)``: its last tokens and its end (:func:`final_state`);
* ``(ERROR, request id, message)``: it failed (the engine step it was in raised, or the server stopped);
* ``(ENGINE_ERROR,)``: a step raised (the scheduler was rebuilt; the requests still waiting moved to it).

The core subscribes to the scheduler's events without token probabilities (``probs=False``): a server
streams tokens and counts, and never shows the probabilities, so the scheduler skips computing them.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import stat
from typing import Callable

from ..engine.request import WAITING, Request
from ..events import HookRegistry, RoundEvent
from .channel import BlockingChannel

log = logging.getLogger("speclab.serve")

SUBMIT, CANCEL, STOP = "submit", "cancel", "stop"
READY, ROUND, TOKENS, FINAL, ERROR, ENGINE_ERROR = "ready", "round", "tokens", "final", "error", "engine_error"
STOPPED = "the server stopped before this request finished"


def final_state(req: Request) -> tuple:
    """What the HTTP side's copy of a finished request needs from the engine's (see :func:`apply_final`)."""
    return (req.finish_reason, req.stop_at, req.rounds, req.drafted, req.accepted, list(req.pos_drafted),
            list(req.pos_accepted), list(req.history), req.seed_used)


def apply_final(req: Request, state: tuple) -> None:
    (req.finish_reason, req.stop_at, req.rounds, req.drafted, req.accepted, req.pos_drafted, req.pos_accepted,
     req.history, req.seed_used) = state
    req.status = "finished"


class EngineCore:
    """``make_scheduler(hooks)`` stepped for the messages of ``channel`` (see the module docstring)."""

    def __init__(self, make_scheduler: Callable[[HookRegistry], object], channel: BlockingChannel):
        self.hooks = HookRegistry()
        self.hooks.subscribe(self._on_event, probs=False)
        self._make = make_scheduler
        self.sched = make_scheduler(self.hooks)
        self.ch = channel
        self.live: dict[str, list] = {}  # request id -> [engine's Request, tokens of it already reported]
        self.cancelled: set[str] = set()
        self.out: list = []
        self.reported = (0, 0)  # (running, waiting) as last sent
        self.stopping = False

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self.out.append((READY,))
        self._flush()
        while True:
            for msg in self.ch.recv(block=self.sched.idle):
                self._handle(msg)
            if self.stopping or self.ch.closed:
                break
            if self.sched.idle:
                continue
            try:
                done = self.sched.step()
            except Exception as exc:  # noqa: BLE001 - fail the affected requests, keep serving
                self._recover(exc)
                continue
            for r in done:  # cancelled requests end without an event
                if r.request_id in self.live:
                    self._final(r, [])
            self._flush(counts_changed=True)
        for live in list(self.live.values()):
            self._final(live[0], [], error=STOPPED)
        self._flush()

    def _handle(self, msg) -> None:
        kind = msg[0]
        if kind == SUBMIT:
            req: Request = msg[1]
            self.live[req.request_id] = [req, 0]
            try:
                self.sched.submit(req)
            except Exception as e:  # noqa: BLE001 - the HTTP side checked already; never fail the core for it
                self._final(req, [], error=f"the engine refused this request: {e}")
        elif kind == CANCEL:
            if msg[1] in self.live:
                self.cancelled.add(msg[1])
                self.sched.cancel(msg[1])
        elif kind == STOP:
            self.stopping = True

    # ------------------------------------------------------------------ outputs
    def _on_event(self, ev) -> None:
        if not isinstance(ev, RoundEvent):
            return
        rows, tokens, finals = [], [], []
        for rr in ev.rows:
            live = self.live.get(rr.request_id)
            if live is None:
                continue
            req = live[0]
            new = req.generated[live[1]:]
            live[1] = len(req.generated)
            rows.append((rr.request_id, len(new), rr.k, rr.k_reason.startswith("budget"), rr.num_drafted,
                         rr.num_accepted))
            if rr.finished:
                finals.append((req, new))
            elif new:
                tokens.append((TOKENS, rr.request_id, new))
        self.out.append((ROUND, ev.phase, ev.time, ev.timings.get("prefill", 0.0), rows, ev.prefix_queries,
                         ev.prefix_hits))
        self.out += tokens
        for req, new in finals:
            self._final(req, new)
        self._flush()  # now: a prefill's first tokens go out while the round that follows runs

    def _final(self, req: Request, new: list[int], error: str | None = None) -> None:
        self.live.pop(req.request_id, None)
        self.cancelled.discard(req.request_id)
        if error is not None:
            self.out.append((ERROR, req.request_id, error))
        else:
            self.out.append((FINAL, req.request_id, list(new), final_state(req)))

    def _flush(self, counts_changed: bool = False) -> None:
        """Send what is pending; with ``counts_changed``, also an empty report when only the counts moved (rows
        leave after their last event)."""
        counts = self.sched.counts()
        if not self.out and not (counts_changed and counts != self.reported):
            return
        out, self.out = self.out, []
        self.reported = counts
        self.ch.send((out, *counts))

    def _recover(self, exc: Exception) -> None:
        log.error("engine step failed (%s: %s); failing the requests in that step", type(exc).__name__, exc,
                  exc_info=exc)
        self.out.append((ENGINE_ERROR,))
        keep = [r for r in self.sched.waiting if r.status == WAITING]
        self.sched = self._make(self.hooks)
        kept = set()
        for r in keep:
            if r.request_id not in self.live or r.request_id in self.cancelled:
                continue
            try:
                self.sched.submit(r)
                kept.add(r.request_id)
            except Exception:  # noqa: BLE001 - it fails below with the others
                pass
        msg = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        for rid, (req, _) in list(self.live.items()):
            if rid in kept:
                continue
            if rid in self.cancelled:
                req.finish_reason = "cancelled"
                self._final(req, [])
            else:
                self._final(req, [], error=msg)
        self._flush()


def close_sockets_except(keep: int) -> None:
    """Release the sockets a forked child inherited (the server's listening socket, the event loop's own), except
    ``keep``: a listening socket held open here would take connections after the server closed it. Each is
    replaced by /dev/null rather than closed, so that its number stays taken: the parent's socket objects,
    copied into this process, may still close their numbers when collected."""
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            if fd in (keep, null) or fd < 3:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


def name_process(name: bytes) -> None:
    """The process name ``ps -o comm`` and ``top`` show (Linux; elsewhere nothing happens). Written to
    ``/proc/self/comm`` (what ``prctl(PR_SET_NAME)`` sets), not through ctypes: a forked child must not load a
    library (``dlopen`` takes the loader's lock, which another thread of the parent may have held at the fork)."""
    try:
        with open("/proc/self/comm", "wb") as f:
            f.write(name[:15])
    except OSError:
        pass


def run_core(make_scheduler, sock, *, own_process: bool, threads: int | None = None) -> None:
    """The engine core's entry point (the child process's, or the engine thread's)."""
    if own_process:
        # the HTTP side decides when to stop (it drains first): a SIGTERM or Ctrl-C sent to the whole process
        # group must not end the core under requests in flight; it exits when told or when the HTTP side is gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            signal.set_wakeup_fd(-1)  # the parent's event loop's; not ours to write
        except ValueError:
            pass
        close_sockets_except(sock.fileno())
        name_process(b"speclab-engine")  # as `ps` and `top` show it (vLLM's is VLLM::EngineCore)
        # `kill -USR1 <pid>` prints where the core is (every thread's Python stack) to the server's stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        if threads:
            import torch

            torch.set_num_threads(threads)
    ch = BlockingChannel(sock)
    try:
        EngineCore(make_scheduler, ch).run()
    except BaseException:
        log.exception("the engine core failed")
        raise
    finally:
        ch.close()
