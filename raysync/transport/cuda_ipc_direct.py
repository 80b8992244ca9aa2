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

# Note [readers in turns]
# N reader processes on one GPU that copy at once make the GPU switch between their contexts: three readers of the
# 7B layout took 27.08 ms against 25.18 ms when each one's copies waited for the previous one's (one H200, 24.54 ms
# for the three reads one after the other in one process; an experiment outside raysync, docs/benchmarks.md,
# section 13). So readers that all read on one GPU take turns: each sends the event it records after its copies
# in Attached, the DirectSources name them in reader order (``chain``), and reader k's stream waits on reader
# k-1's event before its copies. A wait on an event waits for its last record, so reader k must not queue its
# copies before reader k-1 has recorded this push's: the sender sends the go after accept to reader 0 first,
# and to reader k once reader k-1 said Queued (``send_go``). The relays overlap the copies queued before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

import torch

from raysync.core.config import SyncConfig
from raysync.core.control import Channel
from raysync.core.errors import LayoutError, RaysyncError, SchemaError
from raysync.core.plan import Bucket, direct_buckets
from raysync.core.source import SourceTensor
from raysync.core.wire import DTYPES, Accept, Attached, DirectSources, Layout, Queued, RingInfo
from raysync.transport.cuda_ipc import CudaIpcRingSender, export, peer_index, rebuild, uuid_of, wait_stream


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
        self._attached: list[Attached] = []  # each reader's, in reader order
        self._channel: Channel | None = None  # the Fanout of the readers (open), for the go in turns

    @classmethod
    def open(cls, transport: type, config: SyncConfig, channel: Channel) -> CudaIpcDirectSender:
        readers = len(getattr(channel, "channels", [channel]))
        plane = transport(config.num_buffers, config.bucket_bytes, readers=readers)
        plane._channel = channel
        return plane

    def describe(self) -> RingInfo:
        return RingInfo(self.name, 0, 0, (), (), self._ready.ipc_handle(), readers=self.readers)

    def attached(self, attached: Attached) -> None:
        """A reader's "copies queued" event and GPU (Note [readers in turns]); what it maps comes with
        DirectSources, at each new set of tensors."""
        self._attached.append(attached)

    @property
    def chain(self) -> tuple[bytes, ...]:
        return turns(self._attached, self.readers)

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
        exported = tuple(export(b) for b in shared)
        return DirectSources(layout_id, exported, tuple(storage), tuple(offsets), self.chain)

    def send_go(self, go: Accept, stage: str) -> None:
        """The go after accept (a fan-out): to every reader at once or, when they take turns, to each once the
        one before it has queued its copies (Note [readers in turns]); before anything else of the push is sent
        to them (a verified push's digests follow). A reader that fails its turn fails the push for all."""
        if not self.chain or go.skip:
            self._channel.send(go, stage)
            return
        readers = self._channel.channels
        readers[0].send(go, stage)
        try:
            for k in range(1, len(readers)):
                turn = f"accept: reader {k - 1} queues its copies, then reader {k} goes"
                readers[k - 1].expect(Queued, go.push_id, turn)
                readers[k].send(go, turn)
        except RaysyncError as e:  # told at once: the readers still waiting for their go
            self._channel.abort(go.push_id, "accept: the readers' turns", e)
            raise

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
        pass  # nothing to free: PushDone says the receivers have copied everything

    def fail(self) -> None:
        pass

    def close(self) -> None:
        self.shared = []
        torch.cuda.ipc_collect()


def turns(attached: Sequence[Attached], readers: int) -> tuple[bytes, ...]:
    """The readers' events in reader order when they take turns (Note [readers in turns]): two or more readers,
    every one attached with its event, all on one GPU; else none (they copy at once)."""
    gpus = {a.device_uuid for a in attached}
    every = readers > 1 and len(attached) == readers and all(len(a.events) == 1 for a in attached)
    return tuple(a.events[0] for a in attached) if every and len(gpus) == 1 and "" not in gpus else ()


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
        self._queued = torch.cuda.Event(interprocess=True)  # recorded after this reader's copies
        self._queued.record()
        self._after: torch.cuda.Event | None = None  # the reader before this one, when they take turns
        self._tells = False  # a reader after this one waits for its Queued
        self._channel: Channel | None = None

    @classmethod
    def open(cls, transport: type, info: RingInfo, channel: Channel) -> CudaIpcDirectReceiver:
        plane = transport(info)
        plane._channel = channel
        return plane

    def attached(self) -> Attached:
        return Attached((self._queued.ipc_handle(),), uuid_of(self.device))

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
        self._take_turns(sources.chain)
        self._mapped_layout = sources.layout_id
        return buckets

    def _take_turns(self, chain: tuple[bytes, ...]) -> None:
        """This reader's place among readers in turns (Note [readers in turns]); none when ``chain`` is empty."""
        self._after, self._tells = None, False
        if not chain:
            return
        own = self._queued.ipc_handle()
        if chain.count(own) != 1:
            raise SchemaError(f"the readers' turns ({len(chain)}) do not name this reader's event once")
        k = chain.index(own)
        self._after = torch.cuda.Event.from_ipc_handle(self.device, chain[k - 1]) if k else None
        self._tells = k < len(chain) - 1

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
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._ready)
            if self._after is not None:  # and the reader before this one has copied them
                stream.wait_event(self._after)
        return self.buffers[batch[0] : batch[-1] + 1]  # batches are runs of consecutive buckets

    def release(self, batch: list[int], push_id: int) -> None:
        """The sender's tensors are not ours to free; a reader in turns records that its copies are queued
        and says so (the next reader's go)."""
        self._queued.record(torch.cuda.current_stream(self.device))
        if self._tells:
            self._channel.send(Queued(push_id), "copies queued: the next reader's turn")

    def fail(self) -> None:
        pass

    def drain(self, timeout_s: float) -> None:
        wait_stream(torch.cuda.current_stream(self.device), timeout_s)

    def close(self) -> None:
        self.buffers = []
