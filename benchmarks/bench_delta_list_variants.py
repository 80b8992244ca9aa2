"""Benchmark: variants of the sender's listing (raysync.core.delta_kernels._list_blocks: a GAPS chunk's entries'
mask positions, placed by the blocks' running sums) and of the mask it reads, on one 512 MB bf16 bucket at 5%
changed, on a CUDA device, to choose between them.

    python benchmarks/bench_delta_list_variants.py

In a profiled 7B delta push at 4.96% (docs/results/delta_trace_h200_s41_09226c2.txt) the sender's kernels took
~0.95 ms a bucket: compare 0.28, listing 0.37, write 0.31; the listing reads 240 MB of mask and writes ~48 MB
of positions, far under what the GPU's memory moves in 0.37 ms. Rows (medians of 20 runs, ms; each variant's
positions are checked against the kernel's):

    kernel warps=W       the listing as it is (Note [the listing by rows]: from the bitmask), W warps a program
    one scan warps=W     the listing of stop 41: a byte mask, one scan along the block's 4096 elements
    rows R warps=W       a block's byte mask as R rows: each row's entries summed, a scan of the R sums, a scan along
                         each row (shorter scans than one of 4096)
    rows R i32           the same, the positions and offsets computed in 32 bits
    bits: compare        a compare that writes a bitmask (one bit an element), without counts
    write advance=A      the GAPS write as it is (delta_kernels.write_gaps), with and without the reference's
                         scatter (ADVANCE)
    copy, then compare (+ advance)  after a copy of the old words into the reference, a compare of one aligned chunk into the byte mask, without counts, and the same with
                         the reference taking the new words where they differ (a store the compare's own loads
                         brought into the cache, where the write's scatter stores far from any load)
    only the scan        (diagnostic) the scan of a block's mask, nothing stored but its total
    only the store       (diagnostic) the positions stored without the scan (not compacted)
"""

import json

import torch
import triton
import triton.language as tl
from common import counted_bucket, timed_cuda

from raysync.core import delta_blocks, delta_kernels

BLOCK = delta_blocks.BLOCK


@triton.jit
def list_rows(mask_ptr, sums_ptr, index_ptr, BLOCK: tl.constexpr, ROWS: tl.constexpr, I32: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    WIDTH: tl.constexpr = BLOCK // ROWS
    k = tl.arange(0, ROWS)[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
    m = tl.load(mask_ptr + g * BLOCK + k).to(tl.int32)
    per_row = tl.sum(m, axis=1)
    rank = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(m, axis=1) - m
    if I32:
        out = index_ptr + tl.load(sums_ptr + g)
        tl.store(out + rank, (g * BLOCK).to(tl.int32) + k, mask=m != 0)
    else:
        tl.store(index_ptr + tl.load(sums_ptr + g) + rank, g * BLOCK + k, mask=m != 0)


@triton.jit
def list_one_scan(mask_ptr, sums_ptr, index_ptr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    m = tl.load(mask_ptr + g * BLOCK + k).to(tl.int32)
    tl.store(index_ptr + tl.load(sums_ptr + g) + (tl.cumsum(m, axis=0) - m), g * BLOCK + k, mask=m != 0)


@triton.jit
def compare_bits(old_ptr, new_ptr, bits_ptr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    changed = tl.load(old_ptr + g * BLOCK + k) != tl.load(new_ptr + g * BLOCK + k)
    words = tl.sum(changed.to(tl.uint32) << tl.arange(0, 32)[None, :].to(tl.uint32), axis=1)
    tl.store(bits_ptr + g * (BLOCK // 32) + tl.arange(0, BLOCK // 32), words.to(tl.int32, bitcast=True))


@triton.jit
def compare_plain(old_ptr, new_ptr, mask_ptr, BLOCK: tl.constexpr, ADVANCE: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    old = tl.load(tl.multiple_of(old_ptr, 16) + g * BLOCK + k)
    new = tl.load(tl.multiple_of(new_ptr, 16) + g * BLOCK + k)
    changed = old != new
    tl.store(mask_ptr + g * BLOCK + k, changed.to(tl.uint8))
    if ADVANCE:
        tl.store(old_ptr + g * BLOCK + k, new, mask=changed)


@triton.jit
def scan_only(mask_ptr, out_ptr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    m = tl.load(mask_ptr + g * BLOCK + tl.arange(0, BLOCK)).to(tl.int32)
    tl.store(out_ptr + g, tl.max(tl.cumsum(m, axis=0) - m, axis=0))


@triton.jit
def store_only(mask_ptr, index_ptr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    m = tl.load(mask_ptr + g * BLOCK + k)
    tl.store(index_ptr + g * BLOCK + k, (g * BLOCK).to(tl.int32) + k, mask=m != 0)


def main():
    dev = torch.device("cuda")
    n = 256 << 20
    old, new, layout, slab, counted = counted_bucket(n)
    blocks, words = n // BLOCK, counted.mask  # the kernels' bitmask
    sums, entries = counted.sums, int(counted.sums[0, -1])
    # the same entries as a byte mask (one byte an element), which the variants before the bitmask read
    mask = (
        ((words.view(-1, 1) >> torch.arange(32, device=dev, dtype=torch.int32)) & 1).to(torch.uint8).view(-1)
    )
    table = torch.tensor([1, 0], dtype=torch.int64, device=dev)
    want = torch.empty(entries, dtype=torch.int32, device=dev)
    got = torch.empty(n, dtype=torch.int32, device=dev)
    res = {}

    def kernel(w, out):
        delta_kernels._list_blocks[(blocks,)](
            words, sums, layout.chunk_of, table, out, BLOCK=BLOCK, num_warps=w
        )

    kernel(4, want)
    expect = old != new
    expect[65535::65536] = True  # Note [delta pushes]: the forced entries
    if not torch.equal(want.long(), expect.nonzero().view(-1)):
        raise SystemExit("the kernels' positions are not the changed and forced elements")
    res["compare (count_blocks, as it is: the bitmask)"] = timed_cuda(
        lambda: delta_kernels.count_blocks([(old, new)], words, layout, sums), 20
    )
    bad = []
    for w in (2, 4, 8, 16):
        res[f"kernel warps={w}"] = timed_cuda(lambda w=w: kernel(w, got), 20)
        got.zero_()
        list_one_scan[(blocks,)](mask, sums, got, BLOCK=BLOCK, num_warps=w)
        if not torch.equal(got[:entries], want):
            bad.append(f"one scan warps={w}")
        res[f"one scan warps={w}"] = timed_cuda(
            lambda w=w: list_one_scan[(blocks,)](mask, sums, got, BLOCK=BLOCK, num_warps=w), 20
        )
    for rows in (8, 16, 32, 64):
        for i32 in (0, 1):
            for w in (4, 8):
                name = f"rows {rows}{' i32' if i32 else ''} warps={w}"

                def fn(r=rows, i=i32, w=w):
                    list_rows[(blocks,)](mask, sums, got, BLOCK=BLOCK, ROWS=r, I32=i, num_warps=w)

                got.zero_()
                fn()
                if not torch.equal(got[:entries], want):
                    bad.append(name)
                res[name] = timed_cuda(fn, 20)
    bits = torch.empty(n // 32, dtype=torch.int32, device=dev)
    for w in (4, 8):
        res[f"bits: compare warps={w}"] = timed_cuda(
            lambda w=w: compare_bits[(blocks,)](old, new, bits, BLOCK=BLOCK, num_warps=w), 20
        )
    gaps = torch.empty(entries + 8, dtype=torch.int16, device=dev)
    values = torch.empty(entries + 8, dtype=torch.int16, device=dev)
    ref = old.clone()
    row = [0, entries, 0, new.data_ptr(), ref.data_ptr(), gaps.data_ptr(), values.data_ptr(), 0]
    rows = torch.tensor(row, dtype=torch.int64, device=dev)
    for advance in (True, False):
        res[f"write advance={int(advance)}"] = timed_cuda(
            lambda a=advance: delta_kernels.write_gaps(want, rows, entries, 2, a), 20
        )
    for advance in (
        0,
        1,
    ):  # each run after a copy of the old words into the reference (its cost in both rows)
        res[f"copy, then compare{' + advance' if advance else ''}"] = timed_cuda(
            lambda a=advance: (
                ref.copy_(old),
                compare_plain[(blocks,)](ref, new, mask, BLOCK=BLOCK, ADVANCE=a),
            ),
            20,
        )
    out = torch.empty(blocks, dtype=torch.int32, device=dev)
    res["only the scan"] = timed_cuda(lambda: scan_only[(blocks,)](mask, out, BLOCK=BLOCK), 20)
    res["only the store"] = timed_cuda(lambda: store_only[(blocks,)](mask, got, BLOCK=BLOCK), 20)
    for key, v in res.items():
        print(f"{key:60s} {1e3 * v:8.3f} ms")
    print("variants whose positions differ from the kernel's:", bad or "none")
    print(json.dumps({"ms": {k: 1e3 * v for k, v in res.items()}, "differ": bad, "entries": entries}))


if __name__ == "__main__":
    main()
