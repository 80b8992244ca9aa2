"""Fan-out groups (issue 20, item 3): the receivers one sender serves over shm ring pairs on its host, read
from ONE ring by one session (``WeightSender(receivers=N)``): each bucket is packed once for all of them.

Like a broadcast group (raysync.ray.connections), a fan-out is made and lost as a whole: its readers move
together (a push waits for every one of them, and one that fails stops the push for all), so a failure of any
of its pairs marks every pair of the group broken, and ``repair`` rebuilds the whole fan-out before the next
push. The plan says so per pair: its reason ends with "; fan-out: one shm ring read by N engines".

Only ring-mode shm pairs whose sender and receiver share a host qualify (not direct, not cuda_ipc, not the
collective): the session's N readers map one shared segment. Every other pair keeps its own session.

Not with SyncConfig.delta: a delta push keeps one session per pair, as before (a fan-out serves a stale reader
in turns, but reports one PushReport for all of its readers, and its readers fail together, where a delta
fleet's pairs are reported, and fail, each on its own: tests/test_delta_fleet.py).

Opt-in: ``WeightSync(fan_out=True)``. Off by default because it changes what a failure does: with one
session per pair an engine that refuses a push leaves the others updated; in a fan-out none of them is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raysync.ray.placement import PairPlan, Placement

MARK = "; fan-out: one shm ring read by "


def qualifies(p: PairPlan, senders: Sequence[Placement], receivers: Sequence[Placement]) -> bool:
    """Whether pair ``p`` may be one reader of its sender's fan-out ring."""
    s, r = senders[p.sender], receivers[p.receiver]
    return p.transport == "shm" and not p.direct and p.num_buffers > 0 and s.host == r.host and s.ip == r.ip


def plan_fan_outs(
    plans: Sequence[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]
) -> list[PairPlan]:
    """``plans`` with every sender's qualifying pairs, when there are two or more, made one fan-out: one ring
    shape for all of them (the smallest their pairs were planned: the ring is sized as if each had its own,
    never more than the memory allows) and the reason saying so."""
    by_sender: dict[int, list[PairPlan]] = {}
    for p in plans:
        if MARK not in p.reason and qualifies(p, senders, receivers):
            by_sender.setdefault(p.sender, []).append(p)
    shape: dict[int, dict] = {
        i: {
            "bucket_bytes": min(p.bucket_bytes for p in ps),
            "num_buffers": min(p.num_buffers for p in ps),
        }
        for i, ps in by_sender.items()
        if len(ps) >= 2
    }
    out = []
    for p in plans:
        if p.sender in shape and p in by_sender[p.sender]:
            n = len(by_sender[p.sender])
            p = dataclasses.replace(p, reason=f"{p.reason}{MARK}{n} engines", **shape[p.sender])
        out.append(p)
    return out


def groups(plans: Sequence[PairPlan]) -> dict[int, list[int]]:
    """Each sender's fan-out readers (receivers, in the plan's order), as the plan says."""
    out: dict[int, list[int]] = {}
    for p in plans:
        if MARK in p.reason:
            out.setdefault(p.sender, []).append(p.receiver)
    return out


def mates(plans: Sequence[PairPlan], pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """``pairs`` and every pair of a fan-out any of them belongs to: a fan-out is broken (and rebuilt) whole."""
    out = set(pairs)
    for i, js in groups(plans).items():
        if any((i, j) in pairs for j in js):
            out |= {(i, j) for j in js}
    return out
