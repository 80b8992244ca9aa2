"""Triton kernels for a delta on a CUDA device: the sender's listing and GAPS payloads of a listed bucket
(raysync.core.delta_changes lists with them, raysync.core.delta_encode writes with them) and the receiver's
decoding of GAPS payloads (raysync.core.delta.decode). Used when Triton imports (torch's CUDA builds bring it);
without it, or with RAYSYNC_DELTA_KERNELS=0, the same work runs as torch's kernels, bit for bit the same.

    warm(device, itemsizes, encode=True)              # at set-up: compiled, not in the first delta push
    index, cuts = list_span(span, cap, starts)        # the increasing indices of a bool span's True elements
    write_listed(views, payloads, entries, advance)   # a bucket's GAPS payloads, the references advanced
    apply = GapsApply(payloads); apply.run()          # the receiver's: checked on the device, then written

# Note [fused delta kernels]
# Profiled on an H200 (a 7B delta push over shm at 5.7% changed, docs/results/delta_push_shm_h200_stages_76e65fb
# .txt), the sender's kernels ran ~54 ms besides the 32 ms copy to the host: nonzero_static 21.5 ms (0.67 ms a
# 512 MB bucket, where reading its 256 MB mask takes ~0.07 ms), then per chunk the values' gather (5.9 ms), the
# reference's scatter (7.5 ms), the indices made relative (sub, 3.9 ms) and the gaps' passes; and the sender's
# thread spent 97 ms launching ~70 operations a bucket. Here a bucket's listing is three passes that read its
# mask (``list_span``: each block of BLOCK mask bytes counted; an exclusive cumsum of the counts gives each
# block's first place; each block writes its entries' indices there, ranked by a cumsum within the block; the
# cuts at the chunks' starts are the same sums). All of a bucket's GAPS payloads are written by one kernel
# (``write_gaps``): per entry its gap from the entry before it in its chunk, its value, and the reference's
# element, from a table of each chunk's addresses (made on the host once the modes are chosen, crossing with
# the launch). The receiver's ``GapsApply`` sums each block's gaps (the running sum is the index), checks on the
# device that every payload's last index fits its destination, and one kernel writes the values, none of them
# unless all fit; the caller either reads the check back first (one sync) or leaves it for ``settle`` (raysync.
# core.delta: the bucket then waits only for its copy in). Alone each kernel is about as fast as the torch
# operations it replaces (benchmarks/bench_delta_kernels.py); what they spare is launches (one a bucket, not
# several a chunk) and host syncs: on the H200 a 7B delta at 5% went from 106 to 64 ms (docs/benchmarks.md,
# section 12b). What a payload holds, and what a destination ends with, is what torch's path gives
# (tests/test_delta_kernels.py compares them byte for byte, on a GPU and in Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # Triton ships with torch's CUDA builds; the CPU build and a GPU without it use torch's kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096  # mask bytes a listing block reads
WRITE_BLOCK = 1024  # entries a write block takes
ROW_WORDS = 7  # a write table's row: first entry, entries, chunk start, new, reference, gaps, values


def available(device: torch.device | None) -> bool:
    """Whether a bucket on ``device`` is listed and written by these kernels."""
    return (
        triton is not None
        and device is not None
        and device.type == "cuda"
        and os.environ.get("RAYSYNC_DELTA_KERNELS", "1") != "0"
    )


if triton is not None:
    # the sizes are not specialized on (Triton compiles a variant per divisibility of each int argument):
    # the kernels ``warm`` compiles at set-up are those every bucket launches
    @triton.jit(do_not_specialize=["n"])
    def _count_blocks(mask_ptr, n, counts_ptr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = tl.load(mask_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        tl.store(counts_ptr + b, tl.sum(m, axis=0).to(tl.int64))

    @triton.jit(do_not_specialize=["n", "cap"])
    def _list_blocks(mask_ptr, n, before_ptr, out_ptr, cap, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = tl.load(mask_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        place = tl.load(before_ptr + b) + (tl.cumsum(m, axis=0) - m).to(tl.int64)
        tl.store(out_ptr + place, offs, mask=(m != 0) & (place < cap))

    @triton.jit
    def _cut_at(mask_ptr, starts_ptr, before_ptr, cuts_ptr, BLOCK: tl.constexpr):
        j = tl.program_id(0)
        start = tl.load(starts_ptr + j)
        b = start // BLOCK
        offs = b * BLOCK + tl.arange(0, BLOCK)
        m = tl.load(mask_ptr + offs, mask=offs < start, other=0).to(tl.int32)
        tl.store(cuts_ptr + j, tl.load(before_ptr + b) + tl.sum(m, axis=0).to(tl.int64))

    # the write and decode kernels run one program per (row, block of entries), flat: program p is row
    # p // blocks, block p % blocks (a grid's second dimension holds at most 65535, rows can be more)
    @triton.jit(do_not_specialize=["blocks"])
    def _write_gaps(
        entries_ptr, table_ptr, blocks, WORD: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr
    ):
        p = tl.program_id(0).to(tl.int64)
        row = table_ptr + (p // blocks) * 7
        first, count, start = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        k = (p % blocks) * BLOCK + tl.arange(0, BLOCK)
        live = k < count
        at = tl.load(entries_ptr + first + k, mask=live, other=0) - start
        before = tl.load(entries_ptr + first + k - 1, mask=live & (k > 0), other=start - 1) - start
        gaps = tl.load(row + 5).to(tl.pointer_type(tl.int16))
        tl.store(gaps + k, (at - before - 1 - 32768).to(tl.int16), mask=live)
        new = tl.load(row + 3).to(tl.pointer_type(WORD))
        value = tl.load(new + at, mask=live)
        values = tl.load(row + 6).to(tl.pointer_type(WORD))
        tl.store(values + k, value, mask=live)
        if ADVANCE:
            reference = tl.load(row + 4).to(tl.pointer_type(WORD))
            tl.store(reference + at, value, mask=live)

    @triton.jit(do_not_specialize=["blocks"])
    def _gap_sums(table_ptr, sums_ptr, blocks, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        r, b = p // blocks, p % blocks
        row = table_ptr + r * 5
        k = b * BLOCK + tl.arange(0, BLOCK)
        live = k < tl.load(row)
        gaps = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        step = tl.where(live, tl.load(gaps + k, mask=live, other=0).to(tl.int64) + 32769, 0)
        tl.store(sums_ptr + r * blocks + b, tl.sum(step, axis=0))

    @triton.jit(do_not_specialize=["blocks"])
    def _apply_gaps(table_ptr, ends_ptr, fits_ptr, blocks, WORD: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        r, b = p // blocks, p % blocks
        row = table_ptr + r * 5
        k = b * BLOCK + tl.arange(0, BLOCK)
        count = tl.where(tl.load(fits_ptr) != 0, tl.load(row), 0)  # no row is written unless all of them fit
        live = k < count
        gaps = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        step = tl.where(live, tl.load(gaps + k, mask=live, other=0).to(tl.int64) + 32769, 0)
        before = tl.load(ends_ptr + r * blocks + b - 1, mask=b > 0, other=0)
        at = before + tl.cumsum(step, axis=0) - 1
        values = tl.load(row + 2).to(tl.pointer_type(WORD))
        dest = tl.load(row + 3).to(tl.pointer_type(WORD))
        tl.store(dest + at, tl.load(values + k, mask=live), mask=live)

    _WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def warm(device: torch.device, itemsizes, encode: bool = True) -> None:
    """Compile the kernels a delta push on ``device`` launches (or load them from Triton's cache), for words
    of ``itemsizes`` bytes: the encoder's (``encode``) or the decoder's. At set-up, not in the first delta
    push (on an H200 the first listed push took 1.5 s, compiling, where the next took 0.1 s; and the time rule
    would measure it): once per process."""
    key = (device, frozenset(itemsizes), encode)
    if not available(device) or key in _warm:
        return
    if encode:
        span = torch.zeros(BLOCK + 1, dtype=torch.bool, device=device)
        span[[0, BLOCK]] = True
        index, _ = list_span(span, 4, torch.tensor([0, BLOCK + 1], dtype=torch.int64, device=device))
    for itemsize in sorted(set(itemsizes)):
        new, reference, gaps, values = torch.zeros(4, BLOCK + 1, dtype=_DTYPES[itemsize], device=device)
        if encode:
            row = [0, 2, 0, new.data_ptr(), reference.data_ptr(), gaps.data_ptr(), values.data_ptr()]
            write_gaps(index, [row], itemsize, advance=True)
        else:
            apply = GapsApply([(1, gaps.data_ptr(), values.data_ptr(), new)])
            apply.ends()
            apply.run()
    if device.type == "cuda":  # (Triton's interpreter runs them on the CPU)
        torch.cuda.synchronize(device)
    _warm.add(key)


_warm: set = set()


def list_span(
    span: torch.Tensor, cap: int, starts: torch.Tensor, block: int = BLOCK, warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """The increasing indices of ``span``'s True elements (a 1-d bool tensor), the first ``cap`` of them in
    an int64 tensor of ``cap`` (what lies past the count is undefined), and per element of ``starts`` (int64,
    increasing, at most the span's size) how many entries lie before it: cut at the span's end, the count.
    No host sync (Note [fused delta kernels])."""
    n, device = span.numel(), span.device
    blocks = max(1, triton.cdiv(n, block))
    bits = span.view(torch.uint8)
    counts = torch.empty(blocks, dtype=torch.int64, device=device)
    before = torch.zeros(blocks + 1, dtype=torch.int64, device=device)
    index = torch.empty(cap, dtype=torch.int64, device=device)
    cuts = torch.empty(starts.numel(), dtype=torch.int64, device=device)
    with _on(device):
        _count_blocks[(blocks,)](bits, n, counts, BLOCK=block)
        torch.cumsum(counts, 0, out=before[1:])
        _list_blocks[(blocks,)](bits, n, before, index, cap, BLOCK=block, num_warps=warps)
        _cut_at[(starts.numel(),)](bits, starts, before, cuts, BLOCK=block)
    return index, cuts


def write_listed(views, payloads, entries, advance: bool) -> None:
    """Every GAPS payload of a listed bucket: per chunk its (reference, new) word views and its payload's
    (entries, address of its gaps, of its values) on the chunks' device, or None for a chunk that goes
    another way; ``entries``: the bucket's listing (raysync.core.delta_changes.Entries), one range per
    chunk with a reference. One launch per word size."""
    rows: dict[int, list[list[int]]] = {}
    based = 0
    for (old, new), payload in zip(views, payloads, strict=True):
        if old is None:
            continue
        if payload is not None:
            count, gaps, values = payload
            first, start = entries.cut[based], entries.starts[based]
            assert entries.cut[based + 1] - first == count, "a chunk's entries are not its listing's"
            row = [first, count, start, new.data_ptr(), old.data_ptr(), gaps, values]
            rows.setdefault(new.element_size(), []).append(row)
        based += 1
    for itemsize, same in rows.items():
        write_gaps(entries.index, same, itemsize, advance)


def write_gaps(entries: torch.Tensor, rows: list[list[int]], itemsize: int, advance: bool) -> None:
    """Write GAPS payloads, one per row of ``rows``: [first entry in ``entries``, entries, the chunk's first
    index in the span, address of its new values, of its reference, of the payload's gaps, of its values]
    (addresses on ``entries``' device; words of ``itemsize`` bytes): each entry's gap as the payload stores it
    (raysync.core.delta, Note [delta pushes]), its new value, and with ``advance`` the reference's element
    set to it. One launch for all the rows."""
    if not rows:
        return
    table = _to_device(rows, entries.device)
    most = max(r[1] for r in rows)
    blocks = max(1, triton.cdiv(most, WRITE_BLOCK))
    with _on(entries.device):
        _write_gaps[(blocks * len(rows),)](
            entries, table, blocks, WORD=_WORDS[itemsize], ADVANCE=advance, BLOCK=WRITE_BLOCK
        )


class GapsApply:
    """GAPS payloads decoded on a CUDA device (the receiver's half, raysync.core.delta.decode): per payload
    (entries, address of its gaps, of its values, its destination, all on one device). Made: each block of
    entries' index sum queued, and from them on the device each payload's last index + 1 (``lasts``) and
    whether every one fits its destination (gaps are at least 1: the indices increase strictly, the last is
    the largest). ``run``: every destination's elements written, one launch per word size, and nothing at all
    unless every payload fits; ``ends`` (one host sync) says whether they did."""

    def __init__(self, payloads: list[tuple[int, int, int, torch.Tensor]]):
        by_size: dict[int, list[int]] = {}
        for i, (_, _, _, dest) in enumerate(payloads):
            by_size.setdefault(dest.element_size(), []).append(i)
        self.groups, self.order = [], [i for same in by_size.values() for i in same]
        for itemsize, same in by_size.items():
            rows = [[e, gaps, values, dest.data_ptr(), dest.numel()] for e, gaps, values, dest in payloads]
            rows = [rows[i] for i in same]
            device = payloads[same[0]][3].device
            table = _to_device(rows, device)
            blocks = max(1, triton.cdiv(max(r[0] for r in rows), WRITE_BLOCK))
            sums = torch.empty(len(rows), blocks, dtype=torch.int64, device=device)
            with _on(device):
                _gap_sums[(blocks * len(rows),)](table, sums, blocks, BLOCK=WRITE_BLOCK)
            self.groups.append((itemsize, table, sums.cumsum_(1), blocks, len(rows)))
        self.lasts = torch.cat([ends[:, -1] for _, _, ends, _, _ in self.groups])  # in ``order``
        numels = torch.cat([table[:, 4] for _, table, _, _, _ in self.groups])
        self.fits = (self.lasts <= numels).all().view(torch.uint8)

    def ends(self, crossed: list[int] | None = None) -> list[int]:
        """Per payload, in the order given: its last index + 1 (0 without entries); ``crossed``: ``lasts``,
        on the host already."""
        crossed = self.lasts.tolist() if crossed is None else crossed
        out = [0] * len(crossed)
        for i, end in zip(self.order, crossed, strict=True):
            out[i] = end
        return out

    def run(self) -> None:
        for itemsize, table, ends, blocks, rows in self.groups:
            with _on(table.device):
                grid = (blocks * rows,)
                _apply_gaps[grid](table, ends, self.fits, blocks, WORD=_WORDS[itemsize], BLOCK=WRITE_BLOCK)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: that of the tensors (Triton's interpreter: the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 table, crossing with the launches (from pinned memory, which torch keeps until the copy ran)."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
