"""Benchmark: the collective transport (NCCL) from one sender GPU to receiver GPUs, 7B layout by default,
each push landing in preallocated destination tensors; next to a raw NCCL broadcast of one 1 GiB buffer and a
per-tensor broadcast of the same layout, measured in the same run over the same group.

    python benchmarks/bench_collective.py --gpus 2 --bucket-mb 256 512 1024 --num-buffers 2 3

    python benchmarks/bench_collective.py --shares 2        # sharded sources: 2 groups from GPU 0's process

Rank 0 (GPU 0) sends; ranks 1..gpus-1 receive. With --shares S, rank 0 sends S disjoint shares of the tensors
over S groups at once (raysync.core.sharded; every share from GPU 0 here, so one link is still all there is: it
measures the cost of the mechanism, not the gain of several trainer GPUs). Every rank runs the same sequence (SPMD); rank 0 times the
pushes end to end (push returns when every receiver has reported its version applied). Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing as mp
import statistics
import time

import torch
import torch.distributed as dist
from common import emit, timed_cuda

from raysync import SessionSecret, SyncConfig
from raysync.core.sharded import ShardedReceiver, shares
from raysync.tools.models import LAYOUTS, allocate
from raysync.transport.collective import CollectiveReceiver, CollectiveSender


def _bcast(pg, t: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return pg.broadcast([t], opts)


def floors(pg, tensors: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    one_gib = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")

    def raw() -> None:
        _bcast(pg, one_gib).wait()

    def per_tensor() -> None:
        works = [_bcast(pg, t) for t in tensors.values()]
        for w in works:
            w.wait()

    return {
        "raw broadcast, 1 GiB": timed_cuda(raw, repeats),
        "per-tensor broadcast": timed_cuda(per_tensor, repeats),
    }


def sender_main(share: int, args, secret, queues, barrier, out) -> None:
    """Sends the whole layout (or, with --shares, share ``share`` of it) from GPU 0 to every receiver GPU."""
    torch.cuda.set_device(0)
    tensors = allocate(args.layout, device="cuda")
    results = {"floors": None, "runs": []}
    for config in _configs(args):
        if args.shares > 1:
            config = dataclasses.replace(config, include=shares(tensors.items(), args.shares, config)[share])
        group = CollectiveSender(
            secret, config, host="127.0.0.1", num_receivers=args.gpus - 1, backend="nccl"
        )
        for q in queues:
            q.put((share, group.rendezvous))
        side = group.join()
        if results["floors"] is None and share == 0:
            results["floors"] = floors(group.group, tensors, args.pushes)
        times, stages = [], []
        for version in range(args.pushes + 1):  # the first push is the warm-up
            torch.cuda.synchronize()
            barrier.wait(timeout=120)  # every share's push starts together
            t0 = time.perf_counter()
            side.push(tensors.items(), version)  # returns when every receiver applied it
            times.append(time.perf_counter() - t0)
            stages.append(side.last_stages_s)
        split = {k: 1e3 * statistics.median(st[k] for st in stages[1:]) for k in stages[0]}
        results["runs"].append(
            {
                "bucket_mb": config.bucket_bytes >> 20,
                "num_buffers": config.num_buffers,
                "times_s": times[1:],
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "stages_ms": split,
            }
        )
        group.close()
    out.put((share, "sender", results, None))


def receiver_main(rank: int, args, secret, queues, barrier, out) -> None:
    """Receives every share into its preallocated copy of the layout on GPU ``rank``."""
    torch.cuda.set_device(rank)
    tensors = allocate(args.layout, device="cuda", fill=False)
    for i, config in enumerate(_configs(args)):
        rendezvous = sorted(queues[rank - 1].get(timeout=120) for _ in range(args.shares))
        groups = [CollectiveReceiver(secret, config, rank=rank, rendezvous=r) for _, r in rendezvous]
        if args.shares > 1:
            side = ShardedReceiver(groups)
            side.join()
        else:
            side = groups[0].join()  # one group: its plain push session
        if i == 0:  # every rank takes part in the floors' broadcasts (share 0's group)
            floors(groups[0].group, tensors, args.pushes)
        for _ in range(args.pushes + 1):
            side.receive(into=tensors)
        for g in groups:
            g.close()  # each group's session, then the group
    checksum = float(sum(t.view(-1).view(torch.uint8)[::4099].double().sum() for t in tensors.values()))
    out.put((rank, "receiver", None, checksum))


def _configs(args) -> list[SyncConfig]:
    return [
        SyncConfig(bucket_bytes=mb << 20, num_buffers=nb, timeout_s=30, progress=False)
        for nb in args.num_buffers
        for mb in args.bucket_mb
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen2.5-7b")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--num-buffers", type=int, nargs="+", default=[2])
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--shares", type=int, default=1, help="sharded sources: this many groups at once")
    ap.add_argument("--json")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    secret = SessionSecret.generate()
    queues = [ctx.Queue() for _ in range(args.gpus - 1)]
    out, barrier = ctx.Queue(), ctx.Barrier(args.shares)
    procs = [
        ctx.Process(target=sender_main, args=(k, args, secret, queues, barrier, out))
        for k in range(args.shares)
    ]
    procs += [
        ctx.Process(target=receiver_main, args=(r, args, secret, queues, barrier, out))
        for r in range(1, args.gpus)
    ]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    expected = float(
        sum(t.view(-1).view(torch.uint8)[::4099].double().sum() for t in allocate(args.layout).values())
    )
    assert all(c == expected for _, role, _, c in got if role == "receiver"), "a receiver's tensors differ"
    senders = sorted((k, r) for k, role, r, _ in got if role == "sender")
    sender = senders[0][1]
    for i, run in enumerate(sender["runs"]):  # a push ends when the last share has been applied everywhere
        per_push = [max(times) for times in zip(*(r["runs"][i]["times_s"] for _, r in senders), strict=True)]
        run.update(median_s=statistics.median(per_push), min_s=min(per_push))
    nbytes = sum(math.prod(shape) * 2 for _, shape in LAYOUTS[args.layout].named_shapes())  # bf16
    print(
        f"\n{args.layout}: {nbytes / 1e9:.2f} GB bf16, 1 sender GPU -> {args.gpus - 1} receiver GPU(s), "
        f"{torch.cuda.get_device_name(0)}"
    )
    print(f"{'path':<34}{'bucket':>8}{'median ms':>11}{'GB/s':>8}{'peak GiB':>10}")
    gib = 1 << 30
    for name, sec in sender["floors"].items():
        size = gib if name.startswith("raw") else nbytes
        print(f"{'floor: ' + name:<34}{'-':>8}{sec * 1e3:>11.1f}{size / sec / 1e9:>8.1f}{'-':>10}")
    for r in sender["runs"]:
        r["gbps"] = nbytes / r["median_s"] / 1e9
        path = (
            f"collective ({r['num_buffers']} buffers{f', {args.shares} shares' if args.shares > 1 else ''})"
        )
        split = ", ".join(f"{k} {v:.1f}" for k, v in r["stages_ms"].items())
        line = f"{path:<34}{r['bucket_mb']:>6}MB{r['median_s'] * 1e3:>11.1f}{r['gbps']:>8.1f}{r['peak_gib']:>10.1f}"
        print(f"{line}   ms: {split}")
    result = {
        "layout": args.layout,
        "bytes": nbytes,
        "gpus": args.gpus,
        "shares": args.shares,
        "hardware": torch.cuda.get_device_name(0),
        "floors_s": sender["floors"],
        "runs": sender["runs"],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
