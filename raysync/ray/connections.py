"""The connections of every (sender, receiver) pair of a WeightSync: the plan, made from where the actors run;
each pair's session over its transport; the pairs a failed push broke, re-probed, re-planned and reconnected
before the next push (``repair``).

A ring pair (shm, cuda_ipc) is one session: its sender opens it, then its receiver connects. A collective pair
belongs to its sender's broadcast group, which is made (and lost) as a whole: the sender opens the group, then
the sender and all of its receivers join it at once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from raysync.core.config import SyncConfig
from raysync.core.wire import SessionSecret
from raysync.ray import endpoint as ep
from raysync.ray.actors import Key, SyncActors
from raysync.ray.placement import PairPlan, Placement, assign, check_groups, choose, format_plan
from raysync.ray.results import GroupOpened, SessionOpened
from raysync.transport import registry

logger = logging.getLogger(__name__)

Pair = tuple[int, int]  # (sender i, receiver j)


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
    ):
        if shard_sources and (pairs is not None or transport not in (None, "collective")):
            raise ValueError("shard_sources pairs every sender with every receiver over the collective")
        self.actors, self.config, self.sync_id = actors, config, sync_id
        self._source, self._sink, self._override = source, sink, transport
        self._wanted_pairs = list(pairs) if pairs is not None else None
        self._shard, self._timeout_s = shard_sources, setup_timeout_s
        self.plan = Plan([], actors.sender_at, actors.receiver_at)  # placements as they are when printed
        self.push_bytes: dict[Pair, int] = {}  # what a push moves over each pair (for the progress bar)
        self.broken: set[Pair] = set()  # reconnected before the next push

    def open(self) -> None:
        """Plan every pair from the actors' placements (``SyncActors.locate`` first) and connect them all."""
        senders, receivers = self.actors.sender_at, self.actors.receiver_at
        pairs = self._wanted_pairs or assign(senders, receivers)
        if self._shard:
            pairs = [(i, j) for i in range(len(senders)) for j in range(len(receivers))]
        self.plan[:] = [self._choose(i, j) for i, j in pairs]
        check_groups(self.plan, senders, receivers)  # before any group is made: NCCL's error comes too late
        self._connect({(p.sender, p.receiver) for p in self.plan})

    def transport_of(self, pair: Pair) -> str:
        return next(p.transport for p in self.plan if (p.sender, p.receiver) == pair)

    def mark_broken(self, pairs: set[Pair]) -> None:
        """``pairs`` failed, or their sessions are suspect: they are reconnected before the next push."""
        self.broken |= pairs

    def pairs_of(self, key: Key) -> set[Pair]:
        """The pairs of a sender ("sender", i) or of a receiver endpoint ("receiver", e)."""
        role, index = key
        if role == "sender":
            return {(p.sender, p.receiver) for p in self.plan if p.sender == index}
        return {(p.sender, p.receiver) for p in self.plan if self.actors.slots[p.receiver][0] == index}

    def pairs_to(self, j: int) -> set[Pair]:
        """The pairs of receiver j."""
        return {(p.sender, p.receiver) for p in self.plan if p.receiver == j}

    def repair(self) -> None:
        """Re-probe, re-plan and reconnect the broken pairs (their actors may have been restarted, maybe
        elsewhere: ``SyncActors.relocate`` waits for Ray to bring them back)."""
        if not self.broken:
            return
        broken = set(self.broken)  # kept until repaired: a repair that fails is tried again next push
        self.actors.relocate(broken, self._timeout_s)
        for k, p in enumerate(self.plan):
            if (p.sender, p.receiver) in broken:
                self.plan[k] = self._choose(p.sender, p.receiver)
                logger.info("re-planned pair #%d -> #%d: %s", p.sender, p.receiver, self.plan[k].transport)
        check_groups(self.plan, self.actors.sender_at, self.actors.receiver_at)
        self._connect(broken)
        self.broken -= broken

    def _choose(self, i: int, j: int) -> PairPlan:
        if self._shard:
            return PairPlan(
                i, j, "collective", "collective", f"sharded sources: share {i} of {len(self.actors.senders)}"
            )
        o = self._override
        override = o.get((i, j)) if isinstance(o, dict) else o
        # every built transport: what works for a pair is the endpoints' to say (their placements), not the
        # driver's, which may have no GPU at all
        return choose(i, j, self.actors.sender_at[i], self.actors.receiver_at[j], registry.names(), override)

    def _connect(self, pairs: set[Pair]) -> None:
        """(Re)connect ``pairs``: a session per ring pair; a sender's whole broadcast group if any of its
        collective pairs is among them."""
        for p in self.plan:
            if (p.sender, p.receiver) in pairs and p.transport != "collective":
                self._connect_ring(p)
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
        cfg = dataclasses.replace(self.config, transport=p.transport)
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

    def _connect_group(self, i: int, receivers: list[int]) -> None:
        secret, cfg = SessionSecret.generate(), self.config
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
