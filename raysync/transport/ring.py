"""A ring as a data plane: the flow control every ring transport shares (shm, cuda_ipc).

    sender    claim(k): wait for BucketFreed of bucket k - S, then before_pack(k % S) -> pack -> packed(k)
              -> publish(k): BucketReady(k, k % S)
    receiver  read(k): wait for BucketReady(k, k % S), then before_unpack -> unpack -> release(k):
              after_unpack + BucketFreed(k, k % S)

S is the ring's number of buffers. A ring may have N readers (fan-out: shm, cuda_ipc): bucket k is packed
once, BucketReady goes to all N, and its buffer is free again when all N have sent BucketFreed (the session's
Fanout collects one from each). N readers move together (``all_or_none``): one that has the version already
reads the push anyway, so no buffer waits for a reader that skipped.

S Between pushes every buffer is free (a push ends when the receiver has
freed all of them), so the first S buckets of the next push may be claimed and packed before it starts. A
ring transport supplies only its two halves (transport.base.RingSender / RingReceiver: buffers and the
ordering hooks of Note [ordering GPU buffers]); the hooks are looked up on the ring at every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from raysync.core.config import SyncConfig
from raysync.core.control import Channel
from raysync.core.errors import SchemaError, TransportUnavailable
from raysync.core.plan import Bucket, plan_buckets
from raysync.core.source import SourceTensor
from raysync.core.wire import Attached, BucketFreed, BucketReady, DirectSources, Layout, RingInfo
from raysync.transport.base import RingReceiver, RingSender


class RingPlane:
    """The sender's half: owns the ring (``transport``)."""

    reads_in_place = False

    def __init__(self, ring: RingSender, channel: Channel):
        self.transport, self._channel = ring, channel
        self.name = ring.name
        self.all_or_none = getattr(ring, "readers", 1) > 1
        self._push_id, self._buckets = 0, 0

    @classmethod
    def open(cls, transport: type, config: SyncConfig, channel: Channel) -> RingPlane:
        readers = len(getattr(channel, "channels", [channel]))
        if readers == 1:
            return cls(transport(config.num_buffers, config.bucket_bytes), channel)
        if transport.name not in ("shm", "cuda_ipc"):
            raise TransportUnavailable(
                f"{readers} readers of one {transport.name} ring: fan-out is built for shm and cuda_ipc"
            )
        return cls(transport(config.num_buffers, config.bucket_bytes, readers=readers), channel)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.transport.buffers

    @property
    def slots(self) -> int:
        return len(self.transport.buffers)

    def describe(self) -> RingInfo:
        return self.transport.info()

    def attached(self, attached: Attached) -> None:
        self.transport.receiver_attached(attached)

    def place(
        self, layout: Layout, sources: Sequence[SourceTensor]
    ) -> tuple[list[Bucket], DirectSources] | None:
        return None  # the layout's own buckets, packed into the ring

    def begin(self, push_id: int, buckets: list[Bucket]) -> None:
        self._push_id, self._buckets = push_id, len(buckets)

    def claim(self, k: int) -> torch.Tensor:
        slot = k % self.slots
        if k >= self.slots:  # bucket k - S used this buffer: wait until the receiver has read it
            stage = f"wait for buffer {slot} (bucket {k}/{self._buckets})"
            self._channel.expect(BucketFreed, self._push_id, stage)
        self.transport.before_pack(slot)
        return self.transport.buffers[slot]

    def bucket_view(self, k: int) -> torch.Tensor:
        return self.transport.buffers[k % self.slots]

    def packed(self, k: int) -> None:
        self.transport.after_pack(k % self.slots)

    def publish(self, k: int) -> None:
        stage = f"pack bucket {k}/{self._buckets}"
        self._channel.send(BucketReady(self._push_id, k, k % self.slots), stage)

    def wait_released(self) -> None:
        for _ in range(min(self.slots, self._buckets)):  # the frees of the last S buckets
            self._channel.expect(BucketFreed, self._push_id, "finish")

    def fail(self) -> None:
        pass  # the receiver learns it from the Abort

    def close(self) -> None:
        self.transport.close()


class RingReader:
    """The receiver's half: maps the ring the sender described (``transport``)."""

    def __init__(self, ring: RingReceiver, channel: Channel, readers: int = 1):
        self.transport, self._channel = ring, channel
        self.name = ring.name
        self.all_or_none = readers > 1  # the ring's other readers move with this one
        self._buckets = 0

    @classmethod
    def open(cls, transport: type, info: RingInfo, channel: Channel) -> RingReader:
        return cls(transport(info), channel, info.readers)

    @property
    def slots(self) -> int:
        return len(self.transport.buffers)

    def attached(self) -> Attached:
        return self.transport.attached()

    def plan(self, layout: Layout) -> list[Bucket]:
        """The layout's buckets, once its geometry is checked against the ring this side mapped."""
        ring_bytes = self.transport.buffers[0].numel()
        a = layout.align_bytes
        if layout.bucket_bytes > ring_bytes or a < 16 or a & (a - 1) or layout.bucket_bytes % a:
            raise SchemaError(
                f"layout bucket_bytes={layout.bucket_bytes}, align_bytes={a} do not fit buffers of {ring_bytes} bytes"
            )
        buckets = plan_buckets(layout.tensors, layout.bucket_bytes, a)
        self._buckets = len(buckets)
        return buckets

    def take_sources(self, sources: DirectSources, layout: Layout | None) -> list[Bucket]:
        raise SchemaError(
            f"storages for layout {sources.layout_id} do not fit this session (a {self.name} ring)"
        )

    def check_start(self, push_id: int, layout_id: int) -> None:
        pass  # the ring is mapped for the whole session

    def batches(self, buckets: int) -> Iterable[list[int]]:
        self._buckets = buckets
        return ([k] for k in range(buckets))  # each bucket as it arrives: the sender packs the next meanwhile

    def read(self, batch: list[int], push_id: int) -> list[torch.Tensor]:
        return [self._receive(k, push_id) for k in batch]

    def _receive(self, k: int, push_id: int) -> torch.Tensor:
        slot = k % self.slots
        ready = self._channel.expect(BucketReady, push_id, f"wait for bucket {k}/{self._buckets}")
        if (ready.bucket, ready.slot) != (k, slot):
            raise SchemaError(f"bucket {ready.bucket} in buffer {ready.slot}, expected {k} in {slot}")
        self.transport.before_unpack(slot)
        return self.transport.buffers[slot]

    def release(self, batch: list[int], push_id: int) -> None:
        for k in batch:
            slot = k % self.slots
            self.transport.after_unpack(slot)
            self._channel.send(BucketFreed(push_id, k, slot), f"unpack bucket {k}/{self._buckets}")

    def drain(self, timeout_s: float) -> None:
        self.transport.end_push(timeout_s)

    def fail(self) -> None:
        pass

    def close(self) -> None:
        self.transport.close()
