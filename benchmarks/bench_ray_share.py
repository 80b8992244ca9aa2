"""Benchmark: Ray's share of a WeightSync push on the CPU, with a layout so small that the transfer costs ~nothing.

    python benchmarks/bench_ray_share.py --pushes 200 --out docs/results/ray_share_vm.json

A trainer actor and an engine actor (``num_cpus=0``) hold ``--tensors`` float32 tensors of ``--numel`` elements
(20 x 4 KB by default) and push them over shm, through ``WeightSync(push_rounds=...)`` once per way a round
reaches the actors ("calls", "graph", "loop"), and through the same pair as a raw session (WeightSender here,
WeightReceiver in a spawned process, no Ray). Each row: the median of ``--pushes`` pushes after ``--warmup``.
Ray's share is a row's median minus the raw session's. Each row also says the CPU time a push costs (user + system,
``resource.getrusage`` of each process over the timed pushes, every thread of it): the driver, the sender's and
the receiver's process (raw session: the sending process and the receiving one): on a VM whose cores other work
shares, a figure that moves less than the wall clock's.

Then a second pass per row, with stamps (time.perf_counter_ns: CLOCK_MONOTONIC, one clock for the host's
processes) taken by wrappers this script installs around raysync's functions in the driver and in both actors
(nothing in raysync is changed or slowed when the script does not run), splits a push into stages, medians in
microseconds:

    push() -> go sent            the driver's work before the round reaches the actors (loop: the go frames sent;
                                 calls, graph: taken as push() itself)
    go -> woke                   a loop's read returns the go (loop only)
    go -> work starts            the endpoint function begins (sender_push, _receive) in each actor
    work                         the endpoint function, session included
    PushDone sent -> work done   the receiver's session after it sent its sender PushDone (its report, the
                                 endpoint's bookkeeping)
    work done -> encoded         the answer made into a frame (loop only)
    encoded -> sent              the frame handed to the socket (loop only)
    sent -> received             the driver reads it (loop only)
    received -> decoded          checked and rebuilt (loop only)
    receiver's work done -> push() returns   (loops: the sender's answer may come after it: read at the next push)

``--pythonpath`` runs the rows against another checkout of raysync (its ``raysync`` package first on the path of
the driver and the actors), so that a before/after pair of runs measures the same script. Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any

import ray
import torch
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender, WeightSync

ROUNDS = ("calls", "graph", "loop")


# --- the actors ----------------------------------------------------------------------------------------------------
class Holder:
    def __init__(self, tensors: int, numel: int, fill: bool):
        torch.set_num_threads(1)
        self.tensors = layout(tensors, numel, fill)
        instrument_actor(self)

    def bump(self, value: float) -> float:
        for t in self.tensors.values():
            t.view(-1)[:1].fill_(value)
        return checksum(self.tensors)

    def checksum(self) -> float:
        return checksum(self.tensors)


def cpu_s(_actor: Any = None) -> float:
    """User + system CPU seconds of this process so far, every thread of it."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def layout(tensors: int, numel: int, fill: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    make = (lambda: torch.randn(numel, generator=g)) if fill else (lambda: torch.zeros(numel))
    return {f"layers.{i}.weight": make() for i in range(tensors)}


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.double().sum().item() for t in tensors.values()))


def source(actor: Holder):
    return actor.tensors.items()


def sink(actor: Holder):
    return actor.tensors


# --- stamps ----------------------------------------------------------------------------------------------------------
_EVENTS: list[tuple[str, int]] = []  # this process's (stage, perf_counter_ns), while _ON
_ON = [
    False
]  # stamps are taken (the wrappers are installed from the start: Ray keeps what it unpickled once)
_LOOP = threading.local()  # a push loop's thread: when its poll last woke, whether an answer is on its way


def _stamp(name: str) -> None:
    if _ON[0]:
        _EVENTS.append((name, time.perf_counter_ns()))


def stamping(actor: Any, on: bool) -> list[tuple[str, int]]:
    """Turn stamps on or off in this process; returns (and forgets) those taken so far."""
    _ON[0] = on
    out = list(_EVENTS)
    _EVENTS.clear()
    return out


def _wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    """``owner.attr`` stamps ``before`` on entry and ``after`` on return (absent attributes are left alone)."""
    original = getattr(owner, attr, None)
    if original is None or getattr(original, "_stamped", False):
        return

    def stamped(*args, **kwargs):
        if before:
            _stamp(before)
        try:
            return original(*args, **kwargs)
        finally:
            if after:
                _stamp(after)

    stamped._stamped = True  # type: ignore[attr-defined]
    setattr(owner, attr, stamped)


def instrument_actor(actor: Any) -> None:
    """In an actor (through __ray_call__): its endpoint functions, and its push loop's wake-up, answer, send."""
    from raysync.core import control
    from raysync.ray import endpoint, loop_channel, loop_member

    _wrap(endpoint, "sender_push", "work starts", "work done")
    _wrap(endpoint, "_receive", "work starts", "work done")
    _wrap(loop_member, "_run", None, "encoded")
    channel = control.Channel
    if not getattr(channel.send, "_stamped", False):  # the receiver's PushDone, handed to its socket
        send_msg = channel.send

        def timed_send_msg(self, msg, *args, **kwargs):
            send_msg(self, msg, *args, **kwargs)
            if type(msg).__name__ == "PushDone":
                _stamp("PushDone sent")

        timed_send_msg._stamped = True  # type: ignore[attr-defined]
        channel.send = timed_send_msg
    member = loop_channel.MemberEnd
    if getattr(member.recv, "_stamped", False):
        return
    recv, send = member.recv, member.send

    def timed_recv(self, *args, **kwargs):
        frame = recv(self, *args, **kwargs)
        if frame is not None and threading.current_thread().name.startswith("raysync-push-loop"):
            _stamp("woke")
        return frame

    def timed_send(self, *args, **kwargs):
        if threading.current_thread().name.startswith("raysync-push-loop"):
            _stamp(
                "sent"
            )  # as it is handed to the socket: the driver may read it before this thread runs again
        return send(self, *args, **kwargs)

    timed_recv._stamped = timed_send._stamped = True  # type: ignore[attr-defined]
    member.recv, member.send = timed_recv, timed_send


def instrument_driver() -> None:
    """On the driver: the go frames sent, each answer read (Codec.decode) and rebuilt (from_wire)."""
    from raysync.ray import loop_channel, loop_wire, push_loop

    _wrap(loop_channel.DriverEnd, "send", None, "go sent")
    _wrap(loop_wire.Codec, "decode", "received", None)
    _wrap(push_loop, "from_wire", None, "decoded")


# --- one row ---------------------------------------------------------------------------------------------------------
def weightsync_row(actors: tuple[Any, Any], rounds: str, args) -> dict[str, Any]:
    trainer, engine = actors
    config = SyncConfig(transport="shm", timeout_s=60, progress=False)
    want = ray.get(trainer.bump.remote(float(ROUNDS.index(rounds) + 3)))
    t0 = time.perf_counter()
    with WeightSync([trainer], [engine], config, source=source, sink=sink, push_rounds=rounds) as sync:
        setup_s = time.perf_counter() - t0
        timed_pushes(sync, 0, args.warmup, 0)
        before = [cpu_s(), *ray.get([a.__ray_call__.remote(cpu_s) for a in actors])]
        times = timed_pushes(sync, args.warmup, 0, args.pushes)
        after = [cpu_s(), *ray.get([a.__ray_call__.remote(cpu_s) for a in actors])]
        got = ray.get(engine.checksum.remote())
        assert got == want, f"{rounds}: the engine holds other values than the trainer"
        stages = breakdown(sync, actors, rounds, args.warmup + args.pushes, args.pushes)
    return {
        "rounds": rounds,
        "setup_s": setup_s,
        "median_us": statistics.median(times) / 1e3,
        "min_us": min(times) / 1e3,
        "cpu_us_per_push": cpu_per_push(before, after, args.pushes),
        "stages_us": stages,
    }


def cpu_per_push(before: list[float], after: list[float], pushes: int) -> dict[str, float]:
    """CPU us a push cost in each process: [driver or sending process, sender actor, receiver (process)]."""
    us = [(b - a) * 1e6 / pushes for a, b in zip(before, after, strict=True)]
    if len(us) == 2:  # the raw session: no driver
        us = [0.0, *us]
    return {"driver": us[0], "sender": us[1], "receiver": us[2], "all": sum(us)}


def timed_pushes(sync: WeightSync, first: int, warmup: int, pushes: int) -> list[int]:
    for v in range(first, first + warmup):
        sync.push(v)
    times = []
    for v in range(first + warmup, first + warmup + pushes):
        t0 = time.perf_counter_ns()
        sync.push(v)
        times.append(time.perf_counter_ns() - t0)
    return times


def breakdown(sync: WeightSync, actors: tuple[Any, Any], rounds: str, first: int, pushes: int) -> dict:
    """Medians (us) of each stage, each push's stamps read within its own push() call."""
    ray.get([a.__ray_call__.remote(stamping, True) for a in actors])
    stamping(None, True)
    windows = []
    for v in range(first, first + pushes):
        t0 = time.perf_counter_ns()
        sync.push(v)
        windows.append((t0, time.perf_counter_ns()))
    sender_ev, receiver_ev = ray.get([a.__ray_call__.remote(stamping, False) for a in actors])
    driver_ev = stamping(None, False)
    # a round is over once the receiver holds the version; the sender's answer may come after push() returned
    # (Note [the senders' answers, late]): its stamps are read up to the next push's start
    late = [(w[0], nxt[0]) for w, nxt in zip(windows, [*windows[1:], (float("inf"), 0)], strict=True)]
    rows = []
    for w, s in zip(windows, late, strict=True):
        sender = within(sender_ev, s)
        if sender["work done"]:  # the last push's sender may not have answered when the stamps were read
            rows.append(stages(rounds, w, within(driver_ev, w), sender, within(receiver_ev, w)))
    return {k: statistics.median(r[k] for r in rows) / 1e3 for k in rows[0] if all(k in r for r in rows)}


def within(events: list[tuple[str, int]], window: tuple[int, int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = collections.defaultdict(list)
    for name, t in events:
        if window[0] <= t <= window[1]:
            out[name].append(t)
    return out


def stages(
    rounds: str, window: tuple[int, int], driver: dict, sender: dict, receiver: dict
) -> dict[str, int]:
    """One push's stages in ns: ``driver``, ``sender``, ``receiver``: stage -> its stamps in the push's window."""
    t0, t1 = window
    go = driver["go sent"][-1] if rounds == "loop" else t0
    row = {"total": t1 - t0, "push() -> go sent": go - t0}

    def gap(key: str, ev: dict, end: tuple[str, int], start: tuple[str, int] | None) -> None:
        """row[key] = the stamp ``end`` (name, index) minus ``start`` (None: the go); left out where one is
        missing (a stamp this version of raysync does not take)."""
        try:
            row[key] = ev[end[0]][end[1]] - (go if start is None else ev[start[0]][start[1]])
        except IndexError:
            pass

    for who, ev in (("sender", sender), ("receiver", receiver)):
        gap(f"{who}: go -> work starts", ev, ("work starts", 0), None)
        gap(f"{who}: work", ev, ("work done", -1), ("work starts", 0))
        if rounds == "loop":
            gap(f"{who}: go -> woke", ev, ("woke", 0), None)
            gap(f"{who}: woke -> work starts", ev, ("work starts", 0), ("woke", 0))
            gap(f"{who}: work done -> encoded", ev, ("encoded", -1), ("work done", -1))
            gap(f"{who}: PushDone sent -> work done", ev, ("work done", -1), ("PushDone sent", -1))
            gap(f"{who}: encoded -> sent", ev, ("sent", -1), ("encoded", -1))
    if rounds == "loop":  # the driver reads the answers in the order they come: match them by time
        for who, ev in (("sender", sender), ("receiver", receiver)):
            if not ev["sent"] or not [t for t in driver["received"] if t >= ev["sent"][-1]]:
                continue  # read at the next push (the sender's, late)
            received = min(t for t in driver["received"] if t >= ev["sent"][-1])
            decoded = min(t for t in driver["decoded"] if t >= received)
            row[f"{who}: sent -> received"] = received - ev["sent"][-1]
            row[f"{who}: received -> decoded"] = decoded - received
        row["last decoded -> push() returns"] = t1 - max(driver["decoded"])
    row["receiver's work done -> push() returns"] = t1 - receiver["work done"][-1]
    row["sender+receiver work (overlap)"] = max(sender["work done"][-1], receiver["work done"][-1]) - min(
        sender["work starts"][0], receiver["work starts"][0]
    )
    return row


# --- the raw session: two processes, no Ray ------------------------------------------------------------------------
def raw_receiver(q_in, q_out, config: SyncConfig, tensors: int, numel: int, pushes: int) -> None:
    torch.set_num_threads(1)
    dest = layout(tensors, numel, fill=False)
    endpoint, secret, warmup = q_in.get(timeout=120)
    with WeightReceiver(endpoint, secret, config) as receiver:
        for i in range(pushes):
            if i == warmup:
                start = cpu_s()
            receiver.receive(into=dest)
        used = cpu_s() - start
    q_out.put((checksum(dest), used))


def raw_row(args) -> dict[str, Any]:
    config = SyncConfig(transport="shm", timeout_s=60, progress=False)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    total = args.warmup + args.pushes
    proc = ctx.Process(target=raw_receiver, args=(q_in, q_out, config, args.tensors, args.numel, total))
    proc.start()
    src = layout(args.tensors, args.numel, fill=True)
    try:
        secret = SessionSecret.generate()
        with WeightSender(secret, config) as sender:
            q_in.put((sender.endpoint, secret, args.warmup))
            times = []
            for v in range(total):
                if v == args.warmup:
                    start = cpu_s()
                t0 = time.perf_counter_ns()
                sender.push(src.items(), v)
                times.append(time.perf_counter_ns() - t0)
            used = cpu_s() - start
        got, received_cpu = q_out.get(timeout=120)
    finally:
        proc.join(timeout=60)
    assert got == checksum(src), "the raw session's receiver holds other values than the sender's"
    times = times[args.warmup :]
    return {
        "rounds": "raw session",
        "median_us": statistics.median(times) / 1e3,
        "min_us": min(times) / 1e3,
        "cpu_us_per_push": cpu_per_push([0.0, 0.0], [used, received_cpu], args.pushes),
    }


# --- the run ---------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--numel", type=int, default=1024, help="float32 elements per tensor")
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", nargs="+", choices=ROUNDS, default=list(ROUNDS))
    ap.add_argument("--pythonpath", help="a checkout of raysync to run instead of this one (before/after)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.abspath(args.pythonpath or here)
    import raysync

    assert os.path.dirname(os.path.dirname(os.path.abspath(raysync.__file__))) == root, (
        f"raysync is imported from {raysync.__file__}, not {root}: run with PYTHONPATH={root}"
    )
    torch.set_num_threads(1)
    instrument_driver()
    started = time.perf_counter()
    raw = raw_row(args)  # first: after ray.shutdown() Ray's processes are still ending, and take CPU
    path = os.pathsep.join([root, os.path.dirname(os.path.abspath(__file__))])
    ray.init(
        include_dashboard=False,
        logging_level="warning",
        num_gpus=0,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        holder = ray.remote(num_cpus=0)(Holder)
        actors = (
            holder.remote(args.tensors, args.numel, True),
            holder.remote(args.tensors, args.numel, False),
        )
        rows = [weightsync_row(actors, rounds, args) for rounds in args.rounds]
    finally:
        ray.shutdown()
    for row in rows:
        row["ray_share_us"] = row["median_us"] - raw["median_us"]
        row["ray_share_cpu_us"] = row["cpu_us_per_push"]["all"] - raw["cpu_us_per_push"]["all"]
    result = {
        "hardware": f"CPU, {mp.cpu_count()} cores",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ray": ray.__version__,
        "raysync_root": root,
        "tensors": args.tensors,
        "bytes": args.tensors * args.numel * 4,
        "pushes": args.pushes,
        "rows": rows + [raw],
        "wall_s": time.perf_counter() - started,
    }
    print_table(result)
    emit(result, args.out)


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n{r['tensors']} tensors, {r['bytes'] / 1e3:.0f} KB over shm, {r['hardware']}; medians of {r['pushes']}"
    )
    cpu = ("driver", "sender", "receiver")
    head = "".join(f"{'cpu ' + k:>13}" for k in cpu)
    print(f"{'rounds':<14}{'push us':>10}{'min us':>10}{'Ray us':>10}{'setup ms':>10}{head}{'Ray cpu':>10}")
    for row in r["rows"]:
        share = f"{row['ray_share_us']:.0f}" if "ray_share_us" in row else "-"
        setup = f"{row['setup_s'] * 1e3:.0f}" if "setup_s" in row else "-"
        used = "".join(f"{row['cpu_us_per_push'][k]:>13.0f}" for k in cpu)
        cpu_share = f"{row['ray_share_cpu_us']:.0f}" if "ray_share_cpu_us" in row else "-"
        print(
            f"{row['rounds']:<14}{row['median_us']:>10.0f}{row['min_us']:>10.0f}{share:>10}{setup:>10}{used}"
            f"{cpu_share:>10}"
        )
    split = [row for row in r["rows"] if "stages_us" in row]
    names = list(dict.fromkeys(k for row in split for k in row["stages_us"]))
    print(f"\n{'stage, median us':<44}" + "".join(f"{row['rounds']:>9}" for row in split))
    for k in names:
        print(f"  {k:<42}" + "".join(f"{row['stages_us'].get(k, float('nan')):>9.0f}" for row in split))
    print(f"\nwall time: {r['wall_s']:.0f} s")


if __name__ == "__main__":
    import bench_ray_share  # by its name, so that Ray pickles its functions by reference: one _ON per process

    bench_ray_share.main()
