"""Benchmark: fan-out over one shm ring, 1 -> N receivers (issue 20, item 3), each bucket packed once.

    python benchmarks/bench_fanout.py                                   # CPU, Qwen2.5-0.5B layout, N = 1 2 3
    python benchmarks/bench_fanout.py --device cuda --layout qwen2.5-7b --bucket-mb 512

The sender runs in this process, each receiver in a spawned one, every receiver copying every tensor into its
own preallocated destinations; a push returns when all N have applied it. For each N: the median push, the
sender's packs per push (the bucket count, whatever N is) and, measured in the same run on the same tensors,
the floor: one pack of every tensor into host memory plus N copies out of it, one after the other (what N
receivers reading one packed copy cost at least when nothing overlaps). Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time

import torch
from bench_shm import _sync, _timed, checksum, receiver_main
from common import emit

from raysync import SessionSecret, SyncConfig, WeightSender
from raysync.tools.models import allocate


def floor_s(src: dict[str, torch.Tensor], device: str, readers: int, repeats: int) -> float:
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in src.items()}
    outs = [{k: torch.empty_like(v) for k, v in src.items()} for _ in range(readers)]

    def once() -> None:
        for k, v in src.items():
            host[k].copy_(v, non_blocking=True)
        _sync(device)
        for out in outs:
            for k, v in host.items():
                out[k].copy_(v, non_blocking=True)

    return _timed(once, device, repeats)


def bench(src, layout, device, bucket_mb, readers, pushes) -> dict:
    ctx = mp.get_context("spawn")
    config = SyncConfig(bucket_bytes=bucket_mb << 20, timeout_s=300, progress=False, transport="shm")
    secret = SessionSecret.generate()
    out = ctx.Queue()
    with WeightSender(secret, config, receivers=readers) as sender:
        procs = [
            ctx.Process(target=receiver_main, args=(e, secret, config, layout, device, pushes + 1, 1, out))
            for e in sender.endpoints
        ]
        for p in procs:
            p.start()
        sender.push(src.items(), 0)  # warm-up: session set-up, page faults, registration
        times, packs = [], []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            report = sender.push(src.items(), version)
            times.append(time.perf_counter() - t0)
            packs.append(sender.packed_buckets)
        sums = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    assert all(s == checksum(src) for s in sums), "a receiver's tensors differ from the sender's"
    return {
        "readers": readers,
        "median_s": statistics.median(times),
        "packs_per_push": max(packs),
        "buckets": report.buckets,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bucket-mb", type=int, default=32)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = allocate(args.layout, device=args.device, fill=True)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    rows = []
    print(f"{args.layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB, device={args.device} ({hardware})")
    print(
        f"{'readers':>7} {'median s':>9} {'floor s':>8} {'x floor':>8} {'vs N=1':>7} {'packs/push':>10} {'buckets':>7}"
    )
    for n in args.readers:
        floor = floor_s(src, args.device, n, args.pushes)
        r = bench(src, args.layout, args.device, args.bucket_mb, n, args.pushes) | {"floor_s": floor}
        rows.append(r)
        base = rows[0]["median_s"]
        print(
            f"{n:>7} {r['median_s']:>9.3f} {floor:>8.3f} {r['median_s'] / floor:>8.2f} "
            f"{r['median_s'] / base:>7.2f} {r['packs_per_push']:>10} {r['buckets']:>7}"
        )
    emit(
        {
            "layout": args.layout,
            "device": args.device,
            "hardware": hardware,
            "bytes": nbytes,
            "bucket_mb": args.bucket_mb,
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
