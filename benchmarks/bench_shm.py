"""Benchmark: a model's parameter layout pushed over the shm ring, next to a plain copy of the same bytes.

    python benchmarks/bench_shm.py                                  # CPU, Qwen2.5-0.5B layout (0.99 GB bf16)
    python benchmarks/bench_shm.py --device cuda --layout qwen2.5-7b --bucket-mb 256 512 1024

The sender runs in this process, the receiver in a spawned one; each push copies every tensor into
preallocated destination tensors of the same layout (GPU -> shm -> GPU with --device cuda). The floor is
measured in the same run on the same tensors: one copy of every tensor into its destination (CPU); on CUDA,
device -> pinned host, pinned host -> device, and both at once on two streams (the bound of any pipelined
path through host memory). "% floor" is the floor's time over the path's time (floor: the one copy on CPU,
both directions at once on CUDA); "ref" lines are context. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.tools.models import allocate


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.view(-1).view(torch.uint8)[::4099].double().sum() for t in tensors.values()))


def receiver_main(endpoint, secret, config, layout, device, pushes, threads, out) -> None:
    torch.set_num_threads(threads)
    dest = allocate(layout, device=device, fill=False)
    for t in dest.values():
        t.zero_()
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            receiver.receive(into=dest)
        _sync(device)
        out.put(checksum(dest))


def _timed(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floors(src: dict[str, torch.Tensor], device: str, repeats: int) -> dict[str, float]:
    """Seconds for plain copies of the same tensors, into preallocated destinations, measured now."""
    if device == "cpu":
        dst = {k: torch.empty_like(v) for k, v in src.items()}
        dst2 = {k: torch.empty_like(v) for k, v in src.items()}
        pool = ThreadPoolExecutor(2)

        def copy(d: dict, s: dict) -> None:
            for k in s:
                d[k].copy_(s[k])

        def two_at_once() -> None:  # what a path of two copies on two cores can reach: context, not the floor
            list(pool.map(lambda ds: copy(*ds), [(dst, src), (dst2, dst)]))

        return {
            "one copy per tensor": _timed(lambda: copy(dst, src), device, repeats),
            "ref: 2 copies at once, 2 threads": _timed(two_at_once, device, repeats),
        }
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in src.items()}
    back = {k: torch.empty_like(v) for k, v in src.items()}
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()

    def both_at_once() -> None:  # the bound of any pipelined GPU -> host -> GPU path: both directions busy
        with torch.cuda.stream(d2h):
            for k, v in src.items():
                host[k].copy_(v, non_blocking=True)
        with torch.cuda.stream(h2d):
            for k, v in host.items():
                back[k].copy_(v, non_blocking=True)

    return {
        "D2H per tensor, pinned": _timed(
            lambda: [host[k].copy_(v, non_blocking=True) for k, v in src.items()], device, repeats
        ),
        "H2D per tensor, pinned": _timed(
            lambda: [back[k].copy_(v, non_blocking=True) for k, v in host.items()], device, repeats
        ),
        "D2H and H2D at once (2 streams)": _timed(both_at_once, device, repeats),
    }


def bench_one(src, layout, device, bucket_mb, num_buffers, pushes, threads, verify=False) -> dict:
    ctx = mp.get_context("spawn")
    config = SyncConfig(
        bucket_bytes=bucket_mb << 20, num_buffers=num_buffers, timeout_s=120, progress=False, verify=verify
    )
    secret = SessionSecret.generate()
    out = ctx.Queue()
    with WeightSender(secret, config) as sender:
        proc = ctx.Process(
            target=receiver_main,
            args=(sender.endpoint, secret, config, layout, device, pushes + 1, threads, out),
        )
        proc.start()
        sender.push(src.items(), 0)  # warm-up: session set-up, page faults, registration
        times = []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            sender.push(src.items(), version)
            times.append(time.perf_counter() - t0)
        got = out.get(timeout=300)
        proc.join(timeout=60)
    assert got == checksum(src), "receiver's tensors differ from the sender's"
    return {
        "bucket_mb": bucket_mb,
        "num_buffers": num_buffers,
        "verify": verify,
        "median_s": statistics.median(times),
        "min_s": min(times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--num-buffers", type=int, nargs="+", default=[2])
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each process")
    ap.add_argument("--verify", action="store_true", help="also time each point with SyncConfig.verify=True")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    src = allocate(args.layout, device=args.device)
    nbytes = sum(t.nbytes for t in src.values())
    floor = floors(src, args.device, repeats=args.pushes)
    floor_name = next(iter(floor)) if args.device == "cpu" else "D2H and H2D at once (2 streams)"
    bound = floor[floor_name]  # CPU: one copy (a plain memcpy); CUDA: the bound of a pipelined host path
    rows = [
        bench_one(src, args.layout, args.device, mb, nb, args.pushes, args.threads, verify)
        for verify in ([False, True] if args.verify else [False])
        for nb in args.num_buffers
        for mb in args.bucket_mb
    ]
    hw = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(
        f"\n{args.layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB bf16, device={args.device} ({hw}), "
        f"{torch.get_num_threads()} thread(s)/process"
    )
    print(f"{'path':<36}{'bucket':>8}{'median s':>10}{'GB/s':>8}{'% floor':>9}")
    for name, sec in floor.items():
        print(
            f"{('' if name.startswith('ref') else 'floor: ') + name:<36}{'-':>8}{sec:>10.3f}{nbytes / sec / 1e9:>8.2f}{100 * bound / sec:>8.0f}%"
        )
    for r in rows:
        r["gbps"] = nbytes / r["median_s"] / 1e9
        r["pct_of_floor"] = 100 * bound / r["median_s"]
        path = f"shm ring ({r['num_buffers']} buffers){', verify' if r['verify'] else ''}"
        print(
            f"{path:<36}{r['bucket_mb']:>6}MB{r['median_s']:>10.3f}{r['gbps']:>8.2f}{r['pct_of_floor']:>8.0f}%"
        )
    result = {
        "layout": args.layout,
        "device": args.device,
        "hardware": hw,
        "bytes": nbytes,
        "tensors": len(src),
        "threads": args.threads,
        "floors_s": floor,
        "floor": floor_name,
        "floor_s": bound,
        "runs": rows,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
