"""Benchmark: a model's parameter layout pushed over the CUDA IPC ring, next to plain device copies.

    python benchmarks/bench_ipc.py                                    # 1 GPU: Qwen2.5-7B and 1.5B layouts
    python benchmarks/bench_ipc.py --receiver-gpu 1                   # 2 GPUs: the ring on GPU 0, read from GPU 1
    python benchmarks/bench_ipc.py --direct                           # also direct mode (SyncConfig.direct)

The sender runs in this process on GPU 0, the receiver in a spawned process on --receiver-gpu; the session is
set up once (one warm-up push), then every push is timed in full: PushStart to PushDone, the receiver's bytes
in its preallocated destination tensors (its stream synchronized) before the sender's push returns.
Floors, measured in the same run on the sender's GPU with the same tensors: one copy of every tensor into
its destination; two copies through one staging bucket of --bucket-mb (pack, then unpack) per bucket.
With --receiver-gpu 1 the floor is a peer copy of every tensor from GPU 0 into GPU 1. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
from common import emit, ipc_config, timed_cuda

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.plan import plan_buckets
from raysync.core.source import select
from raysync.tools.models import allocate


def receiver_main(endpoint, secret, config, layout, gpu, pushes, out) -> None:
    torch.cuda.set_device(gpu)
    dest = allocate(layout, device="cuda", fill=False)
    stages = []
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            receiver.receive(into=dest)
            stages.append(receiver.last_stages_s)
        out.put((checksum(dest), {k: 1e3 * statistics.median(s[k] for s in stages[1:]) for k in stages[0]}))


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.view(-1).view(torch.uint8)[::4099].double().sum().item() for t in tensors.values()))


def floors(
    src: dict[str, torch.Tensor], bucket_bytes: int, receiver_gpu: int, repeats: int
) -> dict[str, float]:
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    flat_src = {k: v.view(-1).view(torch.uint8) for k, v in src.items()}
    flat_dst = {k: v.view(-1).view(torch.uint8) for k, v in dst.items()}
    sources = select(src.items(), SyncConfig(bucket_bytes=bucket_bytes))
    buckets = plan_buckets(tuple(s.spec for s in sources), bucket_bytes, 256)
    names = list(src)
    staging = torch.empty(bucket_bytes, dtype=torch.uint8, device=src[names[0]].device)

    def one_copy() -> None:
        for k in src:
            dst[k].copy_(src[k])

    def two_copies() -> None:
        for b in buckets:
            for c in b.chunks:
                staging[c.bucket_offset : c.bucket_offset + c.nbytes].copy_(
                    flat_src[names[c.index]][c.src_offset : c.src_offset + c.nbytes]
                )
            for c in b.chunks:
                flat_dst[names[c.index]][c.src_offset : c.src_offset + c.nbytes].copy_(
                    staging[c.bucket_offset : c.bucket_offset + c.nbytes]
                )

    out = {
        "one copy per tensor": timed_cuda(one_copy, repeats),
        f"two copies via a {bucket_bytes >> 20} MB bucket": timed_cuda(two_copies, repeats),
    }
    if receiver_gpu != torch.cuda.current_device():
        peer = {k: torch.empty_like(v, device=f"cuda:{receiver_gpu}") for k, v in src.items()}
        out[f"peer copy per tensor to GPU {receiver_gpu}"] = timed_cuda(
            lambda: [peer[k].copy_(v, non_blocking=True) for k, v in src.items()], repeats
        )
    return out


def bench(src, layout, bucket_mb, num_buffers, receiver_gpu, pushes, direct=False) -> dict:
    ctx = mp.get_context("spawn")
    config = ipc_config(bucket_mb, num_buffers, direct)
    secret = SessionSecret.generate()
    out = ctx.Queue()
    with WeightSender(secret, config) as sender:
        proc = ctx.Process(
            target=receiver_main,
            args=(sender.endpoint, secret, config, layout, receiver_gpu, pushes + 1, out),
        )
        proc.start()
        t0 = time.perf_counter()
        sender.push(src.items(), 0)  # warm-up: session set-up (allocate, export, open: once)
        setup = time.perf_counter() - t0
        times, stages = [], []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            sender.push(src.items(), version)
            times.append(time.perf_counter() - t0)
            stages.append(sender.last_stages_s)
        got, receiver_stages = out.get(timeout=300)
        proc.join(timeout=60)
    assert got == checksum(src), "receiver's tensors differ from the sender's"
    return {
        "layout": layout,
        "mode": "direct" if direct else "ring",
        "bucket_mb": 0 if direct else bucket_mb,
        "num_buffers": 0 if direct else num_buffers,
        "first_push_s": setup,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "stages_ms": {k: 1e3 * statistics.median(s[k] for s in stages) for k in stages[0]},
        "receiver_stages_ms": receiver_stages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", nargs="+", default=["qwen2.5-7b", "qwen2.5-1.5b"])
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--num-buffers", type=int, nargs="+", default=[2])
    ap.add_argument("--receiver-gpu", type=int, default=0)
    ap.add_argument("--pushes", type=int, default=20)
    ap.add_argument("--direct", action="store_true", help="also time direct mode (no ring)")
    ap.add_argument("--no-ring", action="store_true", help="skip the ring rows")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    torch.cuda.set_device(0)
    hw = torch.cuda.get_device_name()
    result = {"hardware": hw, "receiver_gpu": args.receiver_gpu, "torch": torch.__version__, "layouts": []}
    for layout in args.layout:
        src = allocate(layout, device="cuda")
        nbytes = sum(t.nbytes for t in src.values())
        floor = floors(src, 512 << 20, args.receiver_gpu, repeats=10)
        torch.cuda.empty_cache()  # the floors' destinations go back before the receiver allocates its own
        rows = (
            []
            if args.no_ring
            else [
                bench(src, layout, mb, nb, args.receiver_gpu, args.pushes)
                for nb in args.num_buffers
                for mb in args.bucket_mb
            ]
        )
        if args.direct:
            rows.append(
                bench(src, layout, 512, 2, args.receiver_gpu, args.pushes, direct=True)
            )  # sizes unused
        print(
            f"\n{layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB bf16, {hw}, receiver on GPU {args.receiver_gpu}"
        )
        print(f"{'path':<40}{'bucket':>8}{'median ms':>11}{'min ms':>8}{'GB/s':>8}")
        for name, sec in floor.items():
            print(f"{'floor: ' + name:<40}{'-':>8}{sec * 1e3:>11.2f}{'':>8}{nbytes / sec / 1e9:>8.1f}")
        for r in rows:
            r["gbps"] = nbytes / r["median_s"] / 1e9
            path = (
                f"cuda_ipc ring ({r['num_buffers']} buffers)"
                if r["mode"] == "ring"
                else "cuda_ipc direct (no ring)"
            )
            split = ", ".join(f"{k} {v:.1f}" for k, v in r["stages_ms"].items())
            split += "; receiver " + ", ".join(f"{k} {v:.2f}" for k, v in r["receiver_stages_ms"].items())
            print(
                f"{path:<40}{r['bucket_mb'] or '-':>6}MB{r['median_s'] * 1e3:>11.2f}{r['min_s'] * 1e3:>8.2f}"
                f"{r['gbps']:>8.1f}   ms: {split}"
            )
        result["layouts"].append(
            {"layout": layout, "bytes": nbytes, "tensors": len(src), "floors_s": floor, "runs": rows}
        )
        del src
        torch.cuda.empty_cache()
    emit(result, args.json)


if __name__ == "__main__":
    main()
