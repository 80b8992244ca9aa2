"""A sharded trainer as WeightSync's senders: the ranks of one FSDP2 / DTensor or tensor-parallel group, each a
Ray actor, each holding the lazy source it made itself (raysync.sources.DTensorSource, made on every rank at the
same point: it makes a process group).

    ranks = [Rank.remote(r, world) for r in range(world)]            # the user's actors, as they are
    sync = WeightSync(ranks, engines, config, source=lambda rank: rank.source)

WeightSync plans the sending rank of each receiver by the usual rules (the rank on the receiver's GPU, else on
its node, else rank 0), and drives every rank's part of each push: a sending rank pushes, every other rank
follows (``DTensorSource.follow``), in the same round.

Note [every rank takes part in every push]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A sharded source walks its buckets once per push on every rank of its group, each bucket one all-gather that
every rank joins (Note [every rank walks the same buckets] in raysync.sources.walk). So, for WeightSync:
  - every rank of the group is one of the senders (checked at setup: a rank left out would never join);
  - every rank walks once per push: a sending rank serves all of its receivers in one push, i.e. one broadcast
    group (its pairs are planned "collective" when it has several receivers; a transport forced otherwise for
    them is a PlanError), and a rank with no receiver follows;
  - every rank walks the same buckets: the pairs of the group's sending ranks run one bucket size (the smallest
    the plan sized for any of them), and the followers are given it (``walk_config``).
A rank that dies or never joins makes the others' walk fail within timeout_s, naming it (the walk's census).
The driver waits for a follower that has not answered at most ``follower_grace_s`` after every other endpoint
answered, then names it (PeerTimeout); a call of it still queued behind the rank's other work runs later and
fails on its own (its walk finds no one). After a failed gather the source's group is unusable (the walk says so at the next push,
on every rank): the user makes new sources (and, for a rank Ray restarted, a new group), which the next push
picks up, since ``source(actor)`` is asked at every push.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from raysync.core.config import SyncConfig
from raysync.core.errors import PlanError
from raysync.core.source import is_source, select
from raysync.ray.placement import PairPlan
from raysync.ray.results import RemoteFailure
from raysync.sources.walk import CENSUS_SHARE

Pair = tuple[int, int]


@dataclass(frozen=True)
class SourceShape:
    """What a sender's source is, as the sender reports it: ``lazy`` (a Source, not (name, tensor) pairs);
    ``walks``: a sharded source whose ``rank`` of ``world`` takes part in every push (it has ``follow``)."""

    lazy: bool = False
    walks: bool = False
    rank: int = 0
    world: int = 1


@dataclass(frozen=True)
class Followed:
    """A following rank's part of a push: the push's outcome as its walk saw it ("done", "skipped",
    "followed"), or the failure that ended its walk (naming the rank that failed or did not join)."""

    outcome: str = ""
    failure: RemoteFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


# --- inside the trainer ranks (through __ray_call__, like raysync.ray.endpoint) --------------------------------------
def source_shape(actor: Any, source: Callable[[Any], Any]) -> SourceShape:
    given = source(actor)
    if not is_source(given):
        return SourceShape()
    world = int(getattr(given, "world", 1))
    walks = callable(getattr(given, "follow", None)) and world > 1
    return SourceShape(True, walks, int(getattr(given, "rank", 0)) if walks else 0, world if walks else 1)


def follow(actor: Any, source: Callable[[Any], Any], config: SyncConfig, version: int) -> Followed:
    """This rank's part of the push of ``version`` when it sends to no receiver: the same walk of gathers."""
    try:
        return Followed(source(actor).follow(version, config))
    except Exception as e:
        return Followed(failure=RemoteFailure.of("follow", e))  # a walk's error names its own stage


def push_bytes(given: Any, config: SyncConfig) -> int:
    """What a push of ``given`` moves: from a lazy source's metadata, else from the tensors."""
    if is_source(given):
        return sum(s.nbytes for s in given.specs(config))
    return sum(s.spec.nbytes for s in select(given, config))


def device_of(given: Any) -> str | None:
    """Where a source's tensors are ("cpu", "cuda"), None when unknown (a lazy source that does not say)."""
    if is_source(given):
        device = getattr(given, "device", None)
        return None if device is None else str(getattr(device, "type", device))
    first = next(iter(given), None)
    return None if first is None else first[1].device.type


# --- on the driver ---------------------------------------------------------------------------------------------------
def follower_grace_s(config: SyncConfig, failed: bool) -> float:
    """How long the driver waits for a follower once every other endpoint answered. After a push that went
    through, every follower has walked to its end (the sending rank's end exchange needs them all): only Ray's
    answer is on its way, given timeout_s. After a failure, a live rank's walk ended within CENSUS_SHARE of
    timeout_s after the gather that failed began (Note [every rank walks the same buckets]): the rest of it."""
    return (1.0 - CENSUS_SHARE) * config.timeout_s if failed else config.timeout_s


class TrainerGroup:
    """The senders whose sources walk together (Note [every rank takes part in every push])."""

    def __init__(self) -> None:
        self.shapes: dict[int, SourceShape] = {}

    @property
    def ranks(self) -> list[int]:
        """The senders (by index) whose sources walk."""
        return sorted(i for i, s in self.shapes.items() if s.walks)

    def check(self, senders: int, shard_sources: bool) -> None:
        """Every rank of the group is a sender, each once; refused before any session."""
        walking = self.ranks
        lazy = [i for i, s in self.shapes.items() if s.lazy]
        if shard_sources and lazy:
            raise PlanError(
                f"senders {lazy} have lazy sources: shard_sources splits whole tensors between senders that "
                f"hold them all; a sharded trainer's ranks are handed to WeightSync without it"
            )
        if not walking:
            return
        worlds = {self.shapes[i].world for i in walking}
        held = sorted(self.shapes[i].rank for i in walking)
        world = max(worlds)
        if len(worlds) > 1 or held != list(range(world)):
            by_sender = ", ".join(
                f"sender #{i}: rank {self.shapes[i].rank} of {self.shapes[i].world}" for i in walking
            )
            raise PlanError(
                f"the senders hold the ranks of a sharded source as {by_sender}: every rank of one group must "
                f"be a sender, each once (a rank left out never joins the all-gathers of a push, so no push "
                f"could finish); hand WeightSync all {world} trainer ranks of the group"
            )

    def forced_collective(
        self, plans: Sequence[PairPlan], forced: Callable[[int, int], str | None]
    ) -> set[Pair]:
        """The pairs to plan again as "collective": those of a walking rank with several receivers, which
        must share one push. PlanError when a transport was forced otherwise for one of them."""
        out: set[Pair] = set()
        for i in self.ranks:
            mine = [p for p in plans if p.sender == i]
            if len(mine) < 2 or all(p.transport == "collective" for p in mine):
                continue
            refused = [(p.receiver, forced(i, p.receiver)) for p in mine if forced(i, p.receiver)]
            refused = [(j, t) for j, t in refused if t != "collective"]
            if refused:
                raise PlanError(
                    f"sender #{i} ({self._rank(i)}) serves receivers {[p.receiver for p in mine]}, with "
                    f"{', '.join(f'#{j} forced over {t!r}' for j, t in refused)}: a sharded source walks its "
                    f"buckets once per push on every rank, so one rank's receivers must share one push (one "
                    f"broadcast group: transport 'collective'); force 'collective' for them, or give the rank "
                    f"one receiver (pairs=)"
                )
            out |= {(i, p.receiver) for p in mine}
        return out

    def same_buckets(self, plans: Sequence[PairPlan], forced_pairs: set[Pair]) -> list[PairPlan]:
        """Every pair of a walking rank runs one bucket size: the smallest the plan sized for any of them."""
        walking = set(self.ranks)
        out = []
        sizes = [p.bucket_bytes for p in plans if p.sender in walking and p.bucket_bytes]
        smallest = min(sizes, default=0)
        sending = {p.sender for p in plans}
        follow = ", ".join(str(self.shapes[i].rank) for i in sorted(walking - sending)) or "none"
        for p in plans:
            if p.sender not in walking:
                out.append(p)
                continue
            how = [p.how, f"sharded: {self._rank(p.sender)} sends, ranks {follow} follow"]
            if (p.sender, p.receiver) in forced_pairs:
                how.append(f"one broadcast group: {self._rank(p.sender)} walks once per push")
            if p.bucket_bytes != smallest:
                how.append("the group's smallest buckets: every rank walks the same ones")
            out.append(dataclasses.replace(p, bucket_bytes=smallest, how="; ".join(filter(None, how))))
        return out

    def followers(self, receivers_of: dict[int, list[int]]) -> list[int]:
        """The walking senders with no receiver this round; none when no walking rank sends."""
        walking = self.ranks
        if not any(receivers_of.get(i) for i in walking):
            return []
        return [i for i in walking if not receivers_of.get(i)]

    def walk_config(self, plans: Iterable[PairPlan], config: SyncConfig) -> SyncConfig:
        """The config the followers walk with: the sending ranks' (the same buckets)."""
        walking = set(self.ranks)
        sending = next(p for p in plans if p.sender in walking)
        return sending.config(config)

    def _rank(self, i: int) -> str:
        s = self.shapes[i]
        return f"trainer rank {s.rank} of {s.world}"
