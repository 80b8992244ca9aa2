"""The sender's half of the delta encoding (raysync.core.delta, Note [delta pushes], has the format and the
receiver's half): one bucket's chunks compared with their reference and written as FULL, SAME or GAPS
payloads, on the device that holds the chunks (Note [where a delta is encoded]).

    space = Workspace.for_buckets(sizes, device)       # once per layout: reused by every push
    encode(pairs, out, base_version=v, space=space)  ->  BucketCode
    encode(pairs, out, base_version=v, advance=True)   # the references then hold what a decoder writes
    changes = find_changes(pairs, based=True, space=space, slot=1, wait=False)   # a bucket's compare, queued
    encode(pairs, out, base_version=v, changes=changes, then=start_the_next)     # ... and written later

# Note [where a delta is encoded]
# Every pass over a bucket's elements runs on the device that holds the chunks (the trainer's GPU, or the CPU),
# and the bytes cross to another device at most once, compact: the encoding is written into the workspace's
# buffer on the chunks' device and copied into ``out`` (a host ring buffer, for shm) in one copy of the bytes
# it uses. Writing it straight into a host buffer instead made every payload a blocking copy of its own, and
# each int64 -> int16 conversion of gaps ran on the host through a pageable temporary (torch converts the dtype
# of a blocking cross-device copy on the CPU), eight bytes an entry across PCIe. Per bucket:
#
# (With the fused kernels on a CUDA device the compare and count are one pass and the GAPS payloads are listed and
# written by two launches a bucket: Note [fused delta kernels] in raysync.core.delta_kernels. Torch's path:)
#     compare  ne(reference, new) into the workspace's mask, chunk by chunk       (reads 2 x, writes 1 byte)
#     count    changed and forced entries of every chunk, stacked: one host sync  (reads the mask)
#              or, for a bucket the caller expects sparse (``sparse``), list instead of count: each chunk's
#              forced entries set, then the bucket's indices listed at once (nonzero_static, capped: how many
#              fall in each chunk is its count; one host sync a bucket), which spares the count's pass over the
#              mask (Note [listing instead of counting] in raysync.core.delta_changes)
#     choose   FULL / SAME / GAPS per chunk on the host (the density rule, its reason)
#     compact  GAPS: indices (listed already, or nonzero_static where the count is known: no sync on CUDA),
#              gaps as int16, values gathered straight into the payload (index_select out=); FULL: one copy
#     copy     the used bytes into ``out`` when it lives on another device: on CUDA in runs of >= 4 MiB on
#              a side stream as the payloads are written (the copy engine works while the next chunks are
#              compacted), then one wait; elsewhere one copy
#
# Note [the reference advances by the encoding]
# With ``advance`` each reference chunk takes, after its payload is written, what a decoder of that payload
# writes onto it: a FULL payload's bytes, a GAPS payload's values at its indices (a scatter of the changed
# elements only), nothing for SAME. So the reference holds what every receiver holds by construction, even
# when the new tensors change while the bucket is encoded (the trainer's tensors, read in place: Note [a delta
# read in place] in raysync.core.delta_reference): an element that changed after the compare is not sent and
# not taken, and the next push compares against what the receivers hold. What the trainer meant is checked
# apart from it: verify digests the new tensors, not the reference (raysync.core.delta_push, ``meant``). With
# the fused kernels and changes found with ``advance``, the GAPS values go into the reference at the compare
# instead, and the payload takes them from it (Note [the reference advances at the compare] in
# raysync.core.delta_kernels): the same invariant, without the scatter.
#
# Note [the next bucket's compare overlaps this one's copy]
# (The push session now stages its buckets instead, Note [a bucket is encoded while the one before crosses] in
# raysync.core.delta_workspace, and finds the next changes after each; ``then`` serves encode's other callers.)
# A staged encoding on CUDA ends in a wait for its last bytes to cross (``CopyOut.finish``); the compare of the
# next bucket needs none of them. So the caller may pass ``then``, which encode calls once the payloads' kernels
# are queued and before that wait: raysync.core.delta_push finds the next bucket's changes there
# (``find_changes``, its host sync included), and the GPU compares bucket k + 1 while the copy engine moves
# bucket k to the host ring. It is safe on one stream: the compare's writes to the workspace's mask are queued
# after the compaction's reads of it, and the staging buffer, which the copy reads, is written again only by
# the next encode, after the wait. On an H200 a 7B delta push over shm spent, per 512 MB bucket, about 2.4 ms
# comparing and 1.9 ms compacting and copying, one after the other (docs/benchmarks.md section 12).
#
# Note [two buckets in flight]
# Found that way, the next bucket's changes still ended in a host sync inside ``then``: the thread waited for
# the GPU to finish that compare, and the GPU then waited for the thread to queue the next compaction (at 150
# ms a 7B push, its kernels ran ~55 ms: torch.profiler, docs/results/delta_push_shm_h200_stages_32edebb.txt).
# So ``then`` starts the compares of the two buckets after this one without waiting (``find_changes(...,
# wait=False)``: a counted (fused kernels) or listed (torch's) bucket's counts cross to pinned host memory
# behind an event), and each bucket's own encode waits for them (``Changes.ready``), long queued by then.
# Bucket k compares into the workspace's mask ``k % 2``, and with the fused kernels its encode reads that mask
# again (the listing after the counts); the compare of bucket k + 2, queued after bucket k's encode on the same
# stream, is the first to write that mask again, and bucket k + 1's mask is the other one.
#
# ``mark(stage)``, when given, is called at the end of each stage (raysync.core.delta_rule.StageClock times
# them for the benchmark; on a GPU it synchronizes first, so it is off in ordinary pushes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from raysync.core import delta_blocks, delta_kernels
from raysync.core.delta import (
    GAP_SPAN,
    HEADER_BYTES,
    MAGIC,
    ROW_BYTES,
    BucketCode,
    ChunkCode,
    Mode,
    _align,
    _bits,
    _check_buffer,
    _layout_end,
    _no_mark,
    capacity,
    gaps_bytes,
)
from raysync.core.delta_changes import (
    Counting,
    Listing,
    compare,
    host_counts,
    indices,
    start_counting,
    start_listing,
)
from raysync.core.delta_workspace import CopyOut, Workspace
from raysync.core.errors import LayoutError
from raysync.core.version import is_version

Mark = Callable[[str], None]


@dataclass
class Changes:
    """What the compare found in one bucket (``find_changes``), for ``encode`` to write: per chunk its word
    views, its mask of changed elements, its counts and (listed) its entries' indices."""

    views: list[tuple[torch.Tensor | None, torch.Tensor]]
    device: torch.device | None
    based: bool  # compared with a reference: False, every chunk goes FULL
    masks: list[torch.Tensor | None]
    counts: list[tuple[int, int] | None] | None  # None while ``listing`` is under way
    listed: list[torch.Tensor | None] | None
    gaps: list[torch.Tensor | None] | None  # a listed chunk's gaps, int16 as its payload holds them
    # a listing or the kernels' counting not waited for yet (``find_changes(wait=False)``)
    listing: Listing | Counting | None = None
    # a bucket the kernels counted, which they write (``listed``, ``gaps``: None; Note [fused delta kernels])
    entries: delta_blocks.Counted | None = None

    def ready(self) -> Changes:
        """The counts, listings and gaps, waiting for a listing or counting under way (its one host sync)."""
        if isinstance(self.listing, Counting):
            self.counts, self.entries = self.listing.wait()
            self.listed = self.gaps = [None] * len(self.masks)
        elif self.listing is not None:
            self.counts, self.listed, self.gaps = self.listing.result()
        self.listing = None
        return self


def find_changes(
    pairs: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
    *,
    based: bool,
    space: Workspace | None = None,
    sparse: bool = False,
    slot: int = 0,
    wait: bool = True,
    advance: bool = False,
) -> Changes:
    """The compare and count stages of ``encode`` for one bucket (its arguments, ``based``: base_version is not
    None), ending in their one host sync. The masks live in ``space``'s mask ``slot`` (Note [two buckets in
    flight]) until the compare of the bucket after next. ``wait=False``: the sync of a bucket the fused kernels
    count, or torch's lists, is left to ``Changes.ready`` (one torch's kernels count waits here all the same).
    ``advance``: for an ``encode(advance=True)``, the fused kernels' compare advances the references already
    (Note [the reference advances at the compare] in raysync.core.delta_kernels); elsewhere encode does."""
    views = [(_bits(old, "reference") if old is not None else None, _bits(new, "new")) for old, new in pairs]
    device = _check_pairs(pairs, views)
    if based and delta_kernels.available(device) and any(o is not None for o, _ in views):
        counting = start_counting(views, space, device, slot, advance)  # Note [fused delta kernels]
        changes = Changes(views, device, based, counting.masks, None, None, None, counting)
        return changes.ready() if wait else changes
    masks, span = compare(views, based, space, device, slot)
    if sparse and device is not None and device.type != "cpu":  # Note [listing instead of counting]
        listing = start_listing(masks, span, space.spans if space is not None else None)
        changes = Changes(views, device, based, masks, None, None, None, listing)
        return changes.ready() if wait else changes
    counts, listed, gaps = host_counts(masks), [None] * len(masks), [None] * len(masks)
    return Changes(views, device, based, masks, counts, listed, gaps)


def encode(
    pairs: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
    out: torch.Tensor,
    *,
    base_version: int | None,
    max_density: float = 1.0,
    space: Workspace | None = None,
    mark: Mark | None = None,
    staged: bool | None = None,
    sparse: bool = False,
    advance: bool = False,
    changes: Changes | None = None,
    then: Callable[[], None] | None = None,
    slot: int = 0,
) -> BucketCode:
    """Encode one bucket's chunks into ``out`` (a 1-d uint8 buffer, 16-byte aligned, of at least ``capacity``
    bytes, on any device). Each pair is (the chunk's bytes as of ``base_version``, its new values), same dtype
    and size, all on one device; a reference of None, or ``base_version`` None, sends that chunk FULL. Nothing
    is modified but ``out`` and ``space``. One host sync per bucket for the counts (with ``changes`` found
    ahead without waiting: the wait for their listing; two when ``out`` is on another device than the chunks:
    the copy of the bytes used). ``staged``: encode into the workspace first
    and copy (None: when ``out`` lives on another device than the chunks). ``sparse``: the bucket is expected
    to have few changes: on a GPU without the fused kernels its indices are listed without counting first (Note
    [listing instead of counting]; the kernels count every bucket in its compare).
    ``advance``: each reference then holds what decoding this encoding onto it writes, taken from the encoding
    itself (Note [the reference advances by the encoding]); a reference of None stays None. ``changes``: this
    bucket's ``find_changes``, made ahead (for these pairs and ``space``). ``then``: called once the payloads'
    kernels are queued, while their bytes cross to ``out`` on the copy stream, before the wait for them (Note
    [the next bucket's compare overlaps this one's copy]); on a CUDA device with a staged encoding only.
    ``slot``: the workspace's mask this bucket's compare uses (Note [two buckets in flight]), and its staging
    buffer (Note [a bucket is encoded while the one before crosses] in raysync.core.delta_workspace)."""
    _check_buffer(out, "out")
    if base_version is not None and not (is_version(base_version) and 0 <= base_version < 1 << 63):
        raise LayoutError(  # the header stores it in an int64, -1 meaning none: a version never reads as another
            f"base_version={base_version!r}: an int version in [0, 2**63), or None for a full bucket"
        )
    mark = mark or _no_mark
    if changes is None:
        based = base_version is not None
        changes = find_changes(pairs, based=based, space=space, sparse=sparse, slot=slot, advance=advance)
        mark("compare")
    elif changes.based != (base_version is not None):
        raise LayoutError("changes found for another base than this encoding's: find them again")
    changes.ready()
    if changes.entries is not None and changes.entries.advanced and not advance:
        raise LayoutError("changes found by a compare that advanced the references: encode with advance=True")
    views, device, masks, counts = changes.views, changes.device, changes.masks, changes.counts
    codes = tuple(
        _choose(n.numel(), n.element_size(), c, max_density) for (_, n), c in zip(views, counts, strict=True)
    )
    used = _layout_end(codes)
    if used > out.numel():
        raise LayoutError(
            f"bucket buffer of {out.numel()} bytes, {used} needed: size delta buffers with "
            f"raysync.core.delta.capacity (the bucket's bytes, plus header, table and padding)"
        )
    target = out
    if staged is None:
        staged = device is not None and out.device != device  # Note [where a delta is encoded]
    if staged:
        space = space or Workspace(torch.empty(0, dtype=torch.bool, device=device))
        target = space.staging(used, device, slot)
    header = [MAGIC, -1 if base_version is None else base_version, len(codes), used]
    rows = [[int(c.mode), c.numel, c.itemsize, c.entries] for c in codes]
    stream = torch.cuda.current_stream(out.device) if out.is_cuda and space is not None else None  # once
    _write_words(out, header + [w for row in rows for w in row], space, slot, stream)  # from the host
    offset = _align(HEADER_BYTES + ROW_BYTES * len(codes))
    copy = CopyOut(out, target, offset, space, slot) if target is not out else None
    offsets = []
    for code in codes:
        offsets.append(offset)
        offset = _align(offset + code.payload_bytes)
    fused = changes.entries is not None  # the kernels' bitmask: their payloads are written on their device
    if fused and target.device != device:
        raise LayoutError(
            "changes counted by the fused kernels are written on the chunks' device: staged=None"
        )
    try:
        if fused:  # every GAPS payload at once, queued before the copies that read them
            at = [target.data_ptr() + o for o in offsets]
            payloads = [
                (c.entries, a, a + _align(2 * c.entries)) if c.mode == Mode.GAPS else None
                for c, a in zip(codes, at, strict=True)
            ]
            based = [(p, v) for p, v in zip(payloads, views, strict=True) if v[0] is not None]
            upload = (
                None
                if space is None
                else lambda words, device: space.words.table(
                    ("table", slot), words, device, stream if out.device == device else None
                )
            )
            delta_kernels.write_counted(
                [v for _, v in based], [p for p, _ in based], changes.entries, advance, upload
            )
        for code, (old, new), mask, index, gaps, start in zip(
            codes, views, masks, changes.listed, changes.gaps, offsets, strict=True
        ):
            if not (fused and code.mode == Mode.GAPS):
                region = target[start : start + code.payload_bytes]
                index = _write_payload(code, new, mask, index, gaps, region)
                if advance and old is not None:
                    _advance(code, old, index, region)
            if copy is not None:
                copy.written(min(_align(start + code.payload_bytes), used))
    except BaseException:
        if copy is not None:  # no copy in flight into ``out`` (or out of the workspace) once encode returns
            copy.drain()
        raise
    mark("compact")
    if then is not None and copy is not None and copy.stream is not None:
        then()  # Note [the next bucket's compare overlaps this one's copy]
        mark("next compare")
    if copy is not None:
        copy.finish(used)
        mark("copy out")
    return BucketCode(base_version, codes, used)


def _check_pairs(pairs, views) -> torch.device | None:
    """The chunks' one device (None: no chunks); a reference must match its chunk's dtype, size and device."""
    devices = {n.device for _, n in views}
    if len(devices) > 1:
        raise LayoutError(
            f"a bucket's chunks on {sorted(map(str, devices))}: encode takes one device a bucket"
        )
    for (old, new), (o, n) in zip(pairs, views, strict=True):
        if o is not None and (old.dtype != new.dtype or o.numel() != n.numel() or o.device != n.device):
            raise LayoutError(
                f"reference {old.dtype}[{o.numel()}] on {o.device} and new values {new.dtype}[{n.numel()}] on "
                f"{n.device}: a chunk's reference must have its dtype, size and device"
            )
    return next(iter(devices), None)


def _choose(numel: int, itemsize: int, counts: tuple[int, int] | None, max_density: float) -> ChunkCode:
    """The density rule: GAPS when it is smaller than the full bytes and not denser than ``max_density``,
    else FULL (``why`` says which rule); SAME when nothing changed."""
    if counts is None:
        return ChunkCode(Mode.FULL, numel, itemsize, 0, None, "base")
    changed, forced = counts
    if changed == 0:
        return ChunkCode(Mode.SAME, numel, itemsize, 0, 0)
    entries = changed + forced
    if gaps_bytes(entries, itemsize) >= numel * itemsize:
        return ChunkCode(Mode.FULL, numel, itemsize, 0, changed, "size")
    if changed > max_density * numel:
        return ChunkCode(Mode.FULL, numel, itemsize, 0, changed, "density")
    return ChunkCode(Mode.GAPS, numel, itemsize, entries, changed)


def _write_payload(
    code: ChunkCode,
    new: torch.Tensor,
    mask: torch.Tensor | None,
    listed: torch.Tensor | None,
    gaps: torch.Tensor | None,
    region: torch.Tensor,
) -> torch.Tensor | None:
    """One chunk's payload into ``region``, on the chunk's device (Note [where a delta is encoded]).
    ``listed``, ``gaps``: the chunk's entries' indices and gaps when ``list_changes`` found them already.
    Returns a GAPS chunk's indices."""
    if code.mode == Mode.FULL:
        region.copy_(new.view(torch.uint8))
    elif code.mode == Mode.GAPS:
        assert mask is not None and mask.dtype == torch.bool, "torch's path lists from a bool mask"
        if listed is None:
            mask[GAP_SPAN - 1 :: GAP_SPAN] = True  # Note [delta pushes]: no gap longer than 65536
            index = indices(mask, code.entries)
            gaps = torch.diff(index, prepend=index.new_full((1,), -1)).sub_(1 + 32768)  # in [-32768, 32767]
        else:
            index = listed
        split = _align(2 * code.entries)
        region[: 2 * code.entries].view(torch.int16).copy_(gaps)
        values = region[split : split + code.entries * code.itemsize].view(new.dtype)
        torch.index_select(new, 0, index, out=values)
        return index
    return None


def _advance(code: ChunkCode, old: torch.Tensor, index: torch.Tensor | None, region: torch.Tensor) -> None:
    """The reference chunk ``old`` takes what decoding the payload in ``region`` onto it writes: a FULL
    payload's bytes, a GAPS payload's values at its indices; a SAME chunk keeps its bits."""
    if region.device != old.device:  # an unstaged encoding into another device's buffer
        region = region.to(old.device)
    if code.mode == Mode.FULL:
        old.view(torch.uint8).copy_(region)
    elif code.mode == Mode.GAPS:
        split = _align(2 * code.entries)
        values = region[split : split + code.entries * code.itemsize].view(old.dtype)
        old.index_copy_(0, index, values)  # index: on the chunks' device, which is the reference's


def _write_words(
    out: torch.Tensor, words: list[int], space: Workspace | None = None, slot: int = 0, stream=None
) -> None:
    """From the host: into a GPU buffer through pinned memory, queued (a pageable copy would wait for the
    stream); through the workspace's pinned buffer when there is one (Note [the sender's small tables are kept])."""
    if space is not None and out.is_cuda:
        space.words.copy(("header", slot), words, out[: 8 * len(words)].view(torch.int64), stream)
        return
    words = torch.tensor(words, dtype=torch.int64)
    if out.is_cuda:
        words = words.pin_memory()
    out[: 8 * len(words)].view(torch.int64).copy_(words, non_blocking=out.is_cuda)


__all__ = ["Changes", "Workspace", "encode", "find_changes", "capacity"]
