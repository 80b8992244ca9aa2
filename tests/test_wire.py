"""The wire refuses everything but signed, fresh, well-formed frames of this session, and never unpickles."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import pickle

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from raysync.errors import BadSignature, FrameTooLarge, MalformedFrame, ReplayedFrame, SchemaError, WireError
from raysync.wire import (
    MAC_BYTES,
    Abort,
    BucketReady,
    FrameCodec,
    Hello,
    Layout,
    PushStart,
    RingInfo,
    SessionSecret,
    TensorSpec,
    _direction_key,
)

SECRET = SessionSecret.generate()


def pair(max_frame_bytes: int = 1 << 16, secret: SessionSecret = SECRET) -> tuple[FrameCodec, FrameCodec]:
    return (FrameCodec(secret, "sender", "receiver", max_frame_bytes),
            FrameCodec(secret, "receiver", "sender", max_frame_bytes))  # fmt: skip


def signed(payload_obj: object, secret: SessionSecret = SECRET, role: str = "sender") -> bytes:
    """A frame correctly signed for ``role`` around an arbitrary msgpack object (to test the schema checks)."""
    payload = msgpack.packb(payload_obj)
    return payload + hmac.new(_direction_key(secret.key, role), payload, hashlib.sha256).digest()


MESSAGES = [
    Hello(1234, "node-a"),
    RingInfo("shm", 2, 1 << 20, ("raysync-" + "0" * 32, "raysync-" + "1" * 32)),
    Layout(1, 1024, 256, (TensorSpec("w", "bfloat16", (3, 4)), TensorSpec("s", "float8_e4m3fn", ()))),
    PushStart(7, 3, 1, True),
    BucketReady(7, 2, 0),
    Abort(7, "unpack bucket 2/9", "boom", "Traceback ..."),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    tx, rx = pair()
    assert rx.decode(tx.encode(msg)) == msg


def test_rejections_leave_the_codec_usable():
    tx, rx = pair()
    good = tx.encode(PushStart(1, 1, 1, True))
    rejected = {
        "truncated": (good[:-1], BadSignature),
        "empty": (b"", MalformedFrame),
        "too short": (b"x" * MAC_BYTES, MalformedFrame),
        "flipped bit": (bytes([good[0] ^ 1]) + good[1:], BadSignature),
        "oversized": (good + b"\0" * (1 << 16), FrameTooLarge),
        "other key": (
            pair(secret=SessionSecret.generate())[0].encode(PushStart(1, 1, 1, True)),
            BadSignature,
        ),
        "reflected": (
            pair()[1].encode(PushStart(1, 1, 1, True)),
            BadSignature,
        ),  # receiver's frame sent back to it
        "unsigned pickle": (pickle.dumps(Hello(1, "x")), BadSignature),
    }  # keyed by what is wrong, for the reader
    for frame, error in rejected.values():
        with pytest.raises(error):
            rx.decode(frame)
    assert rx.decode(good) == PushStart(1, 1, 1, True)
    with pytest.raises(ReplayedFrame):
        rx.decode(good)
    assert rx.decode(tx.encode(PushStart(2, 2, 1, True))) == PushStart(2, 2, 1, True)


def test_session_and_sequence_checks():
    other = SessionSecret(os.urandom(16), SECRET.key)  # same key, another session
    _, rx = pair()
    with pytest.raises(BadSignature, match="another session"):
        rx.decode(pair(secret=other)[0].encode(Hello(1, "x")))
    for seq in (0, -1, "1", 1.0, True):
        with pytest.raises((ReplayedFrame, MalformedFrame, SchemaError)):
            rx.decode(signed(["rs1", SECRET.session_id, seq, "Hello", {"pid": 1, "host": "x"}]))


@pytest.mark.parametrize(
    "kind, body",
    [
        ("Hello", {"pid": "1", "host": "x"}),  # wrong type
        ("Hello", {"pid": True, "host": "x"}),  # a bool is not an int
        ("Hello", {"pid": -5, "host": "x"}),  # negative
        ("Hello", {"pid": 2**64 - 1, "host": "x"}),  # out of range
        ("Hello", {"pid": 1}),  # missing field
        ("Hello", {"pid": 1, "host": "x", "extra": 1}),  # unknown field
        ("Hello", [1, "x"]),  # not a map
        ("Exec", {"code": "import os"}),  # unknown kind
        ("Layout", {"layout_id": 1, "bucket_bytes": 256, "align_bytes": 256,
                    "tensors": [{"name": "w", "dtype": "object", "shape": [1]}]}),  # dtype not allowed
        ("Layout", {"layout_id": 1, "bucket_bytes": 256, "align_bytes": 256,
                    "tensors": [{"name": "w", "dtype": "int8", "shape": [2**40, 2**40]}]}),  # absurd size
        ("Layout", {"layout_id": 1, "bucket_bytes": 256, "align_bytes": 256,
                    "tensors": [{"name": "w", "dtype": "int8", "shape": [1]}] * 2}),  # duplicate name
        ("Layout", {"layout_id": 1, "bucket_bytes": 256, "align_bytes": 256,
                    "tensors": [{"name": "", "dtype": "int8", "shape": [1]}]}),  # empty name
        ("RingInfo", {"transport": "shm", "num_buffers": 1, "buffer_bytes": 1,
                      "handles": [msgpack.ExtType(1, b"x")]}),  # ext type
        ("Abort", {"push_id": 1, "stage": "s", "message": pickle.dumps(print), "traceback": ""}),  # bytes
    ],
)  # fmt: skip
def test_wrong_schema_is_refused(kind, body):
    _, rx = pair()
    with pytest.raises(SchemaError):
        rx.decode(signed(["rs1", SECRET.session_id, 1, kind, body]))
    assert rx.decode(pair()[0].encode(Hello(1, "x"))) == Hello(1, "x")  # still usable; seq 1 was not consumed


class _Bomb:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    bomb = pickle.dumps(_Bomb(str(marker)))
    _, rx = pair()
    frames = [
        bomb,  # raw
        bomb + b"\0" * MAC_BYTES,  # with a fake signature
        signed(bomb),  # correctly signed: the HMAC is fine, but the payload is no msgpack header
        signed(["rs1", SECRET.session_id, 1, "Hello", {"pid": 1, "host": bomb}]),  # as a field
        signed(["rs1", SECRET.session_id, 1, "Hello", msgpack.ExtType(0x50, bomb)]),  # as an ext type
    ]
    for frame in frames:
        with pytest.raises(WireError):
            rx.decode(frame)
    assert not marker.exists()


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=512))
def test_random_frames_are_refused(frame):
    _, rx = pair()
    with pytest.raises(WireError):
        rx.decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=30))  # fmt: skip
def test_signed_garbage_never_crashes(obj):
    """Even with a valid signature (a buggy peer), any msgpack value is a typed WireError or a valid message."""
    _, rx = pair()
    for payload in (
        obj,
        ["rs1", SECRET.session_id, 1, "Layout", obj],
        ["rs1", SECRET.session_id, 1, "Hello", obj],
    ):
        try:
            msg = rx.decode(signed(payload))
        except WireError:
            continue
        assert dataclasses.is_dataclass(msg)
