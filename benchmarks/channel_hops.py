"""Benchmark: one hop of a small frame between two processes of one host, through zmq (as raysync's control
channels and push loops send them: DEALER -> ROUTER over ipc://, the receiver asleep in zmq's poll) and through a
plain Unix stream socket (the receiver asleep in recv), with the receiver idle between frames as a push loop is.

    python benchmarks/channel_hops.py --frames 2000 --gap-ms 1 --json hops.json

A ping-pong: the parent sends a 100-byte frame, the child answers it at once; a hop is half the round trip.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time

import zmq
from common import emit

FRAME = b"x" * 100


def zmq_child(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send(b"hello")
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(10_000):
            break
        frame = sock.recv()
        if frame == b"stop":
            break
        sock.send(frame)
    sock.close(linger=0)
    ctx.term()


def unix_child(path: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    while True:
        frame = sock.recv(4096)
        if not frame or frame == b"stop":
            break
        sock.sendall(frame)
    sock.close()


def run_zmq(frames: int, gap_s: float, where: str) -> list[float]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    address = f"ipc://{where}/zmq"
    sock.bind(address)
    child = mp.get_context("spawn").Process(target=zmq_child, args=(address,))
    child.start()
    ident, _ = sock.recv_multipart()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    times = []
    for _ in range(frames):
        time.sleep(gap_s)  # the workload: the child idles between frames, as a push loop between pushes
        t0 = time.perf_counter()
        sock.send_multipart([ident, FRAME])
        poller.poll(10_000)
        sock.recv_multipart()
        times.append((time.perf_counter() - t0) / 2)
    sock.send_multipart([ident, b"stop"])
    child.join(10)
    sock.close(linger=0)
    ctx.term()
    return times


def run_unix(frames: int, gap_s: float, where: str) -> list[float]:
    path = f"{where}/unix"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    child = mp.get_context("spawn").Process(target=unix_child, args=(path,))
    child.start()
    conn, _ = server.accept()
    times = []
    for _ in range(frames):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        conn.sendall(FRAME)
        conn.recv(4096)
        times.append((time.perf_counter() - t0) / 2)
    conn.sendall(b"stop")
    child.join(10)
    conn.close()
    server.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--gap-ms", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as where:
        for gap_ms in args.gap_ms:
            for name, run in (("zmq ipc", run_zmq), ("unix socket", run_unix)):
                times = sorted(run(args.frames, gap_ms / 1e3, where))
                os.unlink(f"{where}/{'zmq' if name == 'zmq ipc' else 'unix'}")
                row = {
                    "channel": name,
                    "gap_ms": gap_ms,
                    "hop_p50_us": times[len(times) // 2] * 1e6,
                    "hop_p90_us": times[len(times) * 9 // 10] * 1e6,
                    "hop_mean_us": statistics.fmean(times) * 1e6,
                }
                rows.append(row)
                print(
                    f"{name:<12} idle {gap_ms:>4} ms between frames: hop p50 {row['hop_p50_us']:7.1f} us, "
                    f"p90 {row['hop_p90_us']:7.1f} us"
                )
    emit({"cpus": os.cpu_count(), "frames": args.frames, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
