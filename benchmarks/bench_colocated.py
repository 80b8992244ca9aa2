"""Benchmark: one trainer -> N engines on its GPU (issue 20, item 4), each engine a process of its own that copies
every tensor into its own preallocated destinations, two ways: one session per engine, pushed at once from threads
of the trainer's process (as WeightSync pushes a sender's pairs), and one fan-out session that all N read
(``WeightSender(receivers=N)``: one PushStart, the ring packed once, or in direct mode the trainer's tensors).

    python benchmarks/bench_colocated.py --device cuda --layout qwen2.5-7b --engines 1 2 3   # cuda_ipc direct
    python benchmarks/bench_colocated.py --device cuda --no-direct                          # cuda_ipc ring
    python benchmarks/bench_colocated.py --device cuda --ways fan-out                       # fan-out only
    python benchmarks/bench_colocated.py                                   # CPU stand-in: shm, Qwen2.5-0.5B

In direct mode the trainer packs nothing: each engine reads the trainer's tensors in place, so the trainer's
work does not grow with N. The floor, measured in the same run on the same tensors: N one-copy reads of every
tensor, one after the other (N engines reading one GPU's memory share its bandwidth). A push returns when all N
engines have applied it; every engine's tensors are checked against the trainer's at the end. Table and JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from bench_shm import checksum, receiver_main
from common import emit, timed

from raysync import SessionSecret, SyncConfig, WeightSender
from raysync.tools.models import allocate


def floor_s(src: dict[str, torch.Tensor], device: str, engines: int, repeats: int) -> float:
    outs = [{k: torch.empty_like(v) for k, v in src.items()} for _ in range(engines)]

    def once() -> None:
        for out in outs:
            for k, v in src.items():
                out[k].copy_(v, non_blocking=True)

    return timed(once, torch.device(device), repeats)


def bench(
    src,
    layout: str,
    device: str,
    engines: int,
    pushes: int,
    direct: bool,
    bucket_mb: int,
    fan_out: bool,
    cuda_graphs: bool = True,
) -> dict:
    ctx = mp.get_context("spawn")
    config = SyncConfig(
        transport="cuda_ipc" if device == "cuda" else "shm",
        direct=direct and device == "cuda",
        bucket_bytes=bucket_mb << 20,
        num_buffers=2,
        timeout_s=300,
        progress=False,
        cuda_graphs=cuda_graphs,
    )
    out = ctx.Queue()
    if fan_out:  # one session, N endpoints
        secret = SessionSecret.generate()
        senders = [WeightSender(secret, config, receivers=engines)]
        ends = [(e, secret) for e in senders[0].endpoints]
    else:
        secrets = [SessionSecret.generate() for _ in range(engines)]
        senders = [WeightSender(secret, config) for secret in secrets]
        ends = [(s.endpoint, sec) for s, sec in zip(senders, secrets, strict=True)]
    pool = ThreadPoolExecutor(len(senders))
    try:
        procs = [
            ctx.Process(target=receiver_main, args=(e, sec, config, layout, device, pushes + 1, 1, out))
            for e, sec in ends
        ]
        for p in procs:
            p.start()

        def push_all(version: int) -> None:
            if len(senders) == 1:
                senders[0].push(src.items(), version)
                return
            for f in [pool.submit(s.push, src.items(), version) for s in senders]:
                f.result(timeout=600)

        push_all(0)  # warm-up: the sessions' set-up (export, open, map: once)
        times, stages = [], []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            push_all(version)
            times.append(time.perf_counter() - t0)
            stages.append(senders[0].last_stages_s)
        packed = sum(s.packed_buckets for s in senders)
        sums = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    finally:
        pool.shutdown()
        for s in senders:
            s.close()
    assert all(s == checksum(src) for s in sums), "an engine's tensors differ from the trainer's"
    return {
        "engines": engines,
        "way": "fan-out" if fan_out else "sessions",
        "cuda_graphs": cuda_graphs,
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "packed_buckets_last_push": packed,
        "sender_stages_ms": {k: 1e3 * statistics.median(st[k] for st in stages) for k in stages[0]},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--pushes", type=int, default=10)
    ap.add_argument("--no-direct", action="store_true", help="cuda_ipc ring instead of direct mode")
    ap.add_argument("--bucket-mb", type=int, default=512, help="the ring's bucket (ring and shm only)")
    ap.add_argument("--ways", nargs="+", default=["sessions", "fan-out"], choices=["sessions", "fan-out"])
    ap.add_argument("--cuda-graphs", nargs="+", default=["on"], choices=["on", "off"])
    ap.add_argument("--rounds", type=int, default=1, help="repeat every row (and its floor), interleaved")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    src = allocate(args.layout, device=args.device, fill=True)
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    hardware = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    direct = args.device == "cuda" and not args.no_direct
    path = "cuda_ipc direct" if direct else ("cuda_ipc ring" if args.device == "cuda" else "shm ring")
    if not direct:
        path += f" 2 x {args.bucket_mb} MiB"
    print(f"{args.layout}: {len(src)} tensors, {nbytes / 1e9:.2f} GB, {path}, {hardware}")
    print(
        f"{'engines':>7} {'way':>9} {'graphs':>6} {'median s':>9} {'floor s':>8} {'x floor':>8} {'vs 1':>6} {'packs':>6}"
    )
    rows = []
    for n, rnd in [(n, rnd) for rnd in range(args.rounds) for n in args.engines]:
        floor = floor_s(src, args.device, n, args.pushes)
        for way in args.ways:
            for graphs in args.cuda_graphs:
                r = bench(
                    src,
                    args.layout,
                    args.device,
                    n,
                    args.pushes,
                    direct,
                    args.bucket_mb,
                    way == "fan-out",
                    graphs == "on",
                ) | {"floor_s": floor, "round": rnd}
                rows.append(r)
                one = next(x for x in rows if (x["way"], x["cuda_graphs"]) == (way, graphs == "on"))
                stages = " ".join(f"{k} {v:.2f}" for k, v in r["sender_stages_ms"].items())
                print(
                    f"{n:>7} {way:>9} {graphs:>6} {r['median_s']:>9.4f} {floor:>8.4f} "
                    f"{r['median_s'] / floor:>8.2f} {r['median_s'] / one['median_s']:>6.2f} "
                    f"{r['packed_buckets_last_push']:>6}   sender ms: {stages}"
                )
    summary = []
    for key in dict.fromkeys((r["engines"], r["way"], r["cuda_graphs"]) for r in rows):
        mine = [r for r in rows if (r["engines"], r["way"], r["cuda_graphs"]) == key]
        summary.append(
            {
                "engines": key[0],
                "way": key[1],
                "cuda_graphs": key[2],
                "median_s": statistics.median(r["median_s"] for r in mine),
                "floor_s": statistics.median(r["floor_s"] for r in mine),
                "x_floor_per_round": [r["median_s"] / r["floor_s"] for r in mine],
            }
        )
    if args.rounds > 1:
        print(f"medians over {args.rounds} rounds:")
        for r in summary:
            per = " ".join(f"{x:.3f}" for x in r["x_floor_per_round"])
            print(
                f"{r['engines']:>7} {r['way']:>9} {'on' if r['cuda_graphs'] else 'off':>6} {r['median_s']:>9.4f} "
                f"{r['floor_s']:>8.4f} {r['median_s'] / r['floor_s']:>8.3f}   per round: {per}"
            )
    emit(
        {
            "what": "one trainer -> N engines on its device: one session each, pushed at once, or one fan-out session",
            "layout": args.layout,
            "device": args.device,
            "hardware": hardware,
            "path": path,
            "bytes": nbytes,
            "floor": "N one-copy reads of every tensor, one after the other",
            "rounds": args.rounds,
            "rows": rows,
            "summary": summary,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
