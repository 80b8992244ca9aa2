"""The connections of every (sender, receiver) pair of a WeightSync: the plan, made from where the actors run and
what their sources give (raysync.ray.placement); each pair's session over its transport, in its mode, with its
ring; the pairs a failed push broke, re-probed, re-planned and reconnected before the next push (``repair``).

A ring pair (shm, cuda_ipc) is one session: its sender opens it, then its receiver connects. A collective pair
belongs to its sender's broadcast group, which is made (and lost) as a whole: the sender opens the group, then
the sender and all of its receivers join it at once. A sender's shm ring pairs on its host, two or more, are
one fan-out (raysync.ray.fanout_group): one session whose ring they all read, made and lost as a whole the same
way: the sender opens it, then its receivers connect to their endpoints.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

from raysync.core.config import SyncConfig
from raysync.core.wire import SessionSecret
from raysync.ray import endpoint as ep
from raysync.ray import fanout_group
from raysync.ray.actors import Key, SyncActors
from raysync.ray.placement import (
    PairPlan,
    Placement,
    SourceReport,
    check_groups,
    choose,
    report_source,
    ring_places,
)
from raysync.ray.results import FanoutOpened, GroupOpened, SessionOpened
from raysync.ray.trainer_group import TrainerGroup, source_shape
from raysync.transport import registry

logger = logging.getLogger(__name__)

Pair = tuple[int, int]  # (sender i, receiver j)


def plan_pairs(
    pairs: Sequence[tuple[int, int]],
    senders: Sequence[Placement],
    receivers: Sequence[Placement],
    built: Sequence[str],
    config: SyncConfig,
    sources: Mapping[int, SourceReport] | None = None,
    override: Callable[[int, int], str | None] = lambda i, j: None,
    shares: int = 0,
) -> list[PairPlan]:
    """Every pair's plan, the rings that share a memory sizing themselves together (Note [ring shape]).
    ``override``: WeightSync's ``transport=`` per pair; ``shares``: sharded sources (every pair collective)."""
    sources = sources or {}
    if shares:
        override = lambda i, j: "collective"  # noqa: E731

    def one(i: int, j: int, rings: Mapping[str, int] | None = None) -> PairPlan:
        return choose(
            i,
            j,
            senders[i],
            receivers[j],
            built,
            override(i, j),
            config=config,
            source=sources.get(i),
            rings=rings,
        )

    first = [one(i, j) for i, j in pairs]
    rings: dict[str, int] = {}
    for p in first:
        if not p.direct:
            for place, _ in ring_places(p.transport, senders[p.sender], receivers[p.receiver]):
                rings[place] = rings.get(place, 0) + 1
    plans = [one(i, j, rings) for i, j in pairs]
    if shares:
        plans = [
            dataclasses.replace(p, reason=f"sharded sources: share {p.sender} of {shares}") for p in plans
        ]
    return plans


def group_config(plans: Sequence[PairPlan], i: int, config: SyncConfig) -> SyncConfig:
    """Sender i's broadcast group runs one ring shape on every rank: the smallest its pairs were planned."""
    pairs = [p for p in plans if p.sender == i and p.transport == "collective"]
    smallest = {
        "bucket_bytes": min(p.bucket_bytes for p in pairs),
        "num_buffers": min(p.num_buffers for p in pairs),
    }
    return dataclasses.replace(pairs[0].config(config), **smallest)


def assign(senders: Sequence[Placement], receivers: Sequence[Placement]) -> list[tuple[int, int]]:
    """Which sender serves each receiver: the one on the same GPU, else on the same node, else sender 0.
    One sender gives the disaggregated topology; one per GPU the colocated one; mixed placements mix both."""
    pairs = []
    for j, r in enumerate(receivers):
        same_gpu = [
            i
            for i, s in enumerate(senders)
            if s.node_id == r.node_id and s.current_gpu and s.current_gpu == r.current_gpu
        ]
        same_node = [i for i, s in enumerate(senders) if s.node_id == r.node_id]
        pairs.append(((same_gpu or same_node or [0])[0], j))
    return pairs


def format_plan(
    plans: Sequence[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]
) -> str:
    rows = [("sender", "receiver", "transport", "mode", "why")]
    for p in plans:
        rows.append(
            (
                f"#{p.sender} {senders[p.sender].label()}",
                f"#{p.receiver} {receivers[p.receiver].label()}",
                p.transport,
                p.mode,
                "; ".join(filter(None, (p.reason, p.how))),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class Plan(list):
    """The per-pair plan; ``str(plan)`` is a table."""

    def __init__(self, plans: list[PairPlan], senders: list[Placement], receivers: list[Placement]):
        super().__init__(plans)
        self._senders, self._receivers = senders, receivers

    def __str__(self) -> str:
        return format_plan(self, self._senders, self._receivers)


class PairConnections:
    def __init__(
        self,
        actors: SyncActors,
        config: SyncConfig,
        sync_id: str,
        *,
        source: ep.SourceFn,
        sink: ep.SinkFn,
        transport: str | dict[Pair, str] | None,
        pairs: Sequence[Pair] | None,
        shard_sources: bool,
        setup_timeout_s: float,
        fan_out: bool = False,
    ):
        forced = None if config.is_auto("transport") else config.transport
        if shard_sources and (pairs is not None or {str(transport), str(forced)} - {"None", "collective"}):
            raise ValueError("shard_sources pairs every sender with every receiver over the collective")
        self.actors, self.config, self.sync_id = actors, config, sync_id
        self._source, self._sink, self._override = source, sink, transport
        self._wanted_pairs = list(pairs) if pairs is not None else None
        self._shard, self._timeout_s, self._fan_out = shard_sources, setup_timeout_s, fan_out
        self.plan = Plan([], actors.sender_at, actors.receiver_at)  # placements as they are when printed
        self.push_bytes: dict[Pair, int] = {}  # what a push moves over each pair (for the progress bar)
        self.broken: set[Pair] = set()  # reconnected before the next push
        self._sources: dict[int, SourceReport] = {}  # what each sender's source gives (for the plan)
        self._forced = forced
        self.group = TrainerGroup()  # the senders whose sharded sources walk together (trainer_group.py)

    def open(self) -> None:
        """Plan every pair from the actors' placements (``SyncActors.locate`` first) and connect them all."""
        senders, receivers = self.actors.sender_at, self.actors.receiver_at
        pairs = self._wanted_pairs or assign(senders, receivers)
        if self._shard:
            pairs = [(i, j) for i in range(len(senders)) for j in range(len(receivers))]
        self._report_sources({i for i, _ in pairs})
        self._report_shapes(set(range(len(senders))))
        self.plan[:] = self._choose(pairs)
        check_groups(self.plan, senders, receivers)  # before any group is made: NCCL's error comes too late
        self._connect({(p.sender, p.receiver) for p in self.plan})

    def transport_of(self, pair: Pair) -> str:
        return next(p.transport for p in self.plan if (p.sender, p.receiver) == pair)

    def mark_broken(self, pairs: set[Pair]) -> None:
        """``pairs`` failed, or their sessions are suspect: they are reconnected before the next push (with
        every pair of a fan-out one of them reads: a fan-out is rebuilt whole)."""
        self.broken |= fanout_group.mates(self.plan, pairs)

    def pairs_of(self, key: Key) -> set[Pair]:
        """The pairs of a sender ("sender", i) or of a receiver endpoint ("receiver", e)."""
        role, index = key
        if role == "sender":
            return {(p.sender, p.receiver) for p in self.plan if p.sender == index}
        return {(p.sender, p.receiver) for p in self.plan if self.actors.slots[p.receiver][0] == index}

    def pairs_to(self, j: int) -> set[Pair]:
        """The pairs of receiver j."""
        return {(p.sender, p.receiver) for p in self.plan if p.receiver == j}

    def repair(self) -> bool:
        """Re-probe, re-plan and reconnect the broken pairs (their actors may have been restarted, maybe
        elsewhere: ``SyncActors.relocate`` waits for Ray to bring them back); returns whether any was."""
        if not self.broken:
            return False
        broken = fanout_group.mates(self.plan, self.broken)  # kept until repaired: tried again next push
        self.actors.relocate(broken, self._timeout_s)
        self._report_sources({i for i, _ in broken})
        self._report_shapes({i for i, _ in broken})
        replanned = self._choose([(p.sender, p.receiver) for p in self.plan])  # rings that share memory
        broken = fanout_group.mates(replanned, broken)  # a fan-out the re-plan makes is connected whole
        for k, p in enumerate(replanned):
            if (p.sender, p.receiver) in broken:
                self.plan[k] = p
                logger.info("re-planned pair #%d -> #%d: %s, %s", p.sender, p.receiver, p.transport, p.mode)
        check_groups(self.plan, self.actors.sender_at, self.actors.receiver_at)
        self._connect(broken)
        self.broken -= broken
        return True

    def _report_sources(self, senders: set[int]) -> None:
        """Each of ``senders`` reports what its source gives under this config (placement.report_source)."""
        calls = self.actors.on_senders(
            report_source, {i: (self._source, self.config) for i in sorted(senders)}
        )
        reports = self.actors.get(calls, "report the source", self._timeout_s)
        self._sources.update(zip(sorted(senders), reports, strict=True))

    def _report_shapes(self, senders: set[int]) -> None:
        """Which senders' sources are sharded, walking together (raysync.ray.trainer_group); checked."""
        calls = self.actors.on_senders(source_shape, {i: (self._source,) for i in sorted(senders)})
        shapes = self.actors.get(calls, "report the source's shape", self._timeout_s)
        self.group.shapes.update(zip(sorted(senders), shapes, strict=True))
        self.group.check(len(self.actors.senders), self._shard)

    def followers(self, receivers_of: dict[int, list[int]], version: int) -> dict[int, tuple]:
        """The arguments of trainer_group.follow for each walking sender with no receiver this round."""
        followers = self.group.followers(receivers_of)
        if not followers:
            return {}
        config = self.group.walk_config(self.plan, self.config)
        return {i: (self._source, config, version) for i in followers}

    def _choose(self, pairs: list[Pair]) -> list[PairPlan]:
        o = self._override

        def override(i: int, j: int) -> str | None:
            return o.get((i, j)) if isinstance(o, dict) else o

        def plan(collective: set[Pair]) -> list[PairPlan]:
            # every built transport: what works for a pair is the endpoints' to say (their placements), not
            # the driver's, which may have no GPU at all
            return plan_pairs(
                pairs,
                self.actors.sender_at,
                self.actors.receiver_at,
                registry.names(),
                self.config,
                self._sources,
                lambda i, j: "collective" if (i, j) in collective else override(i, j),
                shares=len(self.actors.senders) if self._shard else 0,
            )

        plans = plan(set())
        # a sharded rank walks once per push: its receivers share one push (Note [every rank takes part in
        # every push] in raysync.ray.trainer_group)
        collective = self.group.forced_collective(plans, lambda i, j: override(i, j) or self._forced)
        plans = self.group.same_buckets(plan(collective) if collective else plans, collective)
        if not self._fan_out or self.config.delta:  # deltas: one session per pair (fanout_group)
            return plans
        return fanout_group.plan_fan_outs(plans, self.actors.sender_at, self.actors.receiver_at)

    def _connect(self, pairs: set[Pair]) -> None:
        """(Re)connect ``pairs``: a session per ring pair; a sender's whole fan-out, or broadcast group, if
        any of its pairs is among them."""
        fanouts = fanout_group.groups(self.plan)
        for p in self.plan:
            if (p.sender, p.receiver) in pairs and p.transport != "collective":
                if p.receiver not in fanouts.get(p.sender, ()):
                    self._connect_ring(p)
        for i, js in sorted(fanouts.items()):
            if any((i, j) in pairs for j in js):
                self._connect_fanout(i, js)
        groups = {
            p.sender for p in self.plan if (p.sender, p.receiver) in pairs and p.transport == "collective"
        }
        for i in sorted(groups):
            self._connect_group(
                i, [p.receiver for p in self.plan if p.sender == i and p.transport == "collective"]
            )

    def _connect_ring(self, p: PairPlan) -> None:
        s = self.actors.sender_at[p.sender]
        same_host = s.host == self.actors.receiver_at[p.receiver].host
        endpoint = None if same_host else f"tcp://{s.ip}:*"
        secret = SessionSecret.generate()  # per pair, made here, handed out through Ray
        cfg = p.config(self.config)
        opened: SessionOpened
        [opened] = self.actors.get(
            self.actors.on_senders(
                ep.sender_connect,
                {p.sender: (self.sync_id, cfg, p.receiver, secret, endpoint, self._source)},
            ),
            f"connect sender #{p.sender}",
            self._timeout_s,
        )
        self.push_bytes[p.sender, p.receiver] = opened.push_bytes
        self.actors.get(
            self.actors.on_receivers(
                ep.receiver_connect, {p.receiver: (self.sync_id, cfg, opened.address, secret, self._sink)}
            ),
            f"connect receiver #{p.receiver}",
            self._timeout_s,
        )

    def _connect_fanout(self, i: int, receivers: list[int]) -> None:
        """Sender i's one session for all of ``receivers`` (one ring they all read), then each of them
        connected to its own endpoint of it, all at once."""
        secret = SessionSecret.generate()
        cfg = next(p for p in self.plan if (p.sender, p.receiver) == (i, receivers[0])).config(self.config)
        opened: FanoutOpened
        [opened] = self.actors.get(
            self.actors.on_senders(
                ep.fanout_connect, {i: (self.sync_id, cfg, receivers, secret, self._source)}
            ),
            f"open the fan-out of sender #{i}",
            self._timeout_s,
        )
        self.push_bytes.update({(i, j): opened.push_bytes for j in receivers})
        args = {
            j: (self.sync_id, cfg, address, secret, self._sink)
            for j, address in zip(receivers, opened.addresses, strict=True)
        }
        self.actors.get(
            self.actors.on_receivers(ep.receiver_connect, args),
            f"connect the readers of sender #{i}'s fan-out",
            self._timeout_s,
        )

    def _connect_group(self, i: int, receivers: list[int]) -> None:
        secret, cfg = SessionSecret.generate(), group_config(self.plan, i, self.config)
        share = (i, len(self.actors.senders)) if self._shard else None
        host = self.actors.sender_at[i].ip
        opened: GroupOpened
        [opened] = self.actors.get(
            self.actors.on_senders(
                ep.collective_open, {i: (self.sync_id, cfg, host, receivers, secret, self._source, share)}
            ),
            f"open the broadcast group of sender #{i}",
            self._timeout_s,
        )
        self.push_bytes.update({(i, j): opened.push_bytes for j in receivers})
        joins = self.actors.on_senders(ep.collective_join, {i: (self.sync_id,)})
        joins |= self.actors.on_receivers(
            ep.collective_connect,
            {
                j: (self.sync_id, cfg, rank, opened.rendezvous, secret, self._sink, share)
                for rank, j in enumerate(receivers, start=1)
            },
        )
        self.actors.get(joins, f"join the broadcast group of sender #{i}", self._timeout_s)
