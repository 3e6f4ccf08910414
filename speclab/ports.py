"""A free TCP port on 127.0.0.1, for the servers and apps speclab starts (tests, benchmarks, notebooks).

The port is free when asked; another process can take it before the caller binds it, so a caller that picked it
itself and finds it taken starts again on another (:func:`speclab.load.servers.start_server`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
