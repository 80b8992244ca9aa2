"""Which elements of a bucket changed since the reference (the first stage of raysync.core.delta_encode): the
masks of changed bits, their counts, and the indices of the entries, on the device that holds the chunks.

    masks, span = compare(views, based, space, device)      # ne(reference, new) per chunk, into the workspace
    counts = host_counts(masks)                              # (changed, forced) per chunk: one host sync
    counts, listed = list_changes(masks, span)               # or, for a bucket sparse at its last push (GPU)
    index = indices(mask, entries)                           # a counted chunk's entries, when it goes GAPS

# Note [listing instead of counting]
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

from typing import TYPE_CHECKING

import numpy as np
import torch

from raysync.core.delta import GAP_SPAN, _to_host

if TYPE_CHECKING:
    from raysync.core.delta_encode import Workspace

SPARSE_DENSITY = 1 / 8  # a bucket at most this dense at its last push is listed, not counted first


def compare(
    views, based: bool, space: Workspace | None, device
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Per chunk, the mask of elements whose bits changed (None: no reference), in the workspace's mask, one
    after the other; and the span of the workspace's mask they cover."""
    total = sum(n.numel() for o, n in views if o is not None) if based else 0
    if space is None or space.mask.numel() < total or space.mask.device != device:
        slab = torch.empty(total, dtype=torch.bool, device=device)
        if space is not None:
            space.mask = slab
    else:
        slab = space.mask
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


def list_changes(
    masks: list[torch.Tensor | None], span: torch.Tensor
) -> tuple[list[tuple[int, int] | None], list[torch.Tensor | None]]:
    """Per mask: (changed, forced) as ``_host_counts`` gives them, and the increasing indices of its entries
    (changed elements and the forced ones, which this sets in the mask: Note [delta pushes]). The masks lie one
    after the other in ``span``: one listing of the span, at most ``_listing_cap`` entries (nonzero_static:
    memory bounded, no sync), cut at the masks' starts; the cuts and the forced counts cross together, one host
    sync a bucket. A span with more entries than the cap (a bucket that turned dense) is counted instead, and
    its indices listed chunk by chunk as a counted bucket's are (None in ``listed``)."""
    based = [m for m in masks if m is not None]
    if not based:
        return [None] * len(masks), [None] * len(masks)
    strided = [m[GAP_SPAN - 1 :: GAP_SPAN] for m in based]
    forced = torch.stack([_count(~s).long() for s in strided])  # before the forced entries are set
    for s in strided:
        s.fill_(True)
    starts = [0]
    for m in based:
        starts.append(starts[-1] + m.numel())
    cap = _listing_cap(span.numel(), len(based))
    index = torch.nonzero_static(span, size=cap, fill_value=span.numel()).view(-1)  # increasing, then fills
    cuts = torch.searchsorted(index, torch.tensor(starts, dtype=index.dtype, device=index.device))
    host = torch.cat([cuts, forced]).tolist()
    cut, forced_n = host[: len(starts)], host[len(starts) :]
    if cut[-1] >= cap:  # the listing may have missed entries: count (the forced entries are set already)
        counted = [(c - f, f) for (c, _), f in zip(host_counts(based), forced_n, strict=True)]
        return _spread(masks, counted), [None] * len(masks)
    owns = [index[cut[j] : cut[j + 1]] for j in range(len(based))]
    counts = [(own.numel() - f, f) for own, f in zip(owns, forced_n, strict=True)]
    listed = [own - start if start else own for own, start in zip(owns, starts[:-1], strict=True)]
    return _spread(masks, counts), _spread(masks, listed)


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
