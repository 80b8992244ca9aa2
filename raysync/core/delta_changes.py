"""Which elements of a bucket changed since the reference (the first stage of raysync.core.delta_encode): the
masks of changed bits, their counts, and the indices of the entries, on the device that holds the chunks.

    counting = start_counting(views, space, device)         # CUDA with Triton: compare and count in one pass
    masks, span = compare(views, based, space, device)      # else ne(reference, new) per chunk, into the workspace
    counts = host_counts(masks)                              # (changed, forced) per chunk: one host sync
    counts, listed = list_changes(masks, span)               # or, sparse at its last push (a GPU without them)
    index = indices(mask, entries)                           # a counted chunk's entries, when it goes GAPS

# Note [listing instead of counting]
# (Torch's path on a GPU, when the fused kernels are off or Triton is missing: the kernels count every bucket in
# its compare pass and list it after, Note [fused delta kernels] in raysync.core.delta_kernels.)
# On an H200, for a 512 MB bf16 bucket at 5% changed (benchmarks/bench_delta_ops.py, docs/benchmarks.md section
# 12): ne 0.33 ms, count_nonzero of the mask 1.34 ms (its sum of the mask's bytes as int32: 0.72 ms), nonzero
# 0.73 ms, nonzero_static with the count known 0.67 ms. Counting and then listing reads the mask twice; listing
# alone gives the count (its length) in the same pass. But listing holds 8 bytes an entry: for a dense chunk (one
# that goes FULL) that is up to 4x its bf16 bytes (8x its fp8 ones), allocated for nothing. So the caller lists
# only buckets that were sparse at their last push (raysync.core.delta_push: at most SPARSE_DENSITY changed),
# and the listing has a fixed size, ``_listing_cap`` (twice that density): a bucket that turned denser is
# counted after all (its listing then cost one pass for nothing), never listed whole.
# The listing is one per bucket, not per chunk: listed chunk by chunk (a host sync each), the compare stage of a
# 7B push (339 tensors in 30 buckets) took 98-110 ms on the H200, where counting took 60.
# On the CPU nothing is listed ahead: counting is cheap there, and nonzero_static fills (and first faults in) a
# listing of the cap's size each bucket.
#
# Note [a listing's work by the bucket]
# A 7B layout has 339 tensors in 30 buckets; on the H200 a delta push of it over shm ran its kernels for about
# 55 ms but took 150 ms, the sender's thread launching about 20 small operations per chunk (counting and
# setting its forced entries, cutting its indices out, their gaps: torch.profiler, docs/benchmarks.md section
# 12). So a listed bucket does these once for the whole span: the forced positions of every chunk are gathered,
# counted by chunk (index_add_) and set in one go (their positions made once per bucket shape: SpanLayout);
# the gaps are the differences of the bucket's consecutive entries, corrected at each chunk's first entry (whose
# places the cuts give, on the host: one small copy), and each chunk takes its slices. What stays per chunk is its
# compare, its indices made relative to its start, its values gathered and the reference's scatter. (A first
# version found each entry's chunk by searchsorted and worked the gaps out in ~13 passes over the listing: its
# kernels took 17 ms of a 7B push on the H200, profile in docs/results/delta_push_shm_h200_stages_cf0d2e5.txt.)
#
# Note [the counts cross on a stream of their own]
# A bucket's counts (a few hundred bytes) cross to the host while the bucket before it crosses to the ring on the
# copy stream (~50 MB, ~0.9 ms at 5% on an H200): in the timeline of a 7B delta push over shm at 5.0% (17a3073,
# docs/benchmarks.md section 12a) their copy, queued on the current stream behind the compare, waited for the
# copy engine until that bucket's copy had ended, and the next bucket's listing and payloads, queued behind it
# on the current stream, waited with it: ~0.7 ms a bucket with no kernel running, a bucket every ~1.9 ms. On a
# stream of their own they still wait for the copy engine, but nothing waits for them until that bucket's own
# encode, a bucket later. Measured at 0259ee6 (docs/benchmarks.md section 12, Latest): the counts now cross
# beside the copy out, but the push did not get faster (60.8-68.7 ms at 5.0% with and without this): the
# sender's thread, busy the whole period, sets it.
#
# Note [numpy on the CPU]
# On the CPU the compare, the counts and the listing of indices run as numpy's kernels over the same memory
# (``Tensor.numpy()`` shares it), which measured faster than torch's CPU kernels for these passes. On an 8 MB
# bf16 bucket at 5% changed on the 2-core VM (benchmarks/bench_delta_ops.py --device cpu --mb 8, docs/results/
# delta_ops_cpu_vm*.json), numpy against torch on one thread: ne 0.53 / 2.50 ms, count 0.17 / 1.05 ms,
# nonzero 3.11 / 6.17 ms; against torch on two threads: 1.18, 0.53 and 3.12 ms. numpy takes one core, which
# leaves the other to the receiver (a delta push of a 392 MB model on that VM, sender and receiver on one
# thread each: 803 ms with torch's kernels, 408 ms with numpy's, docs/benchmarks.md section 12). On the GPU
# they stay torch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from raysync.core import delta_blocks, delta_kernels
from raysync.core.delta import GAP_SPAN, _to_host
from raysync.core.delta_workspace import chunk_masks, on_stream, side_stream

if TYPE_CHECKING:
    from raysync.core.delta_workspace import Workspace

SPARSE_DENSITY = 1 / 8  # a bucket at most this dense at its last push is listed, not counted first


def compare(
    views, based: bool, space: Workspace | None, device, slot: int = 0
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per chunk, the mask of elements whose bits changed (None: no reference), in the workspace's mask
    ``slot`` (0, or 1 for a bucket compared while the one before it is not yet written), one after the other;
    and the span of that mask they cover."""
    total = sum(n.numel() for o, n in views if o is not None) if based else 0
    slab = _slab(space, slot, total, device)
    masks, start = [], 0
    for o, n in views:
        if o is None or not based:
            masks.append(None)
            continue
        mask = slab[start : start + n.numel()]
        if mask.device.type == "cpu":  # Note [numpy on the CPU]
            np.not_equal(o.detach().numpy(), n.detach().numpy(), out=mask.numpy())
        else:
            torch.ne(o, n, out=mask)
        masks.append(mask)
        start += n.numel()
    return masks, slab[:start]


def _slab(space: Workspace | None, slot: int, elements: int, device) -> torch.Tensor:
    """The workspace's bool mask ``slot`` (Note [two buckets in flight] in raysync.core.delta_encode), made
    larger when it holds fewer than ``elements``."""
    held = None if space is None else space.mask if slot == 0 else space.second_mask
    if held is not None and held.numel() >= elements and held.device == device:
        return held
    slab = torch.empty(elements, dtype=torch.bool, device=device)
    if space is not None and slot == 0:
        space.mask = slab
    elif space is not None:
        space.second_mask = slab
    return slab


def cross(
    counts: torch.Tensor, host: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A bucket's counts on their way to the host, not waited for: on a CUDA device into pinned memory (``host``,
    a workspace's, or new) on a stream of their own, behind the current stream's work (Note [the counts cross
    on a stream of their own]), with the event that ends the copy; elsewhere the tensor itself and None."""
    if not counts.is_cuda:
        return counts, None
    stream = side_stream("counts", counts.device)
    stream.wait_stream(torch.cuda.current_stream(counts.device))
    if host is None:
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    on_stream(stream, lambda: host.copy_(counts, non_blocking=True))  # into pinned memory
    ready = torch.cuda.Event()
    ready.record(stream)
    counts.record_stream(stream)  # made on the current stream, read on this one: not reused before
    return host, ready


@dataclass
class Counting:
    """A bucket's compare and counts by the kernels (``start_counting``), queued: its chunks' counts and cuts
    crossing to the host behind an event; ``wait()`` (the one host sync) returns them."""

    masks: list[torch.Tensor | None]  # per chunk, its part of the bitmask, int32 words (None: no reference)
    counted: delta_blocks.Counted
    crossing: torch.Tensor  # on the host once ``ready``: the cuts, then the forced ones' running sums
    ready: torch.cuda.Event | None

    def wait(self) -> tuple[list[tuple[int, int] | None], delta_blocks.Counted]:
        """Per chunk: (changed, forced); and the bucket's counts for ``delta_kernels.write_counted``."""
        if self.ready is not None:
            self.ready.synchronize()
        counted = self.counted.crossed(self.crossing.tolist())
        counts = [
            (b - a - f, f) for a, b, f in zip(counted.cut, counted.cut[1:], counted.forced, strict=False)
        ]
        return _spread(self.masks, counts), counted


def start_counting(
    views, space: Workspace | None, device: torch.device, slot: int = 0, advance: bool = False
) -> Counting:
    """Compare a bucket (its word views, (reference or None, new) per chunk) and count its entries with the
    fused kernels (Note [fused delta kernels]), into the bitmask in the workspace's mask ``slot``
    (delta_blocks.mask_words), without waiting: the counts cross to pinned host memory behind an event.
    ``advance``: the references take the changed words as they are compared (Note [the reference advances at
    the compare] in raysync.core.delta_kernels)."""
    based = [(o, n) for o, n in views if o is not None]
    sizes = tuple(n.numel() for _, n in based)
    blocks = space.blocks(sizes, device) if space is not None else delta_blocks.Blocks.of(sizes, device)
    slab = _slab(space, slot, blocks.elements // 8, device)  # the bitmask's bytes (delta_blocks.mask_words)
    shape = tuple(None if o is None else n.numel() for o, n in views)
    if space is not None:  # made once per bucket shape (Note [the sender's small tables are kept])
        sums, picked, host = space.counting(slot, blocks, device)
        words = delta_blocks.mask_words(slab, blocks)
        counted = delta_kernels.count_blocks(based, words, blocks, sums, advance)
        masks = space.chunk_masks(slab, slot, shape, blocks.firsts, bits=True)
        crossing, ready = cross(counted.picked(picked).view(-1), host)
    else:
        words = delta_blocks.mask_words(slab, blocks)
        counted = delta_kernels.count_blocks(based, words, blocks, advance=advance)
        masks = chunk_masks(slab, shape, blocks.firsts, bits=True)
        crossing, ready = cross(counted.picked().reshape(-1))
    return Counting(masks, counted, crossing, ready)


def host_counts(masks: list[torch.Tensor | None]) -> list[tuple[int, int] | None]:
    """Per mask: (changed elements, unchanged elements at index 65535 mod 65536), one host sync per device."""
    if all(m is None or m.device.type == "cpu" for m in masks):  # Note [numpy on the CPU]
        return [None if m is None else _cpu_counts(m.numpy()) for m in masks]
    stats = [
        None if m is None else torch.stack([_count(m).long(), _count(~m[GAP_SPAN - 1 :: GAP_SPAN]).long()])
        for m in masks
    ]
    return [None if s is None else (int(s[0]), int(s[1])) for s in _to_host(stats)]


def _cpu_counts(mask: np.ndarray) -> tuple[int, int]:
    changed = int(np.count_nonzero(mask))
    strided = mask[GAP_SPAN - 1 :: GAP_SPAN]
    return changed, strided.size - int(np.count_nonzero(strided))


def _count(mask: torch.Tensor) -> torch.Tensor:
    """The True elements of a bool mask, as a 0-d tensor on its device (Note [listing instead of counting])."""
    if mask.device.type == "cuda" and mask.numel() < 1 << 31:
        return mask.view(torch.uint8).sum(dtype=torch.int32)  # 0/1 bytes; int32 cannot overflow here
    return mask.count_nonzero()


@dataclass(frozen=True)
class SpanLayout:
    """Where the chunks of one bucket's span start, and its forced positions (index 65535 mod 65536 of each
    chunk, Note [delta pushes]) with the chunk each lies in: made once per bucket shape, on the span's device
    (``Workspace.spans`` keeps them), so that a listing's per-chunk work is a few kernels a bucket."""

    starts: torch.Tensor  # int64 [chunks + 1]: each chunk's first element in the span, then the span's end
    starts_host: tuple[int, ...]  # the same, on the host
    forced: torch.Tensor  # int64: the forced positions in the span, increasing
    chunk_of_forced: torch.Tensor  # int64: the chunk of each

    @classmethod
    def of(cls, sizes: Sequence[int], device: torch.device) -> SpanLayout:
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        forced = [
            s + GAP_SPAN - 1 + GAP_SPAN * torch.arange(n // GAP_SPAN, dtype=torch.int64)
            for s, n in zip(starts, sizes, strict=False)
        ]
        chunk = [torch.full((f.numel(),), j, dtype=torch.int64) for j, f in enumerate(forced)]
        return cls(
            torch.tensor(starts, dtype=torch.int64).to(device),
            tuple(starts),
            torch.cat(forced).to(device) if forced else torch.empty(0, dtype=torch.int64, device=device),
            torch.cat(chunk).to(device) if chunk else torch.empty(0, dtype=torch.int64, device=device),
        )


def list_changes(
    masks: list[torch.Tensor | None], span: torch.Tensor, spans: dict | None = None
) -> tuple[list[tuple[int, int] | None], list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per mask: (changed, forced) as ``host_counts`` gives them, the increasing indices of its entries
    (changed elements and the forced ones, which this sets in the mask: Note [delta pushes]) and their gaps as
    the GAPS payload holds them (int16). The masks lie one after the other in ``span``: one listing of the
    span, at most ``_listing_cap`` entries (nonzero_static: memory bounded, no sync), cut at the masks'
    starts; the cuts and the forced counts cross together, one host sync a bucket; the forced entries, the
    indices within each chunk and the gaps are worked out for the whole bucket at once (Note [a listing's work
    by the bucket]). A span with more entries than the cap (a bucket that turned dense) is counted instead,
    and its indices listed chunk by chunk as a counted bucket's are (None in the listings). ``spans``: a
    cache of SpanLayout by the masks' sizes. ``start_listing`` and its ``Listing.result`` at once."""
    return start_listing(masks, span, spans).result()


@dataclass
class Listing:
    """A bucket's listing under way (``start_listing``): its kernels queued and its cuts and forced counts
    crossing to the host, not waited for; ``result()`` waits for them (the one host sync) and cuts it."""

    masks: list[torch.Tensor | None]  # the bucket's, one per chunk (None: no reference)
    based: list[torch.Tensor]  # those that are not None, one after the other in the span
    layout: SpanLayout | None
    index: torch.Tensor | None  # the span's entries, increasing, then (up to ``cap``) fills or nothing set
    cap: int
    crossing: torch.Tensor | None  # the cuts, then the forced counts: on the host once ``ready``
    ready: torch.cuda.Event | None  # None: ``crossing`` is on the host already

    def result(
        self,
    ) -> tuple[list[tuple[int, int] | None], list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per mask: (changed, forced), its entries' indices and gaps (None for a counted span's, which lists
        its chunks as a counted bucket's are)."""
        counts, entries = self.wait()
        if entries is None:
            return counts, [None] * len(self.masks), [None] * len(self.masks)
        listed, gaps = entries.split()
        return counts, _spread(self.masks, listed), _spread(self.masks, gaps)

    def wait(self) -> tuple[list[tuple[int, int] | None], Entries | None]:
        """Per mask: (changed, forced); and the bucket's entries, or None for a span that had more than the
        cap (counted instead: its chunks are listed as a counted bucket's are)."""
        masks, based, layout = self.masks, self.based, self.layout
        if not based:
            return [None] * len(masks), None
        if self.ready is not None:
            self.ready.synchronize()
        host = self.crossing.tolist()
        cut, forced_n = host[: len(based) + 1], host[len(based) + 1 :]
        if cut[-1] >= self.cap:  # the listing may have missed entries: count (the forced entries are set)
            counted = [(c - f, f) for (c, _), f in zip(host_counts(based), forced_n, strict=True)]
            return _spread(masks, counted), None
        counts = [(cut[j + 1] - cut[j] - f, f) for j, f in enumerate(forced_n)]
        return _spread(masks, counts), Entries(self.index[: cut[-1]], cut, layout.starts_host)


@dataclass(frozen=True)
class Entries:
    """A listed bucket's entries: their increasing indices in the span, where each based chunk's entries begin
    (and their end), and where each based chunk begins in the span (and its end)."""

    index: torch.Tensor
    cut: list[int]
    starts: tuple[int, ...]

    def split(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per based chunk, its entries' indices within it and their gaps as its GAPS payload holds them."""
        cut, starts = self.cut, self.starts
        gaps = _gaps(self.index, cut, starts)
        listed = [self.index[cut[j] : cut[j + 1]] - starts[j] for j in range(len(cut) - 1)]
        return listed, [gaps[cut[j] : cut[j + 1]] for j in range(len(cut) - 1)]


def start_listing(masks: list[torch.Tensor | None], span: torch.Tensor, spans: dict | None = None) -> Listing:
    """Queue a bucket's listing (``list_changes``) without waiting for it: the cuts and forced counts cross
    to pinned host memory behind an event (Note [two buckets in flight] in raysync.core.delta_encode)."""
    based = [m for m in masks if m is not None]
    if not based:
        return Listing(masks, based, None, None, 0, None, None)
    sizes = tuple(m.numel() for m in based)
    layout = spans.get(sizes) if spans is not None else None
    if layout is None:
        layout = SpanLayout.of(sizes, span.device)
        if spans is not None:
            spans[sizes] = layout
    unset = ~span[layout.forced]  # before the forced entries are set
    forced = torch.zeros(len(based), dtype=torch.int64, device=span.device)
    forced.index_add_(0, layout.chunk_of_forced, unset.long())
    span.index_fill_(0, layout.forced, True)  # not ``span[forced] = True``: its value crosses, a host sync
    cap = _listing_cap(span.numel(), len(based))
    index = torch.nonzero_static(span, size=cap, fill_value=span.numel()).view(-1)  # increasing, then fills
    cuts = torch.searchsorted(index, layout.starts)
    host, ready = cross(torch.cat([cuts, forced]))
    return Listing(masks, based, layout, index, cap, host, ready)


def _gaps(entries: torch.Tensor, cut: list[int], starts: Sequence[int]) -> torch.Tensor:
    """Each of the span's increasing entries' gap as a GAPS payload stores it, as int16: its index less the
    index of the entry before it in its chunk (or its chunk's start less 1, for a chunk's first entry), less
    1 + 32768 (Note [delta pushes]). ``cut``: where each chunk's entries begin, and their end."""
    step = torch.empty_like(entries)
    torch.sub(entries[1:], entries[:-1], out=step[1:])
    firsts = [(cut[j], starts[j] - 1) for j in range(len(cut) - 1) if cut[j] < cut[j + 1]]
    if firsts:  # a chunk's first entry counts from its start: one small copy of (where, from) for all
        where, before = (
            torch.tensor(firsts, dtype=torch.int64).to(entries.device, non_blocking=True).unbind(1)
        )
        step[where] = entries[where] - before
    return step.sub_(1 + 32768).to(torch.int16)


def _spread(masks: list[torch.Tensor | None], values: list) -> list:
    """``values``, one per mask that is not None, laid out as ``masks`` (None where a mask is None)."""
    it = iter(values)
    return [None if m is None else next(it) for m in masks]


def _listing_cap(elements: int, chunks: int) -> int:
    """The most entries a listing holds for a span of ``elements`` in ``chunks`` chunks: twice SPARSE_DENSITY
    (the density a listed bucket had at its last push) and every forced entry; 8 bytes each, at most about
    the bytes of the span's bf16 values."""
    return int(2 * SPARSE_DENSITY * elements) + elements // GAP_SPAN + chunks + 1


def indices(mask: torch.Tensor, entries: int) -> torch.Tensor:
    """The increasing int64 indices of ``mask``'s ``entries`` True elements. On the CPU numpy's nonzero (Note
    [numpy on the CPU]); elsewhere ``nonzero_static`` (the count is known: no host sync), or ``nonzero``."""
    if mask.device.type == "cpu":
        index = torch.from_numpy(mask.numpy().nonzero()[0].astype(np.int64, copy=False))
    elif hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=entries).view(-1)
        except NotImplementedError:  # a torch without it for this device
            index = mask.nonzero().view(-1)
    else:
        index = mask.nonzero().view(-1)
    assert index.numel() == entries, "the mask changed between count and encode"
    return index
