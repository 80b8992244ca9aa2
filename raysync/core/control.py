"""The control channel: signed msgpack frames (raysync.core.wire) over pyzmq, every wait bounded by a timeout.

The sender binds a ROUTER socket; the receiver connects a DEALER. The sender talks only to the first peer
that proves it holds the session key (a signed Hello); frames from any other connection are dropped unread.

Endpoints:
* default: ``ipc://`` in a fresh private directory (mode 0700, unguessable name that carries the owner: Note
  [names that outlive a crash] in raysync.core.leftovers) under the temp dir. The sender removes the socket file and
  the directory as soon as its peer is connected, so a later crash of either side leaves nothing in the temp
  dir; a crash before that leaves a directory that the next sender or receiver made on the machine removes.
* ``ipc:///path``: refused if the path exists (zmq would silently replace it); the socket file is removed when
  the peer is connected and on close, so the path can be used again.
* ``tcp://HOST:PORT`` for other nodes (PORT may be ``*``); a HOST that resolves to every interface (0.0.0.0 or
  :: in any spelling: ``*``, ``0``, ``0x0``, ``000.000.000.000``, ``[::]``, ``::ffff:0.0.0.0``, ...) is
  refused unless ``allow_any_interface=True``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
import traceback

import zmq

from raysync.core import leftovers
from raysync.core.errors import EndpointError, PeerLost, PeerTimeout, RaysyncError, RemoteError, WireError
from raysync.core.frames import FrameCodec
from raysync.core.wire import Abort, Hello, Message, SessionSecret

logger = logging.getLogger(__name__)

_MAX_IPC_PATH = 107  # bytes of a unix socket path, with its terminating NUL: 108


def binds_every_interface(host: str) -> bool:
    """Whether zmq binding ``tcp://HOST:port`` listens on every interface. Decided by what HOST resolves to, read
    the way zmq reads it: brackets and a ``%zone`` suffix are dropped, ``*`` is any address, anything else goes
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
        return False  # not an address: a NIC's name (zmq binds that NIC's address), or nothing zmq binds
    return any(_is_unspecified(str(info[4][0])) for info in found)


def _is_unspecified(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:0.0.0.0 is 0.0.0.0 to a dual-stack socket
    return ip.is_unspecified or (mapped is not None and mapped.is_unspecified)


def bound_to_every_interface(last_endpoint: str) -> bool:
    """Whether the address zmq reports having bound (``tcp://0.0.0.0:5555``, ``tcp://[::]:5555``) is every
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


def _socket(ctx: zmq.Context, kind: int, max_frame_bytes: int, timeout_s: float) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # zmq drops larger messages before allocating them
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    return sock


class Channel:
    """One side of a session's control channel."""

    def __init__(
        self,
        kind: int,
        secret: SessionSecret,
        role: str,
        peer_role: str,
        peer: str,
        timeout_s: float,
        max_frame_bytes: int,
    ):
        self._ctx = zmq.Context()
        self.sock = _socket(self._ctx, kind, max_frame_bytes, timeout_s)
        self.codec = FrameCodec(secret, role, peer_role, max_frame_bytes)
        self.peer, self.timeout_s = peer, timeout_s

    def send(self, msg: Message, stage: str) -> None:
        try:
            self._send(self.codec.encode(msg))
        except zmq.Again:
            raise PeerTimeout(self.peer, stage, self.timeout_s) from None
        except zmq.ZMQError as e:
            raise PeerLost(self.peer, stage, str(e)) from None

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
        """The next authenticated message from the peer. Raises PeerTimeout, or a WireError for a bad frame
        from the peer itself (after which the channel is still usable)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.sock.poll(max(1, int(remaining * 1000))):
                raise PeerTimeout(self.peer, stage, timeout)
            frame = self._read()
            if frame is not None:
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
        self.sock.close(linger=0)
        self._ctx.term()

    def _send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def _read(self) -> bytes | None:
        return self.sock.recv(copy=True)


class SenderChannel(Channel):
    """``label``: what errors call the receiver (with its pid and host once it is connected)."""

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
        super().__init__(zmq.ROUTER, secret, "sender", "receiver", label, timeout_s, max_frame_bytes)
        self.label = label
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        self._peer_id: bytes | None = None
        self._private_dir: str | None = None
        self._ipc_file: tuple[str, int, int] | None = None  # an explicit ipc:// path: (path, device, inode)
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]
        try:
            self.endpoint = self._bind(endpoint, allow_any_interface)
        except BaseException:
            self.close()
            raise

    def _bind(self, endpoint: str | None, allow_any_interface: bool) -> str:
        if endpoint is None:
            # mode 0700 and an unguessable name that carries this process (Note [names that outlive a crash])
            self._private_dir = tempfile.mkdtemp(prefix=f"{leftovers.owner_tag()}-", dir=private_dir_base())
            endpoint = f"ipc://{self._private_dir}/ctl"
        elif endpoint.startswith("ipc://"):
            if os.path.lexists(endpoint[len("ipc://") :]):
                raise EndpointError(f"endpoint {endpoint} exists already; refusing to replace it")
        elif endpoint.startswith("tcp://"):
            if binds_every_interface(endpoint[len("tcp://") :].rsplit(":", 1)[0]) and not allow_any_interface:
                raise _every_interface(endpoint)
        else:
            raise EndpointError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise EndpointError(f"cannot bind {endpoint}: {e}") from None
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if bound_to_every_interface(bound) and not allow_any_interface:
            raise _every_interface(f"{endpoint} (bound as {bound})")  # close() unbinds it
        if endpoint.startswith("ipc://") and self._private_dir is None:
            self._ipc_file = _socket_file(endpoint[len("ipc://") :])
        return bound

    def accept(self, stage: str = "handshake") -> Hello:
        """Wait for the first peer that sends a valid, signed Hello; from then on talk only to it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.sock.poll(max(1, int(remaining * 1000))):
                raise PeerTimeout(self.peer, stage, self.timeout_s)
            parts = self.sock.recv_multipart(copy=True)
            if len(parts) != 2:
                continue
            try:
                msg = self.codec.decode(parts[1])
            except WireError as e:
                logger.warning("dropped a frame from an unauthenticated connection: %s", e)
                continue
            if isinstance(msg, Hello):
                self._peer_id = parts[0]
                self.peer = (
                    f"{self.label}(pid {msg.pid} on {msg.host})"
                    if self.label == "receiver"
                    else f"{self.label} (pid {msg.pid} on {msg.host})"
                )
                self.forget_endpoint()
                return msg

    def forget_endpoint(self) -> None:
        """Remove the socket file and private directory: the peer is connected, nobody else needs to find us.
        An explicit ipc:// path is removed only if it is still the socket this channel bound."""
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

    def _send(self, frame: bytes) -> None:
        if self._peer_id is None:
            raise EndpointError("no receiver has connected yet")
        self.sock.send_multipart([self._peer_id, frame])

    def _read(self) -> bytes | None:
        parts = self.sock.recv_multipart(copy=True)
        if len(parts) != 2 or parts[0] != self._peer_id:
            logger.warning("dropped a frame from a connection that is not this session's receiver")
            return None
        return parts[1]


class ReceiverChannel(Channel):
    def __init__(self, secret: SessionSecret, *, endpoint: str, timeout_s: float, max_frame_bytes: int):
        super().__init__(
            zmq.DEALER, secret, "receiver", "sender", f"sender at {endpoint}", timeout_s, max_frame_bytes
        )
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]
        self.sock.connect(endpoint)


def _every_interface(endpoint: str) -> EndpointError:
    return EndpointError(
        f"endpoint {endpoint} listens on every interface; bind the interface the receivers reach "
        f"(tcp://<node ip>:*), or pass allow_any_interface=True"
    )


def _socket_file(path: str) -> tuple[str, int, int] | None:
    """The socket file zmq just made at ``path``, to remove on close (and only it, not a later file there)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (path, st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None
