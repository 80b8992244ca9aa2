"""Benchmark: variants of the sender's fused delta kernels (raysync.core.delta_kernels, Note [fused delta
kernels]) on one 512 MB bf16 bucket at 5% changed, on a CUDA device, to choose between them.

    python benchmarks/bench_delta_kernel_variants.py

Torch's ne and raysync's compare (delta_kernels.count_blocks: the mask, the counts by block and their sums;
its variants, every block's loads masked or not and 4 / 8 / 16 warps, were measured by this script as of
212fcf6, docs/results/delta_kernel_variants_h200_s36.txt). Writing the GAPS payloads straight from the mask,
one program per block of elements: with or without the scan for the entry before each (SCAN), the mask's shifted reload (SHIFT), the
values' gather and the reference's scatter (VALUES), the gaps' store (GAPS). (Without SCAN or SHIFT the gaps are
wrong: those rows only say what the parts cost.) Medians of 20 runs, ms.
"""

import json

import torch
import triton
import triton.language as tl
from common import counted_bucket, timed_cuda

from raysync.core import delta_kernels

BLOCK = 4096


@triton.jit
def _later(a, b):
    return tl.maximum(a, b)


@triton.jit
def wr_k(
    mask_ptr,
    sums_ptr,
    lasts_ptr,
    gaps_ptr,
    values_ptr,
    new_ptr,
    ref_ptr,
    BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
    SHIFT: tl.constexpr,
    VALUES: tl.constexpr,
    GAPS: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    m = tl.load(mask_ptr + g * BLOCK + k).to(tl.int32)
    entry = m != 0
    place = tl.load(sums_ptr + g)
    rank = tl.cumsum(m, axis=0) - m
    none = -(1 << 20)
    if SHIFT:
        previous = tl.load(mask_ptr + g * BLOCK + k - 1, mask=k > 0, other=0) != 0
    else:
        previous = entry
    if SCAN:
        before = tl.associative_scan(tl.where(previous, k - 1, none), 0, _later)
    else:
        before = tl.where(previous, k - 1, none)
    carry = tl.load(lasts_ptr + g) - g * BLOCK
    before = tl.maximum(before, tl.maximum(carry, none).to(tl.int32))
    if GAPS:
        tl.store(gaps_ptr + place + rank, (k - before - 1 - 32768).to(tl.int16), mask=entry)
    if VALUES:
        value = tl.load(new_ptr + g * BLOCK + k, mask=entry)
        tl.store(values_ptr + place + rank, value, mask=entry)
        tl.store(ref_ptr + g * BLOCK + k, value, mask=entry)


def main():
    dev = torch.device("cuda")
    n = 256 << 20
    old, new, layout, mask, counted = counted_bucket(n)
    blocks, words, sums = n // BLOCK, counted.mask, counted.sums
    res = {"torch ne": timed_cuda(lambda: torch.ne(old, new, out=mask.view(torch.bool)), 20)}

    def compare():  # raysync's compare, its blocks' running sums included
        delta_kernels.count_blocks([(old, new)], words, layout)

    res["raysync's compare kernel (bitmask, counts by block, running sums)"] = timed_cuda(compare, 20)
    # the variants below read a byte mask of the same entries: the changed elements and the forced ones
    torch.ne(old, new, out=mask.view(torch.bool))
    mask[65535::65536] = 1
    # the last entry before each block, for the variants below: a running maximum of each block's last
    at = torch.arange(BLOCK, device=dev).expand(blocks, BLOCK)
    last = torch.where(mask.view(blocks, BLOCK) != 0, at, -1).amax(1)
    last = torch.where(last >= 0, last + torch.arange(blocks, device=dev) * BLOCK, -1)
    lasts = torch.cummax(torch.cat([last.new_full((1,), -1), last]), 0).values
    e = int(sums[0, -1])
    gaps = torch.empty(e + 8, dtype=torch.int16, device=dev)
    values = torch.empty(e + 8, dtype=torch.int16, device=dev)
    ref = old.clone()
    tensors = (mask, sums, lasts, gaps, values, new, ref)
    for scan, shift, vals, gp in [
        (1, 1, 1, 1),
        (0, 1, 1, 1),
        (1, 0, 1, 1),
        (0, 0, 1, 1),
        (1, 1, 0, 1),
        (1, 1, 1, 0),
        (0, 0, 0, 0),
        (0, 0, 0, 1),
    ]:
        for warps in (4, 8, 16):

            def fn(a=scan, b=shift, c=vals, d=gp, w=warps):
                wr_k[(blocks,)](*tensors, BLOCK=BLOCK, SCAN=a, SHIFT=b, VALUES=c, GAPS=d, num_warps=w)

            res[f"write scan={scan} shift={shift} values={vals} gaps={gp} warps={warps}"] = timed_cuda(fn, 20)
    for kk, v in res.items():
        print(f"{kk:60s} {1e3 * v:8.3f} ms")
    print(json.dumps({k: 1e3 * v for k, v in res.items()}))


if __name__ == "__main__":
    main()
