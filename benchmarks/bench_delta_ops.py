"""Benchmark: what the delta encoder's passes over one bucket cost on a GPU or the CPU, and the encoder as a whole.

    python benchmarks/bench_delta_ops.py --json docs/results/delta_ops_h200.json
    python benchmarks/bench_delta_ops.py --device cpu --mb 8 --threads 1 --json docs/results/delta_ops_cpu_vm.json

One bucket of --mb MB of bf16 (default 512), a copy with --density of its elements changed (random positions);
the mask is ``reference != new`` on their int16 views. Each row is the median of --repeats runs (the device
synchronized around each) of one way to do one pass: compare, the ways to count the mask (the count sizes the
encoding and picks FULL, SAME or GAPS, and crosses to the host), the ways to list its indices; then
raysync.core.delta_encode.encode of the bucket (as one chunk) into a device buffer and into pinned host memory.
Floor, same run: one copy of the bucket. On the CPU (--device cpu) the same torch rows, numpy's kernels for the
same passes beside them (Note [numpy on the CPU] in raysync.core.delta_changes), and encode into a host buffer.
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from common import emit, timed

from raysync.core import delta_encode
from raysync.core.delta import capacity


def count_words(mask: torch.Tensor) -> torch.Tensor:
    """The mask's True count from its bytes read as int32 words (each byte 0 or 1): b0+b1+b2+b3 is the top byte
    of word * 0x01010101 (no byte carries: each sum is at most 4)."""
    words = mask.view(torch.int32)
    return words.mul(0x01010101).bitwise_right_shift_(24).sum(dtype=torch.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch's intra-op threads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    n = args.mb * (1 << 20) // 2
    old = torch.randn(n, device=device).mul_(0.02).to(torch.bfloat16)
    new = old.clone()
    where = torch.randperm(n, device=device)[: int(args.density * n)]
    new[where] = new[where] + 1
    a, b = old.view(torch.int16), new.view(torch.int16)
    mask = torch.empty(n, dtype=torch.bool, device=device)
    torch.ne(a, b, out=mask)
    k = int(mask.count_nonzero())
    dst = torch.empty_like(old)
    rows = {
        "floor: copy of the bucket": lambda: dst.copy_(new),
        "ne into the mask": lambda: torch.ne(a, b, out=mask),
        "count_nonzero": lambda: mask.count_nonzero(),
        "sum": lambda: mask.sum(),
        "sum int32": lambda: mask.sum(dtype=torch.int32),
        "uint8 view sum int32": lambda: mask.view(torch.uint8).sum(dtype=torch.int32),
        "int32 words, byte sums": lambda: count_words(mask),
        "nonzero": lambda: mask.nonzero(),
        "nonzero_static (count known)": lambda: torch.nonzero_static(mask, size=k),
    }
    if not cuda:
        an, bn, mn = a.numpy(), b.numpy(), mask.numpy()
        rows["numpy: not_equal into the mask"] = lambda: np.not_equal(an, bn, out=mn)
        rows["numpy: count_nonzero"] = lambda: np.count_nonzero(mn)
        rows["numpy: nonzero"] = lambda: mn.nonzero()
    try:
        if not cuda:
            raise NotImplementedError("a GPU row")
        compiled = torch.compile(lambda x, y: (x != y).sum(), dynamic=False)
        compiled(a, b)
        rows["compiled (ne).sum"] = lambda: compiled(a, b)
    except Exception as e:  # no triton: the row is left out, and says why
        rows["compiled (ne).sum"] = None
        if cuda:
            print(f"torch.compile: {type(e).__name__}: {e}")
    assert int(count_words(mask)) == k and int(mask.view(torch.uint8).sum(dtype=torch.int32)) == k
    cap = capacity([(n, 2)])
    dev_out = torch.empty(cap + 64, dtype=torch.uint8, device=device)[:cap]
    space = delta_encode.Workspace.for_buckets([[(n, 2)]], device)
    rows["encode into device memory" if cuda else "encode"] = lambda: delta_encode.encode(
        [(old, new)], dev_out, base_version=1, space=space
    )
    if cuda:
        host_out = torch.empty(cap, dtype=torch.uint8, pin_memory=True)
        rows["encode into pinned host memory"] = lambda: delta_encode.encode(
            [(old, new)], host_out, base_version=1, space=space
        )
        rows["encode, listed (sparse=True), device"] = lambda: delta_encode.encode(
            [(old, new)], dev_out, base_version=1, space=space, sparse=True
        )
        rows["encode, listed (sparse=True), pinned host"] = lambda: delta_encode.encode(
            [(old, new)], host_out, base_version=1, space=space, sparse=True
        )
    ms = {name: None if fn is None else 1e3 * timed(fn, device, args.repeats) for name, fn in rows.items()}
    for name, t in ms.items():
        print(f"{name:44s} {'-' if t is None else f'{t:8.3f} ms'}")
    emit(
        {
            "bucket_mb": args.mb,
            "density": args.density,
            "changed": k,
            "device": torch.cuda.get_device_name()
            if cuda
            else f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__,
            "ms": ms,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
