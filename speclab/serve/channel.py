"""The channel between the HTTP side and the engine core: pickled messages over one stream socket (a
``socket.socketpair``), each framed by its byte length, as vLLM's API server and engine core talk over ZMQ.

* The engine core's end is blocking (:class:`BlockingChannel`): it waits for a message only when it has
  nothing to run, and between steps takes whatever has arrived without waiting.
* The event loop's end is an asyncio protocol (:class:`LoopChannel`): messages are handled on the loop as
  they arrive, and sending never blocks the loop (the transport buffers), so the two ends can never wait
  on each other.
"""

from __future__ import annotations

import asyncio
import pickle
import select
import socket
import struct
from typing import Callable

HEADER = struct.Struct("<I")  # payload length


def frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class Frames:
    """Bytes in (any split), whole messages out."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out, pos, end = [], 0, len(self.buf)
        while end - pos >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf, pos)
            if end - pos - HEADER.size < n:
                break
            start = pos + HEADER.size
            out.append(pickle.loads(self.buf[start:start + n]))
            pos = start + n
        if pos:
            del self.buf[:pos]
        return out


class BlockingChannel:
    """The engine core's end."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(True)
        self.frames = Frames()
        self.closed = False  # the other end went away

    def send(self, obj) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall(frame(obj))
        except OSError:  # the HTTP side is gone: nobody to tell
            self.closed = True

    def recv(self, block: bool) -> list:
        """The messages that have arrived; with ``block``, waits until there is at least one (or the other end
        closed: :attr:`closed`)."""
        out: list = []
        timeout = None if block else 0.0
        while not self.closed:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                break
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            out += self.frames.feed(data)
            if out:
                timeout = 0.0  # take what else is there, without waiting for more
        return out

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


class LoopChannel(asyncio.Protocol):
    """The event loop's end: ``on_messages(list)`` for what arrives, ``on_lost()`` when the core's end closes."""

    def __init__(self, on_messages: Callable[[list], None], on_lost: Callable[[], None]):
        self.on_messages, self.on_lost = on_messages, on_lost
        self.frames = Frames()
        self.transport: asyncio.Transport | None = None

    @classmethod
    async def open(cls, sock: socket.socket, on_messages, on_lost) -> "LoopChannel":
        loop = asyncio.get_running_loop()
        _, proto = await loop.connect_accepted_socket(lambda: cls(on_messages, on_lost), sock)
        return proto

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        msgs = self.frames.feed(data)
        if msgs:
            self.on_messages(msgs)

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.on_lost()

    def send(self, obj) -> bool:
        """Queue a message (never blocks); False when the core's end is gone."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(frame(obj))
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
