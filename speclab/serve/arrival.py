"""When a request arrived: the clock that TTFT, queue time and E2E start from.

vLLM starts a request's clock when its API server receives it. Here the stamp is taken as early as the
server can see the request: when the event loop reads the bytes that begin it off the connection
(:func:`stamping_protocol`, uvicorn's HTTP protocol with one line added), before parsing, before the app's
task is created and scheduled. A burst of requests is parsed one after another on the loop; stamped in
the app instead, the last of 32 requests sent together started its clock after the other 31 had been
parsed, tokenised and submitted (measured: 5-16 ms of TTFT the server did not see at 8-32 concurrent
requests, 2026-12-01). :class:`ArrivalClock`, an ASGI middleware, stamps the requests that come another way
(another ASGI server, a test client) when the app first sees them.
"""

from __future__ import annotations

import time

ARRIVAL = "speclab.arrival"  # ASGI scope key: when the request's first bytes were read (time.perf_counter)


class ArrivalClock:
    """ASGI middleware: stamps a request the protocol did not stamp, the first thing the app does with it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and ARRIVAL not in scope:
            scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


def stamping_protocol(http: str = "auto"):
    """uvicorn's HTTP protocol class for ``http`` (auto, httptools or h11), subclassed so that every
    request's scope carries the time its bytes were read (``ARRIVAL``). uvicorn builds a request's scope
    inside ``data_received`` while it parses them; the stamp is the time of the read in which the scope was
    built, set once: with httptools the read holding the request's first bytes, with h11 the one completing
    its headers (the same read unless the headers come in pieces)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base = import_from_string(HTTP_PROTOCOLS[http])

    class Stamping(base):
        def data_received(self, data: bytes) -> None:
            t = time.perf_counter()
            before = getattr(self, "scope", None)
            super().data_received(data)
            scope = getattr(self, "scope", None)
            if scope is not None and scope is not before and isinstance(scope, dict):
                scope.setdefault(ARRIVAL, t)

    Stamping.__name__ = Stamping.__qualname__ = f"Stamping{base.__name__}"
    return Stamping
