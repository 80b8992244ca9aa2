"""CUDA IPC direct: a data plane with no ring. The receiver reads the trainer's own tensors in place.

    sender process (GPU a)                                        receiver process (GPU a, or b with peer access)
    trainer params (their storages, exported once per set of tensors) --one copy per tensor, read in place--> model

The storages of the trainer's tensors are exported once per set of tensors (wire.DirectSources, sent after the
Layout); the plan is one bucket per storage (plan.direct_buckets), on both sides. A push is one event record
here (``begin``) and, on the receiver, one wait on that event and one batch of copies (a CopyList) out of the
mapped storages. Nothing is claimed, packed or published per bucket. For trainers whose parameters stay alive,
contiguous and in their wire dtype between pushes (one GPU, plain DDP); gathered or cast tensors need the ring.
N engines may read the same exported tensors (fan-out, ``WeightSender(receivers=N)``): one PushStart for all,
each copies on its own GPU stream, and the push ends when all N have.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch

from raysync.core.config import SyncConfig
from raysync.core.control import Channel
from raysync.core.errors import LayoutError, SchemaError
from raysync.core.plan import Bucket, direct_buckets
from raysync.core.source import SourceTensor
from raysync.core.wire import DTYPES, Attached, DirectSources, Layout, RingInfo
from raysync.transport.cuda_ipc import CudaIpcRingSender, export, peer_index, rebuild, wait_stream


class CudaIpcDirectSender:
    """CUDA IPC, direct mode (SyncConfig.direct): no ring; exports the storages of the trainer's tensors."""

    name: ClassVar[str] = "cuda_ipc_direct"
    is_available = CudaIpcRingSender.is_available
    slots = 0  # nothing to pack ahead: the receiver reads the source in place
    reads_in_place = True
    buffers: ClassVar[list[torch.Tensor]] = []  # nothing for a Packer to write into

    def __init__(self, num_buffers: int = 0, buffer_bytes: int = 0, pin: bool = True, readers: int = 1):
        """The ring's sizes are taken and unused (no ring): the same constructor as every ring sender.
        ``readers``: engines that read the exported tensors (fan-out); they move together (``all_or_none``):
        the trainer's tensors are free again once every one of them has copied them."""
        self.device = torch.cuda.current_device()
        self.transport = self
        self.readers = readers
        self.all_or_none = readers > 1
        self._ready = torch.cuda.Event(interprocess=True)
        self._ready.record()  # created on this device now
        self.shared: list[torch.Tensor] = []  # what is exported: byte views of the trainer's storages

    @classmethod
    def open(cls, transport: type, config: SyncConfig, channel: Channel) -> CudaIpcDirectSender:
        readers = len(getattr(channel, "channels", [channel]))
        return transport(config.num_buffers, config.bucket_bytes, readers=readers)

    def describe(self) -> RingInfo:
        return RingInfo(self.name, 0, 0, (), (), self._ready.ipc_handle(), readers=self.readers)

    def attached(self, attached: Attached) -> None:
        """Nothing to drop: what the receiver maps comes with DirectSources, at each new set of tensors."""

    def place(self, layout: Layout, sources: Sequence[SourceTensor]) -> tuple[list[Bucket], DirectSources]:
        """This plane's own plan: one bucket per exported storage (checked and exported before anything is
        sent), and the DirectSources that let the receiver map them."""
        shared = self.share(layout.layout_id, sources)
        sizes = [b.storage_bytes for b in shared.storages]
        specs = layout.tensors
        return direct_buckets(specs, shared.storage, shared.offset_bytes, sizes), shared

    def share(self, layout_id: int, sources: Sequence[SourceTensor]) -> DirectSources:
        """Export the storages of ``sources`` (each storage once), or say why one cannot be read in place."""
        index: dict[int, int] = {}
        storage, offsets, shared = [], [], []
        for src in sources:
            t = src.tensor
            why = _not_in_place(t, DTYPES[src.spec.dtype], self.device)
            if why:
                raise LayoutError(
                    f"direct mode reads the trainer's tensors in place, and {src.spec.name!r} {why}; "
                    f"use the ring (SyncConfig(direct=False))"
                )
            if t.numel() == 0:
                storage.append(0)
                offsets.append(0)
                continue
            s = t.untyped_storage()
            if s.data_ptr() not in index:
                index[s.data_ptr()] = len(shared)
                shared.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
            storage.append(index[s.data_ptr()])
            offsets.append(t.storage_offset() * t.element_size())
        self.shared = shared
        return DirectSources(layout_id, tuple(export(b) for b in shared), tuple(storage), tuple(offsets))

    def begin(self, push_id: int, buckets: list[Bucket]) -> None:
        """Before PushStart: the trainer's tensors hold this push's values once its stream gets here (the
        receiver's stream waits for this record)."""
        self._ready.record(torch.cuda.current_stream(self.device))

    def claim(self, k: int) -> None:
        return None  # read in place: nothing to pack

    def bucket_view(self, k: int) -> torch.Tensor:
        if k < len(self.shared):
            return self.shared[k]
        return torch.empty(0, dtype=torch.uint8, device=self.device)  # bucket 0 of a layout of empty tensors

    def packed(self, k: int) -> None:
        pass

    def publish(self, k: int) -> None:
        pass  # the ready event recorded in begin covers every bucket

    def wait_released(self) -> None:
        pass  # nothing to free: PushDone says the receiver has copied everything

    def fail(self) -> None:
        pass

    def close(self) -> None:
        self.shared = []
        torch.cuda.ipc_collect()


def _not_in_place(t: torch.Tensor, wire: torch.dtype, device: int) -> str:
    if not t.is_cuda:
        return "is not on a GPU"
    if t.device.index != device:
        return f"is on GPU {t.device.index}, not on this process's current GPU {device}"
    if t.dtype != wire:
        return f"is {t.dtype}, sent as {wire} (a cast needs the ring)"
    return "" if t.is_contiguous() else "is not contiguous"


class CudaIpcDirectReceiver:
    """Maps the sender's storages into this process's GPU (each once per DirectSources) and copies out of
    them after waiting, on its stream, for the sender's ready event."""

    name: ClassVar[str] = "cuda_ipc_direct"

    def __init__(self, info: RingInfo, pin: bool = True):
        if info.transport != self.name or info.num_buffers or info.cuda or not info.ready_event:
            raise LayoutError(
                f"ring description does not fit the cuda_ipc_direct transport: {info.transport}, "
                f"{info.num_buffers} buffers, ready event {bool(info.ready_event)}"
            )
        self.device = torch.cuda.current_device()
        self.transport = self
        self.all_or_none = info.readers > 1  # the other readers of the same tensors move with this one
        self.buffers: list[torch.Tensor] = []
        self._ready = torch.cuda.Event.from_ipc_handle(self.device, info.ready_event)
        self._mapped_layout = 0  # the layout whose DirectSources are mapped

    @classmethod
    def open(cls, transport: type, info: RingInfo, channel: Channel) -> CudaIpcDirectReceiver:
        return transport(info)

    def attached(self) -> Attached:
        return Attached()

    def plan(self, layout: Layout) -> list[Bucket]:
        return []  # planned from the DirectSources that follow

    def take_sources(self, sources: DirectSources, layout: Layout | None) -> list[Bucket]:
        """Map the sender's storages (once per set of tensors) and plan from them."""
        self._mapped_layout = 0
        if layout is None or sources.layout_id != layout.layout_id:
            raise SchemaError(f"storages for layout {sources.layout_id} do not fit this session")
        sizes = [b.storage_bytes - b.tensor_offset for b in sources.storages]
        buckets = direct_buckets(layout.tensors, sources.storage, sources.offset_bytes, sizes)
        self.map(sources)
        self._mapped_layout = sources.layout_id
        return buckets

    def map(self, sources: DirectSources) -> None:
        if len(sources.storages) > len(sources.storage):
            raise LayoutError(f"{len(sources.storages)} storages for {len(sources.storage)} tensors")
        self.buffers = []  # the old mappings go first
        for b in sources.storages:
            peer_index(b.device_uuid, self.device)
            self.buffers.append(rebuild(b, b.storage_bytes - b.tensor_offset, self.device))
        if not self.buffers:
            self.buffers = [torch.empty(0, dtype=torch.uint8, device=self.device)]

    def check_start(self, push_id: int, layout_id: int) -> None:
        if self._mapped_layout != layout_id:
            raise SchemaError(f"push {push_id}: the sender's storages for layout {layout_id} were never sent")

    def batches(self, buckets: int) -> Iterable[list[int]]:
        return [list(range(buckets))] if buckets else []  # every storage at once: one CopyList per push

    def read(self, batch: list[int], push_id: int) -> list[torch.Tensor]:
        if batch[0] == 0:  # on this GPU's stream: the sender's tensors are ready
            torch.cuda.current_stream(self.device).wait_event(self._ready)
        return self.buffers[batch[0] : batch[-1] + 1]  # batches are runs of consecutive buckets

    def release(self, batch: list[int], push_id: int) -> None:
        pass  # the sender's tensors are not ours to free

    def fail(self) -> None:
        pass

    def drain(self, timeout_s: float) -> None:
        wait_stream(torch.cuda.current_stream(self.device), timeout_s)

    def close(self) -> None:
        self.buffers = []
