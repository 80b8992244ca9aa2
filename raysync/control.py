"""The control channel: signed msgpack frames (raysync.wire) over pyzmq, every wait bounded by a timeout.

The sender binds a ROUTER socket; the receiver connects a DEALER. The sender talks only to the first peer
that proves it holds the session key (a signed Hello); frames from any other connection are dropped unread.

Endpoints:
* default: ``ipc://`` in a fresh private directory (mode 0700, unguessable name) under the temp dir. The
  sender removes the socket file and the directory as soon as its peer is connected, so a later crash of
  either side leaves nothing in the temp dir.
* ``ipc:///path``: refused if the path exists (zmq would silently replace it).
* ``tcp://HOST:PORT`` for other nodes (PORT may be ``*``); binding every interface (0.0.0.0, ::, *) is
  refused unless ``allow_any_interface=True``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import traceback

import zmq

from raysync.errors import EndpointError, PeerLost, PeerTimeout, RaysyncError, RemoteError, WireError
from raysync.wire import Abort, FrameCodec, Hello, Message, SessionSecret

logger = logging.getLogger(__name__)

_ANY_INTERFACE = {"0.0.0.0", "*", "::", "[::]"}
_MAX_IPC_PATH = 107


def _socket(ctx: zmq.Context, kind: int, max_frame_bytes: int, timeout_s: float) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # zmq drops larger messages before allocating them
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    return sock


class Channel:
    """One side of a session's control channel."""

    def __init__(self, kind: int, secret: SessionSecret, role: str, peer_role: str, peer: str,
                 timeout_s: float, max_frame_bytes: int):  # fmt: skip
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
            msg = self.recv(stage, timeout_s)
            msg_push = getattr(msg, "push_id", push_id)
            if msg_push < push_id:
                logger.debug("skipping %s of earlier push %d", type(msg).__name__, msg_push)
                continue
            if isinstance(msg, Abort):
                raise RemoteError(self.peer, msg.stage, msg.message, msg.traceback)
            if isinstance(msg, kind) and msg_push == push_id:
                return msg
            raise WireError(
                f"{self.peer} sent {type(msg).__name__} at stage '{stage}', expected {kind.__name__}"
            )

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()

    def _send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def _read(self) -> bytes | None:
        return self.sock.recv(copy=True)


class SenderChannel(Channel):
    def __init__(self, secret: SessionSecret, *, endpoint: str | None, allow_any_interface: bool,
                 timeout_s: float, max_frame_bytes: int):  # fmt: skip
        super().__init__(zmq.ROUTER, secret, "sender", "receiver", "receiver", timeout_s, max_frame_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of dropping
        self._peer_id: bytes | None = None
        self._private_dir: str | None = None
        try:
            self.endpoint = self._bind(endpoint, allow_any_interface)
        except BaseException:
            self.close()
            raise

    def _bind(self, endpoint: str | None, allow_any_interface: bool) -> str:
        if endpoint is None:
            base = tempfile.gettempdir()
            if len(base) > _MAX_IPC_PATH - 24 and os.access("/tmp", os.W_OK):  # "/raysync-XXXXXXXX/ctl"
                base = "/tmp"  # a unix socket path holds 107 bytes at most
            self._private_dir = tempfile.mkdtemp(prefix="raysync-", dir=base)  # mode 0700, unguessable
            endpoint = f"ipc://{self._private_dir}/ctl"
        elif endpoint.startswith("ipc://"):
            if os.path.lexists(endpoint[len("ipc://") :]):
                raise EndpointError(f"endpoint {endpoint} exists already; refusing to replace it")
        elif endpoint.startswith("tcp://"):
            host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
            if host in _ANY_INTERFACE and not allow_any_interface:
                raise EndpointError(
                    f"endpoint {endpoint} listens on every interface; bind the interface the receivers reach "
                    f"(tcp://<node ip>:*), or pass allow_any_interface=True"
                )
        else:
            raise EndpointError(f"endpoint {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise EndpointError(f"cannot bind {endpoint}: {e}") from None
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

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
                self.peer = f"receiver(pid {msg.pid} on {msg.host})"
                self.forget_endpoint()
                return msg

    def forget_endpoint(self) -> None:
        """Remove the socket file and private directory: the peer is connected, nobody else needs to find us."""
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

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
        super().__init__(zmq.DEALER, secret, "receiver", "sender", f"sender at {endpoint}", timeout_s,
                         max_frame_bytes)  # fmt: skip
        self.sock.connect(endpoint)
