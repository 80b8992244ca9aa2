"""Benchmark: a tensor-parallel engine's N ranks fed over shm two ways (issue 16, item 4; Note [which bytes each
rank receives] in raysync.engines.torch_tp):

  full   one ring read by the N ranks (fan-out): every tensor packed once, whole; each rank copies its shard out
  shards one session per rank, each pushing only that rank's shards (column blocks packed from strided views)

    python benchmarks/bench_tp_engine.py                      # Qwen2.5-0.5B layout, TP = 2, CPU
    python benchmarks/bench_tp_engine.py --layout qwen2.5-1.5b --world 2 4

Each rank is a process of its own with preallocated shard tensors; a push returns when every rank has applied
it; every rank's tensors are checked against the trainer's shards at the end. Beside them, measured in the same
run: one copy of every tensor (the floor of packing it once). Table and JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from bench_ipc import checksum
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.engines.torch_tp import ShardLoader, megatron_dims, rank_tensors, shard
from raysync.tools.models import allocate


def rank_main(endpoint, secret, config, layout, rank, world, how, pushes, out) -> None:
    torch.set_num_threads(1)
    full = allocate(layout, device="meta", fill=False)
    dims = megatron_dims(list(full))
    mine = {n: torch.zeros(shard(t, rank, world, dims[n]).shape, dtype=t.dtype) for n, t in full.items()}
    loader = ShardLoader(mine, rank=rank, world=world, dims=dims)
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            if how == "full":
                receiver.receive(load_fn=loader)
            else:
                receiver.receive(into=mine)
        out.put((rank, checksum(mine)))


def bench(src, layout: str, world: int, how: str, pushes: int, bucket_mb: int) -> dict:
    ctx = mp.get_context("spawn")
    config = SyncConfig(transport="shm", bucket_bytes=bucket_mb << 20, timeout_s=300, progress=False)
    dims = megatron_dims(list(src))
    out = ctx.Queue()
    if how == "full":
        secret = SessionSecret.generate()
        senders = [WeightSender(secret, config, receivers=world)]
        ends = [(e, secret) for e in senders[0].endpoints]
        items = [list(src.items())]
    else:
        secrets = [SessionSecret.generate() for _ in range(world)]
        senders = [WeightSender(s, config) for s in secrets]
        ends = [(s.endpoint, sec) for s, sec in zip(senders, secrets, strict=True)]
        items = [rank_tensors(src, r, world, dims) for r in range(world)]
    pool = ThreadPoolExecutor(len(senders))
    try:
        procs = [
            ctx.Process(target=rank_main, args=(e, sec, config, layout, r, world, how, pushes + 1, out))
            for r, (e, sec) in enumerate(ends)
        ]
        for p in procs:
            p.start()

        def push(version: int) -> None:
            for f in [pool.submit(s.push, it, version) for s, it in zip(senders, items, strict=True)]:
                f.result(timeout=600)

        push(0)
        times = []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            push(version)
            times.append(time.perf_counter() - t0)
        sums = dict(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        packed = sum(s.packed_buckets for s in senders)
    finally:
        pool.shutdown()
        for s in senders:
            s.close()
    want = {r: checksum({n: shard(t, r, world, dims[n]).contiguous() for n, t in src.items()}) for r in sums}
    assert sums == want, "a rank's tensors differ from the trainer's shards"
    return {"how": how, "world": world, "median_s": statistics.median(times), "buckets_packed": packed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--world", type=int, nargs="+", default=[2])
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = allocate(args.layout, device="cpu", fill=False)
    for t in src.values():  # values that differ along both dims: a rank given another's shard fails the check
        rows_ = torch.arange(t.shape[0]) % 89
        t.copy_(rows_ if t.dim() == 1 else rows_.view(-1, 1) + (torch.arange(t.shape[1]) % 83) * 0.01)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    copies = []
    for _ in range(args.pushes + 1):
        t0 = time.perf_counter()
        for n, t in src.items():
            dst[n].copy_(t)
        copies.append(time.perf_counter() - t0)
    floor = statistics.median(copies[1:])
    del dst
    hardware = platform.processor() or "cpu"
    print(
        f"{args.layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB, shm 2 x {args.bucket_mb} MiB, {hardware}"
    )
    print(f"one copy of every tensor: {floor:.3f} s")
    print(f"{'world':>5} {'how':>6} {'median s':>9} {'x copy':>7} {'buckets packed':>15}")
    rows = []
    for world in args.world:
        for how in ("full", "shards"):
            r = bench(src, args.layout, world, how, args.pushes, args.bucket_mb)
            rows.append(r)
            print(
                f"{world:>5} {how:>6} {r['median_s']:>9.3f} {r['median_s'] / floor:>7.2f} {r['buckets_packed']:>15}"
            )
    emit(
        {
            "what": "a tensor-parallel engine's ranks fed whole tensors over one ring vs shard-only sessions",
            "layout": args.layout,
            "hardware": hardware,
            "bytes": nbytes,
            "bucket_mb": args.bucket_mb,
            "floor_one_copy_s": floor,
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
