"""Sharded sources: several trainer ranks each broadcast a disjoint share of the tensors to the same receivers,
each over its own group, so one push uses several links (and several senders' GPUs) at once.

    trainer rank 0 --group 0: share 0--\
    trainer rank 1 --group 1: share 1---+--> engine: one CollectiveReceiver per group, all receiving at once
    trainer rank S-1 ------ share S-1--/     into the same destinations (the shares are disjoint)

A share is a tuple of names for ``SyncConfig.include``, from ``shares()``: every trainer rank computes it
from the same list of tensors (the same model), so the shares cover every tensor once. Each group is an
ordinary collective group (raysync.transport.collective) with its own checks, timeouts and aborts; a
ShardedReceiver runs the receives of all its groups at once and counts a version as applied only when every
share has applied it: while the shares hold different versions the engine's weights are a mix that no trainer
had, and ``version`` says MIXED (Note [versions never lie] in raysync.core.version). On NCCL one thread drives them all, the shares taking turns bucket by bucket (NCCL
does not allow communicators of one GPU to be driven from several threads at once), so a share that stalls
holds the others up until its timeout; on gloo each share has its own thread. The groups' joins run in
threads, since each blocks until its own ranks are in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from raysync.core.config import SyncConfig
from raysync.core.errors import LayoutError, PushIncomplete, RaysyncError, SchemaError, WeightsMixed
from raysync.core.report import PushReport
from raysync.core.sink import LoadFn
from raysync.core.source import select
from raysync.core.version import MIXED, Version
from raysync.transport.collective import CollectiveReceiver


def shares(
    named_tensors: Iterable[tuple[str, torch.Tensor]], num_shares: int, config: SyncConfig | None = None
) -> list[tuple[str, ...]]:
    """Split the tensors ``config`` selects into ``num_shares`` disjoint shares of about equal bytes (the
    largest tensors first, each to the lightest share); each share keeps the tensors' order."""
    if num_shares < 1:
        raise ValueError(f"num_shares={num_shares}: need at least 1")
    specs = [s.spec for s in select(named_tensors, config or SyncConfig())]
    if num_shares > len(specs):  # an empty share would be include=(): everything
        raise ValueError(f"{num_shares} shares of {len(specs)} tensors: every share needs at least one")
    load, owner = [0] * num_shares, [0] * len(specs)
    for i in sorted(range(len(specs)), key=lambda i: (-specs[i].nbytes, i)):
        owner[i] = min(range(num_shares), key=lambda k: (load[k], k))
        load[owner[i]] += specs[i].nbytes
    return [tuple(s.name for s, o in zip(specs, owner, strict=True) if o == k) for k in range(num_shares)]


class ShardedReceiver:
    """One engine receiving every share: ``receivers[k]`` is this engine's rank in the group of share k."""

    name = "collective"

    def __init__(self, receivers: Sequence[CollectiveReceiver | None]):
        """``receivers[k]`` may be None until share k's group is made (``replace``): WeightSync makes them one
        group at a time."""
        if not receivers:
            raise ValueError("ShardedReceiver needs the receiver of at least one share")
        self.receivers = list(receivers)
        self._unmade: Version = None  # what the destinations of a share without a group yet hold

    def replace(self, k: int, receiver: CollectiveReceiver) -> None:
        """Share k has a new group (made, or rebuilt after a failure): its old receiver is closed. The same
        destinations keep what they hold, so the new receiver starts at the old one's version."""
        old, self.receivers[k] = self.receivers[k], receiver
        receiver.version = old.version if old is not None else self._unmade
        if old is not None:
            old.close()

    @property
    def version(self) -> Version:
        """The version every share holds; MIXED while the shares differ (the engine's weights are then parts
        of several versions) or any share is MIXED: Note [versions never lie]."""
        versions = {self._share_version(k) for k in range(len(self.receivers))}
        return versions.pop() if len(versions) == 1 else MIXED

    @version.setter
    def version(self, version: Version) -> None:
        self._unmade = version
        for r in self.receivers:
            if r is not None:
                r.version = version

    def _share_version(self, k: int) -> Version:
        r = self.receivers[k]
        return r.version if r is not None else self._unmade

    def join(self, timeout_s: float = 300.0) -> None:
        """Join every share's group at once (each returns when all of its ranks are in)."""
        with ThreadPoolExecutor(len(self.receivers), thread_name_prefix="raysync-join") as pool:
            for f in [pool.submit(_join, r, timeout_s) for r in self.receivers]:
                f.result()

    def receive(
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        load_fn: LoadFn | None = None,
        wait_s: float | None = None,
    ) -> PushReport:
        """Serve one push of every share: on NCCL from this thread, the shares taking turns bucket by bucket
        (NCCL forbids operating communicators of one GPU from several threads at once); on gloo a thread per
        share. The load function is called by one share at a time."""
        missing = [k for k, r in enumerate(self.receivers) if r is None]
        if missing:
            raise RaysyncError(f"shares {missing} have no group yet")
        self._check_disjoint()
        finish = getattr(load_fn, "finish", None)  # a staging loader applies once, after every share
        staging = callable(finish)
        one_fn = _no_finish(load_fn) if load_fn is not None else None
        before = [r.version for r in self.receivers]
        pushes = [
            r.receiving(into=into, load_fn=one_fn, wait_s=wait_s, staging=staging) for r in self.receivers
        ]
        nccl = any(r.device is not None for r in self.receivers)
        reports, failed = _take_turns(pushes) if nccl else _in_threads(pushes)
        if failed:  # the tensors of every share that stopped part-way; else the first error as it is
            if staging:  # the loader only staged: nothing of this push reached the weights
                self._restore(before)
            self._raise_failed(failed)
        versions = sorted({r.version for r in reports})
        if len(versions) != 1:
            raise SchemaError(
                f"the shares' senders pushed different versions {versions}: push one version from all"
            )
        self._check_disjoint()
        if staging and not all(r.skipped for r in reports):
            self._apply(finish, versions[0], before)
        return PushReport(
            versions[0],
            self.name,
            sum(r.bytes for r in reports),
            sum(r.buckets for r in reports),
            sum(r.tensors for r in reports),
            max(r.seconds for r in reports),
            skipped=all(r.skipped for r in reports),
        )

    def _raise_failed(self, failed: list[tuple[int, Exception]]) -> None:
        """One PushIncomplete naming the tensors of every share that stopped part-way (and whether the
        destinations are now mixed); else the first error as it is."""
        incomplete = [(k, e) for k, e in failed if isinstance(e, PushIncomplete)]
        if not incomplete:
            raise failed[0][1]
        k, e = incomplete[0]
        undelivered = [n for _, f in incomplete for n in f.undelivered]
        mixed = self.version == MIXED
        raise PushIncomplete(e.version, f"share {k}: {e.stage}", e.reason, undelivered, mixed=mixed) from e

    def _apply(self, finish, version: int, before: list[Version]) -> None:
        """A staging loader applies every share's part at once. If that fails it has put the old weights back
        (its contract), unless it says WeightsMixed."""
        try:
            finish()
        except Exception as e:
            if isinstance(e, WeightsMixed):
                self.version = MIXED
            else:
                self._restore(before)
            raise PushIncomplete(
                version, "apply", f"{type(e).__name__}: {e}", [], mixed=isinstance(e, WeightsMixed)
            ) from e

    def _restore(self, before: list[Version]) -> None:
        for r, version in zip(self.receivers, before, strict=True):
            r.version = version

    def _check_disjoint(self) -> None:
        """Two shares naming one tensor means the trainer ranks split different lists of tensors."""
        seen: dict[str, int] = {}
        for k, r in enumerate(self.receivers):
            for name in r.names:
                if seen.setdefault(name, k) != k:
                    raise LayoutError(
                        f"tensor {name!r} is in share {seen[name]} and in share {k}: compute "
                        f"the shares from the same tensors on every trainer rank"
                    )

    def close(self) -> None:
        for r in self.receivers:
            if r is not None:
                r.close()


def _take_turns(pushes: list) -> tuple[list[PushReport], list[tuple[int, Exception]]]:
    """NCCL: one thread steps every share's push in turn, bucket by bucket. A share that stalls holds the
    others up (each wait is still bounded by timeout_s)."""
    reports, failed, turns = [], [], dict(enumerate(pushes))
    while turns:
        for k, steps in list(turns.items()):
            try:
                next(steps)
            except StopIteration as done:
                reports.append(done.value)
                del turns[k]
            except Exception as e:
                failed.append((k, e))
                del turns[k]
    return reports, failed


def _in_threads(pushes: list) -> tuple[list[PushReport], list[tuple[int, Exception]]]:
    """gloo: a thread per share (gloo groups are independent of each other), so a share that fails or stalls
    holds no other up; load function calls are made one at a time."""

    def run(steps) -> PushReport:
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    reports, failed = [], []
    with ThreadPoolExecutor(len(pushes), thread_name_prefix="raysync-share") as pool:
        for k, job in enumerate([pool.submit(run, p) for p in pushes]):
            try:
                reports.append(job.result())
            except Exception as e:
                failed.append((k, e))
    return reports, failed


def _join(r: CollectiveReceiver, timeout_s: float) -> None:
    if r.device is not None:
        torch.cuda.set_device(r.device)  # a thread starts on GPU 0, whatever the caller's current GPU
    r.join(timeout_s)


def _no_finish(load_fn: LoadFn) -> LoadFn:
    """The loader, one call at a time, without its ``finish``: ShardedReceiver calls that once every share
    has landed."""
    lock = threading.Lock()

    def load(batch: list[tuple[str, torch.Tensor]]) -> object:
        with lock:
            return load_fn(batch)

    return load
