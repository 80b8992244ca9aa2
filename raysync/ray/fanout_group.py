"""Fan-out groups (issue 20, item 3): the receivers one sender serves on its host over one kind of plane (an
shm ring, a cuda_ipc ring, or cuda_ipc direct mode), served by ONE session (``WeightSender(receivers=N)``): each
bucket is packed once for all of them (direct: nothing is packed; one PushStart, N engines reading the trainer's
tensors).

Like a broadcast group (raysync.ray.connections), a fan-out is made and lost as a whole: its readers move
together (a push waits for every one of them, and one that fails stops the push for all), so a failure of any
of its pairs marks every pair of the group broken, and ``repair`` rebuilds the whole fan-out before the next
push. The plan says so per pair: its reason ends with "; fan-out: one shm ring read by N engines" (or "one
cuda_ipc ring", or "the trainer's tensors (cuda_ipc direct)").

Pairs qualify when their sender and receiver share a host and the pair runs a ring or direct mode (not the
collective, which is a broadcast group already). A sender fans out over one kind of plane: the kind most of its
qualifying pairs were planned with (two at least); its other pairs keep their own sessions.

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

MARK = "; fan-out: "


def _kind(p: PairPlan) -> str:
    """What the readers of ``p``'s fan-out would share, in the plan's words."""
    if p.direct:
        return "the trainer's tensors (cuda_ipc direct)"
    return f"one {p.transport} ring"


def qualifies(p: PairPlan, senders: Sequence[Placement], receivers: Sequence[Placement]) -> bool:
    """Whether pair ``p`` may be one reader of its sender's fan-out."""
    s, r = senders[p.sender], receivers[p.receiver]
    plane = p.transport == "cuda_ipc" or (p.transport == "shm" and not p.direct and p.num_buffers > 0)
    return plane and s.host == r.host and s.ip == r.ip


def plan_fan_outs(
    plans: Sequence[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]
) -> list[PairPlan]:
    """``plans`` with each sender's qualifying pairs of one kind (the kind most of them share), when there are
    two or more, made one fan-out: one ring shape for all of them (the smallest their pairs were planned: the
    ring is sized as if each had its own, never more than the memory allows) and the reason saying so."""
    by_kind: dict[tuple[int, str], list[PairPlan]] = {}
    for p in plans:
        if MARK not in p.reason and qualifies(p, senders, receivers):
            by_kind.setdefault((p.sender, _kind(p)), []).append(p)
    chosen: dict[int, list[PairPlan]] = {}
    for (i, _), ps in by_kind.items():  # in the plan's order: the first kind wins a tie
        if len(ps) >= 2 and len(ps) > len(chosen.get(i, ())):
            chosen[i] = ps
    out = []
    for p in plans:
        ps = chosen.get(p.sender, [])
        if p in ps:
            shape = {
                "bucket_bytes": min(q.bucket_bytes for q in ps),
                "num_buffers": min(q.num_buffers for q in ps),
            }
            p = dataclasses.replace(
                p, reason=f"{p.reason}{MARK}{_kind(p)} read by {len(ps)} engines", **shape
            )
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
