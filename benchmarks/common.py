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
