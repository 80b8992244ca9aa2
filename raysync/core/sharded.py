"""Sharded sources: several trainer ranks each broadcast a disjoint share of the tensors to the same receivers,
each over its own group, so one push uses several links (and several senders' GPUs) at once.

    trainer rank 0 --group 0: share 0--\\
    trainer rank 1 --group 1: share 1---+--> engine: one push session per group, all receiving at once
    trainer rank S-1 ------ share S-1--/     into the same destinations (the shares are disjoint)

A share is a tuple of names for ``SyncConfig.include``, from ``shares()``: every trainer rank computes it
from the same list of tensors (the same model), so the shares cover every tensor once. Each group is an
ordinary broadcast group (raysync.transport.collective) with its own checks, timeouts and aborts, and each
share an ordinary push session (raysync.core.session_receiver.PushReceiver) over it. A ShardedReceiver runs
the receives of all its sessions at once and makes one answer of them, here and nowhere else: one version
(``combined_version``), one PushReport (``combined_report``), one PushIncomplete. The engine holds a version
only when every share has applied it: while the shares hold different versions the weights are a mix that
no trainer had, and ``version`` says MIXED (Note [versions never lie] in raysync.core.version). One share is
the plain case, a group that carries every tensor (WeightSync keeps every collective receiver this way, so a
rebuilt group keeps what its destinations hold).

On NCCL one thread drives every share, the shares taking turns bucket by bucket (NCCL does not allow
communicators of one GPU to be driven from several threads at once), so a share that stalls holds the others
up until its timeout; on gloo each share has its own thread. The groups' joins run in threads, since each
blocks until its own ranks are in.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from raysync.core.config import SyncConfig
from raysync.core.errors import LayoutError, PushIncomplete, RaysyncError, SchemaError, WeightsMixed
from raysync.core.report import PushReport
from raysync.core.session_receiver import PushReceiver
from raysync.core.sink import LoadFn
from raysync.core.source import select
from raysync.core.version import MIXED, Version

Steps = Generator[None, None, PushReport]  # a push in steps: PushReceiver.receiving


class GroupRank(Protocol):
    """This engine's rank in one share's group, before and after it joined
    (raysync.transport.collective.CollectiveReceiver). It owns the session ``join`` returns."""

    @property
    def device(self) -> torch.device | None: ...  # where its broadcasts run (NCCL); None on gloo

    def join(self, timeout_s: float) -> PushReceiver: ...

    def close(self) -> None: ...


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


def combined_version(versions: Sequence[Version]) -> Version:
    """What an engine whose shares hold ``versions`` holds: their one version, else MIXED (its weights are
    then parts of several versions); MIXED when any share is (Note [versions never lie])."""
    distinct = set(versions)
    return distinct.pop() if len(distinct) == 1 else MIXED


def combined_report(reports: Sequence[PushReport]) -> PushReport:
    """One push of every share as one report: bytes, buckets and tensors summed, the slowest share's
    seconds, skipped only when every share skipped. The shares' senders must push one version."""
    versions = sorted({r.version for r in reports})
    if len(versions) != 1:
        raise SchemaError(
            f"the shares' senders pushed different versions {versions}: push one version from all"
        )
    if len(reports) == 1:
        return reports[0]
    return PushReport(
        versions[0],
        reports[0].transport,
        sum(r.bytes for r in reports),
        sum(r.buckets for r in reports),
        sum(r.tensors for r in reports),
        max(r.seconds for r in reports),
        skipped=all(r.skipped for r in reports),
    )


def check_disjoint(sessions: Sequence[PushReceiver]) -> None:
    """Two shares naming one tensor means the trainer ranks split different lists of tensors."""
    seen: dict[str, int] = {}
    for k, r in enumerate(sessions):
        for name in r.names:
            if seen.setdefault(name, k) != k:
                raise LayoutError(
                    f"tensor {name!r} is in share {seen[name]} and in share {k}: compute "
                    f"the shares from the same tensors on every trainer rank"
                )


class ShardedReceiver:
    """One engine receiving every share: ``groups[k]`` is this engine's rank in the group of share k, and
    ``receivers[k]`` its push session once that group has joined."""

    name = "collective"

    def __init__(self, groups: Sequence[GroupRank | None]):
        """``groups[k]`` may be None until share k's group is made (``replace``): WeightSync makes them one
        group at a time."""
        if not groups:
            raise ValueError("ShardedReceiver needs the group of at least one share")
        self.groups = list(groups)
        self.receivers: list[PushReceiver | None] = [None] * len(groups)
        self._held: list[Version] = [None] * len(groups)  # what a share without a session yet holds

    def replace(self, k: int, group: GroupRank) -> None:
        """Share k has a new group (made, or rebuilt after a failure): the old one is closed, with its session.
        The same destinations keep what they hold, so the new session starts at the old one's version."""
        self._held[k] = self._share_version(k)
        old, self.groups[k], self.receivers[k] = self.groups[k], group, None
        if old is not None:
            old.close()

    @property
    def version(self) -> Version:
        """The version every share holds; MIXED while they differ or any share is MIXED."""
        return combined_version([self._share_version(k) for k in range(len(self.groups))])

    @version.setter
    def version(self, version: Version) -> None:
        self._held = [version] * len(self.groups)
        for r in self.receivers:
            if r is not None:
                r.version = version

    def _share_version(self, k: int) -> Version:
        r = self.receivers[k]
        return r.version if r is not None else self._held[k]

    def join(self, timeout_s: float = 300.0, shares: Sequence[int] | None = None) -> None:
        """Join the groups of ``shares`` (default: every share without a session yet), all at once (each
        returns when all of its ranks are in); each new session starts at what its share's destinations
        hold. A share whose join failed stays without a session: ``replace`` its group with a new one."""
        wanted = range(len(self.groups)) if shares is None else shares
        todo = [k for k in wanted if self.receivers[k] is None]
        self._check_made(todo)
        with ThreadPoolExecutor(max(1, len(todo)), thread_name_prefix="raysync-join") as pool:
            joins = {k: pool.submit(_join, self.groups[k], timeout_s) for k in todo}
        errors = []
        for k, job in joins.items():
            try:
                self.receivers[k] = job.result()
            except Exception as e:
                errors.append(e)
                continue
            self.receivers[k].version = self._held[k]
        if errors:
            raise errors[0]

    def _check_made(self, shares: list[int]) -> None:
        missing = [k for k in shares if self.groups[k] is None]
        if missing:
            raise RaysyncError(f"shares {missing} have no group yet")

    def _sessions(self) -> list[PushReceiver]:
        self._check_made(list(range(len(self.groups))))
        unjoined = [k for k, r in enumerate(self.receivers) if r is None]
        if unjoined:
            raise RaysyncError(f"the groups of shares {unjoined} have not joined: call join() first")
        return list(self.receivers)

    def receive(
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        load_fn: LoadFn | None = None,
        wait_s: float | None = None,
    ) -> PushReport:
        """Serve one push of every share: on NCCL (or with one share) from this thread, the shares taking turns
        bucket by bucket (NCCL forbids operating communicators of one GPU from several threads at once); on
        gloo a thread per share. The load function is called by one share at a time; a staging loader's
        ``finish`` (raysync.core.sink) once, after every share has landed."""
        sessions = self._sessions()
        check_disjoint(sessions)
        finish = getattr(load_fn, "finish", None)
        staging = callable(finish) and len(sessions) > 1  # one share: its session applies it, as any session
        one_fn = _one_at_a_time(load_fn) if load_fn is not None and len(sessions) > 1 else load_fn
        before = [r.version for r in sessions]
        pushes = [r.receiving(into=into, load_fn=one_fn, wait_s=wait_s, staging=staging) for r in sessions]
        one_thread = len(pushes) == 1 or any(g.device is not None for g in self.groups)
        reports, failed = _take_turns(pushes) if one_thread else _in_threads(pushes)
        if failed:
            if staging:  # the loader only staged: nothing of this push reached the weights
                self._restore(before)
            self._raise_failed(failed)
        report = combined_report(reports)
        check_disjoint(sessions)
        if staging and not report.skipped:
            self._apply(finish, report.version, before)
        return report

    def _raise_failed(self, failed: list[tuple[int, Exception]]) -> None:
        """One PushIncomplete naming the tensors of every share that stopped part-way (and whether the
        destinations are now mixed); else the first error as it is. One share: its error as it is."""
        incomplete = [(k, e) for k, e in failed if isinstance(e, PushIncomplete)]
        if not incomplete or len(self.groups) == 1:
            raise failed[0][1]
        k, e = incomplete[0]
        undelivered = [n for _, f in incomplete for n in f.undelivered]
        raise self._incomplete(e.version, f"share {k}: {e.stage}", e.reason, undelivered) from e

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
            raise self._incomplete(version, "apply", f"{type(e).__name__}: {e}", []) from e

    def _incomplete(self, version: int, stage: str, reason: str, undelivered: list[str]) -> PushIncomplete:
        """The engine's PushIncomplete: whether its destinations are a mix is what its version says now, the
        rule of every push session (Note [versions never lie])."""
        return PushIncomplete(version, stage, reason, undelivered, mixed=self.version == MIXED)

    def _restore(self, before: list[Version]) -> None:
        for r, version in zip(self.receivers, before, strict=True):
            r.version = version

    def close(self) -> None:
        """Every share's group, each with its session."""
        for g in self.groups:
            if g is not None:
                g.close()


def _take_turns(pushes: list[Steps]) -> tuple[list[PushReport], list[tuple[int, Exception]]]:
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


def _in_threads(pushes: list[Steps]) -> tuple[list[PushReport], list[tuple[int, Exception]]]:
    """gloo: a thread per share (gloo groups are independent of each other), so a share that fails or stalls
    holds no other up; load function calls are made one at a time."""

    def run(steps: Steps) -> PushReport:
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


def _join(group: GroupRank, timeout_s: float) -> PushReceiver:
    if group.device is not None:
        torch.cuda.set_device(group.device)  # a thread starts on GPU 0, whatever the caller's current GPU
    return group.join(timeout_s)


def _one_at_a_time(load_fn: LoadFn) -> LoadFn:
    """The loader, one call at a time, without its ``finish``: ShardedReceiver calls that once every share
    has landed. Its ``check`` stays: each share's accept runs it on that share's tensors, before any byte moves."""
    lock = threading.Lock()

    def load(batch: list[tuple[str, torch.Tensor]]) -> object:
        with lock:
            return load_fn(batch)

    check = getattr(load_fn, "check", None)
    if callable(check):
        load.check = check
    return load
