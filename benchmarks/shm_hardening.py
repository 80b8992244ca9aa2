"""Shared memory and the handshake under attack, at full size: a peer that tries to resize a ring segment at every
bucket, in every way, on both sides; SIGKILLs at every point of the handshake; every spelling of "every interface".

    python benchmarks/shm_hardening.py --kills 10 --json docs/results/shm_hardening.json
    (tests/test_shm_hardening.py runs one case of each at a small size)

1. Resize: one victim process per side runs session after session; this process is the hostile peer and, in
   push 2 of each session, right after bucket k (k = 0..7, 8 buckets over 2 buffers) tries to resize the buffer
   of that bucket: ftruncate to each of several sizes, posix_fallocate past its end, one more seal; through its
   own fd of the segment and through the victim's, opened at /proc/<pid>/fd. Counted: what each attempt got
   (EPERM: refused by the seals; anything else is a finding), and the victim's outcome (no error and every push
   bit-exact, a typed raysync error, or death by a signal: -7 is SIGBUS).
2. Handshake kills: a victim SIGKILLed at fixed points of its first session (sender bound and waiting for a
   Hello; sender with its ring made, waiting for the receiver to fetch it) and at random points of it (either
   side). Counted: entries named after the victim's pid left in /dev/shm and the temp dir right after the
   kill, and after the next session on the machine was made (Note [names that outlive a crash]); the
   survivor's error type (at the ring-made point: a receiver that comes to fetch the ring after the kill).
3. Bind guard: every generated spelling of 0.0.0.0 and :: through SenderChannel, and random IPv4 addresses in
   random inet_aton spellings through the guard. Counted: refusals, wrong decisions, time per decision.
Prints a table per part and JSON.
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import functools
import itertools
import multiprocessing as mp
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable

import torch
from common import emit

from raysync import RaysyncError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.control import ReceiverChannel, SenderChannel, binds_every_interface
from raysync.core.errors import EndpointError
from raysync.core.leftovers import owner_of
from raysync.core.wire import Hello, RingInfo
from raysync.transport.shm import ShmRingReceiver

BUCKETS = 8
CONFIG = SyncConfig(bucket_bytes=256 << 10, timeout_s=5, progress=False)  # 8 buckets of 256 KiB, 2 buffers
SIZES = {
    "0": 0,
    "1 byte": 1,
    "1 page": 4096,
    "half": CONFIG.bucket_bytes // 2,
    "1 byte short": CONFIG.bucket_bytes - 1,
    "1 page longer": CONFIG.bucket_bytes + 4096,
}


def _source(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((CONFIG.bucket_bytes // 4,), float(version * 10 + i)) for i in range(BUCKETS)}


def _dest() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(CONFIG.bucket_bytes // 4) for i in range(BUCKETS)}


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, type(e.__cause__).__name__ if e.__cause__ is not None else ""


# --- 1. resize -------------------------------------------------------------------------------------------------------
def _bit_exact(dest: dict[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(dest[k], v) for k, v in _source(version).items())


def resize_victim(role: str, secret: SessionSecret, conn) -> None:
    """Serves sessions until told to stop: a sender pushes 3 versions per session, a receiver receives them and
    checks every byte."""
    torch.set_num_threads(1)
    conn.send("ready")  # imports done: a session's timeout_s starts only now
    while (msg := conn.recv()) != "stop":
        try:
            exact = True
            if role == "sender":
                with WeightSender(secret, CONFIG) as side:
                    conn.send(side.endpoint)
                    for version in (1, 2, 3):
                        side.push(_source(version).items(), version)
            else:
                with WeightReceiver(msg, secret, CONFIG) as side:
                    for _ in range(3):
                        dest = _dest()
                        exact &= _bit_exact(dest, side.receive(into=dest).version)
            conn.send(("no error", exact))
        except RaysyncError as e:
            error, cause = _error(e)
            conn.send((error + (f" (cause {cause})" if cause else ""), False))


class Victim:
    """A victim process and its pipe; restarted when it dies."""

    def __init__(self, role: str, secret: SessionSecret):
        self.role, self.secret, self.ctx = role, secret, mp.get_context("spawn")
        self.start()

    def start(self) -> None:
        self.conn, theirs = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=resize_victim, args=(self.role, self.secret, theirs), daemon=True)
        self.proc.start()
        theirs.close()  # EOF here when the victim dies
        if not (self.conn.poll(120) and self.conn.recv() == "ready"):
            raise TimeoutError(f"the {self.role} victim did not start within 120 s")

    def outcome(self) -> tuple[str, bool]:
        try:
            if self.conn.poll(60):
                return self.conn.recv()
        except EOFError:
            pass
        self.proc.join(timeout=30)
        code = self.proc.exitcode
        self.start()
        return (f"died ({signal.Signals(-code).name})" if code and code < 0 else f"exit {code}"), False


def _victims_fd(pid: int, inode: int) -> int:
    """The victim's fd of the segment ``inode``, opened through /proc/<pid>/fd as any process of this user can."""
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            if os.readlink(path).startswith("/memfd:raysync-") and os.stat(path).st_ino == inode:
                return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
    raise LookupError(f"process {pid} holds no fd of segment {inode}")


def _attempts(fd: int, size: int) -> dict[str, Callable[[], object]]:
    cuts = {f"ftruncate to {name}": functools.partial(os.ftruncate, fd, n) for name, n in SIZES.items()}
    return cuts | {
        "fallocate past the end": lambda: os.posix_fallocate(fd, size, 4096),
        "add F_SEAL_WRITE": lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
    }


def _try_to_resize(ring, slot: int, victim_pid: int, tried: list[str]) -> None:
    """Every attempt, through this side's fd and the victim's; appends what each got (errno name, or "DONE")."""
    own = ring._segments[slot].fd
    theirs = _victims_fd(victim_pid, os.fstat(own).st_ino)
    try:
        for fd in (own, theirs):
            for attempt in _attempts(fd, CONFIG.bucket_bytes).values():
                try:
                    attempt()
                    tried.append("DONE")
                except OSError as e:
                    tried.append(errno.errorcode.get(e.errno, str(e.errno)))
    finally:
        os.close(theirs)


def _try_after(ring, hook: str, k: int, victim_pid: int, tried: list[str]) -> None:
    """Wrap ``ring.<hook>`` (after_pack, after_unpack) so that its k-th call then tries to resize that buffer."""
    done, count = getattr(ring, hook), itertools.count()

    def then_try(slot: int) -> None:
        done(slot)
        if next(count) == k:
            _try_to_resize(ring, slot, victim_pid, tried)

    setattr(ring, hook, then_try)


def resize_case(victim: Victim, k: int) -> dict:
    """Push 2 of one session: the hostile side tries to resize the buffer of bucket k."""
    tried: list[str] = []
    exact = True
    if victim.role == "sender":  # this process receives, and tries after reading bucket k
        victim.conn.send("session")
        with WeightReceiver(victim.conn.recv(), victim.secret, CONFIG) as receiver:
            for version in (1, 2, 3):
                if version == 2:
                    _try_after(receiver.ring, "after_unpack", k, victim.proc.pid, tried)
                dest = _dest()
                try:
                    exact &= _bit_exact(dest, receiver.receive(into=dest).version)
                except RaysyncError:
                    exact = False
        outcome, victim_exact = victim.outcome()
        return {"tried": tried, "victim_outcome": outcome, "bit_exact": exact and victim_exact}
    with WeightSender(
        victim.secret, CONFIG
    ) as sender:  # this process sends, and tries after packing bucket k
        victim.conn.send(sender.endpoint)
        sender.push(_source(1).items(), 1)
        _try_after(sender.ring, "after_pack", k, victim.proc.pid, tried)
        try:
            for version in (2, 3):
                sender.push(_source(version).items(), version)
        except RaysyncError:
            pass
        outcome, victim_exact = victim.outcome()
        return {"tried": tried, "victim_outcome": outcome, "bit_exact": victim_exact}


def resize_sweep() -> list[dict]:
    rows = []
    for role in ("sender", "receiver"):
        victim = Victim(role, SessionSecret.generate())
        for k in range(BUCKETS):
            rows.append({"victim": role, "bucket": k, **resize_case(victim, k)})
        victim.conn.send("stop")
        victim.proc.join(timeout=30)
    return rows


# --- 2. handshake kills -----------------------------------------------------------------------------------------------
def kill_victim(role: str, secret: SessionSecret, endpoint: str | None, conn) -> None:
    torch.set_num_threads(1)
    if role == "sender":
        with WeightSender(secret, CONFIG) as sender:
            conn.send(sender.endpoint)
            for version in range(1, 1 << 20):
                sender.push(_source(version).items(), version)
    with WeightReceiver(endpoint, secret, CONFIG) as receiver:
        conn.send("connecting")
        while True:
            receiver.receive(into=_dest())


def _entries_of(pid: int) -> list[str]:
    found = []
    for d in ("/dev/shm", tempfile.gettempdir()):
        found += [
            os.path.join(d, n) for n in os.listdir(d) if (o := owner_of(n)) is not None and o.pid == pid
        ]
    return sorted(found)


def kill_case(point: str, rng: random.Random) -> dict:
    ctx, secret = mp.get_context("spawn"), SessionSecret.generate()
    mine, theirs = ctx.Pipe()
    role = "receiver" if point.startswith("receiver") else "sender"
    survivor: WeightSender | WeightReceiver | None = None
    if role == "receiver":
        survivor = WeightSender(secret, CONFIG)
    proc = ctx.Process(
        target=kill_victim, args=(role, secret, survivor and survivor.endpoint, theirs), daemon=True
    )
    proc.start()
    theirs.close()
    assert mine.poll(120), "the victim never started"
    said = mine.recv()
    error, info = "", None
    if point == "sender: ring made, not fetched":
        channel = ReceiverChannel(secret, endpoint=said, timeout_s=CONFIG.timeout_s, max_frame_bytes=1 << 20)
        channel.send(Hello(os.getpid(), "bench"), "handshake")
        info = channel.expect(RingInfo, 0, "handshake: waiting for the ring description")
        channel.close()
    if point.endswith("random point"):
        survivor = survivor or WeightReceiver(said, secret, CONFIG)
        delay = rng.uniform(0, 0.5)  # a random point of set-up and the first pushes, not a synchronisation
        threading.Timer(delay, os.kill, (proc.pid, signal.SIGKILL)).start()
        try:
            for version in range(1, 1 << 20):
                if role == "receiver":
                    survivor.push(_source(version).items(), version)
                else:
                    survivor.receive(into=_dest())
        except RaysyncError as e:
            error = type(e).__name__
        except Exception as e:  # untyped: a finding
            error = f"UNTYPED {type(e).__name__}"
    else:
        os.kill(proc.pid, signal.SIGKILL)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
    if info is not None:  # a receiver that comes to fetch the ring after the kill
        try:
            ShmRingReceiver(info, timeout_s=CONFIG.timeout_s).close()
            error = "FETCHED a dead sender's ring"
        except RaysyncError as e:
            error = type(e).__name__
    left = _entries_of(proc.pid)
    if survivor is not None:
        survivor.close()
    with WeightSender(SessionSecret.generate(), CONFIG):  # the next session on the machine sweeps
        after = _entries_of(proc.pid)
    proc.join(timeout=30)
    return {"point": point, "left_at_kill": left, "left_after_next_session": after, "survivor_error": error}


KILL_POINTS = (
    "sender: bound, no Hello",
    "sender: ring made, not fetched",
    "sender: random point",
    "receiver: random point",
)


# --- 3. bind guard ----------------------------------------------------------------------------------------------------
def zero_spellings() -> list[str]:
    part = ["0", "00", "000", "0000000000", "0x0", "0X0", "0x00", "0x0000000000"]
    v4 = [".".join(p) for n in range(1, 5) for p in itertools.product(part, repeat=n)]
    group = ["0", "00", "0000"]
    v6 = ["::", "::0", "0::", "0::0", "::0.0.0.0", "::ffff:0.0.0.0", "::ffff:0:0", "0:0:0:0:0:ffff:0.0.0.0"]
    v6 += [":".join(g) for g in itertools.product(group, repeat=8)]
    v6 += [f"{':'.join(g)}::" for n in range(1, 7) for g in itertools.product(group, repeat=n)]
    hosts = ["*"] + v4 + v6
    return hosts + [f"[{h}]" for h in v6] + [f"{h}%lo" for h in v4[:500] + v6[:500]]


def random_spelling(rng: random.Random) -> tuple[str, int]:
    value = 0 if rng.random() < 0.5 else rng.getrandbits(32)
    n = rng.randint(1, 4)
    parts, shift = [], 32
    for size in [1] * (n - 1) + [5 - n]:
        shift -= 8 * size
        v = (value >> shift) & ((1 << (8 * size)) - 1)
        zeros = "0" * rng.randint(0, 12)
        parts.append(
            rng.choice(
                [
                    str(v) if v else zeros + "0",
                    "0" + zeros + format(v, "o"),
                    "0x" + zeros + format(v, "x"),
                    "0X" + zeros + format(v, "X"),
                ]
            )
        )
    return ".".join(parts), value


def guard_sweep(random_inputs: int, seed: int) -> dict:
    spellings = zero_spellings()
    accepted, times = [], []
    for host in spellings:
        t0 = time.perf_counter()
        try:
            SenderChannel(
                SessionSecret.generate(),
                endpoint=f"tcp://{host}:*",
                allow_any_interface=False,
                timeout_s=1,
                max_frame_bytes=1 << 16,
            ).close()
            accepted.append(host)
        except EndpointError as e:
            if "every interface" not in str(e):
                accepted.append(f"{host} ({e})")
        times.append(time.perf_counter() - t0)
    rng, wrong, guard_times = random.Random(seed), [], []
    for _ in range(random_inputs):
        host, value = random_spelling(rng)
        t0 = time.perf_counter()
        refused = binds_every_interface(host)
        guard_times.append(time.perf_counter() - t0)
        if refused != (value == 0):
            wrong.append(host)
    return {
        "spellings_of_every_interface": len(spellings),
        "accepted": accepted,
        "channel_refusal_s_median": statistics.median(times),
        "random_ipv4_spellings": random_inputs,
        "wrong_decisions": wrong,
        "guard_s_median": statistics.median(guard_times),
        "guard_s_max": max(guard_times),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10, help="kills per handshake point")
    ap.add_argument("--random-spellings", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    resize = resize_sweep()
    print(f"{'victim':<10}{'cases':>6}{'attempts':>10}  {'attempts got':<24}victim's outcome")
    for role in ("sender", "receiver"):
        rows = [r for r in resize if r["victim"] == role]
        got = collections.Counter(t for r in rows for t in r["tried"])
        outcome = collections.Counter(
            r["victim_outcome"] + (", bit-exact" if r["bit_exact"] else ", NOT bit-exact") for r in rows
        )
        print(f"{role:<10}{len(rows):>6}{sum(got.values()):>10}  {dict(got)!s:<24}{dict(outcome)}")
    rng = random.Random(args.seed)
    kills = [kill_case(p, rng) for p in KILL_POINTS for _ in range(args.kills)]
    print(f"\n{'killed at':<34}{'kills':>6}{'left entries':>14}{'left after next':>17}  survivor errors")
    for p in KILL_POINTS:
        rows = [r for r in kills if r["point"] == p]
        errors = sorted({r["survivor_error"] for r in rows if r["survivor_error"]})
        print(
            f"{p:<34}{len(rows):>6}{sum(len(r['left_at_kill']) for r in rows):>14}"
            f"{sum(len(r['left_after_next_session']) for r in rows):>17}  {', '.join(errors)}"
        )
    guard = guard_sweep(args.random_spellings, args.seed)
    print(
        f"\nbind guard: {guard['spellings_of_every_interface']} spellings of every interface, accepted "
        f"{len(guard['accepted'])}; {guard['random_ipv4_spellings']} random IPv4 spellings, wrong decisions "
        f"{len(guard['wrong_decisions'])}; guard median {guard['guard_s_median'] * 1e6:.1f} us, max "
        f"{guard['guard_s_max'] * 1e6:.1f} us"
    )
    emit(
        {
            "resize": resize,
            "kills": kills,
            "guard": guard,
            "seconds": time.perf_counter() - t0,
            "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
        },
        args.json,
    )


if __name__ == "__main__":
    main()
