"""Which bytes each rank of a sharded trainer contributes to each bucket: pure functions, planned once per layout.

A tensor of a sharded trainer is spread over the W ranks of its mesh: rank r holds ``Share`` r of its flat
(row-major) elements. The buckets are the session's own (raysync.core.plan.plan_buckets of the global shapes), so
a bucket's chunk of tensor i (elements [e0, e1)) takes one piece from every rank whose share meets [e0, e1).
For bucket k every rank takes part in one all-gather over one flat buffer of W equal segments:

    the gathered buffer of bucket k
    +--------+--------------------------+--------+--------------------------+-----
    | header | rank 0's pieces           | header | rank 1's pieces           | ...
    +--------+--------------------------+--------+--------------------------+-----
     HEADER_BYTES  in bucket order, each at a multiple of PIECE_ALIGN, already in the wire dtype
    |<------------ segment_bytes -------->|

Each rank writes its own segment (header and pieces: the cast happens in that copy, so the gather moves wire
bytes); the all-gather fills the others; the sending rank then copies each piece to ``bucket_offset`` in the ring
buffer. A piece is whole elements: chunk cuts fall on multiples of align_bytes and share bounds on elements.

Shares: ``Shard(0)`` follows torch.chunk (and FSDP2): rank r holds rows [r * c, (r + 1) * c) of the first dim,
c = ceil(rows / W), clipped (the last ranks may hold fewer rows, or none). A replicated tensor (``Replicate()``,
or a plain tensor every rank holds whole) is split the same way over its flat elements, each rank sending its
part from its own full copy, so no rank sends more than its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raysync.core.plan import Bucket, align_up
from raysync.core.wire import TensorSpec

HEADER_BYTES = 64  # 8 int64: raysync.sources.walk.Header
PIECE_ALIGN = 16  # the largest itemsize: a piece's bytes may be viewed as any dtype


@dataclass(frozen=True)
class Share:
    """Flat elements [lo, hi) of a tensor come from this rank, where its local tensor's first element is global
    element ``base`` (a shard: base = lo; a full replica: base = 0)."""

    lo: int
    hi: int
    base: int


@dataclass(frozen=True)
class Piece:
    """``count`` elements from ``rank``'s local tensor ``index`` (from element ``local_start``), at byte
    ``offset`` of that rank's segment (after the header) and at byte ``bucket_offset`` of the ring bucket."""

    rank: int
    index: int
    local_start: int
    count: int
    offset: int
    bucket_offset: int


@dataclass(frozen=True)
class BucketGather:
    segment_bytes: int  # each rank's part of the all-gather, header included (the least that fits)
    pieces: tuple[Piece, ...]


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s part [lo, hi) of n items split as torch.chunk splits them (FSDP2's Shard(0))."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def shard0_shares(shape: Sequence[int], world: int) -> list[Share]:
    """Every rank's share of a tensor sharded along dim 0 (``Shard(0)``)."""
    row = 1
    for d in shape[1:]:
        row *= d
    out = []
    for r in range(world):
        a, b = chunk_range(shape[0], world, r)
        out.append(Share(a * row, b * row, a * row))
    return out


def replica_shares(numel: int, world: int) -> list[Share]:
    """Every rank's share of a tensor each rank holds whole: its flat elements split evenly."""
    return [Share(*chunk_range(numel, world, r), 0) for r in range(world)]


def plan_gathers(
    specs: Sequence[TensorSpec], shares: Sequence[Sequence[Share]], buckets: Sequence[Bucket]
) -> list[BucketGather]:
    """For each bucket, each rank's pieces and the segment size (the same on every rank). ``shares[i]``: tensor
    i's W shares, which must cover its elements exactly once (checked)."""
    world = len(shares[0]) if shares else 1
    for spec, own in zip(specs, shares, strict=True):
        covered = sorted((s.lo, s.hi) for s in own if s.hi > s.lo)
        ends = [0] + [hi for _, hi in covered]
        if len(own) != world or [lo for lo, _ in covered] != ends[:-1] or ends[-1] != spec.numel:
            raise ValueError(
                f"tensor {spec.name!r}: shares {own} do not cover its {spec.numel} elements once"
            )
    out = []
    for bucket in buckets:
        cursors = [0] * world
        pieces = []
        for c in bucket.chunks:
            if c.nbytes == 0:
                continue
            size = specs[c.index].itemsize
            e0, e1 = c.src_offset // size, (c.src_offset + c.nbytes) // size
            for r, share in enumerate(shares[c.index]):
                a, b = max(e0, share.lo), min(e1, share.hi)
                if a >= b:
                    continue
                offset = align_up(cursors[r], PIECE_ALIGN)
                pieces.append(
                    Piece(r, c.index, a - share.base, b - a, offset, c.bucket_offset + (a - e0) * size)
                )
                cursors[r] = offset + (b - a) * size
        out.append(BucketGather(HEADER_BYTES + align_up(max(cursors), HEADER_BYTES), tuple(pieces)))
    return out
