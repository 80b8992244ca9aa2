"""CUDA IPC ring: sender and receiver on one node, the receiver able to see the sender's GPU (the same GPU, or
another one with peer access over NVLink / PCIe).

    sender process (GPU a)                                       receiver process (GPU a, or b with peer access)
    params --pack (device copy)--> [ buffer 0 ][ buffer 1 ] on GPU a --read in place (b: over NVLink)--> model

Everything costly happens once per session: the buffers are allocated and exported once, the receiver opens
each handle once (the first open in a process costs ~0.15 s) and keeps the mapping; a push allocates nothing,
exports nothing, and never synchronizes a device: the two processes' streams are ordered by interprocess
CUDA events (Note [ordering GPU buffers] in transport/base.py).

# Note [rebuilding a buffer without pickle]
# torch shares a CUDA tensor as (rebuild_cuda_tensor, args): the args carry the IPC handle of the allocation,
# the buffer's place in it and a reference count that keeps the allocation alive for the consumer. raysync
# sends the args that matter as plain fields of a CudaBuffer (bytes and integers, no callable), and the
# receiver calls rebuild_cuda_tensor itself, passing every argument by name after checking that the names are
# the ones it knows: the layout of that tuple is private to torch and has changed between releases, so a
# layout raysync does not recognise is a clear error, never a misplaced device index. The device is the
# receiver's own index of the sender's GPU, found by UUID.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import subprocess
import sys
import time
from typing import ClassVar

import msgpack
import torch
from torch.multiprocessing import reductions

from raysync.core.errors import LayoutError, PeerTimeout, TransportUnavailable
from raysync.core.wire import Attached, CudaBuffer, RingInfo

logger = logging.getLogger(__name__)

# what raysync passes to rebuild_cuda_tensor, by name (Note [rebuilding a buffer without pickle])
_REBUILD_ARGS = frozenset(
    {
        "tensor_cls",
        "tensor_size",
        "tensor_stride",
        "tensor_offset",
        "storage_cls",
        "dtype",
        "storage_device",
        "storage_handle",
        "storage_size_bytes",
        "storage_offset_bytes",
        "requires_grad",
        "ref_counter_handle",
        "ref_counter_offset",
        "event_handle",
        "event_sync_required",
    }
)


def uuid_of(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: str) -> int:
    """This process's index of the GPU ``uuid`` (each process numbers GPUs after its CUDA_VISIBLE_DEVICES)."""
    mine = [uuid_of(i) for i in range(torch.cuda.device_count())]
    if uuid not in mine:
        raise LayoutError(
            f"the ring lives on the sender's GPU {uuid}, which this process cannot see (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}, GPUs visible here: {mine})"
        )
    return mine.index(uuid)


def export(buffer: torch.Tensor, packed: torch.cuda.Event | None = None) -> CudaBuffer:
    """One GPU buffer as plain values (called once per session), with the event that says it is packed."""
    fn, args = reductions.reduce_tensor(buffer)
    named = inspect.signature(fn).bind(*args).arguments
    if fn is not reductions.rebuild_cuda_tensor or set(named) != _REBUILD_ARGS:
        raise TransportUnavailable(
            f"torch {torch.__version__} shares CUDA tensors as {getattr(fn, '__name__', fn)}{tuple(named)}, "
            f"a layout raysync does not know; use the shm transport"
        )
    return CudaBuffer(
        device_uuid=uuid_of(named["storage_device"]),
        handle=named["storage_handle"],
        storage_bytes=named["storage_size_bytes"],
        storage_offset_bytes=named["storage_offset_bytes"],
        tensor_offset=named["tensor_offset"],
        ref_counter_handle=named["ref_counter_handle"],
        ref_counter_offset=named["ref_counter_offset"],
        event_handle=named["event_handle"] or b"",
        event_sync_required=bool(named["event_sync_required"]),
        packed_event=packed.ipc_handle() if packed else b"",
    )


def rebuild(b: CudaBuffer, nbytes: int, device: int) -> torch.Tensor:
    """The receiver's view of one exported buffer, made by a function it picks itself."""
    expected = set(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    if expected != _REBUILD_ARGS:
        raise TransportUnavailable(
            f"torch {torch.__version__}'s rebuild_cuda_tensor takes {sorted(expected)}, a layout raysync does "
            f"not know; use the shm transport"
        )
    if b.tensor_offset + nbytes > b.storage_bytes:
        raise LayoutError(
            f"a buffer of {nbytes} bytes at {b.tensor_offset} does not fit its {b.storage_bytes}"
        )
    return reductions.rebuild_cuda_tensor(
        tensor_cls=torch.Tensor,
        tensor_size=(nbytes,),
        tensor_stride=(1,),
        tensor_offset=b.tensor_offset,
        storage_cls=torch.UntypedStorage,
        dtype=torch.uint8,
        storage_device=device,
        storage_handle=b.handle,
        storage_size_bytes=b.storage_bytes,
        storage_offset_bytes=b.storage_offset_bytes,
        requires_grad=False,
        ref_counter_handle=b.ref_counter_handle,
        ref_counter_offset=b.ref_counter_offset,
        event_handle=b.event_handle or None,
        event_sync_required=b.event_sync_required,
    )


class CudaIpcRingSender:
    """CUDA IPC: needs a CUDA GPU (and a receiver that can open its handles: see ``ipc_works``)."""

    name: ClassVar[str] = "cuda_ipc"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def __init__(self, num_buffers: int, buffer_bytes: int, pin: bool = True, readers: int = 1):
        """``readers``: receivers that read this ring (fan-out): a buffer is packed again only once every one
        of them has recorded that it read it."""
        self.device = torch.cuda.current_device()
        self.buffer_bytes = buffer_bytes
        self.readers = readers
        self.buffers = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=self.device) for _ in range(num_buffers)
        ]
        self._packed = [torch.cuda.Event(interprocess=True) for _ in self.buffers]
        for e in self._packed:
            e.record()  # created on this device now (an event gets its device at its first record)
        self._exports = [export(b, e) for b, e in zip(self.buffers, self._packed, strict=True)]
        self._freed: list[list[torch.cuda.Event]] = []  # per reader, per buffer: it has read the buffer
        self._reader_gpus: list[str] = []  # per reader, the GPU (UUID) it reads the ring from
        logger.debug(
            "cuda_ipc ring: %d x %d bytes on GPU %s", num_buffers, buffer_bytes, uuid_of(self.device)
        )

    def info(self) -> RingInfo:
        return RingInfo(
            self.name, len(self.buffers), self.buffer_bytes, (), tuple(self._exports), readers=self.readers
        )

    def receiver_attached(self, attached: Attached) -> None:
        """One reader's events (called once per reader, in the session's receiver order)."""
        if len(attached.events) != len(self.buffers):
            raise LayoutError(
                f"the receiver sent {len(attached.events)} events for {len(self.buffers)} buffers"
            )
        if len(self._freed) == self.readers:
            raise LayoutError(f"a reader too many: this ring was made for {self.readers}")
        self._freed.append([torch.cuda.Event.from_ipc_handle(self.device, h) for h in attached.events])
        self._reader_gpus.append(attached.device_uuid)

    @property
    def one_gpu(self) -> bool:
        """Every reader reads the ring on the GPU it lives on (no peer GPU): a push is two device copies."""
        return bool(self._reader_gpus) and all(u == uuid_of(self.device) for u in self._reader_gpus)

    def before_pack(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        for freed in self._freed:  # every reader has read what the buffer held
            stream.wait_event(freed[slot])

    def after_pack(self, slot: int) -> None:
        self._packed[slot].record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Teardown is the one place that releases: the allocation goes back once the receiver's reference
        is dropped too (torch's IPC reference count), and ipc_collect frees what is left."""
        self.buffers, self._exports, self._packed, self._freed, self._reader_gpus = [], [], [], [], []
        torch.cuda.ipc_collect()


class CudaIpcRingReceiver:
    """Reads the ring in place, mapped into this process's own GPU: on the same GPU that is the ring itself;
    on another GPU it is a peer mapping, so the copies out of the ring run on this GPU and pull over NVLink
    while the sender's GPU packs the next bucket (measured: a copy issued on the ring's GPU instead shares
    that GPU with the packing and serializes with it). Every event is recorded and waited on this GPU's
    current stream, the one the copies run on."""

    name: ClassVar[str] = "cuda_ipc"

    def __init__(self, info: RingInfo, pin: bool = True):
        if info.transport != self.name or not 1 <= info.num_buffers == len(info.cuda) <= 64:
            raise LayoutError(
                f"ring description does not fit the cuda_ipc transport: {info.transport}, "
                f"{info.num_buffers} buffers, {len(info.cuda)} described"
            )
        uuids = {b.device_uuid for b in info.cuda}
        if len(uuids) != 1:
            raise LayoutError(f"a ring lives on one GPU; this one names {sorted(uuids)}")
        self.device = torch.cuda.current_device()
        peer_index(uuids.pop(), self.device)  # the UUID check: this process must see the ring's GPU
        self.buffers = [rebuild(b, info.buffer_bytes, self.device) for b in info.cuda]
        self._packed = [torch.cuda.Event.from_ipc_handle(self.device, b.packed_event) for b in info.cuda]
        self._freed = [torch.cuda.Event(interprocess=True) for _ in info.cuda]
        for e in self._freed:
            e.record(self._stream())

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def attached(self) -> Attached:
        return Attached(tuple(e.ipc_handle() for e in self._freed), uuid_of(self.device))

    def before_unpack(self, slot: int) -> None:
        self._stream().wait_event(self._packed[slot])

    def after_unpack(self, slot: int) -> None:
        self._freed[slot].record(self._stream())

    def end_push(self, timeout_s: float) -> None:
        wait_stream(self._stream(), timeout_s)

    def close(self) -> None:
        self.buffers, self._packed, self._freed = [], [], []


def wait_stream(stream: torch.cuda.Stream, timeout_s: float) -> None:
    """Applied means in place: wait (bounded) until ``stream`` has run every copy queued so far."""
    done = torch.cuda.Event()
    done.record(stream)
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise PeerTimeout(
                "this GPU", "apply: waiting for the copies out of the sender's memory", timeout_s
            )
        time.sleep(0)


def peer_index(uuid: str, device: int) -> int:
    """This process's index of the sender's GPU ``uuid``, checked readable from ``device``."""
    gpu = local_index(uuid)
    if gpu != device and not torch.cuda.can_device_access_peer(device, gpu):
        raise LayoutError(f"GPU {uuid_of(device)} has no peer access to the sender's GPU {uuid}")
    return gpu


# --- does CUDA IPC work here? ------------------------------------------------------------------------------------
# Note [the quick IPC probe]
# The probe's child process pays Python's start-up, and with torch its import and CUDA's initialisation: ~seconds,
# most of a first WeightSync's set-up. So the child first runs without torch (transport/ipc_probe_child.py: the CUDA
# driver API through ctypes) where torch's handle is a plain cudaMalloc block's (64 bytes, or torch's versioned
# form: a version byte, 'c', the 64 bytes); any other handle (expandable segments: 'e'), or a quick child that does
# not answer "ipc ok" for any reason, is asked again of the torch child, whose answer stands.
_QUICK_CHILD = os.path.join(os.path.dirname(__file__), "ipc_probe_child.py")


@functools.cache
def ipc_works(timeout_s: float = 120.0) -> bool:
    """Export a small buffer and let a child process (same CUDA_VISIBLE_DEVICES) open it and read it back.
    False where IPC is refused: containers without the needed capabilities, allocators whose memory cannot
    be exported (expandable segments), devices that are not CUDA. Once per process (Note [the quick IPC probe])."""
    if not torch.cuda.is_available():
        return False
    try:
        probe = torch.arange(256, dtype=torch.uint8, device="cuda")
        event = torch.cuda.Event(interprocess=True)
        event.record()
        shared = export(probe, event)
        torch.cuda.current_stream().synchronize()
        ok = _quick_probe(shared, torch.cuda.current_device(), timeout_s) or _torch_probe(shared, timeout_s)
        del probe
        torch.cuda.ipc_collect()
        return ok
    except Exception as e:  # any failure means: do not plan IPC here
        logger.info("CUDA IPC probe failed: %s: %s", type(e).__name__, e)
        return False


def _quick_probe(shared: CudaBuffer, device: int, timeout_s: float) -> bool:
    raw = shared.handle
    if len(raw) == 66 and raw[1] == ord("c"):
        raw = raw[2:]
    if len(raw) != 64:
        return False
    line = f"{device} {raw.hex()} {shared.storage_offset_bytes + shared.tensor_offset}"
    try:
        child = subprocess.run(
            [sys.executable, _QUICK_CHILD], input=line.encode(), capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return False
    ok = child.returncode == 0 and child.stdout.strip().endswith(b"ipc ok")
    if not ok:
        logger.info("quick CUDA IPC probe: %s; asking torch", child.stderr.decode(errors="replace")[-300:])
    return ok


def _torch_probe(shared: CudaBuffer, timeout_s: float) -> bool:
    child = subprocess.run(
        [sys.executable, "-c", "from raysync.transport.cuda_ipc import _probe_child; _probe_child()"],
        input=msgpack.packb(dataclasses.astuple(shared)),
        capture_output=True,
        timeout=timeout_s,
    )
    ok = child.returncode == 0 and child.stdout.strip().endswith(b"ipc ok")
    if not ok:
        logger.info("CUDA IPC refused here: %s", child.stderr.decode(errors="replace")[-500:])
    return ok


def _probe_child() -> None:
    fields = msgpack.unpackb(sys.stdin.buffer.read(), use_list=False)
    shared = CudaBuffer(*fields)
    view = rebuild(shared, 256, local_index(shared.device_uuid))
    expected = torch.arange(256, dtype=torch.uint8, device=view.device)
    print("ipc ok" if torch.equal(view, expected) else "ipc read wrong bytes", flush=True)
