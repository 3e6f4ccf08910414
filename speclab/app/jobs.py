"""Runs the page can stop: :class:`StopGate` (a tab's Stop button and the run it stops) and :class:`Job` (work
on a worker thread that the page polls and can cancel).
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

from .config import AppConfig


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
