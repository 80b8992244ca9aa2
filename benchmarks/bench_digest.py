"""Benchmark: the cost of SyncConfig.verify's digest (raysync.core.digest) over a model layout, the digest before
issue 22 (a plain sum of 64-bit words, kept below for the comparison) next to the current one, and a memory
floor measured in the same run over the same bytes: one sum of them as 64-bit words in a single flat buffer
(one read of every byte, no per-tensor cost) and one copy of that buffer.

    python benchmarks/bench_digest.py                        # cuda if there is one (7B layout), else CPU (0.5B)
    python benchmarks/bench_digest.py --layout qwen2.5-7b --json out.json

Every digest is taken the way a receiver takes it: per tensor, over its bytes (``partial(bytes, 0)``), then
``finish`` for all of them (one host sync per device). Times are medians over --repeats after a warm-up.
Prints a table, then JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch
from common import emit, timed

from raysync.core import digest
from raysync.tools.models import allocate


def old_partial(data: torch.Tensor) -> torch.Tensor:
    """The digest before issue 22: the bytes as 64-bit words (a shorter tail as single bytes), summed. Blind to
    a flipped bit 63 and to swapped words; kept here only to compare the cost."""
    if data.storage_offset() % 8:
        data = data.clone()
    words = data.numel() // 8 * 8
    total = (
        data[:words].view(torch.int64).sum()
        if words
        else torch.zeros((), dtype=torch.int64, device=data.device)
    )
    if words < data.numel():
        total = total + data[words:].to(torch.int64).sum()
    return total


def run(layout: str, device: torch.device, repeats: int) -> dict:
    tensors = allocate(layout, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for t in tensors.values():  # random bits: no pattern for a cache or a compressor to exploit
        t.view(torch.int16).random_(-(1 << 15), 1 << 15, generator=gen)
    views = [t.view(-1).view(torch.uint8) for t in tensors.values()]
    flat = torch.cat(
        views
    )  # the same bytes in one buffer: the floors, and the digest without per-tensor costs
    copy = torch.empty_like(flat)

    def per_tensor(partial: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], object]:
        return lambda: digest.combine(
            [[partial(b)] for b in views]
        )  # as a receiver does: per tensor, one sync

    rows = {
        "floor: sum of the bytes as int64, one buffer": timed(
            lambda: flat.view(torch.int64).sum().item(), device, repeats
        ),
        "floor: copy of the bytes, one buffer": timed(lambda: copy.copy_(flat), device, repeats),
        "old digest (sum of 64-bit words), per tensor": timed(per_tensor(old_partial), device, repeats),
        "digest, per tensor": timed(per_tensor(lambda b: digest.partial(b, 0)), device, repeats),
        "digest, one buffer": timed(lambda: digest.combine([[digest.partial(flat, 0)]]), device, repeats),
    }
    fast = digest._fast_int8_product
    try:  # the path of a device where torch has no fast int8 product (Note in raysync.core.digest)
        digest._fast_int8_product = lambda device: False
        rows["digest, weight table (no fast int8 product), per tensor"] = timed(
            per_tensor(lambda b: digest.partial(b, 0)), device, repeats
        )
    finally:
        digest._fast_int8_product = fast
    return {"bytes": flat.numel(), "tensors": len(views), "int8_product": fast(device), "seconds": rows}


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="qwen2.5-7b" if cuda else "qwen2.5-0.5b")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    result = run(args.layout, device, args.repeats)
    result.update(layout=args.layout, device=str(device), hardware=hardware(device))
    gb = result["bytes"] / 1e9
    print(f"{args.layout} as bf16: {result['tensors']} tensors, {gb:.2f} GB, on {result['hardware']}")
    print(f"{'':48}  {'ms':>9}  {'GB/s':>7}")
    for name, s in result["seconds"].items():
        print(f"{name:48}  {s * 1e3:9.2f}  {gb / s:7.1f}")
    emit(result, args.json)


if __name__ == "__main__":
    main()
