"""What `raysync bench --ray` (raysync.tools.bench_ray) measures with: the trainer and engine actors, the raw
session (a WeightSender in this process, a WeightReceiver in a spawned one, no Ray; pushed one push at a time, so
that its pushes can be interleaved with WeightSync's), and where a WeightSync push spends its time (the
breakdown)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import queue
import statistics
import time
from typing import Any

import ray
import torch

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender, WeightSync
from raysync.core.errors import SessionClosed
from raysync.ray import loop_channel, loop_member
from raysync.ray.endpoint import applied_version
from raysync.tools.bench import checksum, floor_s
from raysync.tools.models import allocate


# --- the actors ----------------------------------------------------------------------------------------------------
class Holder:
    """A trainer (its tensors filled) or an engine (destinations); stamps when WeightSync calls its source / sink."""

    def __init__(self, layout: str, device: str, fill: bool, threads: int):
        torch.set_num_threads(threads)
        self.device = device
        self.tensors = allocate(layout, device=device, fill=fill)
        self.stamps: dict[str, float] = {}
        run = loop_member._run  # a loop's round, stamped: its go decoded, its answer made (to be sent)

        def stamped(codec, actor, *args):
            actor.stamps["go"] = time.monotonic()
            try:
                return run(codec, actor, *args)
            finally:
                actor.stamps["answer"] = time.monotonic()

        loop_member._run = stamped

    def checksum(self) -> float:
        return checksum(self.tensors)

    def step(self, value: int) -> None:
        """A train step's stand-in between two timed pushes, as in an RL loop: new first elements, then the GPU
        synchronized (a real step ends reading its loss)."""
        self.bump(value)
        sync(self.tensors)

    def bump(self, value: int) -> None:
        """New first elements, so that a row whose push moved nothing cannot pass the check after it."""
        for t in self.tensors.values():
            t.view(-1)[:1].fill_(value)

    def take_stamps(self) -> dict[str, float]:
        stamps, self.stamps = self.stamps, {}
        return stamps

    def floor_s(self, repeats: int) -> float:
        """One copy of every tensor into a destination on the same device: the least any push can take."""
        seconds = floor_s(self.tensors, self.device, repeats)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the copies' destinations, gone with floor_s
        return seconds


def source(actor: Holder):
    actor.stamps["source"] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
    return actor.tensors.items()


def sink(actor: Holder):
    actor.stamps["sink"] = time.monotonic()
    return actor.tensors


def sync(tensors: dict[str, torch.Tensor]) -> None:
    if next(iter(tensors.values())).is_cuda:
        torch.cuda.synchronize()


# --- the raw session: two processes, no Ray, pushed one push at a time ----------------------------------------------
class RawPeer:
    """A spawned process that holds a layout's destinations and serves raw sessions, one after the other: each a
    WeightReceiver that takes pushes until its sender closes the session. ``src`` (here, the senders' tensors) and
    the destinations are allocated once per layout, so that a session can be opened beside each row's WeightSync
    while its actors also exist, and its pushes interleaved with WeightSync's (``RawSession``)."""

    def __init__(self, layout: str, device: str, threads: int, timeout_s: float = 900.0):
        ctx = mp.get_context("spawn")
        self._in, self._out, self.timeout_s = ctx.Queue(), ctx.Queue(), timeout_s
        self._proc = ctx.Process(
            target=raw_receiver, args=(self._in, self._out, layout, device, threads, timeout_s)
        )
        self._proc.start()
        self.src = allocate(layout, device=device)

    def session(self, config: SyncConfig) -> RawSession:
        return RawSession(self, config)

    def close(self) -> None:
        self._in.put(None)
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()


class RawSession:
    """A WeightSender here, to the peer's WeightReceiver, with ``config`` (the config the plan gave the pair).
    ``push(version)`` runs the train step's stand-in (as ``Holder.step``), then one timed push; ``close()`` ends
    the session and checks that the receiver holds the sender's bytes (RawSessionError otherwise)."""

    def __init__(self, peer: RawPeer, config: SyncConfig):
        self._peer = peer
        secret = SessionSecret.generate()
        self._sender = WeightSender(secret, config)
        peer._in.put((self._sender.endpoint, secret, config))

    def push(self, version: int) -> float:
        src = self._peer.src
        for t in src.values():
            t.view(-1)[:1].fill_(version % 50 + 60)
        sync(src)
        t0 = time.perf_counter()
        self._sender.push(src.items(), version)
        return time.perf_counter() - t0

    def close(self) -> None:
        self._sender.close()  # its Close ends the receiver's session
        try:
            outcome, value = self._peer._out.get(timeout=self._peer.timeout_s)
        except queue.Empty:
            raise RawSessionError(
                f"the raw receiver did not answer within {self._peer.timeout_s} s"
            ) from None
        if outcome != "ok":
            raise RawSessionError(f"the raw receiver failed: {value}")
        if value != checksum(self._peer.src):
            raise RawSessionError("the raw session's receiver holds other bytes than the sender's")


class RawSessionError(RuntimeError):
    """The raw session's receiver failed, did not answer in time, or holds other bytes than the sender's."""


def raw_receiver(q_in, q_out, layout: str, device: str, threads: int, timeout_s: float) -> None:
    """The peer's process: a session per ``(endpoint, secret, config)`` from ``q_in`` until None; after each, its
    destinations' checksum (or the error) on ``q_out``."""
    torch.set_num_threads(threads)
    dest = allocate(layout, device=device, fill=False)
    while (job := q_in.get(timeout=timeout_s)) is not None:
        endpoint, secret, config = job
        try:
            with WeightReceiver(endpoint, secret, config) as receiver:
                while True:
                    try:
                        receiver.receive(into=dest)
                    except SessionClosed:
                        break
            q_out.put(("ok", checksum(dest)))
        except Exception as e:  # the sender's close() reports it
            q_out.put(("error", repr(e)))


# --- where a WeightSync push spends its time ----------------------------------------------------------------------
class Stopwatch:
    """Times Ray's public calls made in this process (the driver) while installed: ``ActorMethod.remote``
    (a call submitted), ``ray.wait`` and ``ray.get``, each as (start, end) on time.monotonic()."""

    def __init__(self):
        self.calls: dict[str, list[tuple[float, float]]] = {"remote": [], "wait": [], "get": [], "frame": []}
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, attr: str, key: str) -> None:
        original = getattr(owner, attr)
        log = self.calls[key]

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0 = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                log.append((t0, time.monotonic()))

        self._saved.append((owner, attr, original))
        setattr(owner, attr, timed)

    def __enter__(self) -> Stopwatch:
        for owner, attr in ((ray.actor.ActorMethod, "remote"), (ray, "wait"), (ray, "get")):
            self._wrap(owner, attr, attr)
        self._wrap(loop_channel.DriverEnd, "send", "frame")  # the loops' go frames
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)


def bare_round_trip(trainer: Any, engine: Any) -> float:
    """Two calls of a library function that does nothing much (pickled by reference, as the push's are)."""
    t0 = time.monotonic()
    ray.get([trainer.__ray_call__.remote(applied_version), engine.__ray_call__.remote(applied_version)])
    return time.monotonic() - t0


def breakdown(sync: WeightSync, trainer: Any, engine: Any, pushes: int, version0: int) -> dict[str, float]:
    """Medians (ms) of each stage of a push, on one clock (time.monotonic, shared by the host's processes):

    sender dispatch   push() called -> the sender's source called (calls built and submitted, the graph's input
                      written, or the loops' frames sent; the dispatch into the actor, the session looked up)
    receiver dispatch push() called -> the receiver's sink called
    session           the sender's push session (its PushReport.seconds)
    answers back      session end -> push() returns (results to the driver, reports read, SyncReport built)
    submit calls      the round's actor calls submitted (ActorMethod.remote, on the driver; none in a graph or loop)
    ray.wait, ray.get time the driver spent in them, and how many calls (ray.get: a graph's reads too)
    total             push() on the driver
    bare round trip   next to it, two calls that do nothing (endpoint.applied_version) through __ray_call__ on
                      both actors at once, both answers got: Ray's least for a round of ordinary calls"""
    rows: list[dict[str, float]] = []
    for v in range(version0, version0 + pushes):
        ray.get([trainer.take_stamps.remote(), trainer.step.remote(v % 50 + 60), engine.take_stamps.remote()])
        with Stopwatch() as watch:
            t0 = time.monotonic()
            report = sync.push(v)
            t_end = time.monotonic()
        s_stamp, r_stamp = ray.get([trainer.take_stamps.remote(), engine.take_stamps.remote()])
        remote, waits, gets = watch.calls["remote"], watch.calls["wait"], watch.calls["get"]
        frames = watch.calls["frame"]  # the loops' go frames, this push's
        session_end = s_stamp["source"] + report.slowest.seconds
        rows.append(
            {
                "sender dispatch": s_stamp["source"] - t0,
                "receiver dispatch": r_stamp["sink"] - t0,
                "session": report.slowest.seconds,
                "answers back": t_end - session_end,
                "submit calls": remote[-1][1] - remote[0][0] if remote else 0.0,
                "ray.wait": sum(b - a for a, b in waits),
                "ray.wait count": len(waits),
                "ray.get": sum(b - a for a, b in gets),
                "ray.get count": len(gets),
                "total": t_end - t0,
                "bare round trip": bare_round_trip(trainer, engine),
            }
        )
        if frames and "go" in s_stamp:  # the loops: where the dispatch and the answer go
            rows[-1] |= {
                "loop: driver until the first go sent": frames[0][1] - t0,
                "loop: last go sent -> the sender's loop has it": s_stamp["go"] - frames[-1][1],
                "loop: the receiver's loop has go": r_stamp["go"] - frames[0][1],
                "loop: sender's go -> its source called": s_stamp["source"] - s_stamp["go"],
                "loop: receiver's answer made -> push() returns": t_end - r_stamp["answer"],
                "loop: sender's answer made - receiver's": s_stamp.get("answer", float("nan"))
                - r_stamp["answer"],
            }
    keys = [k for k in rows[-1] if all(k in r for r in rows)]
    return {k: statistics.median(r[k] for r in rows) * (1 if k.endswith("count") else 1e3) for k in keys}
