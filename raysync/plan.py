"""Bucket planning: pure functions from a list of TensorSpec and a bucket size to the bytes of every bucket.

A bucket is one ring buffer's worth of bytes. Tensors are laid out in order, each starting at a multiple of
``align_bytes`` so that a view of any dtype is aligned:

    bucket 0                                   bucket 1                      bucket 2
    +--------+--+-----------+--+-------------+ +---------------------------+ +---------+--+----+
    | q_proj |//| k_proj    |//| embed[0:a)  | | embed[a:b)                | | embed[b:]|//| ln |
    +--------+--+-----------+--+-------------+ +---------------------------+ +---------+--+----+
             pad            pad  a tensor larger than a bucket is cut into byte slices over
                                 consecutive buckets; every cut but the last falls on a multiple of
                                 align_bytes, so a slice is a whole number of elements of any dtype

The receiver writes each slice straight into its destination (or one staging tensor for a load function):
nothing is concatenated, and memory stays bounded by the ring. Both sides compute the same plan from the
same Layout, so no offset ever travels on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raysync.errors import LayoutError
from raysync.wire import TensorSpec


@dataclass(frozen=True)
class Chunk:
    """Bytes [src_offset, src_offset + nbytes) of tensor ``index`` live at ``bucket_offset`` in the bucket."""

    index: int
    src_offset: int
    bucket_offset: int
    nbytes: int
    last: bool  # this chunk completes the tensor

    @property
    def whole(self) -> bool:
        return self.src_offset == 0 and self.last


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int  # bytes used, padding included
    chunks: tuple[Chunk, ...]


def align_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int = 256) -> list[Bucket]:
    """Lay ``specs`` out in buckets of ``bucket_bytes``; see the module docstring for the layout."""
    if bucket_bytes <= 0 or bucket_bytes % align_bytes:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} must be a positive multiple of align_bytes={align_bytes}"
        )
    buckets: list[Bucket] = []
    chunks: list[Chunk] = []
    cursor = 0

    def close() -> None:
        nonlocal chunks, cursor
        buckets.append(Bucket(len(buckets), cursor, tuple(chunks)))
        chunks, cursor = [], 0

    for index, spec in enumerate(specs):
        size = spec.nbytes
        start = align_up(cursor, align_bytes)
        if start + size <= bucket_bytes:  # fits here (zero-size tensors always do)
            chunks.append(Chunk(index, 0, start, size, True))
            cursor = start + size
            continue
        if size <= bucket_bytes or start >= bucket_bytes:  # fits in a fresh bucket, or no room left here
            close()  # (never empty: an empty bucket has room for any tensor that fits a bucket)
            start = 0
        if size <= bucket_bytes:
            chunks.append(Chunk(index, 0, 0, size, True))
            cursor = size
            continue
        done = 0  # larger than a bucket: slice it, starting in the room left in this bucket
        while done < size:
            if start >= bucket_bytes:
                close()
                start = 0
            n = min(size - done, bucket_bytes - start)
            chunks.append(Chunk(index, done, start, n, done + n == size))
            done += n
            cursor = start + n
            start = align_up(cursor, align_bytes)
    if chunks:
        close()
    return buckets


def total_bytes(specs: Sequence[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def direct_buckets(
    specs: Sequence[TensorSpec],
    storage: Sequence[int],
    offset_bytes: Sequence[int],
    storage_bytes: Sequence[int],
) -> list[Bucket]:
    """The plan of a push read in place from the sender's storages (cuda_ipc_direct, wire.DirectSources):
    bucket k is storage k, each tensor one whole chunk at its offset there. Tensors of no bytes ride in
    bucket 0 at offset 0 (there is always a bucket 0). Checked, since it comes off the wire: every tensor lies inside its
    storage, at an offset that is a whole number of its elements."""
    if not len(specs) == len(storage) == len(offset_bytes):
        raise LayoutError(f"{len(storage)} storages and {len(offset_bytes)} offsets for {len(specs)} tensors")
    chunks: list[list[Chunk]] = [[] for _ in range(max(1, len(storage_bytes)))]
    for i, (spec, k, offset) in enumerate(zip(specs, storage, offset_bytes, strict=True)):
        if spec.nbytes == 0:
            k = offset = 0
        elif not (k < len(storage_bytes) and offset + spec.nbytes <= storage_bytes[k]):
            raise LayoutError(f"tensor {spec.name!r}: {spec.nbytes} bytes at {offset} in storage {k} do not fit "
                              f"the {len(storage_bytes)} storages exported")  # fmt: skip
        if offset % spec.itemsize:
            raise LayoutError(f"tensor {spec.name!r}: offset {offset} is not a multiple of its itemsize")
        chunks[k].append(Chunk(i, 0, offset, spec.nbytes, True))
    return [Bucket(k, storage_bytes[k] if storage_bytes else 0, tuple(c)) for k, c in enumerate(chunks)]
