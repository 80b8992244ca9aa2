"""Experiment behind Note [readers in turns] (raysync.transport.cuda_ipc_direct), outside raysync: N processes
on one GPU each copy every tensor of a layout out of the trainer's tensors (shared over CUDA IPC by torch), either
all at once, or in turns (process k's stream waits on the event process k-1 records after queueing its copies;
a host event says it has recorded it). Beside the floor: the N reads one after the other in one process.

    python benchmarks/readers_in_turns.py --layout qwen2.5-7b --readers 3 --rounds 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as tmp
from common import emit, timed_cuda

from raysync.tools.models import allocate


def reader(k, shared, recorded, ready, go, done, rounds, handles) -> None:
    torch.cuda.set_device(0)
    dst = [torch.empty_like(t) for t in shared]
    mine = torch.cuda.Event(interprocess=True)
    mine.record()
    ready.put((k, mine.ipc_handle()))
    chain = handles.get(timeout=300)
    before = torch.cuda.Event.from_ipc_handle(0, chain[k - 1]) if k else None
    stream = torch.cuda.current_stream()
    for r in range(rounds):
        (mode,) = go.get(timeout=300)
        if mode == "in turns" and before is not None:
            if not recorded[k - 1].wait(timeout=60):
                raise TimeoutError(f"reader {k - 1} did not queue its copies within 60 s")
            recorded[k - 1].clear()
            stream.wait_event(before)
        for d, t in zip(dst, shared, strict=True):
            d.copy_(t, non_blocking=True)
        mine.record(stream)
        if mode == "in turns":
            recorded[k].set()
        stream.synchronize()
        done.put((k, r, time.perf_counter()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="qwen2.5-7b")
    ap.add_argument("--readers", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=40, help="alternating: at once, in turns")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.cuda.set_device(0)
    src = list(allocate(args.layout, device="cuda", fill=True).values())
    ctx, n = tmp.get_context("spawn"), args.readers
    recorded = [ctx.Event() for _ in range(n)]
    ready, done = ctx.Queue(), ctx.Queue()
    go, handles = [ctx.Queue() for _ in range(n)], [ctx.Queue() for _ in range(n)]
    procs = [
        ctx.Process(target=reader, args=(k, src, recorded, ready, go[k], done, args.rounds, handles[k]))
        for k in range(n)
    ]
    for p in procs:
        p.start()
    events = dict(ready.get(timeout=300) for _ in range(n))
    for q in handles:
        q.put([events[i] for i in range(n)])
    outs = [[torch.empty_like(t) for t in src] for _ in range(n)]

    def floor() -> None:
        for out in outs:
            for d, t in zip(out, src, strict=True):
                d.copy_(t, non_blocking=True)

    floor_s = timed_cuda(floor, 5)
    times: dict[str, list[float]] = {"at once": [], "in turns": []}
    for r in range(args.rounds):
        mode = "at once" if r % 2 == 0 else "in turns"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for q in go:
            q.put((mode,))
        times[mode].append(max(done.get(timeout=300)[2] for _ in range(n)) - t0)
    for p in procs:
        p.join(timeout=60)
    print(
        f"{args.layout}, {n} readers on one GPU ({torch.cuda.get_device_name()}); floor {floor_s * 1e3:.2f} ms"
    )
    rows = []
    for mode, xs in times.items():
        xs = xs[2:]  # the first of each: warm-up
        med = statistics.median(xs)
        rows.append({"mode": mode, "median_s": med, "min_s": min(xs), "x_floor": med / floor_s})
        print(f"{mode:9s} median {med * 1e3:.2f} ms  x floor {med / floor_s:.3f}  min {min(xs) * 1e3:.2f} ms")
    emit({"layout": args.layout, "readers": n, "floor_s": floor_s, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
