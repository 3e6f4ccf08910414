"""A ``speclab serve`` app on uvicorn in a thread of this process, on a free local port: what the app's
Load tab measures by default, and what tests use for servers built around drafters made in-process."""

from __future__ import annotations

import threading
import time

from ..errors import SpeclabError


class InProcessServer:
    """``with InProcessServer(Server(...)) as srv: srv.url`` — started on enter (waits for /health),
    stopped on exit (the app's shutdown stops the engine core)."""

    def __init__(self, server, startup_timeout: float = 120.0):
        import uvicorn

        from .app import create_app
        from .arrival import event_loop, stamping_protocol
        from .cli import listen

        self.server = server
        self.sock = listen("127.0.0.1", 0)  # bound now: no other process can take the port before uvicorn starts
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = startup_timeout
        self.uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="critical", access_log=False,
                                                loop=event_loop(), http=stamping_protocol()))
        server.on_exit = lambda: setattr(self.uv, "should_exit", True)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"speclab-serve-{self.port}")

    def start(self) -> "InProcessServer":
        import httpx

        # one client, built before the engine forks its cores: building a client makes an SSL context, and a fork
        # while another thread holds OpenSSL's lock hands the child that lock held
        with httpx.Client(timeout=1) as client:
            self.thread.start()
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                if not self.thread.is_alive():
                    break
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise SpeclabError(f"the in-process speclab serve did not come up on {self.url}")

    def stop(self) -> None:
        self.uv.should_exit = True
        if self.thread.is_alive():
            self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> "InProcessServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
