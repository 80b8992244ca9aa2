"""Frames over a stream socket: what the control channels (raysync.core.control) and the push loops' channel
(raysync.ray.loop_channel) carry. A frame is a 4-byte big-endian length and that many bytes; what is in it is
the caller's (signed msgpack, checked there). A side reads at most ``max_bytes`` a frame: a longer one closes
the connection before anything of it is kept.

    listener = listen(address)                     ipc://PATH (a Unix socket) or tcp://HOST:PORT (0: any port)
    conn = connect(address, max_bytes, timeout_s)   retried while nothing listens there yet, up to timeout_s
    conn.send(frame, timeout_s) / conn.recv(timeout_s) -> bytes | None / ready([conns], timeout_s)

# Note [frames on stream sockets]
# A push has control hops on its critical path, each after the other side idled (a train step, the pack):
# PushStart, Accept and PushDone in every session, the go and the answer in a push loop. Measured on the H200's
# host (benchmarks/channel_hops.py, a 100-byte frame, the receiver asleep between frames): zmq over ipc://
# (DEALER -> ROUTER, asleep in zmq's poll) 174-202 us a hop after 1-10 ms idle, 45 us back to back; a Unix
# stream socket (asleep in recv) 38-44 us, 11 us back to back. zmq hands each frame to an I/O thread on either
# side, three threads to wake instead of one. What zmq does besides (reconnecting, queueing while no peer is
# there, routing among peers) no channel here needs: a channel has one peer, proved by its first frames, and a
# connection that ends is a peer lost.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from raysync.core.errors import WireError

_LENGTH = struct.Struct("!I")
READ_BYTES = 1 << 16  # the most one read of a socket takes
_RETRY_S = (
    0.001,
    0.05,
)  # the first and the longest pause between two tries of a connect (nothing listens yet)


def frame(data: bytes) -> bytes:
    """``data`` as one frame on the wire."""
    return _LENGTH.pack(len(data)) + data


class Frames:
    """A connection's bytes as whole frames; one over ``max_bytes`` raises WireError (its bytes are not kept)."""

    def __init__(self, max_bytes: int):
        self._buf, self._max = bytearray(), max_bytes

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out = []
        while len(self._buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buf)
            if n > self._max:
                self._buf.clear()
                raise WireError(f"a frame of {n} bytes, over the bound of {self._max}")
            if len(self._buf) < _LENGTH.size + n:
                break
            out.append(bytes(self._buf[_LENGTH.size : _LENGTH.size + n]))
            del self._buf[: _LENGTH.size + n]
        return out


def parse(address: str) -> tuple[socket.AddressFamily, Any]:
    """(family, address to bind or connect) of ``ipc://PATH``, ``tcp://HOST:PORT`` or ``tcp://[IPV6]:PORT``."""
    kind, sep, where = address.partition("://")
    if sep and kind == "ipc" and where:
        return socket.AF_UNIX, where
    if sep and kind == "tcp":
        host, _, port = where.rpartition(":")
        if host.startswith("[") and host.endswith("]") and port.isdigit():
            return socket.AF_INET6, (host[1:-1], int(port))
        if host and port.isdigit():
            return (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, int(port))
    raise ValueError(f"address {address!r}: expected ipc://PATH or tcp://HOST:PORT")


def listen(address: str, backlog: int = 8) -> socket.socket:
    """A listening socket bound at ``address`` (a port of 0: any free one; read it with ``address_of``)."""
    family, where = parse(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def address_of(listener: socket.socket) -> str:
    """The address a listening socket is bound at, as ``listen`` and ``connect`` take it."""
    where = listener.getsockname()
    if listener.family == socket.AF_UNIX:
        return f"ipc://{where}"
    host = f"[{where[0]}]" if listener.family == socket.AF_INET6 else where[0]
    return f"tcp://{host}:{where[1]}"


class Connection:
    """One end of a connected stream socket, read and written by one thread at a time."""

    def __init__(self, sock: socket.socket, max_bytes: int):
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self._frames, self._ready = sock, Frames(max_bytes), []

    def fileno(self) -> int:
        return self.sock.fileno()

    def pending(self) -> bool:
        """Whether a frame was read off the socket already (``select`` on the socket would not say so)."""
        return bool(self._ready)

    def recv(self, timeout_s: float) -> bytes | None:
        """The next frame; None after ``timeout_s`` (0: at once) with none. Raises ConnectionError when the other end closed,
        WireError on a frame over the bound (the connection is closed then: nothing after it can be read)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.0))  # 0: one read of what is there
            try:
                data = self.sock.recv(READ_BYTES)
            except (TimeoutError, BlockingIOError):
                return None
            if not data:
                raise ConnectionError("the other end closed the connection")
            try:
                self._ready = self._frames.feed(data)
            except WireError:
                self.close()
                raise
        return self._ready.pop(0)

    def send(self, data: bytes, timeout_s: float) -> None:
        """Raises TimeoutError when the other end does not read within ``timeout_s`` (the connection is closed
        then: a frame may have gone in part), OSError when it is gone."""
        self.sock.settimeout(timeout_s)
        try:
            self.sock.sendall(frame(data))
        except TimeoutError:
            self.close()
            raise

    def close(self) -> None:
        self.sock.close()


def connect(
    address: str, max_bytes: int, timeout_s: float, kind: type[Connection] = Connection
) -> Connection:
    """A connection (a ``kind``) to the listener at ``address``, tried again while nothing listens there yet (its
    side may bind a moment later), up to ``timeout_s``: then TimeoutError."""
    family, where = parse(address)
    deadline = time.monotonic() + timeout_s
    pause = _RETRY_S[0]
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.connect(where)
            return kind(sock, max_bytes)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise TimeoutError(f"nothing listens at {address} after {timeout_s:g} s: {e}") from None
        except BaseException:
            sock.close()
            raise
        time.sleep(pause)  # a bounded retry of a connect, as zmq's reconnect interval
        pause = min(2 * pause, _RETRY_S[1])


def ready(conns: Sequence[Any], timeout_s: float) -> list[Any]:
    """Those of ``conns`` (Connections, or listening sockets) that have a frame, a connection or an end to
    read, waiting up to ``timeout_s`` for one; [] when none came."""
    # a whole frame already read, or a closed connection: ready at once
    now = [c for c in conns if isinstance(c, Connection) and (c.pending() or c.fileno() < 0)]
    if now or not conns:
        return now
    poller, by_fd = select.poll(), {}  # poll, not select: a process with Ray and vLLM in it has fds over 1024
    for c in conns:
        by_fd[c.fileno()] = c
        poller.register(c.fileno(), select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(max(math.ceil(timeout_s * 1000), 0))]
