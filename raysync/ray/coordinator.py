"""WeightSync: the driver-side coordinator. Finds where every endpoint runs, picks a transport per pair, runs
push rounds across all pairs at once, and repairs pairs whose actor was restarted.

    sync = WeightSync(senders=[trainer], receivers=[engine_a, engine_b], config=SyncConfig(...))
    print(sync.plan)                  # who sends to whom, over what, and why
    report = sync.push(version=1)     # every pair at once; raises SyncError naming the failed endpoints
    sync.versions()                   # what each receiver holds: a version, "mixed" or None
    sync.push(version=2, staged=True) # lands in staging memory while the engines keep generating (docs/staged.md)
    sync.flip()                       # then every engine applies it at its next step boundary, or none does
    sync.staging()                    # where each engine staged it: whole or groups, device or host, bytes, why
    sync.close()                      # or use `with WeightSync(...) as sync:`

Endpoints are the user's own Ray actors. By default a sender pushes ``actor.model.named_parameters()`` and a
receiver writes into ``actor.model``'s parameters; pass ``source=`` / ``sink=`` (functions of the actor) for
anything else — a sink may return a dict of tensors or a ``load_weights``-style function. A receiver may also
be an engine adapter (``raysync.engines.vllm.VllmEngine(actor)``): one receiver per engine worker, each loading
through the engine's own path. ``plan``, ``versions()`` and reports number receivers that way: an engine of
two workers is two receivers.

Ray restarts actors (``max_restarts``): every set-up call asks an actor again while Ray restarts it, up to
setup_timeout_s, then gives that actor a typed error (ActorUnavailable, PeerTimeout). A push is not asked again
(a restarted actor has no session): its pairs are reconnected, and pushed the full weights, at the next push.

WeightSync is the facade over the pieces, each in its module:

    actors.py       SyncActors: the senders and receivers, where they run, how to ask them
    connections.py  PairConnections: the plan, each pair's session, repair of the pairs a push broke
    push_round.py   PushRound: one push across every pair at once, into a SyncReport or a SyncError
    push_graph.py   PushGraph: the push round as one compiled Ray graph, rebuilt when the connections change
    push_loop.py    PushLoops: push rounds through a loop in each actor (the default; loop_member.py, the
                    actor's side), over loop_channel.py's sockets; call_order.py: a round behind the driver's
                    own pending calls goes through calls
    staged_round.py StagedPushes: a push staged on every receiver, its flip (all or nothing), its discard
    results.py      what the actors answer the driver (EndpointResult, ...); report.py what push returns
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from raysync.core.config import SyncConfig
from raysync.core.errors import (  # the actor errors and SyncError are part of this module's API
    ActorGone,
    ActorUnavailable,
    FlipFailed,
    NothingStaged,
    StageFailed,
    SyncClosed,
    SyncError,
)
from raysync.core.version import Version
from raysync.ray import endpoint as ep
from raysync.ray.actors import SyncActors
from raysync.ray.connections import PairConnections, Plan
from raysync.ray.push_graph import keeper_for
from raysync.ray.push_round import PushRound
from raysync.ray.report import FlipReport, PairReport, SyncReport
from raysync.ray.results import StagingReport
from raysync.ray.staged_round import StagedPushes, StagingPlan, check_staged_options

__all__ = [
    "ActorGone",
    "ActorUnavailable",
    "FlipFailed",
    "FlipReport",
    "NothingStaged",
    "PairReport",
    "Plan",
    "StageFailed",
    "StagingReport",
    "SyncClosed",
    "SyncError",
    "SyncReport",
    "WeightSync",
]

logger = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self,
        senders: Sequence[Any],
        receivers: Sequence[Any],
        config: SyncConfig | None = None,
        *,
        pairs: Sequence[tuple[int, int]] | None = None,
        source: ep.SourceFn = ep.model_parameters,
        sink: ep.SinkFn = ep.model_destinations,
        transport: str | dict[tuple[int, int], str] | None = None,
        setup_timeout_s: float = 300.0,
        push_timeout_s: float = 3600.0,
        shard_sources: bool = False,
        compiled_graph: bool = False,
        max_version_lag: int | None = None,
        push_rounds: str = "loop",
        fan_out: bool = False,
        staging_memory: str = "auto",
    ):
        """``pairs`` (sender index, receiver index) default to placement: the sender on the receiver's GPU,
        else on its node, else sender 0. ``transport`` overrides the plan globally or per pair.
        ``shard_sources``: every sender broadcasts a disjoint share of the tensors to every receiver over its
        own collective group (raysync.transport.sharded): the senders must hold the same tensors (trainer ranks).
        ``compiled_graph``: push rounds through one compiled Ray graph, a fraction of the ordinary calls' cost
        per push (raysync.ray.push_graph; what changes for the actors, and why it is not the default, is in its
        Note); False: ``push_rounds`` says. ``push_rounds``: how push rounds reach the actors: "loop" (the
        default: a loop in each plain actor, started at setup and triggered over raysync's own signed control
        channel, Ray supervising: raysync.ray.push_loop), "graph" (= ``compiled_graph=True``) or "calls" (one
        ordinary Ray call per endpoint and round). Engine adapters keep their ordinary calls; and a round whose
        actors still run or queue a call this process made (``trainer.step.remote()`` not waited for) goes
        through ordinary calls, queued behind it as Ray queues calls (raysync.ray.call_order; the report's
        ``rounds`` says how each round went). ``max_version_lag``: an engine that runs
        its steps in ``engine_steps`` (raysync.ray.staged_endpoint) waits at a step boundary, rather than start a
        step on weights more than this many versions older than the newest staged on it (docs/staged.md).
        ``fan_out``: a sender's pairs to engines on its host that the plan reaches one way (an shm ring, a
        cuda_ipc ring, or direct mode) become one session that they all read, each bucket packed once
        (raysync.ray.fanout_group); its engines then move together: one that fails a push fails it for all of
        them. Not with SyncConfig.delta (one session per pair). ``staging_memory``: where the
        engines stage a staged push: "device" (beside the live weights), "host" (pinned host memory) or "auto"
        (the device when it has room; raysync.core.staging_memory); ``staging()`` and ``plan`` say what each
        chose, and why, once it staged."""
        check_staged_options(max_version_lag, staging_memory)  # before any actor call
        self._actors = SyncActors(senders, receivers, source, sink)
        self.senders, self.receivers = self._actors.senders, self._actors.receivers
        self.config = config or SyncConfig()
        self._sync_id = secrets.token_hex(8)
        self._setup_timeout_s, self._push_timeout_s = setup_timeout_s, push_timeout_s
        self._connections = PairConnections(
            self._actors,
            self.config,
            self._sync_id,
            source=source,
            sink=sink,
            transport=transport,
            pairs=pairs,
            shard_sources=shard_sources,
            setup_timeout_s=setup_timeout_s,
            fan_out=fan_out,
        )
        self._closed = False
        self._graphs = keeper_for("graph" if compiled_graph else push_rounds, self._actors, self._connections)
        self._staged = StagedPushes(
            self._actors,
            self._connections,
            setup_timeout_s=setup_timeout_s,
            max_version_lag=max_version_lag,
            staging_memory=staging_memory,
        )
        self._actors.locate(setup_timeout_s)
        self._connections.open()
        self._graphs.current()  # compiled at setup: the first push starts at once
        logger.info("WeightSync %s set up:\n%s", self._sync_id, self.plan)

    @property
    def plan(self) -> Plan:
        """Who sends to whom, over which transport, and why: one PairPlan per pair; ``str(plan)`` is a table,
        followed by how the push rounds reach the actors (a compiled graph, ordinary calls) and the engines'
        staging memory (``plan.staging``, as ``staging()``; "chosen at the first staged push" before it)."""
        return StagingPlan(self._graphs.plan(), self._staged)

    def push(self, version: int, *, staged: bool = False, full: bool = False) -> SyncReport:
        """One round: every sender pushes ``version`` to its receivers, all pairs at once. Raises SyncError
        naming each failed endpoint; the next push first reconnects the pairs that failed. ``full``: no delta
        this time (SyncConfig.delta). ``staged``: every receiver lands it in staging memory and keeps its live
        weights (``versions()`` unchanged) until ``flip()``; a failure on any endpoint is StageFailed, after
        which every receiver has dropped it. A push while a version is staged replaces it (staged) or drops
        it (applied live). Staged and full pushes run through ordinary Ray calls, also with compiled_graph."""
        self._check_open("push")
        if staged or full or self._connections.broken:  # Note [the senders' answers, late] in push_loop
            self._graphs.settle()  # the last round's late answers first: nothing else runs in those sessions
        # pairs repaired: an actor may have been restarted (no loop in it), so new loops (or graph)
        if self._connections.repair():
            self._graphs.close()
        if staged:
            report = self._staged.push(
                version, full=full, timeout_s=self._push_timeout_s, progress=self.config.progress
            )
        else:
            self._staged.dropped()
            round_ = PushRound(
                self._actors,
                self._connections,
                version,
                timeout_s=self._push_timeout_s,
                progress=self.config.progress,
                full=full,
            )
            graph, rounds = (None, "calls (a full push)") if full else self._graphs.for_push()
            if graph is None:  # ordinary calls: the loops' last round is over first
                self._graphs.settle()
            try:
                report = round_.run(graph, rounds, whole=self._graphs.whole)
            finally:  # a sender's late failure this round took: its pairs reconnect before the next push
                self._graphs.settle(wait=False)
        logger.info("%s", report)
        return report

    def flip(self) -> FlipReport:
        """Apply the staged version on every receiver, each at its engine's next step boundary (now, for an
        engine without ``engine_steps``): all of them, or none when any cannot (its stage failed, its actor was
        restarted): FlipFailed names it, every receiver discards and keeps its live weights (Note [all or
        nothing across engines] in raysync.ray.staged_round). NothingStaged when no staged push waits."""
        self._check_open("flip")
        report = self._staged.flip(self.config.timeout_s)
        logger.info("%s", report)
        return report

    def discard(self) -> int | None:
        """Every receiver drops the version staged for a flip; returns it (None: nothing was staged)."""
        self._check_open("discard")
        return self._staged.discard()

    def staged_versions(self) -> list[int | None]:
        """Each receiver's version waiting for its flip (None: nothing staged there)."""
        self._check_open("staged_versions")
        return self._staged.staged_versions()

    def staging(self) -> list[StagingReport | None]:
        """Where each receiver staged its last staged push, as it answered that push (no call now): whole or
        groups, device or host memory, its bytes, and why (StagingReport); None where none was staged yet."""
        self._check_open("staging")
        return [self._staged.staging.get(j) for j in range(len(self._actors.slots))]

    def versions(self) -> list[Version]:
        """What each receiver holds (Note [versions never lie]): the version of its last complete push,
        "mixed" after a push that failed part-way (until the next one completes), None before any push (or
        restarted by Ray and not pushed to since; also an actor that died for good). Waits (up to
        setup_timeout_s) for actors that Ray is restarting; raises ActorUnavailable if one is still not back."""
        self._check_open("versions")
        slots = self._actors.slots
        calls = self._actors.on_receivers(
            ep.receiver_version, {j: (self._sync_id,) for j in range(len(slots))}
        )
        versions: dict[int, Version] = {}
        for (_, e), by_slot in self._actors.ask(calls, "versions", self._setup_timeout_s).items():
            if isinstance(by_slot, ActorGone):
                logger.warning("%s", by_slot)  # no process, no weights: it holds no version
                by_slot = {slot: None for e_, slot in slots if e_ == e}
            elif isinstance(by_slot, BaseException):
                raise by_slot
            versions.update(self._actors.by_receiver(e, by_slot))
        return [versions[j] for j in range(len(slots))]

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise SyncClosed(
                f"{what}() on WeightSync {self._sync_id}, which was closed (close() or the end of its "
                f"`with` block) and holds no sessions any more: make a new WeightSync"
            )

    def close(self) -> None:
        """End every session (idempotent). Actors that are gone or restarting have none left: not waited for."""
        self._closed = True
        self._graphs.close()  # the graph's loops first: they hold the sessions' answers
        self._actors.close(self._sync_id, self.config.timeout_s)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
