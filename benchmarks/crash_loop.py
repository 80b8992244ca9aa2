"""Crash loop: SIGKILL the sender or the receiver at a random point of a push, over and over, on every
transport this machine runs (shm, collective), and check what the survivor and the machine are left with.

    python benchmarks/crash_loop.py --cycles 50         # the figures in docs/reliability.md
    (tests/test_hardening.py runs a few cycles of the same loop)

Each cycle: this process is the survivor (a WeightSender / WeightReceiver, or a rank of a broadcast group),
a spawned process the victim. They push continuously; once a push has completed, a timer SIGKILLs the victim
at a random delay within about two push durations. Checked per cycle: the survivor raises a typed raysync
error, and how long after the kill (the figure; the test checks only the error); nothing that raysync named for
this process or the victim is left in /dev/shm or the temp dir.
Checked over the run: this process's open file descriptors do not grow; a clean session works at the end.
Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import signal
import statistics
import tempfile
import threading
import time

import torch
from common import emit

from raysync import RaysyncError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core import leftovers
from raysync.tools.bench import receiver_for, sender_for, session

TENSORS = 8
NUMEL = 1 << 20  # 8 x 4 MB: 8 buckets of 4 MB per push


def _source() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((NUMEL,), float(i)) for i in range(TENSORS)}


def _dest() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(NUMEL) for i in range(TENSORS)}


# --- the victim, in a spawned process: pushes or receives until killed ------------------------------------------
def victim(role: str, transport: str, secret, config, where, out) -> None:
    torch.set_num_threads(1)
    if role == "sender":
        owner, found_at = sender_for(transport, secret, config)
        out.send(found_at)
    else:
        owner = receiver_for(transport, where, secret, config)
    side = session(owner)
    if role == "receiver":
        out.send("ready")  # the survivor starts the session only now: timeout_s need not cover our start-up
    src, dest = _source(), _dest()
    for version in range(1, 1 << 30):  # nothing more goes through the pipe: the kill may come at any point
        if role == "sender":
            side.push(src.items(), version)
        else:
            side.receive(into=dest)


# --- the survivor, here ------------------------------------------------------------------------------------------
def cycle(transport: str, victim_role: str, config: SyncConfig, rng: random.Random) -> dict:
    ctx = mp.get_context("spawn")
    secret = SessionSecret.generate()
    inbox, out = ctx.Pipe(duplex=False)  # a pipe, not a Queue: no named semaphores to leak when killed
    survivor = None
    if victim_role == "receiver":  # we send
        owner, where = sender_for(transport, secret, config)
        proc = ctx.Process(
            target=victim, args=("receiver", transport, secret, config, where, out), daemon=True
        )
        proc.start()
        survivor = session(owner)
        if not inbox.poll(120):
            raise TimeoutError("the victim never started")
        inbox.recv()
    else:  # we receive
        proc = ctx.Process(target=victim, args=("sender", transport, secret, config, None, out), daemon=True)
        proc.start()
        if not inbox.poll(120):
            raise TimeoutError("the victim never started")
        owner = receiver_for(transport, inbox.recv(), secret, config)
        survivor = session(owner)
    src, dest = _source(), _dest()
    durations: list[float] = []
    killed_at: list[float] = []
    armed = threading.Event()

    def killer() -> None:
        if not armed.wait(120):
            return  # the pushes never got going: the survivor's error says why
        time.sleep(rng.uniform(0, 2 * statistics.median(durations)))  # a random point, not a synchronisation
        os.kill(proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    error, raised_at = None, None
    try:
        for version in range(1, 1 << 30):
            t0 = time.monotonic()
            if victim_role == "receiver":
                survivor.push(src.items(), version)
            else:
                survivor.receive(into=dest)
            durations.append(time.monotonic() - t0)
            if len(durations) == 3:
                armed.set()
    except RaysyncError as e:
        error, raised_at = e, time.monotonic()
    except Exception as e:  # anything untyped counts as a failure of the test
        error, raised_at = e, time.monotonic()
    finally:
        owner.close()  # a group's session, then the group
    thread.join(timeout=10)
    proc.join(timeout=30)
    inbox.close()
    out.close()
    return {
        "transport": transport,
        "killed": victim_role,
        "error": type(error).__name__,
        "typed": isinstance(error, RaysyncError),
        "pushes_before": len(durations),
        "seconds_to_error": raised_at - killed_at[0] if killed_at else None,
        "victim_exit": proc.exitcode,
        "victim_pid": proc.pid,
    }


def raysync_entries(pids: set[int]) -> set[str]:
    """The entries in /dev/shm and the temp dir whose raysync name says one of ``pids`` made them (other
    programs on the machine make and remove theirs meanwhile: Note [names that outlive a crash])."""
    found = set()
    for directory in ("/dev/shm", tempfile.gettempdir()):
        for name in os.listdir(directory):
            owner = leftovers.owner_of(name)
            if owner is not None and owner.pid in pids:
                found.add(os.path.join(directory, name))
    return found


def open_fds() -> int:
    """Open file descriptors of this process, after a garbage collection (objects in reference cycles hold
    theirs until then)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def clean_session_works(config: SyncConfig) -> bool:
    src, dest = _source(), _dest()
    secret = SessionSecret.generate()
    with WeightSender(secret, config) as sender, WeightReceiver(sender.endpoint, secret, config) as receiver:
        t = threading.Thread(target=receiver.receive, kwargs={"into": dest})
        t.start()
        sender.push(src.items(), 1)
        t.join(timeout=60)
    return all(torch.equal(dest[k], src[k]) for k in src)


def run(cycles: int, timeout_s: float = 2.0, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    config = SyncConfig(bucket_bytes=4 << 20, timeout_s=timeout_s, progress=False)
    plan = [(t, v) for t in ("shm", "collective") for v in ("receiver", "sender")]
    before_entries = raysync_entries({os.getpid()})
    rows = []
    fds_after_first = None
    for c in range(cycles):
        transport, victim_role = plan[c % len(plan)]
        row = cycle(transport, victim_role, config, rng)
        row["leftovers"] = sorted(raysync_entries({os.getpid(), row["victim_pid"]}) - before_entries)
        rows.append(row)
        if c == len(plan) - 1:
            fds_after_first = open_fds()  # after one cycle of each kind: libraries have opened what they keep
    fds_end = open_fds()
    late = [r["seconds_to_error"] for r in rows if r["seconds_to_error"] is not None]
    return {
        "cycles": cycles,
        "timeout_s": timeout_s,
        "rows": rows,
        "untyped": [r for r in rows if not r["typed"]],
        "late": [r for r in rows if r["seconds_to_error"] is None or r["seconds_to_error"] > timeout_s + 1],
        "leftovers": sorted({x for r in rows for x in r["leftovers"]}),
        "max_seconds_to_error": max(late) if late else None,
        "median_seconds_to_error": statistics.median(late) if late else None,
        "fds_after_first_round": fds_after_first,
        "fds_at_end": fds_end,
        "clean_session_after": clean_session_works(config),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--timeout-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    r = run(args.cycles, args.timeout_s, args.seed)
    print(f"{'transport':<12}{'killed':<10}{'kills':>6}{'typed':>7}{'max s to error':>16}  errors")
    for t in ("shm", "collective"):
        for v in ("receiver", "sender"):
            rows = [x for x in r["rows"] if (x["transport"], x["killed"]) == (t, v)]
            if rows:
                worst = max((x["seconds_to_error"] or float("inf")) for x in rows)
                errors = ", ".join(sorted({x["error"] for x in rows}))
                print(
                    f"{t:<12}{v:<10}{len(rows):>6}{sum(x['typed'] for x in rows):>7}{worst:>16.2f}  {errors}"
                )
    print(
        f"timeout_s {r['timeout_s']}: late {len(r['late'])}, untyped {len(r['untyped'])}, leftovers "
        f"{len(r['leftovers'])}, fds after the first round {r['fds_after_first_round']} -> at the end "
        f"{r['fds_at_end']}, clean session after: {r['clean_session_after']}"
    )
    emit(r, args.json)


if __name__ == "__main__":
    main()
