"""The control channel: signed msgpack frames (raysync.core.wire) on one stream socket (raysync.core.stream,
Note [frames on stream sockets]), every wait bounded by a timeout.

The sender listens; the receiver connects. The sender talks only to the first connection that proves it holds
the session key (a signed Hello), then listens no more; a connection whose frame fails the check is closed.

Endpoints:
* default: ``ipc://`` in a fresh private directory (mode 0700, unguessable name that carries the owner: Note
  [names that outlive a crash] in raysync.core.leftovers) under the temp dir. The sender removes the socket file and
  the directory as soon as its peer is connected, so a later crash of either side leaves nothing in the temp
  dir; a crash before that leaves a directory that the next sender or receiver made on the machine removes.
* ``ipc:///path``: refused if the path exists (binding there would replace, or fail on, someone's file); the
  socket file is removed when the peer is connected and on close, so the path can be used again.
* ``tcp://HOST:PORT`` for other nodes (PORT may be ``*``; HOST an address, or a name that resolves); a HOST that
  resolves to every interface (0.0.0.0 or :: in any spelling: ``*``, ``0``, ``0x0``, ``000.000.000.000``,
  ``[::]``, ``::ffff:0.0.0.0``, ...) is
  refused unless ``allow_any_interface=True``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
import traceback

from raysync.core import leftovers, stream
from raysync.core.errors import EndpointError, PeerLost, PeerTimeout, RaysyncError, RemoteError, WireError
from raysync.core.frames import FrameCodec
from raysync.core.wire import Abort, Hello, Message, SessionSecret

logger = logging.getLogger(__name__)

_MAX_IPC_PATH = 107  # bytes of a unix socket path, with its terminating NUL: 108


def binds_every_interface(host: str) -> bool:
    """Whether binding ``tcp://HOST:port`` listens on every interface. Decided by what HOST resolves to, read
    the way a bind reads it: brackets and a ``%zone`` suffix are dropped, ``*`` is any address, anything else goes
    to getaddrinfo as a numeric host (which takes inet_aton's forms: ``0``, ``0x0``, ``0.0``, octal parts)."""
    if len(host) >= 2 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    if "%" in host:
        host = host[: host.rindex("%")]
    if host in ("*", ""):
        return True
    try:
        found = socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)
    except (OSError, UnicodeError, ValueError):
        return False  # not an address: a name (its address is checked once bound), or nothing that binds
    return any(_is_unspecified(str(info[4][0])) for info in found)


def _is_unspecified(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:0.0.0.0 is 0.0.0.0 to a dual-stack socket
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def bound_to_every_interface(last_endpoint: str) -> bool:
    """Whether the address a listener reports having bound (``tcp://0.0.0.0:5555``, ``tcp://[::]:5555``) is every
    interface: the check after binding, for a spelling ``binds_every_interface`` did not foresee."""
    if not last_endpoint.startswith("tcp://"):
        return False
    host = last_endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:
        return _is_unspecified(host)
    except ValueError:
        return False


def private_dir_base() -> str:
    """Where control sockets' private directories are made: the temp dir, or /tmp where the temp dir's path is
    too long for a unix socket path ("<base>/raysync-<pid>-<start>-<ns>-XXXXXXXX/ctl")."""
    base = tempfile.gettempdir()
    room = len(base) + len(f"/{leftovers.owner_tag()}-XXXXXXXX/ctl")
    if room > _MAX_IPC_PATH and os.access("/tmp", os.W_OK):
        base = "/tmp"
    return base


class Channel:
    """One side of a session's control channel: one connection (raysync.core.stream), its frames signed."""

    def __init__(
        self,
        secret: SessionSecret,
        role: str,
        peer_role: str,
        peer: str,
        timeout_s: float,
        max_frame_bytes: int,
    ):
        self.codec = FrameCodec(secret, role, peer_role, max_frame_bytes)
        self.peer, self.timeout_s, self.max_frame_bytes = peer, timeout_s, max_frame_bytes
        self.conn: stream.Connection | None = None

    def send(self, msg: Message, stage: str) -> None:
        conn = self._connection(stage)
        try:
            conn.send(self.codec.encode(msg), self.timeout_s)
        except TimeoutError:
            raise PeerTimeout(self.peer, stage, self.timeout_s) from None
        except OSError as e:
            raise PeerLost(self.peer, stage, f"the connection failed: {e}") from None

    def abort(self, push_id: int, stage: str, error: BaseException) -> None:
        """Best effort: tell the peer that this push failed here (with our traceback), so it need not wait."""
        tb = "".join(traceback.format_exception(error))
        self.try_send(Abort(push_id, stage, f"{type(error).__name__}: {error}", tb))

    def try_send(self, msg: Message) -> None:
        try:
            self.send(msg, "best-effort send")
        except RaysyncError:
            logger.debug("could not send %s to %s", type(msg).__name__, self.peer)

    def recv(self, stage: str, timeout_s: float | None = None) -> Message:
        """The next authenticated message from the peer. Raises PeerTimeout, PeerLost once the connection ended,
        or a WireError for a bad frame from the peer itself (after which the channel is still usable, unless
        the frame was over the bound)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        conn = self._connection(stage, timeout)
        try:
            frame = conn.recv(max(deadline - time.monotonic(), 0.0))
        except OSError as e:
            raise PeerLost(self.peer, stage, f"the connection ended: {e}") from None
        if frame is None:
            raise PeerTimeout(self.peer, stage, timeout)
        return self.codec.decode(frame)

    def expect(self, kind: type, push_id: int, stage: str, timeout_s: float | None = None) -> Message:
        """Wait for a ``kind`` message of push ``push_id``: an Abort of this push raises RemoteError, messages
        left over from an earlier, failed push are skipped."""
        while True:
            msg = self.expected(self.recv(stage, timeout_s), kind, push_id, stage)
            if msg is not None:
                return msg

    def expected(self, msg: Message, kind: type, push_id: int, stage: str) -> Message | None:
        """``msg`` if it is the awaited ``kind`` of push ``push_id``; None for a leftover of an earlier push."""
        msg_push = getattr(msg, "push_id", push_id)
        if msg_push < push_id:
            logger.debug("skipping %s of earlier push %d", type(msg).__name__, msg_push)
            return None
        if isinstance(msg, Abort):
            raise RemoteError(self.peer, msg.stage, msg.message, msg.traceback)
        if isinstance(msg, kind) and msg_push == push_id:
            return msg
        raise WireError(f"{self.peer} sent {type(msg).__name__} at stage '{stage}', expected {kind.__name__}")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def _connection(self, stage: str, timeout_s: float | None = None) -> stream.Connection:
        if self.conn is None:
            raise EndpointError(f"{self.peer} has not connected yet (stage '{stage}')")
        return self.conn


class SenderChannel(Channel):
    """The sender's side: it listens until the first peer that proves it holds the session key (a signed Hello)
    is connected, then talks only to it and listens no more. ``label``: what errors call the receiver (with its
    pid and host once it is connected)."""

    def __init__(
        self,
        secret: SessionSecret,
        *,
        endpoint: str | None,
        allow_any_interface: bool,
        timeout_s: float,
        max_frame_bytes: int,
        label: str = "receiver",
    ):
        super().__init__(secret, "sender", "receiver", label, timeout_s, max_frame_bytes)
        self.label = label
        self._listener: socket.socket | None = None
        self._private_dir: str | None = None
        self._ipc_file: tuple[str, int, int] | None = None  # an explicit ipc:// path: (path, device, inode)
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]
        try:
            self.endpoint = self._bind(endpoint, allow_any_interface)
        except BaseException:
            self.close()
            raise

    def _bind(self, endpoint: str | None, allow_any_interface: bool) -> str:
        address = endpoint
        if endpoint is None:
            # mode 0700 and an unguessable name that carries this process (Note [names that outlive a crash])
            self._private_dir = tempfile.mkdtemp(prefix=f"{leftovers.owner_tag()}-", dir=private_dir_base())
            address = endpoint = f"ipc://{self._private_dir}/ctl"
        elif endpoint.startswith("ipc://"):
            if os.path.lexists(endpoint[len("ipc://") :]):
                raise EndpointError(f"endpoint {endpoint} exists already; refusing to replace it")
        elif endpoint.startswith("tcp://"):
            host, _, port = endpoint[len("tcp://") :].rpartition(":")
            if binds_every_interface(host) and not allow_any_interface:
                raise _every_interface(endpoint)
            host = "0.0.0.0" if host in ("*", "") else host
            address = f"tcp://{host}:{0 if port == '*' else port}"
        else:
            raise EndpointError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
        try:
            self._listener = stream.listen(address)
        except (OSError, ValueError) as e:
            raise EndpointError(f"cannot bind {endpoint}: {e}") from None
        bound = stream.address_of(self._listener)
        if bound_to_every_interface(bound) and not allow_any_interface:
            raise _every_interface(f"{endpoint} (bound as {bound})")  # close() unbinds it
        if endpoint.startswith("ipc://") and self._private_dir is None:
            self._ipc_file = _socket_file(endpoint[len("ipc://") :])
        return bound

    def accept(self, stage: str = "handshake") -> Hello:
        """Wait for the first connection whose first frame is a valid, signed Hello; from then on talk only to
        it (a later accept waits for its next Hello). A connection whose frame fails the check is closed."""
        deadline = time.monotonic() + self.timeout_s
        # connected: the receiver says Hello again (it starts over after an Abort before a push)
        if self.conn is not None:
            return self._hello_again(stage, deadline)
        candidates: list[stream.Connection] = []
        try:
            while True:
                remaining = deadline - time.monotonic()
                ready = stream.ready([self._listener, *candidates], remaining) if remaining > 0 else []
                if not ready:
                    raise PeerTimeout(self.peer, stage, self.timeout_s)
                for conn in ready:
                    if conn is self._listener:
                        with contextlib.suppress(OSError):  # it went away before it was taken
                            candidates.append(
                                stream.Connection(self._listener.accept()[0], self.max_frame_bytes)
                            )
                        continue
                    hello = self._hello(conn)
                    if hello is not None:
                        candidates.remove(conn)
                        self._connected(conn, hello)
                        return hello
                    if conn.sock.fileno() < 0:
                        candidates.remove(conn)
        finally:
            for conn in candidates:
                conn.close()

    def _hello_again(self, stage: str, deadline: float) -> Hello:
        while True:
            if time.monotonic() >= deadline:
                raise PeerTimeout(self.peer, stage, self.timeout_s)
            try:
                msg = self.recv(stage, deadline - time.monotonic())
            except WireError as e:
                logger.warning("dropped a frame from %s: %s", self.peer, e)
                continue
            if isinstance(msg, Hello):
                return msg

    def _hello(self, conn: stream.Connection) -> Hello | None:
        """The Hello ``conn`` sent, if it sent one; a connection that ended or sent a frame that fails the check
        is closed."""
        try:
            frame = conn.recv(0.0)
            msg = None if frame is None else self.codec.decode(frame)
        except (OSError, WireError) as e:
            logger.warning("dropped an unauthenticated connection: %s", e)
            conn.close()
            return None
        return msg if isinstance(msg, Hello) else None

    def _connected(self, conn: stream.Connection, hello: Hello) -> None:
        self.conn = conn
        if self.label == "receiver":
            self.peer = f"{self.label}(pid {hello.pid} on {hello.host})"
        else:
            self.peer = f"{self.label} (pid {hello.pid} on {hello.host})"
        self.forget_endpoint()

    def forget_endpoint(self) -> None:
        """Stop listening; remove the socket file and private directory: the peer is connected (or the channel
        closes), nobody else needs to find us. An explicit ipc:// path is removed only if it is still the socket
        this channel bound."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        if self._ipc_file is not None:
            path, device, inode = self._ipc_file
            self._ipc_file = None
            try:
                st = os.lstat(path)
                if (st.st_dev, st.st_ino) == (device, inode):
                    os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.forget_endpoint()
        super().close()


class ReceiverChannel(Channel):
    """The receiver's side: it connects to the sender's endpoint when it first sends or waits, tried again
    while nothing listens there yet, up to that send's or wait's timeout."""

    def __init__(self, secret: SessionSecret, *, endpoint: str, timeout_s: float, max_frame_bytes: int):
        super().__init__(secret, "receiver", "sender", f"sender at {endpoint}", timeout_s, max_frame_bytes)
        try:
            stream.parse(endpoint)
        except ValueError as e:
            raise EndpointError(str(e)) from None
        self.endpoint = endpoint
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]

    def _connection(self, stage: str, timeout_s: float | None = None) -> stream.Connection:
        if self.conn is None:
            timeout = self.timeout_s if timeout_s is None else timeout_s
            try:
                self.conn = stream.connect(self.endpoint, self.max_frame_bytes, timeout)
            except TimeoutError:
                raise PeerTimeout(self.peer, stage, timeout) from None
            except OSError as e:
                raise PeerLost(self.peer, stage, f"cannot connect: {e}") from None
        return self.conn


def _every_interface(endpoint: str) -> EndpointError:
    return EndpointError(
        f"endpoint {endpoint} listens on every interface; bind the interface the receivers reach "
        f"(tcp://<node ip>:*), or pass allow_any_interface=True"
    )


def _socket_file(path: str) -> tuple[str, int, int] | None:
    """The socket file the bind just made at ``path``, to remove on close (and only it, not a later file there)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (path, st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None
