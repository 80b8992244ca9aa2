"""What the sender's delta encoding (raysync.core.delta_encode) works in: the masks its compare writes, and, when
the encoding crosses to another device (a host ring of a GPU trainer), the staging buffers it is written into
first and the copy that takes it across (``CopyOut``); and the receiver's copy of a bucket from a host ring into
its GPU (``copy_in_stream``).

    space = Workspace.for_buckets(sizes, device)        # once per layout: reused by every push
    target = space.staging(nbytes, device, slot)        # a bucket's encoding, written here first ...
    copy = CopyOut(out, target, start, space, slot)     # ... crosses into ``out`` in runs as it is written
    copy.finish(used)                                   # (or ``wait=False``, then ``space.wait_copied(slot)``)

# Note [a bucket is encoded while the one before crosses]
# On an H200 a 7B delta push over shm at 5% density (~47 MB of encoding per 512 MB bucket) took ~2 ms a bucket at
# 64 ms a push (docs/benchmarks.md 12c). Per bucket the sender claimed a ring buffer (waiting for the receiver to
# free bucket k - 2), then wrote the payloads, then copied them to the host (~1.1 ms), then published; the
# receiver then copied them to its GPU (~1.1 ms): the compute engine and the two copies took turns. So in a
# delta push whose encoding crosses on a copy stream (raysync.core.sender_stream, ``Reference.stages``), bucket
# k + 1 is encoded into the other staging buffer (slot (k + 1) % 2) right after bucket k's copy out is queued,
# before the wait for that copy and before bucket k + 1's ring buffer is claimed; when the receiver frees it,
# bucket k + 1's bytes only have to cross. A slot's buffer is written again by bucket k + 2, whose writes the
# current stream orders after that slot's copy (``staging`` waits for its event). With the receiver's copy in on a
# stream of its own (``copy_in_stream``): 61.0-64.2 ms at 5.0% against 64.7-72.2 ms before, in the same leases
# (docs/benchmarks.md 12b). Publishing bucket k only after bucket k + 1 was packed instead made it slower: the
# receiver waited a bucket longer.
#
# Note [the sender's small tables are kept]
# Once a delta push's buckets were encoded while the one before crossed, the sender's thread paced the push: on
# an H200 a 7B delta at 5% spent ~1.7 ms of host time a bucket (torch.profiler, docs/results/delta_trace_h200_s40_*)
# where its kernels took ~0.95 ms and its copy out ~0.9. Part of that was small tensors made per bucket: the
# counts' sums (zeros: an allocation and a fill), what is picked of them and their pinned copy on the host, the
# header and the kernels' table (each a tensor from a list, pinned, then copied). Now each slot keeps them, made
# once: ``counting`` (the sums, the picks, their pinned copy) and ``HostWords`` (a pinned buffer and a device
# buffer per use, reused by the buckets of that slot, which follow one another on the current stream; the host
# writes a pinned buffer again only once the copy that read it last has run: its event). Against the code before,
# in the same calls, unprofiled: 52.1 vs 54.0 ms and 53.0 vs 53.0 ms at 5% (docs/benchmarks.md 12, Latest): no
# faster push; the thread's time was not the whole of what sets the period.
#
# Note [the first delta push's one-time work]
# A session's first delta push took ~20-40 ms more than the next ones on an H200 (7B over shm: 126-142 ms at 10.2%,
# 1.6-2.1x its floor; the time rule's first delta 63-98 ms at 4.2% against 38-57 ms later, docs/benchmarks.md 12).
# Under torch's profiler (host time, docs/results/delta_first_h200_s45_*) both processes made torch's pool of CUDA
# streams in it (128 streams, ~3.3 ms each side: the first ``torch.cuda.Stream`` a process makes makes them all),
# the sender pinned host memory for its count buffers (10 cudaHostAlloc, 4.4 ms), the receiver allocated its
# copies in (11 cudaMalloc, 8.4 ms), and its first bucket's ``torch.cat`` and ``all`` took 10 and 22 ms: CUDA
# loads a kernel at its first launch, and the decoder's warm-up had run them only in other shapes (one payload of
# one entry, one bucket), which evidently took other kernels (torch picks one by shape and layout). So the
# set-up makes the side streams (``side_stream``, the workspace's ``copy_stream``) and every bucket's count
# buffers, delta_decode_kernels.warm runs the decoder in a bucket's shapes, and the receiver's first delta reserves
# its copies in at once (``reserve_copy_in``: one allocation of two buckets, not one per size; none in a receiver
# of full pushes only, whose engine keeps that memory). In a fresh process the first bucket-shaped decode took 52
# ms after the old warm-up and 1.2-1.6 ms after this one (benchmarks/first_apply_warm.py); a session's first delta
# (7B, 10.2%) took 89-97 ms (1.25-1.34x its floor) against 116-140 ms (1.7-1.8x) for the code before in the same
# leases, and the time rule's first delta 40-43 ms against 77-93 ms (docs/results/delta_*_h200_s46_*).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from raysync.core import delta_kernels
from raysync.core.delta_blocks import BLOCK, Blocks

COPY_RUN_BYTES = 4 << 20  # a staged encoding crosses in copies of at least this, overlapping the compaction
SLOTS = 2  # staging buffers: Note [a bucket is encoded while the one before crosses]


@dataclass
class Workspace:
    """Work tensors one bucket's encoding needs, made once and reused by every push: a bool mask of the
    bucket's elements and, where ``out`` lives on another device, buffers to encode into first."""

    mask: torch.Tensor  # bool, at least the bucket's elements
    # the same, for the buckets that compare into slot 1 (Note [two buckets in flight] in delta_encode)
    second_mask: torch.Tensor | None = None
    # by a bucket's chunk sizes: SpanLayout (torch's listing, delta_changes), delta_blocks.Blocks under
    # ("blocks", sizes) (``blocks``); and under ("masks", slot) that slot's mask and its chunk slices by shape
    # (``chunk_masks``)
    spans: dict = field(default_factory=dict)
    # uint8 of ``capacity`` bytes on the chunks' device, one per slot (made when needed)
    buffers: list[torch.Tensor | None] = field(default_factory=lambda: [None] * SLOTS)
    copied: list[torch.cuda.Event | None] = field(
        default_factory=lambda: [None] * SLOTS
    )  # a slot's copy's end
    stream: object | None = None  # CUDA: the side stream that copies the staged bytes out (CopyOut)
    # the small tables the host writes for the device: Note [the sender's small tables are kept]
    words: HostWords = field(default_factory=lambda: HostWords())

    @classmethod
    def for_buckets(cls, sizes: Sequence[Sequence[tuple[int, int]]], device: torch.device) -> Workspace:
        """A workspace for buckets whose chunks are ``(elements, bytes each)``: the largest of each (a chunk's
        mask rounded up to whole blocks of the fused kernels, raysync.core.delta_blocks.Blocks). Where the fused
        kernels count, the mask is their bitmask: an eighth of the bytes (torch's path grows it when it runs)."""
        elements = max((sum(n + BLOCK - 1 for n, _ in chunks) for chunks in sizes), default=0)
        if delta_kernels.available(device):
            elements = -(-elements // 8)
        return cls(torch.empty(elements, dtype=torch.bool, device=device))

    def blocks(self, sizes: tuple[int, ...], device: torch.device) -> Blocks:
        """The fused kernels' layout of a bucket whose chunks have ``sizes`` elements (delta_blocks.Blocks),
        made once: its two small copies to the device wait for the stream."""
        key = ("blocks", sizes)
        if key not in self.spans:
            self.spans[key] = Blocks.of(sizes, device)
        return self.spans[key]

    def chunk_masks(
        self, slab: torch.Tensor, slot: int, sizes: tuple[int | None, ...], firsts, bits: bool = False
    ) -> list:
        """``chunk_masks`` of ``slab``, the mask of ``slot``, made once per slab and bucket shape: a bucket's
        slices are the same every push."""
        key = ("masks", slot, bits)
        held = self.spans.get(key)
        if held is None or held[0] is not slab:
            held = self.spans[key] = (slab, {})
        if sizes not in held[1]:
            held[1][sizes] = chunk_masks(slab, sizes, firsts, bits)
        return held[1][sizes]

    def counting(self, slot: int, blocks: Blocks, device: torch.device) -> tuple:
        """Slot ``slot``'s buffers for a bucket's counts (delta_kernels.count_blocks): the blocks' sums [2,
        blocks + 1] and what is picked of them [2, chunks + 1] on the device, and on CUDA the pinned host
        memory they cross into (else None). Views of one buffer per slot, made once per bucket shape: the
        buckets of a slot are counted one after the other (Note [the sender's small tables are kept])."""
        key = ("counting", slot, blocks.firsts)
        held = self.spans.get(key)
        if held is not None and held[0].device == device:
            return held
        columns, chunks = blocks.firsts[-1] + 1, len(blocks.firsts)
        need = 2 * columns + 2 * chunks
        slab, host = self.spans.get(("counting", slot), (None, None))
        if slab is None or slab.numel() < need or slab.device != device:
            for old in [k for k in self.spans if k[:2] == ("counting", slot)]:
                del self.spans[old]  # views of the buffers this slot held before
            slab = torch.empty(
                max(need, 2 * slab.numel() if slab is not None else 0), dtype=torch.int64, device=device
            )
            host = (
                torch.empty(slab.numel(), dtype=torch.int64, pin_memory=True)
                if device.type == "cuda"
                else None
            )
            self.spans[("counting", slot)] = (slab, host)
        held = (
            slab[: 2 * columns].view(2, columns),
            slab[2 * columns : need].view(2, chunks),
            None if host is None else host[: 2 * chunks],
        )
        self.spans[key] = held
        return held

    def copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream the staged encodings cross on (``CopyOut``), made once."""
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def touch(self) -> None:
        """Write every work tensor once (a fresh host allocation is faulted in page by page on first use)."""
        self.mask.zero_()
        for buffer in self.buffers:
            if buffer is not None:
                buffer.zero_()

    def staging(self, nbytes: int, device: torch.device, slot: int = 0) -> torch.Tensor:
        """Slot ``slot``'s staging buffer, of at least ``nbytes``: the current stream's writes into it wait for
        the copy out of what it held before."""
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes or buffer.device != device:
            self.wait_copied(slot)
            buffer = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif self.copied[slot] is not None:
            torch.cuda.current_stream(device).wait_event(self.copied[slot])
        return buffer[:nbytes]

    def wait_copied(self, slot: int | None = None) -> None:
        """Wait until the copy out of slot ``slot`` (None: of every slot) has ended: its bytes are in ``out``."""
        for s in range(SLOTS) if slot is None else (slot,):
            event, self.copied[s] = self.copied[s], None
            if event is not None:
                event.synchronize()


class HostWords:
    """Small int64 tables the host writes for the device: a bucket's header and table, the kernels' tables.
    On CUDA each use (``key``) keeps a pinned buffer and a device buffer, reused by every bucket under that key
    (Note [the sender's small tables are kept])."""

    def __init__(self):
        self._held: dict = {}  # key -> (pinned host buffer, its numpy view, device buffer, the last copy's end)

    def copy(self, key, words: list[int], dst: torch.Tensor, stream=None) -> None:
        """``words`` into ``dst`` (int64, their length), queued on the current stream (``stream``, when the
        caller has it) when it is on CUDA."""
        if not dst.is_cuda:
            dst.copy_(torch.tensor(words, dtype=torch.int64))
            return
        self._send(key, self._written(key, words, dst.device), dst, stream)

    def table(self, key, words: list[int], device: torch.device, stream=None) -> torch.Tensor:
        """``words`` as an int64 tensor on ``device``. On CUDA the next table under ``key`` overwrites it, on
        the current stream (``stream``): after the kernels queued before it, which read it."""
        if device.type != "cuda":
            return torch.tensor(words, dtype=torch.int64)
        host = self._written(key, words, device)
        dst = self._held[key][2][: len(words)]
        self._send(key, host, dst, stream)
        return dst

    def _send(self, key, host: torch.Tensor, dst: torch.Tensor, stream) -> None:
        dst.copy_(host, non_blocking=True)
        self._held[key][3].record(stream or torch.cuda.current_stream(dst.device))

    def _written(self, key, words: list[int], device: torch.device) -> torch.Tensor:
        """``words`` in key's pinned buffer, once the copy that read it last has run."""
        n, held = len(words), self._held.get(key)
        if held is None or held[0].numel() < n or held[2].device != device:
            size = max(64, 2 * n)
            host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            held = (
                host,
                host.numpy(),
                torch.empty(size, dtype=torch.int64, device=device),
                torch.cuda.Event(),
            )
            self._held[key] = held
        else:
            held[3].synchronize()  # long run, as a rule: it is the copy of the bucket before last
        held[1][:n] = words
        return held[0][:n]


class CopyOut:
    """A staged encoding's way into ``out``. On a CUDA device in runs of at least ``COPY_RUN_BYTES``, on a
    side stream, as the payloads are written: the copy engine moves the first chunks across while the next
    ones are compacted; ``finish`` copies the rest and waits, or leaves the wait to ``Workspace.wait_copied``.
    Elsewhere one copy, at ``finish``."""

    def __init__(
        self,
        out: torch.Tensor,
        staged: torch.Tensor,
        start: int,
        space: Workspace,
        slot: int = 0,
        written: torch.cuda.Event | None = None,
    ):
        """``written``: recorded once ``staged`` was written (else the current stream's work so far is waited
        for at each run)."""
        self.out, self.staged, self.done, self.stream = out, staged, start, None
        self.space, self.slot, self._written = space, slot, written
        if staged.device.type == "cuda":
            self.stream = space.copy_stream(staged.device)
            if out.is_cuda and out.device != staged.device:  # a ring on another GPU: the side stream's writes
                free = torch.cuda.Event()  # wait for what that GPU's stream waits for (its reader's release)
                free.record(torch.cuda.current_stream(out.device))
                self.stream.wait_event(free)

    def written(self, end: int) -> None:
        """The payloads up to byte ``end`` are written (their kernels enqueued on the current stream)."""
        if self.stream is not None and end - self.done >= COPY_RUN_BYTES:
            self._copy(end)

    def finish(self, used: int, wait: bool = True) -> None:
        """Copy the rest; ``wait``: every byte is in ``out`` on return, else once ``space.wait_copied(slot)``
        returns (Note [a bucket is encoded while the one before crosses])."""
        if self.stream is None:
            self.out[self.done : used].copy_(self.staged[self.done : used])
            return
        if used > self.done:
            self._copy(used)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        self.space.copied[self.slot] = copied
        if wait:
            self.space.wait_copied(self.slot)

    def drain(self) -> None:
        """Encode failed part-way: wait for the runs already queued, so none writes into ``out`` or reads the
        workspace after encode returned (the next bucket's compaction reuses it on the current stream)."""
        if self.stream is not None:
            self.stream.synchronize()
            self.space.copied[self.slot] = None

    def _copy(self, end: int) -> None:
        written = self._written
        if written is None:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.staged.device))  # after the kernels that wrote them
        self.stream.wait_event(written)
        done = self.done
        on_stream(self.stream, lambda: self.out[done:end].copy_(self.staged[done:end], non_blocking=True))
        self.done = end


def on_stream(stream, work: Callable[[], object]) -> None:
    """``work()`` with ``stream`` current. On the thread's current device through ``set_stream``, cheaper than
    torch.cuda.stream's context (which reads the environment and the current stream twice); on another device
    through that context, which restores the device too (``set_stream`` would leave the thread on the stream's)."""
    if stream.device_index != torch.cuda.current_device():
        with torch.cuda.stream(stream):
            work()
        return
    current = torch.cuda.current_stream(stream.device)
    torch.cuda.set_stream(stream)
    try:
        work()
    finally:
        torch.cuda.set_stream(current)


_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}  # side_stream's: (use, device) -> stream


def side_stream(use: str, device: torch.device) -> torch.cuda.Stream:
    """The stream of ``use`` ("counts": the sender's counts to the host; "copy in": the receiver's copy from a
    host ring) on ``device``, one per process, made at set-up (Note [the first delta push's one-time work])."""
    stream = _STREAMS.get((use, device))
    if stream is None:
        stream = _STREAMS[use, device] = torch.cuda.Stream(device)
    return stream


def reserve_copy_in(device: torch.device, nbytes: int) -> None:
    """Have torch's caching allocator hold ``nbytes`` for the copies in on ``device`` (``copy_in_stream``), in one
    allocation: made and freed at once, it stays cached for the copy stream, and the copies of a delta push are cut
    from it, where each size not cached yet took a cudaMalloc of its own in the first delta push (11, ~8 ms, for a
    7B push over shm: Note [the first delta push's one-time work]). Once per device and process, at a session's
    first delta: a receiver of full pushes holds none of it."""
    if device.type != "cuda" or _RESERVED.get(device, 0) >= nbytes:
        return
    with torch.cuda.stream(side_stream("copy in", device)):
        torch.empty(nbytes, dtype=torch.uint8, device=device)
    _RESERVED[device] = nbytes


_RESERVED: dict[torch.device, int] = {}  # reserve_copy_in's: device -> bytes


def copy_in_stream(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The receiver's copy of a bucket from a host ring into ``device`` (raysync.core.delta.decode), on a copy
    stream of its own: the current stream's kernels wait for its event, and the next bucket's copy does not wait
    for this one's apply (the apply took 0.2-0.4 ms a bucket of a 7B delta push at 5% in H200 timelines). The
    copy is allocated from the copy stream's pool and kept from reuse until the current stream's kernels are
    done with it (``record_stream``): about two buckets' bytes used stay cached for that stream, where one
    stayed for the current stream before. Returns the copy and its event."""
    stream = side_stream("copy in", device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        moved = host.to(device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(stream)
    current.wait_event(copied)
    moved.record_stream(current)  # allocated on the copy stream, read on the current one
    return moved, copied


def chunk_masks(
    slab: torch.Tensor, sizes: tuple[int | None, ...], firsts: Sequence[int], bits: bool = False
) -> list:
    """Each chunk's part of the mask ``slab`` as the fused kernels lay it out (the j-th chunk with a reference
    from block ``firsts[j]``; None for a chunk of no reference, whose size is None): a bool per element, or
    with ``bits`` the int32 words of the kernels' bitmask in the same buffer (delta_blocks.mask_words)."""
    at, masks = iter(firsts), []
    if bits:
        words = slab.view(torch.uint8)[: firsts[-1] * BLOCK // 8].view(torch.int32)
        return [None if n is None else words[next(at) * (BLOCK // 32) :][: -(-n // 32)] for n in sizes]
    for n in sizes:
        masks.append(None if n is None else slab[next(at) * BLOCK :][:n])
    return masks
