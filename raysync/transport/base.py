"""What a transport provides: a data plane (the session's view: ``DataPlane`` / ``PlaneReader``), and for a
ring transport the two halves of its ring (``RingSender`` / ``RingReceiver``), which ``transport.ring`` turns
into a data plane. The sender owns the buffers; the receiver maps them.

A ring is ``num_buffers`` buffers of ``buffer_bytes`` each, exposed as uint8 tensors. The sender writes bucket
k into buffer k % num_buffers and tells the receiver over the control channel; the receiver says when it has
finished reading, and only then is that buffer written again. Nothing about flow control lives here.

# Note [ordering GPU buffers]
# A host buffer is ready when the copy call returns (device -> host copies are synchronized by the packer).
# A GPU buffer is ready when the GPU says so: the control messages only say "queued". So a GPU ring orders
# the two processes' streams with CUDA events, without ever blocking a host thread:
#     sender    wait(freed[s]) -> pack into buffer s -> record(packed[s]) -> BucketReady
#     receiver  BucketReady -> wait(packed[s]) -> unpack buffer s -> record(freed[s]) -> BucketFreed
# A stream that waits on an event waits for the record that preceded the wait call, and each record here
# precedes the message that lets the peer wait. ``end_push`` on the receiver waits (bounded) for its streams
# once, so a push counts as applied only when its bytes are in place. Host rings inherit the no-op hooks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

import torch

from raysync.core.config import SyncConfig
from raysync.core.plan import Bucket
from raysync.core.source import SourceTensor
from raysync.core.wire import Attached, DirectSources, Layout, RingInfo


class DataPlane(Protocol):
    """The sender's half of a data plane, as the push session (raysync.core.session) drives it. A push claims,
    packs and publishes bucket k = 0, 1, ...; ``slots`` buckets may be claimed before the push starts (pack
    ahead: 0 for a plane that reads the source in place)."""

    name: str
    transport: object  # the transport's own object (its ring), for tools and tests
    slots: int
    buffers: list[torch.Tensor]  # what a Packer writes into (none when the plane reads the source in place)
    reads_in_place: (
        bool  # the receiver reads the source's own tensors: nothing is packed or published per bucket
    )
    all_or_none: bool  # every receiver moves together (a broadcast): the session sends a go after accept

    @classmethod
    def open(cls, transport: type, config: SyncConfig, channel: object) -> DataPlane: ...

    def describe(self) -> RingInfo: ...  # plain values for the receiver to attach

    def attached(self, attached: Attached) -> None: ...

    def place(
        self, layout: Layout, sources: Sequence[SourceTensor]
    ) -> tuple[list[Bucket], DirectSources] | None:
        """None: the plane moves the layout's buckets (plan_buckets). A plane that reads the source in place
        returns its own plan and the message that lets the receiver map it."""
        ...

    def begin(self, push_id: int, buckets: list[Bucket]) -> None: ...  # right before PushStart

    def claim(self, k: int) -> torch.Tensor | None: ...  # a free buffer for bucket k; None: read in place

    def bucket_view(self, k: int) -> torch.Tensor: ...  # bucket k's bytes as the receiver reads them

    def packed(self, k: int) -> None: ...  # bucket k's bytes are written (Note [ordering GPU buffers])

    def publish(self, k: int) -> None: ...  # the receiver may read bucket k

    def wait_released(self) -> None: ...  # wait until the receiver has released every bucket

    def fail(self) -> None: ...  # this push failed here: end whatever a receiver may still wait on

    def close(self) -> None: ...


class PlaneReader(Protocol):
    """The receiver's half of a data plane."""

    name: str
    transport: object
    all_or_none: bool  # see DataPlane: wait for the sender's go after answering accept

    @classmethod
    def open(cls, transport: type, info: RingInfo, channel: object) -> PlaneReader: ...

    def attached(self) -> Attached: ...

    def plan(self, layout: Layout) -> list[Bucket]: ...  # raises SchemaError when the layout does not fit

    def take_sources(self, sources: DirectSources, layout: Layout | None) -> list[Bucket]: ...

    def check_start(self, push_id: int, layout_id: int) -> None: ...  # before accept: is the plane ready?

    def batches(self, buckets: int) -> Iterable[list[int]]: ...  # bucket indices unpacked together

    def read(self, batch: list[int], push_id: int) -> list[torch.Tensor]: ...  # the batch's bytes, once there

    def release(self, batch: list[int], push_id: int) -> None: ...  # done reading them

    def drain(self, timeout_s: float) -> None: ...  # Note [ordering GPU buffers]

    def fail(self) -> None: ...  # this push failed here

    def close(self) -> None: ...


class RingSender(Protocol):
    name: ClassVar[str]
    buffers: list[torch.Tensor]

    @classmethod
    def is_available(cls) -> bool: ...

    def info(self) -> RingInfo:
        """What the receiver needs to map the ring: plain names and sizes, never anything callable."""
        ...

    def receiver_attached(self, attached: Attached) -> None:
        """The receiver mapped every buffer: drop whatever names still make the ring reachable by others."""
        ...

    def before_pack(self, slot: int) -> None: ...  # Note [ordering GPU buffers]

    def after_pack(self, slot: int) -> None: ...

    def close(self) -> None: ...


class RingReceiver(Protocol):
    name: ClassVar[str]
    buffers: list[torch.Tensor]

    def attached(self) -> Attached: ...

    def before_unpack(self, slot: int) -> None: ...

    def after_unpack(self, slot: int) -> None: ...

    def end_push(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class HostRing:
    """The hooks of a ring in host memory: nothing to order (Note [ordering GPU buffers])."""

    def before_pack(self, slot: int) -> None:
        pass

    def after_pack(self, slot: int) -> None:
        pass

    def attached(self) -> Attached:
        return Attached()

    def before_unpack(self, slot: int) -> None:
        pass

    def after_unpack(self, slot: int) -> None:
        pass

    def end_push(self, timeout_s: float) -> None:
        pass
