"""Waiting for servers to go quiet before a measurement.

A server may keep a CPU busy after its last request: vLLM's CPU engine polls for about a second. On a small
machine the server measured next would run that second on what CPU is left, and a short load level (one wave of
requests lasts about as long) would read slow for a reason that is not its own. So a benchmark that takes turns
between servers waits, before each turn, until every server it started uses less than ``below`` of a CPU over
``windows`` windows in a row. Only the servers' own processes count (each runs in a session of its own), not the
rest of the machine, which a benchmark does not control.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterable

QUIET_BELOW = 0.1  # CPUs in use by the servers, at most, for them to count as quiet
QUIET_WINDOW_S = 0.2
QUIET_WINDOWS = 2  # windows in a row under QUIET_BELOW
QUIET_MAX_S = 10.0  # a server that never goes quiet delays each turn this long at most


def session_cpu_seconds(sessions: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of ``sessions`` (session ids: a process
    started with ``start_new_session=True`` leads the session of its pid), from /proc; 0.0 without /proc."""
    want = set(sessions)
    ticks = 0
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
        except OSError:
            continue  # gone meanwhile
        # fields[0] is the state (field 3 of stat): session is field 6, utime and stime fields 14 and 15
        if int(fields[3]) in want:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_quiet(sessions: Iterable[int], *, below: float = QUIET_BELOW, window: float = QUIET_WINDOW_S,
               windows: int = QUIET_WINDOWS, max_s: float = QUIET_MAX_S,
               read: Callable[[Iterable[int]], float] = session_cpu_seconds,
               sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> float:
    """Wait until ``sessions`` use under ``below`` CPUs for ``windows`` windows of ``window`` seconds in a row, or
    ``max_s`` seconds have passed; returns the seconds waited."""
    sessions = list(sessions)
    start = clock()
    quiet = 0
    last = read(sessions)
    while quiet < windows and clock() - start < max_s:
        t = clock()
        sleep(window)
        now = read(sessions)
        used = max(0.0, now - last) / max(clock() - t, 1e-9)  # a process that ended takes its seconds away
        last = now
        quiet = quiet + 1 if used < below else 0
    return clock() - start
