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

Note [layout bounds]
~~~~~~~~~~~~~~~~~~~~
A Layout comes off the wire, and its plan holds one Chunk per (tensor, bucket) it touches: a 1 GiB tensor in
16-byte buckets is 67M chunks, gigabytes of memory and tens of seconds of planning before anything could
refuse it. So a layout is checked before it is planned (check_layout), in one pass over its tensors that
allocates nothing per chunk: its geometry (check_geometry), its tensor count, and the buckets and chunks that
plan_buckets *would* make, counted arithmetically by layout_size (which mirrors plan_buckets step by step; a
property test holds the two equal). The bounds are constants in raysync.core.wire (MAX_LAYOUT_*), the same on both
sides, so a layout its sender accepts is one every receiver accepts, and a refusal is the same BadLayout, with
the same message, on both. Layout.__post_init__ runs the check, so it happens where a sender makes a layout and
where a receiver decodes one; plan_buckets and direct_buckets run it too, for any other caller. What a layout
within the bounds costs: at most MAX_LAYOUT_CHUNKS chunks of planning memory, and at most MAX_LAYOUT_BUCKETS
buckets of bucket_bytes (a size each receiver checks against its own buffers) per push.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raysync.core.errors import BadLayout
from raysync.core.wire import (
    MAX_ALIGN_BYTES,
    MAX_BUCKET_BYTES,
    MAX_LAYOUT_BUCKETS,
    MAX_LAYOUT_CHUNKS,
    MAX_LAYOUT_TENSORS,
    MIN_ALIGN_BYTES,
    TensorSpec,
)


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


# --- layout bounds: checked before planning (Note [layout bounds]) ----------------------------------------------
@dataclass(frozen=True)
class LayoutBounds:
    """The most tensors, buckets and chunks one layout may have (raysync.core.wire's constants; tests pass others)."""

    tensors: int = MAX_LAYOUT_TENSORS
    buckets: int = MAX_LAYOUT_BUCKETS
    chunks: int = MAX_LAYOUT_CHUNKS


BOUNDS = LayoutBounds()


@dataclass(frozen=True)
class LayoutSize:
    """What plan_buckets makes of a layout, counted without making it."""

    tensors: int
    buckets: int
    chunks: int
    nbytes: int  # the tensors' bytes
    padded_bytes: int  # each tensor's bytes rounded up to align_bytes: what padding can make of it


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_geometry(bucket_bytes: int, align_bytes: int) -> None:
    """Refuse a degenerate bucket size or alignment (SyncConfig and every Layout, both sides, call this)."""
    a, b = align_bytes, bucket_bytes
    if not (_is_int(a) and MIN_ALIGN_BYTES <= a <= MAX_ALIGN_BYTES and a & (a - 1) == 0):
        raise BadLayout(
            f"align_bytes={a!r}: must be a power of two from {MIN_ALIGN_BYTES} (the largest itemsize) to "
            f"{MAX_ALIGN_BYTES}; the default, 256, suits every dtype"
        )
    if not (_is_int(b) and a <= b <= MAX_BUCKET_BYTES and b % a == 0):
        example = min(max(a, int(b) // a * a), MAX_BUCKET_BYTES) if isinstance(b, (int, float)) else 512 << 20
        raise BadLayout(
            f"bucket_bytes={b!r}: must be a positive multiple of align_bytes={a} and at most "
            f"{MAX_BUCKET_BYTES} (e.g. {example})"
        )


def check_tensor_count(count: int, bounds: LayoutBounds = BOUNDS) -> None:
    """Refuse a layout of more tensors than the bound: callable on a frame's array before it is decoded."""
    if count > bounds.tensors:
        raise BadLayout(
            f"a layout of {count} tensors is above the limit of {bounds.tensors} (raysync.core.wire."
            f"MAX_LAYOUT_TENSORS, which bounds what planning a layout costs each side); send fewer tensors per "
            f"sender: split them over several (SyncConfig.include / exclude, or WeightSync(shard_sources=True))"
        )


def layout_size(specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int) -> LayoutSize:
    """Count what plan_buckets would make of a layout, without making it: O(len(specs)), arithmetic only.
    Mirrors plan_buckets branch by branch (a property test holds them equal); geometry checked beforehand."""
    size_b, align = bucket_bytes, align_bytes
    closed = chunks = cursor = nbytes = padded = 0
    for spec in specs:
        size = spec.nbytes
        nbytes += size
        padded += align_up(size, align)
        start = align_up(cursor, align)
        if start + size <= size_b:  # fits here
            chunks, cursor = chunks + 1, start + size
            continue
        if size <= size_b or start >= size_b:  # a fresh bucket
            closed, start = closed + 1, 0
        if size <= size_b:
            chunks, cursor = chunks + 1, size
            continue
        rest = size - (size_b - start)  # sliced: the first slice fills this bucket, the rest spans
        more = -(-rest // size_b)  # this many more, each opened by closing the one before
        closed, chunks, cursor = closed + more, chunks + 1 + more, rest - (more - 1) * size_b
    return LayoutSize(len(specs), closed + (1 if specs else 0), chunks, nbytes, padded)


def check_layout(
    specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int, bounds: LayoutBounds = BOUNDS
) -> LayoutSize:
    """Refuse a layout whose plan would exceed ``bounds``, before planning it (Note [layout bounds]); returns
    what its plan will hold. Raises BadLayout naming the counts, the limits and the bucket size that fits."""
    check_tensor_count(len(specs), bounds)
    check_geometry(bucket_bytes, align_bytes)
    size = layout_size(specs, bucket_bytes, align_bytes)
    if size.buckets > bounds.buckets or size.chunks > bounds.chunks:
        raise BadLayout(
            f"a layout of {size.tensors} tensors ({size.nbytes} bytes) in buckets of {bucket_bytes} bytes "
            f"makes {size.buckets} buckets and {size.chunks} chunks, above the limits of {bounds.buckets} "
            f"buckets and {bounds.chunks} chunks (raysync.core.wire.MAX_LAYOUT_BUCKETS and MAX_LAYOUT_CHUNKS bound "
            f"what planning a layout costs each side); {_fewer_buckets(size, align_bytes, bounds)}"
        )
    return size


def fitting_bucket_bytes(size: LayoutSize, align_bytes: int, bounds: LayoutBounds = BOUNDS) -> int | None:
    """A power of two with which, and with any larger multiple of align_bytes, as bucket size ``size`` plans
    within ``bounds``; None when no bucket size does (too many tensors for the chunk bound).

    Why it fits: in a plan every bucket but the last, together with the next one, holds at least bucket_bytes
    of padded bytes (a bucket is closed only when the next tensor does not fit behind it), so
    buckets <= 2 * padded_bytes / bucket_bytes + 1; and chunks <= tensors + buckets - 1."""
    most = min(bounds.buckets, bounds.chunks - size.tensors + 1)  # buckets allowed
    if most < 1:
        return None
    need = size.padded_bytes if most == 1 else -(-2 * size.padded_bytes // (most - 1))
    return max(align_bytes, 1 << max(0, need - 1).bit_length())


def _fewer_buckets(size: LayoutSize, align_bytes: int, bounds: LayoutBounds) -> str:
    fit = fitting_bucket_bytes(size, align_bytes, bounds)
    if fit is None:
        return (
            "send fewer tensors per sender (SyncConfig.include / exclude, or WeightSync(shard_sources=True))"
        )
    if fit > MAX_BUCKET_BYTES:
        return f"no bucket size fits {size.nbytes} bytes: split the tensors over several senders"
    return f"raise bucket_bytes to {fit} or more"


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int = 256) -> list[Bucket]:
    """Lay ``specs`` out in buckets of ``bucket_bytes``; see the module docstring for the layout. A layout
    beyond the bounds is refused first (BadLayout), before a single bucket is made."""
    check_layout(specs, bucket_bytes, align_bytes)
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
    bucket 0 at offset 0 (there is always a bucket 0). Checked, since it comes off the wire: bounds first
    (Note [layout bounds]: a sender exports only the storages its tensors live in, so no more storages than
    tensors), then every tensor lies inside its storage, at an offset that is a whole number of its elements."""
    check_tensor_count(len(specs))
    if not len(specs) == len(storage) == len(offset_bytes):
        raise BadLayout(f"{len(storage)} storages and {len(offset_bytes)} offsets for {len(specs)} tensors")
    if len(storage_bytes) > max(1, len(specs)):
        raise BadLayout(
            f"{len(storage_bytes)} storages exported for {len(specs)} tensors: a sender exports only "
            f"the storages its tensors live in, at most one per tensor"
        )
    chunks: list[list[Chunk]] = [[] for _ in range(max(1, len(storage_bytes)))]
    for i, (spec, k, offset) in enumerate(zip(specs, storage, offset_bytes, strict=True)):
        if spec.nbytes == 0:
            k = offset = 0
        elif not (k < len(storage_bytes) and offset + spec.nbytes <= storage_bytes[k]):
            raise BadLayout(
                f"tensor {spec.name!r}: {spec.nbytes} bytes at {offset} in storage {k} do not fit "
                f"the {len(storage_bytes)} storages exported"
            )
        if offset % spec.itemsize:
            raise BadLayout(f"tensor {spec.name!r}: offset {offset} is not a multiple of its itemsize")
        chunks[k].append(Chunk(i, 0, offset, spec.nbytes, True))
    return [Bucket(k, storage_bytes[k] if storage_bytes else 0, tuple(c)) for k, c in enumerate(chunks)]
