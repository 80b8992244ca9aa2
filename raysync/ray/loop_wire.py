"""The frames between WeightSync's driver and a push loop in an actor (raysync.ray.push_loop, Note [push loops]):
msgpack signed with HMAC-SHA256 under a key per member and direction, numbered (a replay is refused), decoding
to scalars only; a round's answer is rebuilt as EndpointResult, PushReport, RemoteFailure from checked values."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import operator
from typing import Any

from raysync.core import errors
from raysync.core.frames import SignedFrames
from raysync.core.report import PushReport
from raysync.core.version import MIXED
from raysync.ray.results import EndpointResult, RemoteFailure

_PROTOCOL = "rs-loop1"
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


_SCALARS = frozenset((int, float, str, bool, type(None)))  # exactly these types (no subclass)


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
        type(values) is not list or len(values) != _COUNTS[cls] or not _SCALARS.issuperset(map(type, values))
    ):
        raise errors.SchemaError(f"push loop answer: {cls.__name__} fields {values!r:.200}")
    return None if values is None else cls(*values)
