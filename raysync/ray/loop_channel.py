"""The push loops' channel (raysync.ray.push_loop): one stream socket per member between the driver and the
member's loop, a Unix socket in a private directory when every member runs on the driver's node, else TCP on the
driver's node IP. Frames are length-prefixed bytes, signed and checked by raysync.ray.loop_wire.Codec; a member's
connection starts with its name, then its signed hello, which proves the name (a stranger's is closed).

    driver: DriverEnd(keys, nodes) -> .address -> hellos() -> send(key, ...) / wait() + frames() -> close()
    member: MemberEnd.connect(address, name, hello) -> recv() / send() on the loop's thread -> close()

# Note [the loops' channel]
# A push through the loops has two of the channel's hops on its critical path (the go, the receiver's answer),
# each after the member idled (through a train step): frames on plain stream sockets, as the sessions' control
# channels (Note [frames on stream sockets] in raysync.core.stream, with the measurements). The driver learns
# at once that a member's connection closed (a read finds its end): it then asks Ray about the member
# (PushLoops). A frame over the side's bound closes the connection.
#
# Note [a read or write without CPython's poll]
# A socket with a timeout (the driver's connections: 5 s for a send, a member's: each recv and send sets one) has
# a non-blocking fd, and CPython polls it before each recv and send, for the timeout: a syscall more than the
# read or write, on the round's critical path (the go frames, the receiver's answer, the driver's reads of the
# answers). Where the poll has nothing to wait for, this channel reads and writes the fd itself (``_write``,
# os.read): a read after the driver's selector found the connection ready, a frame written while the socket
# buffer has room (a go or an answer is a few hundred bytes). Only a frame that does not fit at once goes on
# through ``sendall``, bounded by the socket's timeout as before. ~1 us a read or write on the VM (warm).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import shutil
import socket
import tempfile
import time
from typing import Any

from raysync.core import errors, leftovers, stream
from raysync.core.control import private_dir_base

logger = logging.getLogger(__name__)


# --- the member's end -------------------------------------------------------------------------------------------------
class MemberEnd(stream.Connection):
    """A loop's connection, used by the loop's thread only (made on the actor's thread, then handed over)."""

    def send(self, data: bytes, timeout_s: float) -> None:
        """Connection.send: written at once where the socket has room (Note [a read or write without CPython's
        poll]), else the rest waits for the other end, up to ``timeout_s``."""
        framed = stream.frame(data)
        sent = _write(self.sock, framed)
        if sent < len(framed):
            self.sock.settimeout(timeout_s)
            try:
                self.sock.sendall(framed[sent:])
            except TimeoutError:
                self.close()
                raise

    @classmethod
    def connect(cls, address: str, name: str, hello: bytes, max_bytes: int, timeout_s: float) -> MemberEnd:
        end = stream.connect(address, max_bytes, timeout_s, kind=cls)
        try:
            end.send(name.encode(), timeout_s)
            end.send(hello, timeout_s)
        except BaseException:
            end.close()
            raise
        return end


# --- the driver's end -------------------------------------------------------------------------------------------------
class DriverEnd:
    """The driver's side: a listening socket until every member said hello, then one connection per member.
    ``codecs``: each member's Codec, by key; ``names``: each member's name, by key."""

    def __init__(self, codecs: dict[Any, Any], names: dict[Any, str], local: bool, host: str, max_bytes: int):
        self._codecs, self._max = codecs, max_bytes
        self._by_name = {name: key for key, name in names.items()}
        self._dir: str | None = None
        self._conns: dict[Any, socket.socket] = {}  # key -> its connection, once its hello was read
        # a connection -> (its member's key, None until its name was read; its frames)
        self._readers: dict[socket.socket, tuple[Any, stream.Frames]] = {}
        self._selector = selectors.DefaultSelector()
        # what wait() found ready: the next frames() reads that, rather than select again
        self._ready: list | None = None
        self.dropped = False  # a member's connection closed since this was last reset
        try:
            if local:  # Note [names that outlive a crash]
                self._dir = tempfile.mkdtemp(prefix=f"{leftovers.owner_tag()}-", dir=private_dir_base())
                self._listener = stream.listen(f"ipc://{self._dir}/loop", len(names) + 8)
            else:
                self._listener = stream.listen(f"tcp://{host}:0", len(names) + 8)
            self.address = stream.address_of(self._listener)
            self._listener.setblocking(False)
            self._selector.register(self._listener, selectors.EVENT_READ)
        except BaseException:
            self.close()
            raise

    def hellos(self, timeout_s: float, label) -> None:
        """Wait until every member has said hello (nothing else is sent before); then nobody else needs to find
        the socket."""
        deadline = time.monotonic() + timeout_s
        while len(self._conns) < len(self._codecs):
            left = deadline - time.monotonic()
            waiting = [k for k in self._codecs if k not in self._conns]
            if left <= 0 or not self.wait(left):
                raise errors.PeerTimeout(", ".join(map(label, sorted(waiting))), "push loop hello", timeout_s)
            self.frames()
        self._forget()

    def wait(self, timeout_s: float) -> bool:
        """Whether something came (a frame, a connection, one closed) within ``timeout_s``: read it with frames()."""
        self._ready = self._selector.select(max(timeout_s, 0.0))
        return bool(self._ready)

    def frames(self) -> list[tuple[Any, str, list]]:
        """The frames waiting, checked: (key, kind, body); those that fail their check are dropped, connections
        that closed or sent too much are closed (``dropped`` set)."""
        out = []
        ready, self._ready = self._ready, None
        for selected, _ in ready or self._selector.select(0):
            sock = selected.fileobj
            if sock is self._listener:
                self._accept()
                continue
            if sock not in self._readers:  # closed since wait() found it ready (a send to it failed)
                continue
            key, frames = self._readers[sock]
            try:
                # ready: read the fd, no poll first (Note [a read or write without CPython's poll])
                data = os.read(sock.fileno(), stream.READ_BYTES)
                if not data:
                    raise ConnectionError("closed")
                whole = frames.feed(data)
            except BlockingIOError:  # ready, and nothing to read after all: the next wait finds what comes
                continue
            except (OSError, errors.WireError) as e:
                if key is not None:
                    logger.debug("push loops: the connection of %s ended: %s", key, e)
                self._drop(sock)
                continue
            for frame in whole:
                if key is None:  # its first frame: the member's name
                    key = self._by_name.get(frame.decode(errors="replace"))
                    if key is None:
                        logger.warning("push loops: dropped a connection that is no member's")
                        self._drop(sock)
                        break
                    self._readers[sock] = (key, frames)
                    continue
                try:
                    kind, body = self._codecs[key].decode(frame)
                except errors.WireError as e:
                    logger.warning("push loops: dropped a frame: %s", e)
                    continue
                if kind == "hello" and self._conns.get(key) not in (None, sock):
                    logger.warning("push loops: dropped a second connection of %s", key)
                    self._drop(sock)  # the name is proved on another one already
                    break
                if kind == "hello":
                    self._conns[key] = sock
                out.append((key, kind, body))
        return out

    def send(self, key: Any, kind: str, body: list) -> None:
        """Raises ConnectionError when that member is not connected."""
        sock = self._conns.get(key)
        if sock is None:
            raise ConnectionError(f"push loop member {key} is not connected")
        try:
            data = stream.frame(self._codecs[key].encode(kind, body))
            sent = _write(sock, data)  # Note [a read or write without CPython's poll]
            if sent < len(data):  # no room for all of it: the rest waits, up to the socket's timeout
                sock.sendall(data[sent:])
        except OSError as e:
            self._drop(sock)
            raise ConnectionError(f"push loop member {key}: {e}") from e

    def close(self) -> None:
        for key in list(self._conns):
            with contextlib.suppress(ConnectionError):  # not connected: its loop ends by its stop call
                self.send(key, "stop", [])
        for sock in list(self._readers):
            self._drop(sock)
        with contextlib.suppress(Exception):
            self._selector.close()
        self._forget()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                logger.warning("push loops: a connection failed: %s", e)
            return
        sock.setblocking(True)
        sock.settimeout(5.0)  # a send to a member that stopped reading ends, rather than hang the driver
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._readers[sock] = (None, stream.Frames(self._max))
        self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket) -> None:
        key, _ = self._readers.pop(sock, (None, None))
        if key is not None and self._conns.get(key) is sock:
            del self._conns[key]
            self.dropped = True
        with contextlib.suppress(Exception):
            self._selector.unregister(sock)
        sock.close()

    def _forget(self) -> None:
        """Stop listening (every member is connected, or the end closes)."""
        self._ready = None  # it may name the listener
        listener = getattr(self, "_listener", None)
        if listener is not None and listener.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._selector.unregister(listener)
            listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _write(sock: socket.socket, data: bytes) -> int:
    """How much of ``data`` went into ``sock`` at once (0: no room), written to its fd without the poll CPython
    makes first on a socket with a timeout, whose fd is non-blocking (Note [a read or write without CPython's
    poll]). Raises OSError when the other end is gone."""
    try:
        return os.write(sock.fileno(), data)
    except BlockingIOError:
        return 0
