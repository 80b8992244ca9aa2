"""Benchmark: the fused delta kernels (raysync.core.delta_kernels, Note [fused delta kernels]) on one bucket,
beside torch's operations they replace, on a CUDA device.

    python benchmarks/bench_delta_kernels.py [--mb 512] [--density 0.05] [--json out.json]

Rows (median ms of --repeats): the floors (one read of the bucket's reference and new words with a write of
its mask: torch's ne; one read of the mask: a sum), the sender's compare (the kernels' count_blocks, which
writes the mask and counts it by block, against torch's ne then its listing, nonzero_static with the cap and
searchsorted), the GAPS write of every entry (the kernels' write_counted, which lists each block from the mask,
against torch's gather + the reference's index_copy_ of a listing already made), and the receiver's apply (the
kernels against torch's int64 cumsum + index_copy_)."""

from __future__ import annotations

import argparse

import torch
from common import emit, timed_cuda

from raysync.core import delta_blocks, delta_decode_kernels, delta_kernels
from raysync.core.delta_changes import _listing_cap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=512, help="the bucket's bf16 bytes")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    n = args.mb * 2**20 // 2
    g = torch.Generator(device=device).manual_seed(0)
    new = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=device, generator=g)
    old = torch.where(torch.rand(n, device=device, generator=g) < args.density, new + 1, new)
    mask = torch.empty(n, dtype=torch.bool, device=device)
    cap = _listing_cap(n, 1)
    starts = torch.tensor([0, n], dtype=torch.int64, device=device)
    blocks = delta_blocks.Blocks.of([n], device)
    slab = torch.empty(blocks.elements, dtype=torch.uint8, device=device)
    rows = {
        "floor: ne of reference and new into the mask": lambda: torch.ne(old, new, out=mask),
        "floor: sum of the mask's bytes": lambda: mask.view(torch.uint8).sum(dtype=torch.int32),
        "torch: ne, nonzero_static + searchsorted": lambda: torch.searchsorted(
            torch.nonzero_static(torch.ne(old, new, out=mask), size=cap, fill_value=n).view(-1), starts
        ),
        "kernels: count_blocks (compare, counts by block)": lambda: delta_kernels.count_blocks(
            [(old, new)], delta_blocks.mask_words(slab, blocks), blocks
        ),
    }
    counted = delta_kernels.count_blocks([(old, new)], delta_blocks.mask_words(slab, blocks), blocks)
    entries = counted.entries(0)
    index = torch.nonzero(torch.ne(old, new, out=mask)).view(-1)
    reference = old.clone()
    out = torch.empty(2 * entries + 16, dtype=torch.int16, device=device)
    gaps, values = out[:entries], out[entries + 8 : 2 * entries + 8]
    payload = [(entries, gaps.data_ptr(), values.data_ptr())]
    rows["kernels: write_counted (list, gaps, values, reference)"] = lambda: delta_kernels.write_counted(
        [(reference, new)], payload, counted, advance=True
    )

    def torch_write() -> None:
        torch.index_select(new, 0, index, out=values[: index.numel()])
        reference.index_copy_(0, index, values[: index.numel()])

    rows["torch: gather values + reference index_copy_"] = torch_write
    delta_kernels.write_counted([(reference, new)], payload, counted, advance=True)  # the receiver's rows
    dest = torch.empty_like(new)

    def kernels_apply() -> None:
        apply = delta_decode_kernels.GapsApply([(entries, gaps.data_ptr(), values.data_ptr(), dest)])
        apply.ends()
        apply.run()

    def torch_apply() -> None:
        at = gaps.to(torch.int64).add_(1 + 32768).cumsum_(0).sub_(1)
        int(at[-1])
        dest.index_copy_(0, at, values)

    rows["kernels: GapsApply (sums, one sync, apply)"] = kernels_apply
    rows["torch: int64 cumsum, one sync, index_copy_"] = torch_apply
    ms = {name: 1e3 * timed_cuda(fn, args.repeats) for name, fn in rows.items()}
    delta_kernels.write_counted(
        [(reference, new)], payload, counted, advance=True
    )  # (torch's row wrote values)
    kernels_apply()
    at = torch.nonzero(slab[:n]).view(-1)  # the entries: changed and forced
    assert torch.equal(values, new[at]) and torch.equal(dest[at], new[at]), "the kernels put values elsewhere"
    assert torch.equal(reference, new), "the kernels left the reference behind"
    print(f"{torch.cuda.get_device_name()}: {args.mb} MB bf16 bucket, {entries} entries ({entries / n:.2%})")
    for name, t in ms.items():
        print(f"{name:52s} {t:8.3f} ms")
    emit(
        {
            "bucket_mb": args.mb,
            "density": args.density,
            "entries": entries,
            "ms": ms,
            "gpu": torch.cuda.get_device_name(),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
