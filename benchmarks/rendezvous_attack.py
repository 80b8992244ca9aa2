"""Sweep: strangers on the collective's rendezvous port while a real gloo session sets up and pushes.

    python benchmarks/rendezvous_attack.py --receivers 2 --attack-s 30 --attackers 4 --hoard 200 --json out.json

Rank 0 (this process) hosts the rendezvous store (raysync.transport.rendezvous). An attacker process starts
first, on the store's port: ``--attackers`` threads each write every hostile payload over a fresh connection
in a loop, ``--hoard`` connections are opened and left silent, and a client that knows the server's public
key (as if it leaked) but not the session's client key sends forged requests. Once it is at work, the
receivers (spawned processes, each with its own copy of the tiny model) join the group and the session pushes
for ``--attack-s`` seconds, every push checked bit-exact on every receiver; then the attack stops and the
same session pushes ``--pushes`` more versions (the baseline). Reported: the pushes' median seconds with and
without the attack, what became of every hostile connection (closed by the server, and after how long at
most), handshakes refused, forged requests answered, the sender's RSS growth during the attack, and a store
round trip (set + get) next to torch's TCPStore on this machine. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import threading
import time

import msgpack
import torch
import torch.distributed as dist
import zmq
from common import emit

from raysync import SessionSecret, SyncConfig
from raysync.transport.collective import CollectiveReceiver, CollectiveSender
from raysync.transport.rendezvous import CurveKeys, StoreClient
from raysync.transport.rendezvous_server import StoreServer

_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00"
HOSTILE = {
    "garbage 4 KiB": lambda: os.urandom(4096),
    "huge length prefix (ZMTP 1.0)": lambda: b"\xff" + struct.pack(">Q", (1 << 63) - 1) + b"x" * 64,
    "huge value (TCPStore SET)": lambda: b"\x00" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 1 << 40),
    "NULL greeting + 4 EiB frame": lambda: (
        _GREETING + b"NULL".ljust(52, b"\0") + b"\x06" + struct.pack(">Q", 1 << 62)
    ),
    "CURVE greeting + 4 EiB frame": lambda: (
        _GREETING + b"CURVE".ljust(52, b"\0") + b"\x06" + struct.pack(">Q", 1 << 62)
    ),
    "garbage 1 MiB": lambda: os.urandom(1 << 20),
}


def digest(named) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def perturb(model, version: int) -> None:
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def receiver_main(secret, config, rank, rendezvous, pushes, out) -> None:
    from raysync.tools.models import tiny_qwen2

    params = dict(tiny_qwen2(seed=99).named_parameters())
    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    receiver = group.join()
    for _ in range(pushes):
        try:
            report = receiver.receive(into=params, wait_s=600)
            out.put((rank, "ok", report.version, digest(params.items())))
        except Exception as e:
            out.put((rank, type(e).__name__, str(e), ""))
            return
    group.close()


# --- the attacker process --------------------------------------------------------------------------------------
def _hit(port: int, payload: bytes) -> tuple[str, float]:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        try:
            conn.sendall(payload)
            while conn.recv(1 << 16):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            return "open after 30 s", time.monotonic() - started
    return "closed", time.monotonic() - started


def attacker_main(port: int, server_public: bytes, threads: int, hoard: int, ready, stop, out) -> None:
    stats: dict[str, dict] = {}
    lock = threading.Lock()

    def record(kind: str, outcome: str, seconds: float) -> None:
        with lock:
            s = stats.setdefault(kind, {"connections": 0, "closed": 0, "max_open_s": 0.0})
            s["connections"] += 1
            s["closed"] += outcome == "closed"
            s["max_open_s"] = max(s["max_open_s"], seconds)

    def flood() -> None:
        while not stop.is_set():
            for kind, make in HOSTILE.items():
                record(kind, *_hit(port, make()))
            ready.set()  # every kind has been tried once: the session may start

    def hoarder() -> None:  # silent connections: closed by the server's handshake limit
        conns = [
            (socket.create_connection(("127.0.0.1", port), timeout=30), time.monotonic())
            for _ in range(hoard)
        ]
        for conn, opened in conns:
            outcome = "open after 30 s" if _drain(conn) else "closed"
            record(f"silent connection ({hoard} at once)", outcome, time.monotonic() - opened)
            conn.close()

    forged = {"tried": 0, "queued by zmq": 0, "answered": 0}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    for option, value in (
        (zmq.LINGER, 0),
        (zmq.CURVE_SERVERKEY, server_public),
        (zmq.CURVE_PUBLICKEY, public),
        (zmq.CURVE_SECRETKEY, secret),
        (zmq.SNDHWM, 0),
    ):
        sock.setsockopt(option, value)
    sock.connect(f"tcp://127.0.0.1:{port}")
    workers = [threading.Thread(target=flood, daemon=True) for _ in range(threads)]
    workers.append(threading.Thread(target=hoarder, daemon=True))
    for w in workers:
        w.start()
    while not stop.is_set():
        forged["tried"] += 1
        try:
            sock.send(msgpack.packb([forged["tried"], "set", ["1/start", b"forged"]]), zmq.NOBLOCK)
            forged["queued by zmq"] += 1
        except zmq.Again:  # no connection of this client ever completes its handshake
            pass
        if sock.poll(10):
            sock.recv_multipart()
            forged["answered"] += 1
    for w in workers:
        w.join(timeout=60)
    sock.close()
    out.put({"connections": stats, "forged_requests": forged})


def _drain(conn: socket.socket) -> bool:
    """Read until the server closes (False) or 30 s pass (True: still open)."""
    try:
        while conn.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return True
    return False


# --- measurements ------------------------------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store_round_trips(repeats: int) -> dict[str, float]:
    """Median microseconds of one set + get, raysync's store vs torch's TCPStore, on this machine."""
    secret = SessionSecret.generate()
    server = StoreServer(secret, "127.0.0.1", 1 << 20)
    ours = StoreClient(secret, "127.0.0.1", server.port, timeout_s=10, max_value_bytes=1 << 20)
    master = dist.TCPStore(
        "127.0.0.1",
        0,
        2,
        is_master=True,
        wait_for_workers=False,
        use_libuv=False,
        timeout=datetime.timedelta(seconds=10),
    )
    theirs = dist.TCPStore(
        "127.0.0.1", master.port, 2, is_master=False, use_libuv=False, timeout=datetime.timedelta(seconds=10)
    )

    def median_us(store) -> float:
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            store.set(f"k{i}", b"v" * 200)
            store.get(f"k{i}")
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    result = {"raysync store (CURVE)": median_us(ours), "torch TCPStore": median_us(theirs)}
    ours.close()
    server.close()
    return result


def pushes(sender, model, out, receivers: int, versions: range) -> tuple[list[float], list[str]]:
    seconds, problems = [], []
    for version in versions:
        perturb(model, version)
        t0 = time.perf_counter()
        sender.push(model.named_parameters(), version)
        seconds.append(time.perf_counter() - t0)
        want = digest(model.named_parameters())
        for _ in range(receivers):
            rank, kind, got_version, got = out.get(timeout=600)
            if (kind, got_version, got) != ("ok", version, want):
                problems.append(f"rank {rank} push {version}: {kind} {got_version}")
    return seconds, problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--attack-s", type=float, default=30.0, help="how long the session pushes under attack")
    ap.add_argument("--pushes", type=int, default=20, help="baseline pushes, after the attack")
    ap.add_argument("--attackers", type=int, default=4)
    ap.add_argument("--hoard", type=int, default=200)
    ap.add_argument("--round-trips", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from raysync.tools.models import tiny_qwen2

    ctx = mp.get_context("spawn")
    config = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)
    model = tiny_qwen2(seed=0)
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=args.receivers, backend="gloo")
    ready, stop, attack_out = ctx.Event(), ctx.Event(), ctx.Queue()
    rss_before = rss_bytes()
    attacker = ctx.Process(
        target=attacker_main,
        args=(
            group.rendezvous.port,
            CurveKeys.of(secret).server_public,
            args.attackers,
            args.hoard,
            ready,
            stop,
            attack_out,
        ),
    )
    attacker.start()
    if not ready.wait(timeout=300):
        raise TimeoutError("the attacker process did not start within 300 s")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=receiver_main, args=(secret, config, r, group.rendezvous, 1 << 20, out))
        for r in range(1, args.receivers + 1)
    ]
    for p in procs:
        p.start()
    sender = group.join()  # under attack
    attacked, problems, version = [], [], 0
    started = time.monotonic()
    while time.monotonic() - started < args.attack_s or not attacked:
        version += 1
        seconds, wrong = pushes(sender, model, out, args.receivers, range(version, version + 1))
        attacked, problems = attacked + seconds, problems + wrong
    stop.set()
    attack = attack_out.get(timeout=300)
    attacker.join(timeout=60)
    rss_growth = rss_bytes() - rss_before
    refused = group._server.refused
    baseline, more = pushes(sender, model, out, args.receivers, range(version + 1, version + 1 + args.pushes))
    group.close()
    for p in procs:
        p.kill()
        p.join(timeout=60)
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "pushes": {
            "attacked": len(attacked),
            "attacked_median_s": statistics.median(attacked),
            "baseline": len(baseline),
            "baseline_median_s": statistics.median(baseline),
            "bit_exact": not (problems + more),
            "problems": problems + more,
        },
        "attack": attack,
        "handshakes_refused": refused,
        "sender_rss_growth_bytes": rss_growth,
        "store_set_get_us": store_round_trips(args.round_trips),
    }
    print(f"{'hostile connection':40} {'count':>7} {'closed':>7} {'max open s':>10}")
    for kind, s in attack["connections"].items():
        print(f"{kind:40} {s['connections']:7d} {s['closed']:7d} {s['max_open_s']:10.2f}")
    f = attack["forged_requests"]
    print(
        f"forged requests from a leaked-key client: {f['tried']} tried, {f['queued by zmq']} queued by zmq, "
        f"{f['answered']} answered; handshakes refused: {refused}"
    )
    r = result["pushes"]
    print(
        f"pushes: {r['attacked']} under attack (median {r['attacked_median_s']:.3f} s), {r['baseline']} after "
        f"(median {r['baseline_median_s']:.3f} s); bit-exact: {r['bit_exact']}; "
        f"sender RSS growth under attack: {rss_growth / 1e6:.1f} MB"
    )
    print("store set+get: " + ", ".join(f"{k} {v:.0f} us" for k, v in result["store_set_get_us"].items()))
    emit(result, args.json)


if __name__ == "__main__":
    main()
