"""Benchmark: a model's parameter layout pushed over the shm ring, next to a plain copy of the same bytes.

    python benchmarks/bench_shm.py                                  # CPU, Qwen2.5-0.5B layout (0.99 GB bf16)
    python benchmarks/bench_shm.py --device cuda --layout qwen2.5-7b --bucket-mb 256 512 1024

The sender runs in this process, the receiver in a spawned one; each push copies every tensor into
preallocated destination tensors of the same layout (GPU -> shm -> GPU with --device cuda). The floor is
measured in the same run on the same tensors: one copy of every tensor into its destination (CPU) or one
device -> pinned host copy and one pinned host -> device copy of every tensor (CUDA). Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time

import torch

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.models import allocate


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.view(-1).view(torch.uint8)[:: 4099].double().sum() for t in tensors.values()))


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


def floor_seconds(src: dict[str, torch.Tensor], device: str, repeats: int) -> float:
    """One copy of every tensor into a preallocated destination (CPU), or D2H + H2D through pinned memory."""
    if device == "cpu":
        dst = {k: torch.empty_like(v) for k, v in src.items()}
        hops = [(dst, src)]
    else:
        host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in src.items()}
        back = {k: torch.empty_like(v) for k, v in src.items()}
        hops = [(host, src), (back, host)]
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        for dst, s in hops:
            for k in s:
                dst[k].copy_(s[k], non_blocking=True)
            _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(src, layout, device, bucket_mb, num_buffers, pushes, threads) -> dict:
    ctx = mp.get_context("spawn")
    config = SyncConfig(bucket_bytes=bucket_mb << 20, num_buffers=num_buffers, timeout_s=120, progress=False)
    secret = SessionSecret.generate()
    out = ctx.Queue()
    with WeightSender(secret, config) as sender:
        proc = ctx.Process(target=receiver_main, args=(sender.endpoint, secret, config, layout, device, pushes + 1, threads, out))
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
    return {"bucket_mb": bucket_mb, "num_buffers": num_buffers, "median_s": statistics.median(times), "min_s": min(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--num-buffers", type=int, nargs="+", default=[2])
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in each process")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    src = allocate(args.layout, device=args.device)
    nbytes = sum(t.nbytes for t in src.values())
    floor = floor_seconds(src, args.device, repeats=args.pushes)
    rows = [bench_one(src, args.layout, args.device, mb, nb, args.pushes, args.threads)
            for nb in args.num_buffers for mb in args.bucket_mb]
    hw = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"\n{args.layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB bf16, device={args.device} ({hw}), "
          f"{torch.get_num_threads()} thread(s)/process")  # fmt: skip
    floor_name = "one copy per tensor" if args.device == "cpu" else "D2H + H2D pinned, per tensor"
    print(f"{'path':<34}{'bucket':>8}{'median s':>10}{'GB/s':>8}{'% floor':>9}")
    print(f"{'floor: ' + floor_name:<34}{'-':>8}{floor:>10.3f}{nbytes / floor / 1e9:>8.2f}{100:>8.0f}%")
    for r in rows:
        r["gbps"] = nbytes / r["median_s"] / 1e9
        r["pct_of_floor"] = 100 * floor / r["median_s"]
        print(f"{'shm ring (%d buffers)' % r['num_buffers']:<34}{r['bucket_mb']:>6}MB{r['median_s']:>10.3f}{r['gbps']:>8.2f}"
              f"{r['pct_of_floor']:>8.0f}%")  # fmt: skip
    result = {
        "layout": args.layout, "device": args.device, "hardware": hw, "bytes": nbytes, "tensors": len(src),
        "threads": args.threads, "floor": {"what": floor_name, "seconds": floor, "gbps": nbytes / floor / 1e9},
        "runs": rows,
    }  # fmt: skip
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
