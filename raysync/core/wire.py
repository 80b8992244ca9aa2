"""The control protocol's messages: their schemas (frozen dataclasses), the size caps and the dtype allowlist.
How they travel, signed and checked, is raysync.core.frames. Nothing received is ever unpickled. A frame is

    +--------------------------------------------------------------+----------------------+
    | msgpack [ "rs1", session_id: bin16, seq: uint, kind: str, body: map ] | HMAC-SHA256 (32 B) |
    +--------------------------------------------------------------+----------------------+

and is checked in this order, cheapest and safest first: size cap, HMAC (before a single byte is parsed),
msgpack (no ext types, no pickle, strict map keys), session id, sequence number (strictly increasing per
direction), then the body against the frozen dataclass of its kind. Each direction has its own key derived
from the session key, so a frame reflected back at its sender fails the HMAC.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import secrets
import typing
from dataclasses import dataclass

import torch

from raysync.core.errors import (
    BadLayout,
    LayoutError,
)

PROTOCOL = "rs1"
MAC_BYTES = 32
SESSION_ID_BYTES = 16
MAX_NAME_CHARS = 1024
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 48  # beyond any real tensor

# What one layout may ask of the two sides that plan it (Note [layout bounds] in raysync.core.plan): anything beyond
# is refused, counted arithmetically, before a single bucket is made. What the costliest layout within them
# costs to decode and plan is measured in docs/reliability.md (benchmarks/fuzz_layout.py).
MIN_ALIGN_BYTES = 16  # the largest itemsize (complex128): a view of any dtype stays aligned
MAX_ALIGN_BYTES = 1 << 21  # a huge page: no copy gains from a coarser alignment
MAX_BUCKET_BYTES = 1 << 40  # one ring buffer
MAX_LAYOUT_TENSORS = 1 << 18  # the largest public checkpoints hold ~150k tensors
MAX_LAYOUT_BUCKETS = 1 << 17  # every bucket costs two signed frames per push: use larger buckets instead
MAX_LAYOUT_CHUNKS = MAX_LAYOUT_TENSORS + MAX_LAYOUT_BUCKETS  # a plan has at most tensors + buckets - 1
MAX_ARRAY_ITEMS = MAX_LAYOUT_TENSORS  # any array in a frame (per-tensor lists are the longest)

# --- dtypes: by name, from an allowlist --------------------------------------------------------------------------
_DTYPE_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def check_dtype_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise BadLayout(f"dtype {name!r} is not in the allowlist {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutError(f"dtype {dtype} cannot be sent; supported: {sorted(DTYPES)}") from None


# --- the session secret ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionSecret:
    """Session id + HMAC key, handed to both sides out of band (by the coordinator, through Ray)."""

    session_id: bytes
    key: bytes = dataclasses.field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.session_id, bytes) or len(self.session_id) != SESSION_ID_BYTES:
            raise ValueError(f"session_id must be {SESSION_ID_BYTES} bytes")
        if not isinstance(self.key, bytes) or len(self.key) < 32:
            raise ValueError("key must be at least 32 random bytes")

    @classmethod
    def generate(cls) -> SessionSecret:
        return cls(secrets.token_bytes(SESSION_ID_BYTES), secrets.token_bytes(32))


# --- messages ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """One tensor as it travels: its name, its wire dtype and its shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > MAX_NAME_CHARS:
            raise BadLayout(f"tensor name must have 1..{MAX_NAME_CHARS} characters, got {len(self.name)}")
        check_dtype_name(self.dtype)
        if len(self.shape) > MAX_NDIM or any(d < 0 for d in self.shape):
            raise BadLayout(f"tensor {self.name!r}: bad shape {self.shape} (at most {MAX_NDIM} sizes >= 0)")
        if self.nbytes > MAX_TENSOR_BYTES:
            raise BadLayout(
                f"tensor {self.name!r}: {self.nbytes} bytes is beyond any real tensor "
                f"(limit {MAX_TENSOR_BYTES})"
            )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Hello:
    """receiver -> sender, first frame of a session."""

    pid: int
    host: str


@dataclass(frozen=True)
class CudaBuffer:
    """One GPU ring buffer as plain values: the CUDA IPC handle of its allocation and where the buffer lies in
    it, the GPU it lives on (by UUID: indices differ between processes), and the IPC handle of the event the
    sender records when it has packed the buffer."""

    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    tensor_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes  # the allocation's own event (torch's), b"" when none
    event_sync_required: bool
    packed_event: bytes


@dataclass(frozen=True)
class RingInfo:
    """sender -> receiver: where the buffers are. ``handles``: the shm ring's handoff socket path and one-time
    token (Note [handing over the segments] in raysync.transport.shm); ``cuda`` describes GPU
    buffers (cuda_ipc); ``ready_event`` is the IPC handle of the event the sender records when its tensors are
    ready to be read (cuda_ipc_direct, which has no buffers)."""

    transport: str
    num_buffers: int
    buffer_bytes: int
    handles: tuple[str, ...]
    cuda: tuple[CudaBuffer, ...] = ()
    ready_event: bytes = b""
    readers: int = 1  # receivers reading this ring (fan-out: each bucket packed once for all of them)


@dataclass(frozen=True)
class Attached:
    """receiver -> sender: every buffer is mapped (the sender may now forget the names). ``events``: the IPC
    handles of the events the receiver records when it has read a buffer, and ``device_uuid`` the GPU it reads
    them from (cuda_ipc only)."""

    events: tuple[bytes, ...] = ()
    device_uuid: str = ""


@dataclass(frozen=True)
class Layout:
    """sender -> receiver, once per session and again only when the tensors change. Checked on construction
    against the layout bounds (plan.check_layout), on the side that makes it and on the side that decodes it,
    with the same BadLayout."""

    layout_id: int
    bucket_bytes: int
    align_bytes: int
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        from raysync.core.plan import (
            check_layout,  # plan imports this module; resolved once, then a dict lookup
        )

        check_layout(self.tensors, self.bucket_bytes, self.align_bytes)
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise BadLayout(f"tensor name {t.name!r} appears more than once in the layout")
            seen.add(t.name)

    @functools.cached_property
    def nbytes(self) -> int:
        """Every tensor's bytes (summed once: a push's report says it, and the layout has ~340 tensors)."""
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class DirectSources:
    """sender -> receiver (cuda_ipc_direct), after a Layout and whenever the trainer's tensors move: the
    storages that hold them, each exported once, and where tensor i of the layout lies: ``offset_bytes[i]``
    into ``storages[storage[i]]`` (a tensor of no bytes names storage 0). ``chain``: N readers on one GPU (a
    fan-out) take turns: every reader's "copies queued" event (its Attached), in reader order; reader k's copies
    wait on the GPU for reader k-1's, and reader k says Queued when its own are queued (Note [readers in turns]
    in raysync.transport.cuda_ipc_direct). Empty: every reader copies at once."""

    layout_id: int
    storages: tuple[CudaBuffer, ...]
    storage: tuple[int, ...]
    offset_bytes: tuple[int, ...]
    chain: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class PushStart:
    push_id: int
    version: int
    layout_id: int
    verify: bool = False  # a PushDigest follows the last bucket (SyncConfig.verify)
    delta: bool = (
        False  # the buckets are deltas from ``base_version`` (raysync.core.delta), unless the go says full
    )
    base_version: int = 0  # what a delta applies on top of; 0 when not a delta
    # the sender checks its tensors after this PushStart: a Checked follows (Note [start, then check])
    checks: bool = False

    def __post_init__(self) -> None:
        if not self.delta and self.base_version != 0:
            raise ValueError(f"base_version={self.base_version} in a push that is not a delta")


@dataclass(frozen=True)
class Accept:
    """receiver -> sender: destinations checked, buffers free. ``skip``: this version is applied already;
    ``full``: a delta was offered and this receiver cannot take it (another version, a load function).
    sender -> receivers of a plane that moves them together (a broadcast), and of a delta: the go; ``skip``
    if all have it, ``full`` when the push goes full (for all of them)."""

    push_id: int
    skip: bool
    full: bool = False


@dataclass(frozen=True)
class BucketReady:
    push_id: int
    bucket: int
    slot: int


@dataclass(frozen=True)
class BucketFreed:
    push_id: int
    bucket: int
    slot: int


@dataclass(frozen=True)
class Queued:
    """receiver -> sender (a reader of a chained fan-out, DirectSources.chain): its copies of push ``push_id``
    are queued on its GPU, and its event recorded after them; the next reader may go."""

    push_id: int


@dataclass(frozen=True)
class Checked:
    """sender -> receiver, after a PushStart that ``checks`` (Note [start, then check] in raysync.core.session):
    ``same``: the trainer's tensors are the ones the receiver maps, so what it reads is this push; else they moved
    (new storages, shapes), and the push starts again at once. receiver -> sender, answering a ``same=False``:
    its reads of this push ended, it drops it, and it waits for the push again."""

    push_id: int
    same: bool


@dataclass(frozen=True)
class PushDigest:
    """sender -> receiver, after the last bucket of a verified push: each tensor's digest (raysync.core.digest),
    in layout order, computed from what the sender packed."""

    push_id: int
    digests: tuple[int, ...]


@dataclass(frozen=True)
class PushDone:
    push_id: int
    version: int


@dataclass(frozen=True)
class Abort:
    """Either direction: this push failed here; the peer raises, its version does not advance."""

    push_id: int
    stage: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Close:
    """sender -> receiver: the session ends."""


Message = (
    Hello
    | RingInfo
    | Attached
    | Layout
    | DirectSources
    | PushStart
    | Accept
    | BucketReady
    | BucketFreed
    | Queued
    | Checked
    | PushDigest
    | PushDone
    | Abort
    | Close
)
MESSAGE_TYPES: dict[str, type] = {cls.__name__: cls for cls in typing.get_args(Message)}


SHM_NAME = re.compile(r"raysync-[0-9a-f]{32}")
