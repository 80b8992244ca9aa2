"""The sender's reference in delta mode, as memory (Note [the delta reference] in raysync.core.delta_push): the
wire-dtype bytes of the last version pushed, laid out as the buckets are, with one bucket of scratch that a
push packs into and encode's workspace, all on the trainer's device; and, per bucket, the trainer's tensors
where encode can read them in place (Note [a delta read in place])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from raysync.core import delta, delta_kernels
from raysync.core.delta_workspace import SLOTS, Workspace, side_stream
from raysync.core.plan import Bucket, align_up
from raysync.core.wire import DTYPES, TensorSpec

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout
    from raysync.core.source import SourceTensor

# Note [a delta read in place]
# A bucket whose every chunk lies in a trainer's tensor that is contiguous, already in the wire dtype and on the
# reference's device is encoded straight from those tensors: encode compares them with the reference and
# gathers the changed values from them. Packing it into the scratch first (as a cast, a non-contiguous tensor or
# a lazy source needs) is one more read and write of the bucket's bytes per push. The tensors are not one
# snapshot, as the scratch was: one may change while its bucket is encoded (a push beside a train step still
# writing). The reference still holds what the receivers hold, since it advances by the encoding (Note [the
# reference advances by the encoding] in raysync.core.delta_encode), and verify digests the tensors themselves,
# so such a push fails verify rather than passing a mix of two versions for one.


def chunk_sizes(bucket: Bucket, specs: Sequence[TensorSpec]) -> list[tuple[int, int]]:
    """(elements, bytes each) of every chunk as delta compares it: words of the dtype's width, 8 at most."""
    out = []
    for c in bucket.chunks:
        width = min(specs[c.index].itemsize, 8)
        out.append((c.nbytes // width, width))
    return out


class ReferenceBytes:
    """The reference's tensors for one layout on one device (Note [the delta reference]): every bucket's bytes,
    one bucket of scratch, encode's workspace, and per bucket the (reference, scratch) chunk views it pairs."""

    def __init__(self, agreed: SenderLayout, buffers: Sequence[torch.Tensor], device: torch.device):
        specs, buckets = agreed.layout.tensors, agreed.buckets
        self.layout_id, self.device = agreed.layout.layout_id, device
        self.offsets = [0]
        for b in buckets:
            self.offsets.append(self.offsets[-1] + align_up(b.nbytes, delta.PAYLOAD_ALIGN))
        self.bytes = torch.empty(self.offsets[-1], dtype=torch.uint8, device=device)
        self.sizes = [b.nbytes for b in buckets]  # a bucket's bytes, padding between its chunks included
        self.scratch = torch.empty(max(self.sizes, default=0), dtype=torch.uint8, device=device)
        chunks = [chunk_sizes(b, specs) for b in buckets]
        self.room = buffers[0].numel() if buffers else 0
        self.fits = all(delta.capacity(c) <= self.room for c in chunks)
        self.space = Workspace.for_buckets(chunks, device)
        self.ring_device = buffers[0].device if buffers else device
        self.staging_bytes = max((delta.capacity(c) for c in chunks), default=0)
        if (
            self.ring_device != device
        ):  # encoded here first, then copied (Note [where a delta is encoded]); on
            # CUDA in two buffers (Note [a bucket is encoded while the one before crosses])
            for slot in range(SLOTS if device.type == "cuda" else 1):
                self.staging(slot)
        self.scratch.zero_()  # these pages are faulted in now, not in the first delta push (the time rule's)
        self.space.touch()
        delta_kernels.warm(device, {size for c in chunks for _, size in c})  # Note [fused delta kernels]
        if delta_kernels.available(device):  # Note [the first delta push's one-time work] in delta_workspace
            for c in chunks:  # each bucket's blocks and count buffers (pinned on the host: cudaHostAlloc)
                blocks = self.space.blocks(tuple(n for n, _ in c), device)
                for slot in range(SLOTS):
                    self.space.counting(slot, blocks, device)
            side_stream("counts", device)  # the first stream a process makes makes torch's pool of them
            if self.ring_device != device:
                self.space.copy_stream(device)
        self.pairs = [
            [(_words(self.bucket(k), c, specs), _words(self.scratch, c, specs)) for c in b.chunks]
            for k, b in enumerate(buckets)
        ]  # the same offsets in both
        # bucket k is listed, not counted (encode's ``sparse``), by torch's kernels on a GPU: it had few changes
        # at its last delta push (the fused kernels count every bucket in its compare and list it after: Note
        # [fused delta kernels] in raysync.core.delta_kernels)
        self.sparse = [False] * len(buckets)

    def staging(self, slot: int) -> torch.Tensor:
        """Staging buffer ``slot``: a bucket's encoding on its way to a ring on another device."""
        return self.space.staging(self.staging_bytes, self.device, slot)

    @property
    def off(self) -> str | None:
        if self.fits:
            return None
        return (
            f"layout {self.layout_id}: its buckets' encoding does not fit the plane's buffers of {self.room} "
            f"bytes (made for the first layout), so its pushes go full"
        )

    def bucket(self, k: int) -> torch.Tensor:
        return self.bytes[self.offsets[k] : self.offsets[k + 1]]

    def in_place(self, buckets: Sequence[Bucket], sources: Sequence[SourceTensor]) -> list[list | None]:
        """Per bucket, (reference chunk, the trainer's chunk) word views where every chunk can be read in place
        (Note [a delta read in place]), else None: that bucket is packed into the scratch."""
        out = []
        for k, b in enumerate(buckets):
            views = [_in_place(sources[c.index], c, self.device) for c in b.chunks]
            ok = all(v is not None for v in views)
            out.append(
                [(old, new) for (old, _), new in zip(self.pairs[k], views, strict=True)] if ok else None
            )
        return out


def _in_place(src: SourceTensor, chunk: object, device: torch.device) -> torch.Tensor | None:
    """The chunk's words in the trainer's tensor, when it can be read there: contiguous, in the wire dtype, on
    ``device``."""
    t = src.tensor
    if t.device != device or t.dtype != DTYPES[src.spec.dtype] or not t.is_contiguous():
        return None
    width = min(src.spec.itemsize, 8)
    flat = t.reshape(-1).view(torch.uint8)
    return flat[chunk.src_offset : chunk.src_offset + chunk.nbytes].view(delta.WORDS[width])


def _words(buffer: torch.Tensor, chunk: object, specs: Sequence[TensorSpec]) -> torch.Tensor:
    width = min(specs[chunk.index].itemsize, 8)
    return buffer[chunk.bucket_offset : chunk.bucket_offset + chunk.nbytes].view(delta.WORDS[width])
