"""When a request arrived: the clock that TTFT, queue time and E2E start from.

vLLM starts a request's clock when its API server receives it. Here the stamp is taken as early as the
server can know it: the time the kernel received the bytes that begin the request (:class:`KernelReads`),
before the event loop woke up to read them, before parsing, before the app's task is created and scheduled.

Two delays sit between a request reaching the host and the app seeing it, and the server's own histograms
must count both, as a client does:

* the event loop waking up to read it: on a machine whose cores the engine holds, about 1 ms (with both
  engine cores busy on two CPUs: the mean over 64 requests at 2-32 streams, 5-10% of a 7-12 ms TTFT). Stamped
  at the read, the server's TTFT missed it and read 5-10% under a client's from two streams on. The kernel's
  receive timestamp (``SO_TIMESTAMPNS``, Linux) is taken when the packet arrives, whoever holds the CPUs;
* a burst of requests parsed one after another on the loop: stamped in the app instead, the last of 32 requests
  sent together started its clock after the other 31 had been parsed, tokenised and submitted (measured: 5-16 ms
  of TTFT the server did not see at 8-32 concurrent requests).

:func:`stamping_protocol` (uvicorn's HTTP protocol, subclassed) stamps each request with the time of the read in
which its scope was built: the kernel's time for that read where :class:`KernelReads` reads the connection, else
the time the loop read it. :class:`ArrivalClock`, an ASGI middleware, stamps the requests that come another way
(another ASGI server, a test client) when the app first sees them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
import time

ARRIVAL = "speclab.arrival"  # ASGI scope key: when the request's first bytes arrived (time.perf_counter)
READ = "speclab.read"  # ASGI scope key: when the event loop read them (set with a kernel's stamp only)

SO_TIMESTAMPNS = 35  # Linux <asm-generic/socket.h> (also SCM_TIMESTAMPNS); Python's socket module lacks it
READ_SIZE = 256 * 1024  # bytes a read takes at most (asyncio's and uvloop's size)
# Kernel reads are not made on uvloop: libuv stops a poll handle whose descriptor reports an error (a peer's
# reset) and tells uvloop, which drops it without calling the reader back, so a connection reset mid-request went
# unseen and its handler waited for the rest of the body for ever (seen in CI). asyncio's selector
# reports the error as readable, and the read raises. speclab serve runs asyncio's loop with --arrival kernel.
MAX_LAG = 60.0  # a kernel stamp further back than this is a clock step (the wall clock set), not a slow loop


class ArrivalClock:
    """ASGI middleware: stamps a request the protocol did not stamp, the first thing the app does with it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and ARRIVAL not in scope:
            scope[ARRIVAL] = time.perf_counter()
        await self.app(scope, receive, send)


def kernel_stamp(ancdata, perf_now: float, wall_now: float) -> float | None:
    """The ``time.perf_counter`` time at which the kernel received a read's bytes, from the read's ancillary data
    (an ``SCM_TIMESTAMPNS`` message: the wall clock at the packet's arrival) and the two clocks read after it;
    None without one, or when the stamp lies in the future or more than ``MAX_LAG`` back (the wall clock stepped).
    e.g. a packet stamped 2.5 ms before the wall clock read 100.0 s, perf_counter read 7.0: 6.9975."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            lag = wall_now - (sec + nsec * 1e-9)
            if 0.0 <= lag <= MAX_LAG:
                return perf_now - lag
            return perf_now if -0.001 < lag < 0.0 else None  # (two clocks' reads a hair apart)
    return None


def event_loop(requested: str = "auto", kernel: bool = True) -> str:
    """The uvicorn event loop to run for a server whose protocol comes from ``stamping_protocol(..., kernel)``:
    ``auto`` means asyncio's where the kernel's stamps are to be read (see the note on uvloop above), else uvicorn's
    own choice (uvloop when installed). An explicit choice stands (uvloop with kernel stamps stamps at the read)."""
    return "asyncio" if requested == "auto" and kernel else requested


def stamp_listener(sock: socket.socket) -> bool:
    """Ask the kernel to stamp every packet a listening socket's connections receive (Linux; an accepted connection
    inherits the option), so that a request written the moment its connection opens, before the server accepts it,
    is stamped too. False where the option is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


class KernelReads:
    """Reads a connection's bytes itself, with ``recvmsg``, so that every read carries the time the kernel
    received them, and hands them to the protocol (``protocol.stamped_data(data, t)``).

    The transport keeps everything else (writing, closing, the protocol's connection_lost); its own reading is
    paused, and the protocol is given a :class:`ReadingTransport` whose ``pause_reading`` / ``resume_reading`` /
    ``set_protocol`` act on these reads. The reads go through a duplicate of the connection's descriptor, watched by
    the same event loop (asyncio's ``add_reader``; not uvloop's, see the note above)."""

    def __init__(self, transport, protocol, sock_fd: int):
        self.transport, self.protocol = transport, protocol
        self.loop = asyncio.get_running_loop()
        self.sock = socket.socket(fileno=os.dup(sock_fd))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.anc = socket.CMSG_SPACE(16)
        self.reading = self.done = False

    @classmethod
    def attach(cls, transport, protocol) -> "KernelReads | None":
        """Read ``transport``'s connection for ``protocol`` (a TCP or Unix socket on Linux); None where that is
        not possible, and the transport reads as before. :meth:`start` once the protocol's connection_made is done."""
        if not sys.platform.startswith("linux") or type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
            return None  # uvloop: see the note on it above
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6, socket.AF_UNIX):
            return None
        try:
            reads = cls(transport, protocol, sock.fileno())
        except (OSError, RuntimeError, ValueError):
            return None
        transport.pause_reading()  # (asyncio's transport starts reading after connection_made unless paused)
        return reads

    def start(self) -> None:
        """Read from here on: what is already waiting (a request written as the connection opened) now, the rest as
        it comes."""
        self.resume()
        self._readable()

    def resume(self) -> None:
        if not self.reading and not self.done:
            self.loop.add_reader(self.sock.fileno(), self._readable)
            self.reading = True

    def pause(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False

    def close(self) -> None:
        """The connection is gone (the protocol's connection_lost): stop reading and drop the duplicate."""
        self.pause()
        if not self.done:
            self.done = True
            self.sock.close()

    def hand_back(self, protocol) -> None:
        """The connection moves to another protocol (an upgrade): the transport reads for it from here on."""
        self.close()
        self.transport.set_protocol(protocol)
        self.transport.resume_reading()

    def _readable(self) -> None:
        t = self.transport
        if t.is_closing():
            self.pause()
            return
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(READ_SIZE, self.anc)
        except (BlockingIOError, InterruptedError):
            return  # nothing after all
        except OSError:  # reset by the peer: as the transport does on a read error
            self.close()
            t.abort()
            return
        if not data:  # the peer closed its side
            self.pause()
            if not self.protocol.eof_received():
                t.close()
            return
        self.protocol.stamped_data(data, kernel_stamp(anc, time.perf_counter(), time.time()))


class ReadingTransport:
    """The transport as the protocol sees it when :class:`KernelReads` reads for it: reading is paused and resumed
    there, everything else goes to the transport."""

    def __init__(self, transport, reads: KernelReads):
        self._transport, self._reads = transport, reads

    def pause_reading(self) -> None:
        self._reads.pause()

    def resume_reading(self) -> None:
        self._reads.resume()

    def is_reading(self) -> bool:
        return self._reads.reading

    def set_protocol(self, protocol) -> None:
        self._reads.hand_back(protocol)

    def __getattr__(self, name):
        return getattr(self._transport, name)


def stamping_protocol(http: str = "auto", kernel: bool = True):
    """uvicorn's HTTP protocol class for ``http`` (auto, httptools or h11), subclassed so that every
    request's scope carries the time its bytes arrived (``ARRIVAL``): the kernel's receive time where
    :class:`KernelReads` can read the connection (``kernel``), else the time the loop read them. uvicorn builds
    a request's scope inside ``data_received`` while it parses them; the stamp is the time of the read in which the
    scope was built, set once: with httptools the read holding the request's first bytes, with h11 the one
    completing its headers (the same read unless the headers come in pieces)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base = import_from_string(HTTP_PROTOCOLS[http])

    class Stamping(base):
        _reads = None
        _stamp = None  # the kernel's time for the read being handed over (stamped_data)

        def connection_made(self, transport) -> None:
            self._reads = KernelReads.attach(transport, self) if kernel else None
            super().connection_made(ReadingTransport(transport, self._reads) if self._reads else transport)
            if self._reads is not None:
                self._reads.start()

        def connection_lost(self, exc) -> None:
            if self._reads is not None:
                self._reads.close()
            super().connection_lost(exc)

        def stamped_data(self, data: bytes, t: float | None) -> None:
            self._stamp = t
            try:
                self.data_received(data)
            finally:
                self._stamp = None

        def data_received(self, data: bytes) -> None:
            read = time.perf_counter()
            stamp = self._stamp
            before = getattr(self, "scope", None)
            super().data_received(data)
            scope = getattr(self, "scope", None)
            if scope is not None and scope is not before and isinstance(scope, dict) and ARRIVAL not in scope:
                scope[ARRIVAL] = stamp if stamp is not None else read
                if stamp is not None:
                    scope[READ] = read

    Stamping.__name__ = Stamping.__qualname__ = f"Stamping{base.__name__}"
    return Stamping
