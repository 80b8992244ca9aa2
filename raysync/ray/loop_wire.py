"""The frames between WeightSync's driver and a push loop in an actor (raysync.ray.push_loop, Note [push loops]):
msgpack signed with HMAC-SHA256 under a key per member and direction, numbered (a replay is refused), decoding
to scalars only; a round's answer is rebuilt as EndpointResult, PushReport, RemoteFailure from checked values.

They travel over one stream socket per member, each frame after its length (4 bytes, big-endian), read only
up to a cap per direction:

    ┌──────────┬─────────────────────────────────────────────────────────────┐
    │ length n │ n bytes: msgpack [protocol, member, seq, kind, body] + HMAC │
    └──────────┴─────────────────────────────────────────────────────────────┘

A plain socket rather than zmq: a frame goes from the writer's thread to the reader's with no I/O thread of
zmq's on either side, two thread wake-ups fewer each way (benchmarks/bench_ray_share.py times a round)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import operator
import socket
import struct
from typing import Any

from raysync.core import errors
from raysync.core.frames import SignedFrames
from raysync.core.report import PushReport
from raysync.core.version import MIXED
from raysync.ray.results import EndpointResult, RemoteFailure

logger = logging.getLogger(__name__)

_PROTOCOL = "rs-loop2"  # 2: length-prefixed frames over a stream socket, not zmq
_MAX_FRAME = 64 << 20  # an answer carries failures' tracebacks


class Codec:
    """Signs what one side sends to, and checks what it receives from, one member's loop: core.frames'
    SignedFrames under a key per member and direction, the member's name as the channel; bodies are lists."""

    def __init__(self, secret: bytes, member: str, role: str):
        keys = {
            r: hmac.new(secret, f"raysync/{_PROTOCOL}/{member}/{r}".encode(), hashlib.sha256).digest()
            for r in ("actor", "driver")
        }
        peer = "actor" if role == "driver" else "driver"
        self._frames = SignedFrames(
            keys[role],
            keys[peer],
            protocol=_PROTOCOL,
            channel=member,
            max_frame_bytes=_MAX_FRAME,
            what="push loop frame",
            scope="push loop member",
            use_list=True,
        )

    def encode(self, kind: str, body: list) -> bytes:
        return self._frames.seal(kind, body)

    def decode(self, frame: bytes) -> tuple[str, list]:
        seq, kind, body = self._frames.open(frame)
        if type(kind) is not str or type(body) is not list:
            raise errors.MalformedFrame("signed frame does not carry a push loop header")
        self._frames.accept(seq)
        return kind, body


_SCALARS = (int, float, str, bool, type(None))


# each class's fields in order, read at once (dataclasses.astuple deep-copies every field: ~20 us a report)
_FIELDS = {
    cls: operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))
    for cls in (PushReport, RemoteFailure)
}
_COUNTS = {cls: len(dataclasses.fields(cls)) for cls in _FIELDS}


def to_wire(answer: dict[int, EndpointResult]) -> list:
    """{receiver or slot: EndpointResult} as plain values: [[index, report fields, failure fields, version]]."""
    return [
        [k, _values(r.report, PushReport), _values(r.failure, RemoteFailure), r.version]
        for k, r in answer.items()
    ]


def _values(x: object, cls: type) -> tuple | None:
    """The fields of ``x``, an instance of exactly ``cls`` (a subclass could add fields the other side lacks)."""
    if x is None:
        return None
    if type(x) is not cls:
        raise TypeError(f"push loop answer: a {type(x).__name__} where a {cls.__name__} goes")
    return _FIELDS[cls](x)


def from_wire(items: list) -> dict[int, EndpointResult]:
    """The inverse of to_wire, every value checked: SchemaError for anything else."""
    out: dict[int, EndpointResult] = {}
    for item in items:
        k, report, failure, version = item if type(item) is list and len(item) == 4 else (None,) * 4
        if type(k) is not int or not (version is None or version == MIXED or type(version) is int):
            raise errors.SchemaError(f"push loop answer: bad item {item!r:.200}")
        try:
            out[k] = EndpointResult(_build(PushReport, report), _build(RemoteFailure, failure), version)
        except ValueError as e:  # a report and a failure, or neither
            raise errors.SchemaError(f"push loop answer: {e}") from None
    return out


def _build(cls: type, values: object) -> Any:
    """``cls`` (a dataclass of scalar fields) from its fields' values, in order; None stays None."""
    if values is not None and (
        type(values) is not list
        or len(values) != _COUNTS[cls]
        or not all(type(v) in _SCALARS for v in values)
    ):
        raise errors.SchemaError(f"push loop answer: {cls.__name__} fields {values!r:.200}")
    return None if values is None else cls(*values)


# --- the stream ------------------------------------------------------------------------------------------------------
_LENGTH = struct.Struct("!I")


def listen(path: str | None, host: str | None, backlog: int) -> tuple[socket.socket, str]:
    """The driver's listening socket and its address: a unix socket at ``path``, else TCP on ``host`` (a port
    the kernel picks); ``ipc://path`` or ``tcp://host:port``, as the loops connect to it."""
    family = socket.AF_UNIX if path is not None else socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(path if path is not None else (host, 0))
        sock.listen(backlog)
        if path is not None:
            return sock, f"ipc://{path}"
        port = sock.getsockname()[1]
        return sock, f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    except BaseException:
        sock.close()
        raise


def connect(address: str, timeout_s: float) -> socket.socket:
    """A loop's connection to the driver's ``address`` (what ``listen`` gave); sends and reads wait up to
    ``timeout_s``."""
    if address.startswith("ipc://"):
        sock, to = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), address[len("ipc://") :]
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        host = host.strip("[]")
        sock, to = (
            socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM),
            (host, int(port)),
        )
    else:
        raise ValueError(f"a push loop address is ipc:// or tcp://, not {address!r}")
    try:
        sock.settimeout(timeout_s)
        sock.connect(to)
        nodelay(sock)
    except BaseException:
        sock.close()
        raise
    return sock


def hello_from(conn: socket.socket, codecs: dict[Any, Codec], max_bytes: int) -> Any:
    """The key of the codec under which ``conn``'s first frame is a signed hello, or None (logged): a stranger,
    a member that is not waited for, a frame past ``max_bytes`` or the socket's timeout."""
    try:
        frame = recv_frame(conn, max_bytes)
    except (OSError, errors.WireError) as e:
        logger.warning("push loops: dropped a connection: %s", e)
        return None
    for key, codec in codecs.items() if frame is not None else ():
        try:
            kind, _ = codec.decode(frame)
        except errors.WireError:
            continue  # another member's key, or no member's
        return key if kind == "hello" else None
    logger.warning("push loops: dropped a connection whose first frame is no member's hello")
    return None


def nodelay(sock: socket.socket) -> None:
    """A small frame leaves at once (no Nagle delay on TCP)."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send_frame(sock: socket.socket, frame: bytes) -> None:
    """Raises OSError when the other end is closed, or the send waited past the socket's timeout."""
    sock.sendall(_LENGTH.pack(len(frame)) + frame)


def recv_frame(sock: socket.socket, max_bytes: int) -> bytes | None:
    """The next frame; None when the other end closed between frames. FrameTooLarge past ``max_bytes`` (the
    stream is then unusable: its reader closes it); OSError on a reset, a timeout, or an end mid-frame."""
    header = _recv_exactly(sock, _LENGTH.size, at_boundary=True)
    if header is None:
        return None
    (n,) = _LENGTH.unpack(header)
    if n > max_bytes:
        raise errors.FrameTooLarge(f"push loop frame of {n} bytes exceeds max_frame_bytes={max_bytes}")
    return bytes(_recv_exactly(sock, n, at_boundary=False) or b"")


def _recv_exactly(sock: socket.socket, n: int, *, at_boundary: bool) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0 and at_boundary:
                return None
            raise ConnectionError(f"push loop stream ended {got} bytes into a {n}-byte read")
        got += k
    return buf
