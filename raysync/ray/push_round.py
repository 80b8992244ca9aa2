"""One push round, across every pair of a WeightSync at once:

    start    every sender's sender_push and every receiver endpoint's receiver_receive, all at once
    collect  every answer, bounded by push_timeout_s, with a byte progress bar for long pushes
    read     each EndpointResult: a PairReport per pair that went through, an EndpointFailure per endpoint
             that did not, whose pairs are marked broken (reconnected, with the full weights, next push)
    report   a SyncReport, or one SyncError naming every failed endpoint and the receivers left "mixed"

A call of a push is not made again when Ray restarts its actor (a restarted actor has no session): the next push
repairs its pairs (PairConnections.repair).

# Note [a round with no ordinary call]
# Through push loops (or a compiled graph) that reach every endpoint, the common case, a round makes no ordinary Ray
# call, and ``start`` has nothing to build: the keeper says so (GraphKeeper.whole, worked out once per set of
# connections, with their shape), and ``run`` skips it. That walk of the plan, the trainer group and the call
# builders was on the driver's path to the first "go" frame: 15-30 us of its ~180 us on the 2-core VM, where the
# driver's code runs cold (it just woke from the caller's ray.get; runs of 400 pushes of tiny tensors).
# Its answers, when every one is a success (the common case), are read in one pass into the SyncReport
# (``_all_went_through``); any other answer sends the round through the reading that names failures and marks
# pairs broken. That pass is between the receivers' answers and push()'s return, the critical path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from raysync.core.errors import EndpointFailure, PeerTimeout, SyncError
from raysync.core.version import MIXED
from raysync.ray import endpoint as ep
from raysync.ray.actors import Key, SyncActors, first_line
from raysync.ray.connections import PairConnections
from raysync.ray.push_graph import GraphTimedOut, PushGraph, receivers_of_senders
from raysync.ray.report import PairReport, SyncReport
from raysync.ray.results import EndpointResult, RemoteFailure
from raysync.ray.trainer_group import Followed, follow, follower_grace_s


class PushRound:
    def __init__(
        self,
        actors: SyncActors,
        connections: PairConnections,
        version: int,
        *,
        timeout_s: float,
        progress: bool,
        full: bool = False,
        receive: tuple[Callable, tuple] = (ep.receiver_receive, ()),
    ):
        """``full``: the senders push no delta this time. ``receive``: the receivers' function and its
        arguments after the sync_id (a staged push: raysync.ray.staged_endpoint.receiver_stage)."""
        self.actors, self.connections, self.version = actors, connections, version
        self._timeout_s, self._progress = timeout_s, progress
        self._full, self._receive = full, receive
        self._sent: dict[int, dict[int, EndpointResult]] = {}  # sender i -> its result for each receiver j
        self._received: dict[int, EndpointResult] = {}  # receiver j -> its result
        self._followed: dict[int, Followed] = {}  # a sharded trainer's rank i that sent to no one -> its walk
        self._following: set[Key] = set()  # their calls (Note [every rank takes part in every push])
        self._heard_failure = False  # an endpoint of this round failed
        self._waiting_since: float | None = None  # when only followers were left to answer
        self._failures: list[EndpointFailure] = []

    def run(
        self, graph: PushGraph | None = None, rounds: str = "calls", *, whole: bool = False
    ) -> SyncReport:
        """Raises SyncError when any endpoint failed, PeerTimeout when the round outlasts push_timeout_s.
        ``graph``: its members take their part through it, the others through ordinary calls; ``rounds``: how,
        for the report; ``whole``: the graph's members are every endpoint of the round (GraphKeeper.whole): no
        ordinary call is made (Note [a round with no ordinary call])."""
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        if graph is not None and whole:  # Note [a round with no ordinary call]
            answers = self._graph_answers(graph, deadline)
            report = self._all_went_through(answers, rounds, started)
            if report is not None:
                return report
            self._take_answers(answers)
            calls = {}
        else:  # submitted first: they run meanwhile
            calls = self._start(set(graph.keys) if graph is not None else set())
            if graph is not None:
                self._take_answers(self._graph_answers(graph, deadline))
        self._collect(calls, deadline)
        pairs = self._read_senders()
        self._read_receivers()
        self._read_followers()
        if self._failures:
            mixed = sorted(j for j, r in self._received.items() if r.version == MIXED)
            raise SyncError(self.version, self._failures, mixed)
        by_receiver = tuple(sorted(pairs, key=lambda p: p.receiver))
        return SyncReport(self.version, time.perf_counter() - started, by_receiver, rounds=rounds)

    def _start(self, members: set[Key]) -> dict[Any, Key]:
        """Every ordinary call of the round (those of endpoints not in the graph), made: ObjectRef -> who answers.
        A graph's or the loops' members get no call, nor is one built for them (a push through loops that
        reach every endpoint builds none)."""
        sync_id, receivers_of = self.connections.sync_id, receivers_of_senders(self.connections)
        senders = {i: js for i, js in receivers_of.items() if ("sender", i) not in members}
        calls = self.actors.on_senders(
            ep.sender_push, {i: (sync_id, self.version, js, self._full) for i, js in senders.items()}
        )
        fn, args = self._receive
        slots = self.actors.slots
        receivers = [
            j for js in receivers_of.values() for j in js if ("receiver", slots[j][0]) not in members
        ]
        calls |= self.actors.on_receivers(fn, {j: (sync_id, *args) for j in receivers})
        following = self.actors.on_senders(follow, self.connections.followers(receivers_of, self.version))
        self._following = set(following)
        calls |= following
        return {make(): key for key, make in calls.items() if key not in members}

    def _graph_answers(self, graph: PushGraph, deadline: float) -> dict[Key, Any]:
        try:
            return graph.run(self.version, deadline, self._timeout_s)
        except GraphTimedOut as e:
            self._time_out(e.keys)
            raise  # not reached: _time_out raises

    def _all_went_through(self, answers: dict[Key, Any], rounds: str, started: float) -> SyncReport | None:
        """The report of a round in which every endpoint answered a success, read in one pass (Note [a round with
        no ordinary call]); None when any did not: ``_take_answers`` then reads each (failures, broken pairs)."""
        transports = {(p.sender, p.receiver): p.transport for p in self.connections.plan}
        pairs = []
        for (role, i), answer in answers.items():
            if type(answer) is not dict:
                return None
            for j, r in answer.items():
                if type(r) is not EndpointResult or r.failure is not None:
                    return None
                if role == "sender" and r.report is not None:  # as _read_senders reads it
                    pairs.append(PairReport(i, j, transports[i, j], r.report.bytes, r.report.seconds))
        pairs.sort(key=lambda p: p.receiver)
        return SyncReport(self.version, time.perf_counter() - started, tuple(pairs), rounds=rounds)

    def _take_answers(self, answers: dict[Key, Any]) -> None:
        for key, answer in answers.items():
            if isinstance(answer, Exception):
                self._lost(key, answer)
            else:
                self._take(key, answer, None)

    def _collect(self, refs: dict[Any, Key], deadline: float) -> None:
        if not refs:  # every endpoint answered through the graph or the loops
            return
        import ray

        pending = list(refs)
        bar = tqdm(
            total=sum(self.connections.push_bytes.values()),
            unit="B",
            unit_scale=True,
            delay=1.0,
            desc=f"push v{self.version}",
            disable=not self._progress,
            leave=False,
        )
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._time_out([refs[ref] for ref in pending])
                if all(refs[ref] in self._following for ref in pending):  # only followers left
                    left = min(left, self._grace_left())
                    if left <= 0:
                        self._follower_timed_out([refs[ref] for ref in pending])
                        break
                done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
                for ref in done:
                    try:
                        answer = ray.get(ref)
                    except ray.exceptions.RayError as e:  # the actor died, or Ray could not run the call
                        self._lost(refs[ref], e)
                    else:
                        self._take(refs[ref], answer, bar)
        finally:
            bar.close()

    def _grace_left(self) -> float:
        """How much longer the driver waits for the followers once every other endpoint answered
        (trainer_group.follower_grace_s: shorter after a failure, which ended the followers' walk too)."""
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        grace = follower_grace_s(self.connections.config, self._heard_failure)
        return self._waiting_since + grace - time.monotonic()

    def _follower_timed_out(self, keys: list[Key]) -> None:
        """Named (PeerTimeout). A call still queued behind the rank's other work runs later all the same (not
        cancelled: ray.cancel of a call queued on a plain actor answered TaskCancelledError and still ran it, in
        a check with Ray 2.60): its walk then fails on its own within timeout_s, and no one waits for it."""
        grace = follower_grace_s(self.connections.config, self._heard_failure)
        for key in keys:
            name = f"{self.actors.label(key)} (a rank of the sharded trainer)"
            error = PeerTimeout(name, "following the push", grace)
            self._followed[key[1]] = Followed(failure=RemoteFailure.of("following the push", error))

    def _take(self, key: Key, answer: Any, bar: tqdm | None) -> None:
        role, index = key
        results = answer.values() if isinstance(answer, dict) else [answer]
        self._heard_failure |= any(not getattr(r, "ok", True) for r in results)
        if isinstance(answer, Followed):
            self._followed[index] = answer
        elif role == "sender":  # a sender answers when all of its pairs are done
            self._sent[index] = answer
            if bar is not None:
                bar.update(sum(b for (i, _), b in self.connections.push_bytes.items() if i == index))
        else:
            for j, result in self.actors.by_receiver(index, answer).items():
                self._received[j] = result

    def _lost(self, key: Key, error: Exception) -> None:
        """Ray gave no answer for ``key``: every pair of that endpoint is repaired before the next push."""
        self._heard_failure = True
        name = self.actors.label(key)
        self._failures.append(EndpointFailure(name, f"push v{self.version}", first_line(error), str(error)))
        self.connections.mark_broken(self.connections.pairs_of(key))

    def _time_out(self, keys: list[Key]) -> None:
        for key in keys:  # whatever they were doing, their sessions are suspect now
            self.connections.mark_broken(self.connections.pairs_of(key))
        names = ", ".join(self.actors.label(key) for key in keys)
        raise PeerTimeout(names, f"push v{self.version}", self._timeout_s)

    def _read_senders(self) -> list[PairReport]:
        pairs = []
        # each pair's transport, in one walk of the plan (not one walk per pair)
        transports = {(p.sender, p.receiver): p.transport for p in self.connections.plan}
        for i, by_receiver in self._sent.items():
            for j, r in by_receiver.items():
                if r.failure is not None:
                    at = self.actors.sender_at[i].label()
                    self._failed(f"sender #{i} ({at}) (pushing to receiver #{j})", r.failure)
                    self.connections.mark_broken({(i, j)})
                elif r.report is not None:
                    pairs.append(PairReport(i, j, transports[i, j], r.report.bytes, r.report.seconds))
        return pairs

    def _read_receivers(self) -> None:
        for j, r in self._received.items():
            if r.failure is not None:
                self._failed(f"receiver #{j} ({self.actors.receiver_at[j].label()})", r.failure)
                self.connections.mark_broken(self.connections.pairs_to(j))

    def _read_followers(self) -> None:
        for i, f in sorted(self._followed.items()):
            if f.failure is not None:
                self._failed(f"sender #{i} ({self.actors.sender_at[i].label()}) (following)", f.failure)

    def _failed(self, endpoint: str, failure: RemoteFailure) -> None:
        self._failures.append(EndpointFailure(endpoint, failure.stage, failure.error, failure.traceback))
