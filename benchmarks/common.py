"""What the benchmark scripts share: timing GPU work, and printing a result as JSON (and saving it)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, a GPU ``device`` synchronized around each."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_cuda(fn: Callable[[], object], repeats: int) -> float:
    """``timed`` on the current GPU."""
    return timed(fn, torch.device("cuda", torch.cuda.current_device()), repeats)


def ipc_config(bucket_mb: int, num_buffers: int, direct: bool = False):
    """The cuda_ipc benchmarks' session config: a ring of ``num_buffers`` x ``bucket_mb``, or direct mode."""
    from raysync import SyncConfig

    return SyncConfig(
        transport="cuda_ipc",
        bucket_bytes=bucket_mb << 20,
        num_buffers=num_buffers,
        timeout_s=120,
        progress=False,
        direct=direct,
    )


def emit(result: dict, path: str | None) -> None:
    """Print ``result`` as one line of JSON (after the script's table), and write it to ``path`` if given."""
    print(json.dumps(result))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def counted_bucket(n: int, density: float = 0.05, seed: int = 0) -> tuple:
    """For the delta kernels' benchmarks, on the current GPU: (old, new, layout, slab, counted): ``n`` random
    int16 words (a bf16 bucket's bits) as ``new``, ``old`` a copy with about ``density`` of them changed, the
    bucket's blocks, a mask buffer of ``n`` bytes and the kernels' compare of the two (its bitmask in the slab)."""
    from raysync.core import delta_blocks, delta_kernels

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    new = torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16, device=dev, generator=gen)
    old = torch.where(torch.rand(n, device=dev, generator=gen) < density, new + 1, new)
    layout = delta_blocks.Blocks.of([n], dev)
    slab = torch.empty(n, dtype=torch.uint8, device=dev)
    counted = delta_kernels.count_blocks([(old, new)], delta_blocks.mask_words(slab, layout), layout)
    return old, new, layout, slab, counted
