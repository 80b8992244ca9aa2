"""Frames: how a message (raysync.core.wire) travels, signed, and how a received one is checked.

Checked in this order, cheapest and safest first: size cap, HMAC (before a single byte is parsed), msgpack
(no ext types, no pickle, strict map keys), session id, sequence number (strictly increasing per direction),
then the body against the frozen dataclass of its kind (each schema type's checker made once).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import typing

import msgpack

from raysync.core.errors import (
    BadLayout,
    BadSignature,
    FrameTooLarge,
    LayoutError,
    MalformedFrame,
    ReplayedFrame,
    SchemaError,
)
from raysync.core.wire import (
    MAC_BYTES,
    MAX_ARRAY_ITEMS,
    MESSAGE_TYPES,
    PROTOCOL,
    Layout,
    Message,
    SessionSecret,
)

# --- schema checking ---------------------------------------------------------------------------------------------
# Each schema type gets its checker made once (typing's introspection costs microseconds a call, and a Layout
# frame holds up to MAX_LAYOUT_TENSORS specs of three fields each).
_SCALARS = (int, str, bytes, bool, float)
_INT_END = 1 << 63
_Checker = typing.Callable[[object, str], object]


def _check_int(value: object, where: str) -> object:
    if type(value) is not int:  # exact: a bool is not an int here
        raise SchemaError(f"{where}: expected int, got {type(value).__name__}")
    if not 0 <= value < _INT_END:
        raise SchemaError(f"{where}: integer {value} out of range [0, 2**63)")
    return value


@functools.cache
def _checker(hint: object) -> _Checker:
    """The function that checks a received value against the schema type ``hint`` (and builds it)."""
    if hint is int:
        return _check_int
    if hint in _SCALARS:

        def check_scalar(value: object, where: str) -> object:
            if type(value) is not hint:
                raise SchemaError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")  # type: ignore[union-attr]
            return value

        return check_scalar
    if typing.get_origin(hint) is tuple:
        (item_hint, _ellipsis) = typing.get_args(hint)
        return functools.partial(_check_array, _checker(item_hint))
    if dataclasses.is_dataclass(hint):
        fields = tuple((name, _checker(h)) for name, h in typing.get_type_hints(hint).items())
        return functools.partial(_build, hint, fields, frozenset(name for name, _ in fields))
    raise AssertionError(f"unsupported schema type {hint}")


def _check_array(item: _Checker, value: object, where: str) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise SchemaError(f"{where}: expected an array, got {type(value).__name__}")
    if len(value) > MAX_ARRAY_ITEMS:
        raise SchemaError(f"{where}: {len(value)} items, above the limit of {MAX_ARRAY_ITEMS}")
    if item is _check_int and all(type(v) is int and 0 <= v < _INT_END for v in value):
        return tuple(value)  # the common case (shapes, offsets, digests) without a call per item
    return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))


def _build(
    cls: type, fields: tuple[tuple[str, _Checker], ...], names: frozenset[str], body: object, where: str
) -> object:
    if not isinstance(body, dict):
        raise SchemaError(f"{where}: expected a map, got {type(body).__name__}")
    if body.keys() != names:
        raise SchemaError(f"{where}: fields {sorted(map(str, body))} != schema {sorted(names)}")
    if cls is Layout:
        _precheck_layout(body)
    values = {name: check(body[name], f"{where}.{name}") for name, check in fields}
    try:
        return cls(**values)
    except BadLayout:
        raise  # the very error, and message, that the side making this layout gets
    except (LayoutError, ValueError) as e:
        raise SchemaError(f"{where}: {e}") from None


def _precheck_layout(body: dict) -> None:
    """The checks of a Layout that need no TensorSpec, made before one is built, so that a degenerate or
    oversized layout costs its frame's scalars only: the geometry (which a sender's SyncConfig checked before
    it selected a tensor), then the tensor count. The same BadLayout as on the sender; values the schema
    refuses anyway are left to it."""
    from raysync.core.plan import check_geometry, check_tensor_count

    bucket, align = body["bucket_bytes"], body["align_bytes"]
    if all(type(v) is int and 0 <= v < _INT_END for v in (bucket, align)):
        check_geometry(bucket, align)
    if isinstance(body["tensors"], (list, tuple)):
        check_tensor_count(len(body["tensors"]))


def _decode_body(cls: type, body: object, where: str) -> object:
    return _checker(cls)(body, where)


# --- framing -----------------------------------------------------------------------------------------------------
def _direction_key(key: bytes, role: str) -> bytes:
    return hmac.new(key, f"raysync/{PROTOCOL}/{role}".encode(), hashlib.sha256).digest()


class SignedFrames:
    """The signing half of a channel, shared by the session's FrameCodec and WeightSync's push loops
    (raysync.ray.loop_wire): msgpack frames ``[protocol, channel, seq, kind, body]`` followed by an HMAC-SHA256
    of them under this direction's key, numbered per direction. ``open`` checks, cheapest and safest first: size
    cap, length, signature (before a byte is parsed), msgpack (no ext types, strict map keys), protocol and
    channel, then that the sequence number is above the last accepted one; ``accept(seq)`` records it once the
    caller has checked the body too, so that a frame refused for its body does not use up its number."""

    def __init__(
        self,
        send_key: bytes,
        recv_key: bytes,
        *,
        protocol: str,
        channel: str,
        max_frame_bytes: int,
        what: str = "frame",
        scope: str = "session",
        use_list: bool = False,
    ):
        self._send_key, self._recv_key = send_key, recv_key
        self._protocol, self._channel, self._max, self._what = protocol, channel, max_frame_bytes, what
        self._scope, self._use_list = scope, use_list
        self._sent_seq = self._seen_seq = 0

    def seal(self, kind: str, body: object) -> bytes:
        self._sent_seq += 1
        payload = msgpack.packb([self._protocol, self._channel, self._sent_seq, kind, body])
        if len(payload) + MAC_BYTES > self._max:
            raise FrameTooLarge(
                f"{kind} {self._what} of {len(payload)} bytes exceeds max_frame_bytes={self._max}"
            )
        return payload + hmac.new(self._send_key, payload, hashlib.sha256).digest()

    def open(self, frame: bytes) -> tuple[int, object, object]:
        """(seq, kind, body) of a frame whose signature, header and number are good; ``kind`` and ``body``
        are unchecked values for the caller's schema."""
        if len(frame) > self._max:
            raise FrameTooLarge(f"{self._what} of {len(frame)} bytes exceeds max_frame_bytes={self._max}")
        if len(frame) <= MAC_BYTES:
            raise MalformedFrame(f"{self._what} of {len(frame)} bytes is too short to carry a signature")
        payload, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._recv_key, payload, hashlib.sha256).digest()):
            raise BadSignature(f"{self._what} signature does not match this {self._scope}'s key")
        try:
            header = msgpack.unpackb(payload, raw=False, use_list=self._use_list, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types on bad input
            raise MalformedFrame(f"signed {self._what} is not valid msgpack: {e}") from None
        if not (isinstance(header, (tuple, list)) and len(header) == 5 and header[0] == self._protocol):
            raise MalformedFrame(f"signed {self._what} does not carry a raysync header")
        _, channel, seq, kind, body = header
        if channel != self._channel:
            raise BadSignature(f"{self._what} belongs to another {self._scope}")
        if type(seq) is not int or seq <= self._seen_seq:
            raise ReplayedFrame(f"sequence number {seq!r} is not above the last accepted {self._seen_seq}")
        return seq, kind, body

    def accept(self, seq: int) -> None:
        self._seen_seq = seq


@functools.cache
def _flat_fields(cls: type) -> tuple[str, ...] | None:
    """The field names of a message none of whose fields holds a dataclass (most of them: PushStart, Accept,
    BucketReady, ...), whose body needs no recursive ``asdict`` (6-11 us a frame on the VM, against ~1);
    None for the others."""
    hints = typing.get_type_hints(cls)
    nested = any(dataclasses.is_dataclass(a) for h in hints.values() for a in (h, *typing.get_args(h)))
    return None if nested else tuple(f.name for f in dataclasses.fields(cls))


class FrameCodec:
    """Signs what this side sends and checks what its peer sends. One per endpoint per session."""

    def __init__(self, secret: SessionSecret, role: str, peer_role: str, max_frame_bytes: int):
        self._frames = SignedFrames(
            _direction_key(secret.key, role),
            _direction_key(secret.key, peer_role),
            protocol=PROTOCOL,
            channel=secret.session_id,
            max_frame_bytes=max_frame_bytes,
        )

    def encode(self, msg: Message) -> bytes:
        names = _flat_fields(type(msg))  # a message of scalars and tuples of them: its fields as they are
        body = {n: getattr(msg, n) for n in names} if names is not None else dataclasses.asdict(msg)  # type: ignore[call-overload]
        _decode_body(
            type(msg), body, type(msg).__name__
        )  # never send what the peer would refuse (e.g. version -1)
        return self._frames.seal(type(msg).__name__, body)

    def decode(self, frame: bytes) -> Message:
        seq, kind, body = self._frames.open(frame)
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise SchemaError(f"unknown message kind {kind!r}")
        msg = _decode_body(cls, body, kind)
        self._frames.accept(seq)
        return msg  # type: ignore[return-value]
