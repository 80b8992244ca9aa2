"""Triton kernels for a delta on a CUDA device, the sender's: the compare, counts and GAPS payloads of a bucket
(raysync.core.delta_changes counts with them, raysync.core.delta_encode writes with them; the receiver's
decoding is raysync.core.delta_decode_kernels). Used when Triton imports (torch's CUDA builds bring it); without
it, or with RAYSYNC_DELTA_KERNELS=0, the same work runs as torch's kernels, bit for bit the same.

    warm(device, itemsizes)                           # at set-up: compiled, not in the first delta push
    counted = count_blocks(pairs, mask_words(slab, blocks), blocks)  # compare into a bitmask, count by block
    write_counted(pairs, payloads, counted, advance)  # (counts on the host) the GAPS payloads, references advanced

# Note [fused delta kernels]
# Profiled on an H200 (a 7B delta push over shm at 5.7% changed, docs/results/delta_push_shm_h200_stages_76e65fb
# .txt), the sender's kernels ran ~54 ms besides the 32 ms copy to the host: nonzero_static 21.5 ms (0.67 ms a
# 512 MB bucket, where reading its 256 MB mask takes ~0.07 ms), then per chunk the values' gather (5.9 ms), the
# reference's scatter (7.5 ms), the indices made relative (sub, 3.9 ms) and the gaps' passes; and the sender's
# thread spent 97 ms launching ~70 operations a bucket. Here a bucket's chunks (those with a reference) lie in
# its mask in whole blocks of BLOCK elements (``Blocks``), so that every block belongs to one chunk:
# * ``count_blocks``: one pass over the chunks (one launch per kind of chunk: Note [one compare launch a
#   bucket]) reads their reference and new words, writes the bitmask of entries (changed elements, and the
#   forced ones at index 65535 mod 65536: Note [delta pushes]) and per block how many entries it holds and how
#   many forced entries did not change; a running sum of those gives each block's first entry and each chunk's
#   counts (they cross to the host behind an event: the bucket's one sync). It reads what torch's ne reads.
# * ``write_counted``, once the modes are chosen on the host: the GAPS chunks' blocks list their entries' mask
#   positions (Note [the listing by rows]), then one kernel per word size writes every GAPS payload
#   (``write_gaps``): per entry its gap from the entry before it in its chunk and its value, from a table of
#   each chunk's addresses (made on the host, crossing with the launch). Listing after the counts are known
#   needs no cap and no second try for a dense bucket. (Writing the payloads straight from the mask, one
#   program per block of elements, took 2.1-3.4 ms a bucket against ~0.7 for listing and then writing per
#   entry: every lane issues the gathers and scatters; docs/benchmarks.md section 12a.)
#
# Note [the reference advances at the compare]
# The reference must end a bucket holding what its receivers will (Note [the reference advances by the
# encoding] in raysync.core.delta_encode). Scattering the GAPS values into it after the write cost 0.22 ms of
# the write's 0.36 ms on a 512 MB bf16 bucket at 5% on an H200: a store per entry into sectors that no load
# had brought into the cache. So a push's compare (``advance``) stores the new words that differ into the
# reference as it reads them (0.12 ms more than the compare), and the write reads the values from the
# reference: what is sent is what the reference took, even if the tensors change after the compare (read in
# place). A FULL chunk's bytes still overwrite it; a SAME chunk had nothing to take. A compare that advanced
# must be followed by its encoding or by the push's failure (the reference is then no version): the sender
# never compares such a bucket again within the push (raysync.core.delta_push, ``find_ahead``).
# The receiver's ``GapsApply`` (raysync.core.delta_decode_kernels) sums each block's gaps (the running sum is
# the index), checks on the device that every payload's last index fits its destination, and one kernel writes
# the values, none of them unless all fit (the check read back first, or left for ``settle``). What they spare
# is passes over the bucket, launches and host syncs (a 7B delta at 5% on an H200: 106 -> 64 ms with the first
# kernels, docs/benchmarks.md 12c). Payloads and destinations are torch's path's, byte for byte
# (tests/test_delta_kernels.py, on a GPU and in Triton's interpreter).
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

from raysync.core.delta_blocks import BLOCK, Blocks, Counted, mask_words

WRITE_BLOCK = 1024  # entries a write or decode block takes


def available(device: torch.device | None) -> bool:
    """Whether a bucket on ``device`` is compared, counted, listed and written by these kernels."""
    return (
        triton is not None
        and device is not None
        and device.type == "cuda"
        and os.environ.get("RAYSYNC_DELTA_KERNELS", "1") != "0"
    )


if triton is not None:
    # the sizes are not specialized on (Triton compiles a variant per divisibility of each int argument):
    # the kernels ``warm`` compiles at set-up are those every bucket launches
    # A chunk's full blocks load without a mask: a mask on a length Triton is not told divides 16 (``n`` is not
    # specialized on) keeps it from loading in vectors, which made the compare 1.05 ms on a 512 MB bf16 bucket
    # on an H200, where torch's ne takes 0.35 ms; this way it takes 0.37 ms, its counts included.
    # Note [one compare launch a bucket]: the chunks' addresses come from a table, one program per block of
    # the bucket (``chunk_of`` says whose), so a bucket is one launch per kind of chunk (word size, and whether
    # its new words start at 16 bytes) instead of one a chunk (a 7B delta push at 5.0% on an H200: 52.9-53.0
    # ms against 59.8 ms; docs/benchmarks.md, section 12, stop 39). A pointer read from memory is of unknown
    # alignment, so Triton would load scalars; ``tl.multiple_of`` on it promises 16 bytes where the host
    # checked both chunks' (a reference chunk starts there: PAYLOAD_ALIGN; a tensor read in place may not).
    @triton.jit(do_not_specialize=["columns", "kind"])
    def _compare_chunks(
        table_ptr,
        chunk_of_ptr,
        mask_ptr,
        sums_ptr,
        columns,
        kind,
        WORD: tl.constexpr,
        ALIGNED: tl.constexpr,
        BLOCK: tl.constexpr,
        ADVANCE: tl.constexpr,
    ):
        g = tl.program_id(0).to(tl.int64)  # the block, in the bucket's mask
        if g == 0:  # column 0 of the sums, before all: a reused buffer's (only differences of the sums are
            # read, but what a buffer held before could make them overflow)
            tl.store(sums_ptr, 0)
            tl.store(sums_ptr + columns, 0)
        row = table_ptr + tl.load(chunk_of_ptr + g).to(tl.int64) * 5  # old, new, n, first block, kind
        if tl.load(row + 4) == kind:  # the chunks of another kind are another launch's
            old_ptr = tl.load(row).to(tl.pointer_type(WORD))
            new_ptr = tl.load(row + 1).to(tl.pointer_type(WORD))
            if ALIGNED:
                old_ptr = tl.multiple_of(old_ptr, 16)
                new_ptr = tl.multiple_of(new_ptr, 16)
            n = tl.load(row + 2)
            b = g - tl.load(row + 3)  # the block's place in its chunk
            # the block as rows of 32 elements: each row's entries become one word of the bitmask
            k = tl.arange(0, BLOCK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
            base = b * BLOCK
            if base + BLOCK <= n:
                fresh = tl.load(new_ptr + base + k)
                changed = tl.load(old_ptr + base + k) != fresh
                live = k >= 0
            else:
                live = k < n - base
                fresh = tl.load(new_ptr + base + k, mask=live, other=0)
                changed = tl.load(old_ptr + base + k, mask=live, other=0) != fresh
            if ADVANCE:  # Note [the reference advances at the compare]
                tl.store(old_ptr + base + k, fresh, mask=changed)
            # Note [delta pushes]: every index 65535 mod 65536 of a chunk is an entry; BLOCK divides 65536, so
            # it is the last element of every (65536 / BLOCK)-th block
            spans = 65536 // BLOCK
            forced = live & (k == BLOCK - 1) & (b % spans == spans - 1)
            entry = changed | forced
            words = tl.sum(entry.to(tl.uint32) << tl.arange(0, 32)[None, :].to(tl.uint32), axis=1)
            at = mask_ptr + g * (BLOCK // 32)  # the padding past the chunk's end: no entry
            tl.store(at + tl.arange(0, BLOCK // 32), words.to(tl.int32, bitcast=True))
            unchanged = forced & ~changed
            tl.store(sums_ptr + g + 1, tl.sum(tl.sum(entry.to(tl.int32), axis=1), axis=0).to(tl.int64))
            tl.store(
                sums_ptr + columns + g + 1,
                tl.sum(tl.sum(unchanged.to(tl.int32), axis=1), axis=0).to(tl.int64),
            )

    # Note [the listing by rows]: a block's mask is read as its BLOCK / 32 words, each a row of 32 bits; an
    # entry's rank in its block is the entries of the rows before its own (a scan of the rows' sums) plus those
    # before it in its row (a scan along the row). On an H200, one 512 MB bf16 bucket at 5%
    # (benchmarks/bench_delta_list_variants.py, docs/results/delta_list_variants_h200_s42_*.txt): 0.20 ms,
    # against 0.29 ms for a byte mask read as 32 rows and 0.38-0.45 ms for one scan along the block's 4096
    # bytes; and the compare writes 1/8 of the bytes. The positions are the same, in the same places.
    @triton.jit
    def _list_blocks(mask_ptr, sums_ptr, chunk_of_ptr, table_ptr, index_ptr, BLOCK: tl.constexpr):
        g = tl.program_id(0).to(tl.int64)
        row = table_ptr + tl.load(chunk_of_ptr + g).to(tl.int64) * 2
        if tl.load(row) != 0:  # the block's chunk goes GAPS: its entries are listed
            words = tl.load(mask_ptr + g * (BLOCK // 32) + tl.arange(0, BLOCK // 32)).to(
                tl.uint32, bitcast=True
            )
            m = ((words[:, None] >> tl.arange(0, 32)[None, :].to(tl.uint32)) & 1).to(tl.int32)
            k = tl.arange(0, BLOCK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
            per_row = tl.sum(m, axis=1)
            rank = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(m, axis=1) - m
            place = tl.load(sums_ptr + g) + tl.load(row + 1)  # the block's first entry's place in the listing
            tl.store(index_ptr + place + rank, g * BLOCK + k, mask=m != 0)

    # the write and decode kernels run one program per (row, block of entries), flat: program p is row
    # p // blocks, block p % blocks (a grid's second dimension holds at most 65535, rows can be more)
    @triton.jit(do_not_specialize=["blocks"])
    def _write_gaps(
        entries_ptr, table_ptr, blocks, WORD: tl.constexpr, ADVANCE: tl.constexpr, BLOCK: tl.constexpr
    ):
        p = tl.program_id(0).to(tl.int64)
        row = table_ptr + (p // blocks) * 8  # 7 words and one of padding
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

    TL_INTS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}  # word size -> Triton's int
INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # ... and torch's


def warm(device: torch.device, itemsizes) -> None:
    """Compile the encoder's kernels a delta push on ``device`` launches (or load them from Triton's cache), for
    words of ``itemsizes`` bytes (the decoder's: raysync.core.delta_decode_kernels.warm). At set-up, not in the
    first delta push (on an H200 the first listed push took 1.5 s, compiling, where the next took 0.1 s; and the
    time rule would measure it): once per process. The compare is compiled for chunks at a 16-byte boundary and
    off one (Note [one compare launch a bucket]): a reference chunk starts at 16 bytes at least (PAYLOAD_ALIGN),
    a chunk of a trainer's tensor read in place anywhere."""
    key = (device, frozenset(itemsizes))
    if not available(device) or key in _warm:
        return
    for itemsize in sorted(set(itemsizes)):
        new, reference, payload = torch.zeros(3, 2 * BLOCK + 16, dtype=INTS[itemsize], device=device)
        for skew in (0, 1):  # the reference is aligned; a tensor read in place may start anywhere
            pairs = [(reference[: BLOCK + 1], new[skew : skew + BLOCK + 1])]
            blocks = Blocks.of([BLOCK + 1], device)
            slab = torch.empty(blocks.elements, dtype=torch.uint8, device=device)
            for advance in (False, True):  # a push's compare advances the reference (Note [the ...compare])
                counted = count_blocks(pairs, mask_words(slab, blocks), blocks, advance=advance)
                row = [(counted.entries(0), payload.data_ptr(), payload[BLOCK:].data_ptr())]
                write_counted(pairs, row, counted, advance=True)
    if device.type == "cuda":  # (Triton's interpreter runs them on the CPU)
        torch.cuda.synchronize(device)
    _warm.add(key)


_warm: set = set()


def count_blocks(
    pairs, mask: torch.Tensor, blocks: Blocks, sums: torch.Tensor | None = None, advance: bool = False
) -> Counted:
    """Compare each (reference, new) word pair (the chunks with a reference, in ``blocks``' order) into the
    bitmask ``mask`` (``mask_words``) and count its entries by block: one pass over the chunks, a launch
    per kind of chunk (Note [one compare launch a bucket]), then the blocks' running sums, into ``sums`` (int64
    [2, blocks + 1] on the device: a workspace's, reused) or a new tensor. No host sync (Note [fused delta
    kernels]). ``advance``: each reference takes the new words that differ from it, in the same pass (Note [the
    reference advances at the compare])."""
    device = mask.device
    columns = blocks.firsts[-1] + 1
    if sums is None:
        sums = torch.empty(2, columns, dtype=torch.int64, device=device)
    table, kinds = _compare_table(pairs, blocks, device)
    if not kinds:  # no launch writes the sums' first column
        sums.zero_()
    else:
        with on(device):
            for kind, (itemsize, aligned) in enumerate(kinds):
                _compare_chunks[(blocks.firsts[-1],)](
                    table,
                    blocks.chunk_of,
                    mask,
                    sums,
                    columns,
                    kind,
                    WORD=TL_INTS[itemsize],
                    ALIGNED=aligned,
                    BLOCK=BLOCK,
                    ADVANCE=advance,
                )
    # one running sum over both rows, flat: row 1's sums then carry row 0's total, which its differences (the
    # forced ones per chunk) drop; a scan along rows of 2 x 65537 took 0.11 ms a 512 MB bucket on an H200
    sums.view(-1).cumsum_(0)
    return Counted(mask, blocks, sums, advanced=advance)


def _compare_table(pairs, blocks: Blocks, device: torch.device) -> tuple[torch.Tensor | None, list]:
    """The compare's table on ``device``, a row per chunk: (reference's address, new words' address, elements,
    first block, kind), and the kinds, (word size, both chunks at 16 bytes) each. A bucket's tables are made once
    and kept (``_TABLES``): a bucket compares the same tensors every push, and a table holds nothing but where
    they are, so a table found under the same rows is that table."""
    rows, kinds = [], []
    for (old, new), first in zip(pairs, blocks.firsts, strict=False):
        kind = (new.element_size(), old.data_ptr() % 16 == 0 and new.data_ptr() % 16 == 0)
        if kind not in kinds:
            kinds.append(kind)
        rows.append((old.data_ptr(), new.data_ptr(), new.numel(), first, kinds.index(kind)))
    if not rows:
        return None, kinds
    key = (device, tuple(rows))
    table = _TABLES.pop(key, None)
    if table is None:
        table = to_device([list(r) for r in rows], device)
    _TABLES[key] = table  # the most recent last
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.pop(next(iter(_TABLES)))
    return table, kinds


_TABLES: dict = {}  # _compare_table's, the most recently used last
_TABLES_KEPT = 512  # a 7B layout's buckets are 32, each compared in one of two slots


def write_counted(pairs, payloads, counted: Counted, advance: bool, upload=None) -> None:
    """Every GAPS payload of a counted bucket: per chunk with a reference (``counted``'s order) its (reference,
    new) word views and its payload's (entries, address of its gaps, of its values) on the chunks' device, or
    None for a chunk that goes another way. The GAPS chunks' entries are listed from the mask (their mask
    positions, increasing, one launch), then each entry's gap, value and, with ``advance``, the reference's
    element set to it are written (one launch per word size); a bucket whose compare advanced the references
    has its values read from them (what the compare found) and nothing scattered (Note [the reference advances
    at the compare]). ``upload(words, device)``: how the table reaches the device (a workspace's kept buffers:
    raysync.core.delta_workspace.HostWords), else ``to_device``."""
    assert advance or not counted.advanced, "the compare advanced the references: the encoding must"
    firsts, cut, device = counted.blocks.firsts, counted.cut, counted.mask.device
    listed, rows, at = [[0, 0] for _ in pairs], {}, 0
    for j, ((old, new), payload) in enumerate(zip(pairs, payloads, strict=True)):
        if payload is None:
            continue
        count, gaps, values = payload
        assert cut[j + 1] - cut[j] == count, "a chunk's entries are not its count's"
        listed[j] = [1, at - cut[j]]
        source = old if counted.advanced else new  # the values: what the compare found
        row = [at, count, firsts[j] * BLOCK, source.data_ptr(), old.data_ptr(), gaps, values, 0]
        rows.setdefault(new.element_size(), []).append(row)
        at += count
    if not rows:
        return
    # mask positions: int32 while they fit (half the bytes for the write to read, and at most 4 bytes an entry,
    # where a GAPS chunk of bf16 can hold up to half its elements as entries: up to the bucket's bytes)
    wide = counted.blocks.elements > 2**31 - 1
    index = torch.empty(at, dtype=torch.int64 if wide else torch.int32, device=device)
    # the listing's table and every write's rows cross in one copy: [flag, offset] per chunk, then 8 words a row
    # (64 bytes: each launch's rows start at 16 bytes, as ``warm`` compiled it)
    groups = list(rows.items())
    words = [w for pair in listed for w in pair] + [w for _, same in groups for r in same for w in r]
    table = to_device(words, device) if upload is None else upload(words, device)
    with on(device):
        _list_blocks[(firsts[-1],)](
            counted.mask,
            counted.sums,
            counted.blocks.chunk_of,
            table,
            index,
            BLOCK=BLOCK,
        )
    at = 2 * len(listed)
    for itemsize, same in groups:
        scatter = advance and not counted.advanced
        write_gaps(index, table[at : at + 8 * len(same)], max(r[1] for r in same), itemsize, scatter)
        at += 8 * len(same)


def write_gaps(entries: torch.Tensor, table: torch.Tensor, most: int, itemsize: int, advance: bool) -> None:
    """Write GAPS payloads, one per row of ``table`` (int64 on ``entries``' device, 8 words a row: first entry
    in ``entries``, entries, the chunk's first index in the span, address of its new values, of its reference,
    of the payload's gaps, of its values, padding; words of ``itemsize`` bytes; ``most``: the most entries of a row):
    each entry's gap as the payload stores it (raysync.core.delta, Note [delta pushes]), its new value, and
    with ``advance`` the reference's element set to it. One launch for all the rows."""
    blocks = max(1, triton.cdiv(most, WRITE_BLOCK))
    with on(entries.device):
        _write_gaps[(blocks * (table.numel() // 8),)](
            entries, table, blocks, WORD=TL_INTS[itemsize], ADVANCE=advance, BLOCK=WRITE_BLOCK
        )


def on(device: torch.device):
    """Triton launches on the current CUDA device: that of the tensors (Triton's interpreter: the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 table, crossing with the launches (from pinned memory, which torch keeps until the copy ran)."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
