"""The wire refuses everything but signed, fresh, well-formed frames of this session, and never unpickles."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import pickle
import tracemalloc

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import event, given, settings

from raysync.core.config import SyncConfig
from raysync.core.errors import (
    BadLayout,
    BadSignature,
    FrameTooLarge,
    MalformedFrame,
    ReplayedFrame,
    SchemaError,
    WireError,
)
from raysync.core.frames import FrameCodec
from raysync.core.plan import check_layout, check_tensor_count, layout_size, plan_buckets
from raysync.core.wire import (
    MAC_BYTES,
    MAX_ARRAY_ITEMS,
    MAX_LAYOUT_BUCKETS,
    MAX_LAYOUT_CHUNKS,
    MAX_LAYOUT_TENSORS,
    Abort,
    BucketReady,
    Checked,
    Hello,
    Layout,
    PushDigest,
    PushStart,
    RingInfo,
    SessionSecret,
    TensorSpec,
)

SECRET = SessionSecret.generate()


def pair(max_frame_bytes: int = 1 << 16, secret: SessionSecret = SECRET) -> tuple[FrameCodec, FrameCodec]:
    return (
        FrameCodec(secret, "sender", "receiver", max_frame_bytes),
        FrameCodec(secret, "receiver", "sender", max_frame_bytes),
    )


def signed(payload_obj: object, secret: SessionSecret = SECRET, role: str = "sender") -> bytes:
    """A frame correctly signed for ``role`` around an arbitrary msgpack object (to test the schema checks), by
    the wire's specification (docs/design.md: each direction's key is HMAC(session key, "raysync/rs1/<role>"))
    rather than by raysync's own code, as a peer written elsewhere would sign it."""
    payload = msgpack.packb(payload_obj)
    direction_key = hmac.new(secret.key, f"raysync/rs1/{role}".encode(), hashlib.sha256).digest()
    return payload + hmac.new(direction_key, payload, hashlib.sha256).digest()


MESSAGES = [
    Hello(1234, "node-a"),
    RingInfo("shm", 2, 1 << 20, ("raysync-" + "0" * 32, "raysync-" + "1" * 32)),
    Layout(1, 1024, 256, (TensorSpec("w", "bfloat16", (3, 4)), TensorSpec("s", "float8_e4m3fn", ()))),
    PushStart(7, 3, 1),
    PushStart(8, 4, 1, checks=True),
    Checked(8, False),
    BucketReady(7, 2, 0),
    Abort(7, "unpack bucket 2/9", "boom", "Traceback ..."),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    tx, rx = pair()
    assert rx.decode(tx.encode(msg)) == msg


def test_rejections_leave_the_codec_usable():
    tx, rx = pair()
    good = tx.encode(PushStart(1, 1, 1))
    rejected = {
        "truncated": (good[:-1], BadSignature),
        "empty": (b"", MalformedFrame),
        "too short": (b"x" * MAC_BYTES, MalformedFrame),
        "flipped bit": (bytes([good[0] ^ 1]) + good[1:], BadSignature),
        "oversized": (good + b"\0" * (1 << 16), FrameTooLarge),
        "other key": (
            pair(secret=SessionSecret.generate())[0].encode(PushStart(1, 1, 1)),
            BadSignature,
        ),
        "reflected": (
            pair()[1].encode(PushStart(1, 1, 1)),
            BadSignature,
        ),  # receiver's frame sent back to it
        "unsigned pickle": (pickle.dumps(Hello(1, "x")), BadSignature),
    }  # keyed by what is wrong, for the reader
    for frame, error in rejected.values():
        with pytest.raises(error):
            rx.decode(frame)
    assert rx.decode(good) == PushStart(1, 1, 1)
    with pytest.raises(ReplayedFrame):
        rx.decode(good)
    assert rx.decode(tx.encode(PushStart(2, 2, 1))) == PushStart(2, 2, 1)


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
        (
            "Layout",
            {
                "layout_id": 1,
                "bucket_bytes": 256,
                "align_bytes": 256,
                "tensors": [{"name": "w", "dtype": "object", "shape": [1]}],
            },
        ),  # dtype not allowed
        (
            "Layout",
            {
                "layout_id": 1,
                "bucket_bytes": 256,
                "align_bytes": 256,
                "tensors": [{"name": "w", "dtype": "int8", "shape": [2**40, 2**40]}],
            },
        ),  # absurd size
        (
            "Layout",
            {
                "layout_id": 1,
                "bucket_bytes": 256,
                "align_bytes": 256,
                "tensors": [{"name": "w", "dtype": "int8", "shape": [1]}] * 2,
            },
        ),  # duplicate name
        (
            "Layout",
            {
                "layout_id": 1,
                "bucket_bytes": 256,
                "align_bytes": 256,
                "tensors": [{"name": "", "dtype": "int8", "shape": [1]}],
            },
        ),  # empty name
        (
            "RingInfo",
            {"transport": "shm", "num_buffers": 1, "buffer_bytes": 1, "handles": [msgpack.ExtType(1, b"x")]},
        ),  # ext type
        ("Abort", {"push_id": 1, "stage": "s", "message": pickle.dumps(print), "traceback": ""}),  # bytes
    ],
)
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
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
        max_leaves=30,
    )
)
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


# --- layouts as a peer sends them: hostile or degenerate, refused with one BadLayout ---------------------------
def layout_frame(
    bucket_bytes: int, align_bytes: int, tensors: list[tuple[str, str, list[int]]], seq: int = 1
):
    body = {
        "layout_id": 1,
        "bucket_bytes": bucket_bytes,
        "align_bytes": align_bytes,
        "tensors": [{"name": n, "dtype": d, "shape": shape} for n, d, shape in tensors],
    }
    return signed(["rs1", SECRET.session_id, seq, "Layout", body])


def made_here(make, *args, **kwargs) -> str | None:
    """What the side that makes a layout gets from ``make(*args, **kwargs)``: None when accepted, else the
    BadLayout's message."""
    try:
        make(*args, **kwargs)
    except BadLayout as e:
        return str(e)
    return None


def sender_side(bucket: int, align: int, tensors: list[tuple[str, str, list[int]]]) -> Layout:
    """What a sender does with these values: its SyncConfig, then its tensors' specs, then its Layout."""
    config = SyncConfig(bucket_bytes=bucket, align_bytes=align)
    specs = tuple(TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in tensors)
    return Layout(1, config.bucket_bytes, config.align_bytes, specs)


def received(frame: bytes) -> str | None:
    """What the side that receives a layout gets from the same values (the receiver decodes the frame)."""
    _, rx = pair(max_frame_bytes=1 << 24)
    try:
        rx.decode(frame)
    except BadLayout as e:
        return str(e)
    return None


ALIGNS = [0, 1, 2, 8, 15, 16, 17, 24, 32, 48, 256, 4096, 1 << 21, (1 << 21) + 16, 1 << 22, 1 << 40, 2**63 - 1]
BUCKETS = [0, 1, 15, 16, 17, 32, 255, 256, 257, 512, 1000, 4096, 1 << 21, 1 << 40, (1 << 40) + 256, 2**63 - 1]


def test_degenerate_geometry_is_one_error_with_one_message_on_both_sides():
    """Every pair of these bucket sizes and alignments: SyncConfig (the sender's side) and a decoded Layout
    frame (the receiver's side) both accept it, or both raise BadLayout with the same message."""
    refused = 0
    for align in ALIGNS:
        for bucket in BUCKETS:
            here = made_here(SyncConfig, bucket_bytes=bucket, align_bytes=align)
            there = received(layout_frame(bucket, align, [("w", "bfloat16", [3, 4])]))
            assert here == there, (bucket, align)
            refused += here is not None
            if here is not None:
                assert f"={bucket}:" in here or f"={align}:" in here  # names the value
                assert isinstance(BadLayout(here), ValueError)  # old `except ValueError` callers still work
    assert 0 < refused < len(ALIGNS) * len(BUCKETS)


def _hostile_tensor(draw_size: int, dtype: str, nd: int) -> list[int]:
    """A shape of ``nd`` dims whose product is about draw_size elements."""
    if nd == 0:
        return []
    head = max(1, round(draw_size ** (1 / nd)))
    return [head] * (nd - 1) + [max(0, draw_size // head ** (nd - 1))]


elements = st.one_of(
    st.integers(0, 4096), st.integers(1 << 20, 1 << 30), st.sampled_from([0, 1, 1 << 47, 1 << 49])
)
geometry = st.tuples(
    st.sampled_from([16, 256, 4096, 1 << 20, 1 << 30, 1 << 40, 0, 1 << 41]),
    st.sampled_from([16, 256, 4096, 16, 256, 0, 24, 1 << 22]),
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(elements, st.sampled_from(["uint8", "float32", "complex128"]), st.integers(0, 3)),
        max_size=8,
    ),
    geometry,
    st.sampled_from(["unique", "unique", "unique", "duplicate", "empty"]),
)
def test_hostile_layouts_off_the_wire_plan_within_bounds_or_are_refused_before_planning(
    items, geometry, names
):
    """A Layout frame as a peer would send it (signed, any values the schema lets through): the receiver either
    decodes a layout whose plan is within the bounds, or raises BadLayout with exactly the message the sender
    gets when it makes a Layout of the same values, having allocated no plan."""
    bucket, align = geometry
    tensors = [(f"t{i}", dtype, _hostile_tensor(n, dtype, nd)) for i, (n, dtype, nd) in enumerate(items)]
    if tensors and names != "unique":
        tensors[-1] = (tensors[0][0] if names == "duplicate" else "",) + tensors[-1][1:]
    _, rx = pair(max_frame_bytes=1 << 24)
    tracemalloc.start()
    try:
        layout, refusal = rx.decode(layout_frame(bucket, align, tensors)), None
    except BadLayout as e:
        layout, refusal = None, str(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # decoding made no plan: a refused plan here would hold >131k chunks (>30 MB); hypothesis's own tracing
    # allocates a few hundred KB inside the window
    assert peak < 4 << 20
    assert refusal == made_here(sender_side, bucket, align, tensors)
    event("refused" if refusal else "accepted")
    if refusal is not None:
        return
    size = check_layout(layout.tensors, bucket, align)
    assert size.buckets <= MAX_LAYOUT_BUCKETS and size.chunks <= MAX_LAYOUT_CHUNKS
    if size.chunks <= 4096:  # plan the small ones in full (test_plan holds the count exact for all)
        buckets = plan_buckets(layout.tensors, bucket, align)
        assert (len(buckets), sum(len(b.chunks) for b in buckets)) == (size.buckets, size.chunks)


def test_the_hostile_layouts_of_issue_22_are_refused_at_decode():
    for bucket, align, shape in [(16, 16, [1 << 30]), (256, 256, [1 << 47])]:
        frame = layout_frame(bucket, align, [("w", "uint8", shape)])
        message = received(frame)
        assert message is not None and "raise bucket_bytes to" in message
        assert message == made_here(check_layout, [TensorSpec("w", "uint8", tuple(shape))], bucket, align)
    sizes = layout_size([TensorSpec("w", "uint8", (1 << 30,))], 1 << 20, 256)
    assert received(layout_frame(1 << 20, 256, [("w", "uint8", [1 << 30])])) is None and sizes.chunks == 1024


def test_too_many_tensors_are_refused_before_they_are_decoded():
    tensors = [("t", "bool", [])] * MAX_LAYOUT_TENSORS + [("last", "pickle", [])]
    message = received(layout_frame(1 << 20, 256, tensors))
    # the count, not the last tensor's dtype (refused if it were decoded), is what the receiver names
    assert message == made_here(check_tensor_count, MAX_LAYOUT_TENSORS + 1)


def test_degenerate_geometry_is_refused_before_the_tensors_are_decoded():
    tensors = [("t", "bool", [])] * 1000 + [("last", "pickle", [])]
    for bucket, align in [(0, 256), (1000, 256), (256, 24), (1 << 41, 256)]:
        message = received(layout_frame(bucket, align, tensors))
        assert message is not None and "pickle" not in message  # the last tensor was never looked at
        assert message == made_here(SyncConfig, bucket_bytes=bucket, align_bytes=align)


def test_every_array_in_a_frame_is_bounded():
    _, rx = pair(max_frame_bytes=1 << 24)
    frame = signed(
        ["rs1", SECRET.session_id, 1, "PushDigest", {"push_id": 1, "digests": [1] * (MAX_ARRAY_ITEMS + 1)}]
    )
    with pytest.raises(SchemaError, match="above the limit"):
        rx.decode(frame)
    tx, _ = pair(max_frame_bytes=1 << 24)
    assert rx.decode(tx.encode(PushDigest(1, (1,) * MAX_ARRAY_ITEMS))).digests[-1] == 1
