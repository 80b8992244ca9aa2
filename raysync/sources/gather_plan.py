"""Which bytes each rank of a sharded trainer contributes to each bucket: pure functions, planned once per layout.

A tensor of a sharded trainer is spread over the W ranks of its group. Each tensor is seen as a matrix of
``width`` columns (its flat, row-major elements cut into rows), and rank r holds one block of it (``Share`` r):

    Shard(0), Replicate: one row (width = numel); rank r holds columns [lo, hi) of it
    Shard(d), d > 0:     rows = prod(shape[:d]), width = prod(shape[d:]); rank r holds every row, columns
                         [a * rest, b * rest) where [a, b) is its part of dim d and rest = prod(shape[d + 1:])

    Shard(1) of a 4 x 6 tensor on 2 ranks      the bucket (global, row-major)   rank 1's local tensor
    +-------+-------+                          +-----------------------------+  +-------+
    | r0    | r1    |  row 0                   | r0 r0 r0 r1 r1 r1 r0 r0 ... |  | row 0 |  contiguous,
    | r0    | r1    |  row 1                   +-----------------------------+  | row 1 |  3 columns a row
    ...                                         a piece of r1 lands every 6 elements ...

The buckets are the session's own (raysync.core.plan.plan_buckets of the engine's global shapes), so a bucket's
chunk of engine tensor i (elements [e0, e1)) is a run of elements of one or more trainer tensors (``Part``: the
name/shape mapping, raysync.sources.mapping; without one, tensor i itself). That run is cut into at most three
row blocks (a partial first row, whole rows, a partial last row), and each block into one ``Piece`` per rank
whose share meets it: ``rows`` x ``cols`` elements, read from the rank's local tensor with a row stride and
written to the bucket with the trainer tensor's width as the row stride. For bucket k every rank takes part in
one all-gather over one flat buffer of W equal segments:

    the gathered buffer of bucket k
    +--------+--------------------------+--------+--------------------------+-----
    | header | rank 0's pieces           | header | rank 1's pieces           | ...
    +--------+--------------------------+--------+--------------------------+-----
     HEADER_BYTES  in bucket order, each at a multiple of PIECE_ALIGN, already in the wire dtype, each one
                   block packed row after row
    |<------------ segment_bytes -------->|

Each rank writes its own segment (header and pieces: the cast happens in that copy, so the gather moves wire
bytes); the all-gather fills the others; the sending rank then copies each piece to its place in the ring
buffer: a Shard(1) piece is re-interleaved into the global layout by that one strided copy. A piece is whole
elements: chunk cuts fall on multiples of align_bytes and share bounds on elements.

Shares: ``Shard(d)`` follows torch.chunk (and FSDP2): rank r holds [r * c, (r + 1) * c) of dim d, c = ceil(n / W),
clipped (the last ranks may hold fewer, or none). A replicated tensor (``Replicate()``, or a plain tensor every
rank holds whole) is split evenly over its flat elements, each rank sending its part from its own full copy, so
no rank sends more than its share. On a 2-D mesh (FSDP x TP) the cuts nest, as DTensor nests them (mesh_shares):
``(Shard(0), Shard(1))`` of a matrix gives rank (a, b) rows chunk a and columns chunk b, one block of the matrix;
the ranks that hold the same block (a ``Replicate()`` mesh dim) split it by rows, or by columns when it is one row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from raysync.core.plan import Bucket, align_up
from raysync.core.wire import TensorSpec

HEADER_BYTES = 64  # 8 int64: raysync.sources.walk.Header
PIECE_ALIGN = 16  # the largest itemsize: a piece's bytes may be viewed as any dtype


@dataclass(frozen=True)
class Share:
    """A rank's block of a tensor seen as a matrix of ``width`` columns: rows [row_lo, row_hi), columns [lo, hi).
    Element (i, j) of the block is element ``(i - row_lo) * stride + j - base`` of the rank's local tensor
    (a Shard(0) shard: base = lo; a full replica: base = 0; a Shard(d) shard: base = lo, stride = hi - lo)."""

    lo: int
    hi: int
    base: int
    width: int
    row_lo: int = 0
    row_hi: int = 1
    stride: int = 0

    @property
    def numel(self) -> int:
        return max(0, self.hi - self.lo) * max(0, self.row_hi - self.row_lo)


@dataclass(frozen=True)
class Part:
    """Elements [start, start + count) of trainer tensor ``source`` (global, flat), in order: one run of an
    engine tensor (raysync.sources.mapping). ``rows`` > 0: the whole trainer matrix (``rows`` x
    count / rows), transposed."""

    source: int
    start: int
    count: int
    rows: int = 0


@dataclass(frozen=True)
class Piece:
    """A block of ``rows`` x ``cols`` elements of ``rank``'s local tensor ``source``, from element
    ``local_start`` with ``local_stride`` elements between rows, for engine tensor ``index``. It sits packed at
    byte ``offset`` of that rank's segment (after the header), and at byte ``bucket_offset`` of the ring bucket
    with ``ring_stride`` elements between rows."""

    rank: int
    index: int
    source: int
    local_start: int
    rows: int
    cols: int
    local_stride: int
    ring_stride: int
    offset: int
    bucket_offset: int
    ring_step: int = 1  # elements between columns in the ring (a transposed piece: the matrix's rows)

    @property
    def count(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class BucketGather:
    segment_bytes: int  # each rank's part of the all-gather, header included (the least that fits)
    pieces: tuple[Piece, ...]


def chunk_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s part [lo, hi) of n items split as torch.chunk splits them (FSDP2's Shard(0))."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def shard_shares(shape: Sequence[int], world: int, dim: int = 0) -> list[Share]:
    """Every rank's share of a tensor sharded along ``dim`` (``Shard(dim)``) as torch.chunk cuts it."""
    if not 0 <= dim < len(shape):
        raise ValueError(f"Shard({dim}) of a tensor of shape {tuple(shape)}")
    rows, rest = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    width = shape[dim] * rest
    out = []
    for r in range(world):
        a, b = chunk_range(shape[dim], world, r)
        out.append(Share(a * rest, b * rest, a * rest, width, 0, rows, (b - a) * rest))
    return out


def shard0_shares(shape: Sequence[int], world: int) -> list[Share]:
    """Every rank's share of a tensor sharded along dim 0 (``Shard(0)``)."""
    return shard_shares(shape, world, 0)


def replica_shares(numel: int, world: int) -> list[Share]:
    """Every rank's share of a tensor each rank holds whole: its flat elements split evenly."""
    return [Share(*chunk_range(numel, world, r), 0, numel, 0, 1, numel) for r in range(world)]


def block_ranges(
    shape: Sequence[int], mesh: Sequence[int], placements: Sequence[int | None], flat: int
) -> list[tuple[int, int]]:
    """The block [lo, hi) per tensor dim that rank ``flat`` of the mesh holds (ranks in row-major order of their
    mesh coordinates, as DeviceMesh flattens them), cut as DTensor cuts it: torch.chunk along each mesh dim in
    turn, for each ``placements`` entry that is a tensor dim (Shard); None is Replicate."""
    coord = _coordinate(mesh, flat)
    ranges = [(0, n) for n in shape]
    for d, c, size in zip(placements, coord, mesh, strict=True):
        if d is not None:
            lo, hi = ranges[d]
            a, b = chunk_range(hi - lo, size, c)
            ranges[d] = (lo + a, lo + b)
    return ranges


def mesh_shares(shape: Sequence[int], mesh: Sequence[int], placements: Sequence[int | None]) -> list[Share]:
    """Every rank's share of a tensor on a mesh (block_ranges); the ranks that hold the same block (a Replicate
    mesh dim) split it by rows, or by columns when it is one row. ValueError when a block is not rows x columns
    of a matrix view of the tensor (two sharded dims with a dim of size > 1 before the first)."""
    out = []
    replicas = [i for i, d in enumerate(placements) if d is None]
    for flat in range(math.prod(mesh)):
        share = _block(shape, block_ranges(shape, mesh, placements, flat))
        coord, index = _coordinate(mesh, flat), 0
        for i in replicas:
            index = index * mesh[i] + coord[i]
        out.append(_split_among(share, math.prod(mesh[i] for i in replicas), index))
    return out


def _coordinate(mesh: Sequence[int], flat: int) -> list[int]:
    coord = []
    for size in reversed(mesh):
        coord.append(flat % size)
        flat //= size
    return coord[::-1]


def _block(shape: Sequence[int], ranges: list[tuple[int, int]]) -> Share:
    """A hyper-rectangle of a tensor as rows x columns of a matrix view [prod(shape[:k]), prod(shape[k:])]."""
    cut = [d for d, (lo, hi) in enumerate(ranges) if (lo, hi) != (0, shape[d])]
    numel = math.prod(shape)
    if not cut:
        return Share(0, numel, 0, numel, 0, 1, numel)
    k, (lo, hi) = cut[-1], ranges[cut[-1]]
    rest = math.prod(shape[k + 1 :])
    width = shape[k] * rest
    row_lo, row_hi = 0, math.prod(shape[:k])
    if len(cut) == 2 and math.prod(shape[: cut[0]]) == 1:
        mid = math.prod(shape[cut[0] + 1 : k])
        row_lo, row_hi = ranges[cut[0]][0] * mid, ranges[cut[0]][1] * mid
    elif len(cut) > 1:
        raise ValueError(f"a block {ranges} of a tensor of shape {tuple(shape)} is not rows x columns")
    cols = (hi - lo) * rest
    return Share(lo * rest, hi * rest, lo * rest, width, row_lo, row_hi, cols)


def _split_among(share: Share, group: int, index: int) -> Share:
    """Part ``index`` of ``group`` ranks that hold the same block: its rows, or its columns when it has one."""
    if group == 1:
        return share
    if share.row_hi - share.row_lo > 1:
        a, b = chunk_range(share.row_hi - share.row_lo, group, index)
        base = share.base - a * share.stride  # local rows before the part's first
        return Share(share.lo, share.hi, base, share.width, share.row_lo + a, share.row_lo + b, share.stride)
    a, b = chunk_range(share.hi - share.lo, group, index)
    return Share(
        share.lo + a, share.lo + b, share.base, share.width, share.row_lo, share.row_hi, share.stride
    )


def check_cover(name: str, numel: int, shares: Sequence[Share]) -> None:
    """The shares of a tensor of ``numel`` elements cover each element exactly once (ValueError otherwise)."""
    width = shares[0].width if shares else 0
    rows = numel // width if width else 0
    inside = all(
        s.width == width and 0 <= s.lo and s.hi <= width and 0 <= s.row_lo and s.row_hi <= rows
        for s in shares
        if s.numel
    )
    blocks = [s for s in shares if s.numel]
    disjoint = all(
        a.hi <= b.lo or b.hi <= a.lo or a.row_hi <= b.row_lo or b.row_hi <= a.row_lo
        for i, a in enumerate(blocks)
        for b in blocks[i + 1 :]
    )
    if (
        (numel and rows * width != numel)
        or not inside
        or not disjoint
        or sum(s.numel for s in blocks) != numel
    ):
        raise ValueError(f"tensor {name!r}: shares {list(shares)} do not cover its {numel} elements once")


def row_blocks(e0: int, e1: int, width: int) -> list[tuple[int, int, int, int]]:
    """Elements [e0, e1) of a matrix ``width`` wide as at most three blocks (rows [i0, i1), columns [j0, j1))."""
    if e1 <= e0:
        return []
    i0, i1 = e0 // width, (e1 - 1) // width
    if i0 == i1:
        return [(i0, i0 + 1, e0 - i0 * width, e1 - i0 * width)]
    out = []
    if e0 % width:
        out.append((i0, i0 + 1, e0 % width, width))
        i0 += 1
    full_end = e1 // width
    if full_end > i0:
        out.append((i0, full_end, 0, width))
    if e1 % width:
        out.append((full_end, full_end + 1, 0, e1 % width))
    return out


def plan_gathers(
    specs: Sequence[TensorSpec],
    shares: Sequence[Sequence[Share]],
    buckets: Sequence[Bucket],
    parts: Sequence[Sequence[Part]] | None = None,
    numels: Sequence[int] | None = None,
) -> list[BucketGather]:
    """For each bucket, each rank's pieces and the segment size (the same on every rank). ``specs``: the engine's
    tensors (wire dtypes); ``parts[i]``: the runs of trainer tensors that make engine tensor i (default: tensor
    i itself); ``shares[t]``: trainer tensor t's W shares, which must cover its ``numels[t]`` elements exactly
    once (checked; default numels: the specs')."""
    given = parts
    if parts is None:
        parts = [[Part(i, 0, s.numel)] for i, s in enumerate(specs)]
    numels = [s.numel for s in specs] if numels is None else numels
    world = len(shares[0]) if shares else 1
    for t, own in enumerate(shares):
        if len(own) != world:
            raise ValueError(f"tensor {t}: {len(own)} shares for {world} ranks")
        check_cover(specs[t].name if given is None else f"#{t}", numels[t], own)
    return [_plan_bucket(bucket, specs, shares, parts, world) for bucket in buckets]


def _plan_bucket(bucket, specs, shares, parts, world) -> BucketGather:
    cursors, pieces = [0] * world, []
    for c in bucket.chunks:
        if c.nbytes == 0:
            continue
        size = specs[c.index].itemsize
        e0, e1 = c.src_offset // size, (c.src_offset + c.nbytes) // size
        at = 0  # the engine element where the part begins
        for part in parts[c.index]:
            a, b = max(e0, at), min(e1, at + part.count)
            if a < b:
                g0 = part.start + a - at  # the trainer tensor's global element at a
                ring0 = c.bucket_offset + (a - e0) * size
                for rank, share in enumerate(shares[part.source]):
                    if part.rows:
                        made = _transposed(share, rank, c.index, part, a - at, b - at, ring0, size)
                    else:
                        made = _pieces(share, rank, c.index, part.source, g0, g0 + b - a, ring0, size)
                    for piece in made:
                        offset = align_up(cursors[rank], PIECE_ALIGN)
                        pieces.append(_placed(piece, offset))
                        cursors[rank] = offset + piece.count * size
            at += part.count
    return BucketGather(HEADER_BYTES + align_up(max(cursors), HEADER_BYTES), tuple(pieces))


def _placed(piece: Piece, offset: int) -> Piece:
    return Piece(**{**piece.__dict__, "offset": offset})


def _pieces(share: Share, rank: int, index: int, source: int, g0: int, g1: int, ring0: int, size: int):
    """The pieces ``rank`` gives of trainer elements [g0, g1), which sit from byte ``ring0`` of the bucket."""
    for i0, i1, j0, j1 in row_blocks(g0, g1, share.width):
        r0, r1 = max(i0, share.row_lo), min(i1, share.row_hi)
        c0, c1 = max(j0, share.lo), min(j1, share.hi)
        if r0 >= r1 or c0 >= c1:
            continue
        local = (r0 - share.row_lo) * share.stride + c0 - share.base
        ring = ring0 + (r0 * share.width + c0 - g0) * size
        yield Piece(rank, index, source, local, r1 - r0, c1 - c0, share.stride, share.width, 0, ring)


def _transposed(share: Share, rank: int, index: int, part: Part, x0: int, x1: int, ring0: int, size: int):
    """The pieces ``rank`` gives of elements [x0, x1) of the transpose of a matrix of ``part.rows`` rows:
    each a block of the matrix read row by row, written into the ring one column of the transpose at a time."""
    rows, cols = part.rows, part.count // part.rows
    for j0, j1, i0, i1 in row_blocks(x0, x1, rows):  # rows j of the transpose are columns j of the matrix
        for r0, r1, c0, c1, start, stride in _natural(share, cols):
            a0, a1, b0, b1 = max(i0, r0), min(i1, r1), max(j0, c0), min(j1, c1)
            if a0 < a1 and b0 < b1:
                local = start + (a0 - r0) * stride + b0 - c0
                ring = ring0 + (b0 * rows + a0 - x0) * size
                yield Piece(rank, index, part.source, local, a1 - a0, b1 - b0, stride, 1, 0, ring, rows)


def _natural(share: Share, cols: int):
    """A rank's share of a matrix ``cols`` wide as blocks of it: (rows [r0, r1), columns [c0, c1), the local
    element of (r0, c0), the local row stride)."""
    if share.numel == 0:
        return
    if share.width == cols:
        yield share.row_lo, share.row_hi, share.lo, share.hi, share.lo - share.base, share.stride
        return
    for r0, r1, c0, c1 in row_blocks(share.lo, share.hi, cols):  # one row of the whole matrix: a flat range
        yield r0, r1, c0, c1, r0 * cols + c0 - share.base, cols
