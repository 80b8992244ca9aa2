"""Benchmark: how long a session's control messages take from one process to the other (issue 19: where the time
of a push goes besides the copies). A raw session (no Ray) of --tensors small tensors, cuda_ipc direct on a GPU or
shm on the CPU; both processes stamp every message they send and receive (time.perf_counter_ns: one clock for
the host's processes), by wrapping raysync.core.control.Channel's send and recv in this script only.

    python benchmarks/control_hops.py --device cuda
    python benchmarks/control_hops.py                  # CPU, shm

Prints the medians, in microseconds, of each hop (PushStart, Accept, PushDone: send called -> message decoded
on the other side) and of the work between them, then JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core import control


def stamp(log: list) -> None:
    """Every message this process's channels send or receive, with its kind and the time."""
    send, recv = control.Channel.send, control.Channel.recv

    def stamped_send(self, msg, stage):
        log.append(("send", type(msg).__name__, time.perf_counter_ns()))
        return send(self, msg, stage)

    def stamped_recv(self, stage, timeout_s=None):
        msg = recv(self, stage, timeout_s)
        log.append(("recv", type(msg).__name__, time.perf_counter_ns()))
        return msg

    control.Channel.send, control.Channel.recv = stamped_send, stamped_recv


def engine(endpoint, secret, config, device, tensors, pushes, out) -> None:
    log: list = []
    stamp(log)
    dest = {f"t{i}": torch.zeros(64, device=device) for i in range(tensors)}
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            receiver.receive(into=dest)
    out.put(log)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tensors", type=int, default=339, help="the 7B layout's count")
    ap.add_argument("--pushes", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    config = SyncConfig(
        transport="cuda_ipc" if cuda else "shm",
        direct=cuda,
        bucket_bytes=1 << 20,
        timeout_s=60,
        progress=False,
    )
    src = {f"t{i}": torch.randn(64, device=args.device) for i in range(args.tensors)}
    secret, ctx = SessionSecret.generate(), mp.get_context("spawn")
    out, log, warm = ctx.Queue(), [], 20
    with WeightSender(secret, config) as sender:
        child = ctx.Process(
            target=engine, args=(sender.endpoint, secret, config, args.device, args.tensors, args.pushes, out)
        )
        child.start()
        for version in range(warm):
            sender.push(src.items(), version)
        stamp(log)
        for version in range(warm, args.pushes):
            sender.push(src.items(), version)
        theirs = out.get(timeout=300)
        child.join(timeout=60)

    def at(lg: list, way: str, kind: str) -> list[int]:
        return [t for w, k, t in lg if (w, k) == (way, kind)]

    starts = at(log, "send", "PushStart")
    n = len(starts)
    pairs = {
        "PushStart: sender -> engine": (starts, at(theirs, "recv", "PushStart")[-n:]),
        "engine: PushStart -> Accept sent": (
            at(theirs, "recv", "PushStart")[-n:],
            at(theirs, "send", "Accept")[-n:],
        ),
        "Accept: engine -> sender": (at(theirs, "send", "Accept")[-n:], at(log, "recv", "Accept")),
        "engine: Accept sent -> PushDone sent": (
            at(theirs, "send", "Accept")[-n:],
            at(theirs, "send", "PushDone")[-n:],
        ),
        "PushDone: engine -> sender": (at(theirs, "send", "PushDone")[-n:], at(log, "recv", "PushDone")),
    }
    medians = {
        k: statistics.median(b - a for a, b in zip(x, y, strict=True)) / 1e3 for k, (x, y) in pairs.items()
    }
    print(f"{args.tensors} tensors, {config.transport}{' direct' if cuda else ''}, {n} pushes; medians in us")
    for k, v in medians.items():
        print(f"  {k:40s} {v:8.1f}")
    emit({"device": args.device, "tensors": args.tensors, "pushes": n, "median_us": medians}, args.json)


if __name__ == "__main__":
    main()
