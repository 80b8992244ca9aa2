"""A push round as one compiled Ray graph (Ray Compiled Graphs, ``ray.dag``): every sender's push and every
receiver's receive bound to one input, the version, compiled once per set of connections.

    version ─┬─> sender #i    endpoint.sender_round(version, sync_id, its receivers)   -> {receiver j: result}
             └─> receiver e   endpoint.receiver_round(version, sync_id, its slots)     -> {slot: result}

An ordinary Ray call is submitted, scheduled and answered through Ray's task machinery every time; a compiled
graph's actors wait on shared channels in a loop that Ray started once, so a round costs a channel write and a
read per actor (benchmarks/bench_weightsync.py measures both ways). The answers are the same typed results
(raysync.ray.results) as the ordinary calls', read by the same PushRound.

# Note [a push round in a compiled graph]
# - Only plain actors are in the graph: the senders and the receivers given as Ray actor handles. An engine
#   adapter (raysync.engines.vllm.VllmEngine) keeps its ordinary call, queued with the engine actor's own calls
#   (generation must not run beside a load); ``sync.plan`` says who is reached which way.
# - Ray runs a graph's tasks on a background thread of each actor ("_ray_system"): the actor still serves its
#   ordinary calls, beside the push, not before it. A push does not wait for calls the driver submitted to the
#   same actors without waiting for them: wait for the train step (ray.get) before pushing, as the README does,
#   or leave WeightSync(compiled_graph=False), the default.
# - Not the default: with Ray 2.60, an actor that took part in a compiled graph is not released when the
#   user's last handle to it goes (seen here: its resources stay taken after teardown), so actors made and
#   dropped per job stage would pile up; ray.kill ends them. And Ray's loop in each actor polls its channels
#   between rounds: an idle actor of a graph keeps part of a core busy for as long as the graph lives. Opt in where the actors live as long as the job and
#   that is cheaper than Ray's per-call cost; compare both rows of benchmarks/bench_weightsync.py first.
# - An actor runs one compiled graph at a time: a second WeightSync over the same actors cannot compile its
#   own and pushes through ordinary calls (said in its plan).
# - Failures: a remote failure is an answer (EndpointResult), as with ordinary calls. An actor that dies makes
#   Ray tear the whole graph down (ActorDiedError / RayChannelError at ray.get): the driver waits for the
#   teardown (every task that began has ended and kept its answer: endpoint.round_answer), then asks each
#   actor for its answer with an ordinary call; a dead actor's call fails as it fails today, and its pairs are
#   repaired before the next push, which compiles a new graph. A round past push_timeout_s tears the graph
#   down too (a read that timed out cannot be read again).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from raysync.core.errors import PeerTimeout
from raysync.ray import call_order
from raysync.ray import endpoint as ep
from raysync.ray.actors import Key, SyncActors, first_line, typed
from raysync.ray.connections import PairConnections, Plan

logger = logging.getLogger(__name__)

_RAY_TEARDOWN_S = (
    30.0  # beyond a push's own timeout_s: Ray's wait for the loops (RAY_CGRAPH_teardown_timeout)
)
_HELD: dict[str, str] = {}  # actor id -> the sync_id whose graph it runs (Ray would compile a second one)


class GraphTimedOut(Exception):
    """The graph's round outlasted its deadline: ``keys`` had not answered (the graph is torn down)."""

    def __init__(self, keys: list[Key]):
        super().__init__(keys)
        self.keys = keys


class PushGraph:
    """The compiled graph of one set of connections: ``shape`` is what it was compiled for."""

    def __init__(self, actors: SyncActors, sync_id: str, shape: tuple, *, teardown_s: float):
        """``teardown_s``: how long a teardown may wait for the actors' loops (a push ends within timeout_s)."""
        from ray.dag import InputNode, MultiOutputNode

        self.actors, self.sync_id, self.shape, self._teardown_s = actors, sync_id, shape, teardown_s
        senders, receivers = shape
        self.keys: list[Key] = [("sender", i) for i, _ in senders] + [("receiver", e) for e, _ in receivers]
        self._ids = [self._handle(key)._actor_id.hex() for key in self.keys]
        for key, actor_id in zip(self.keys, self._ids, strict=True):
            if _HELD.get(actor_id, sync_id) != sync_id:
                raise RuntimeError(
                    f"{actors.label(key)} runs the push graph of WeightSync {_HELD[actor_id]} (one graph per actor)"
                )
        with InputNode() as version:
            nodes = [
                actors.senders[i].__ray_call__.bind(ep.sender_round, version, sync_id, list(js))
                for i, js in senders
            ]
            nodes += [
                actors.receivers[e].actor.__ray_call__.bind(ep.receiver_round, version, sync_id, list(slots))
                for e, slots in receivers
            ]
            dag = MultiOutputNode(nodes)
        self._compiled = dag.experimental_compile()
        _HELD.update(dict.fromkeys(self._ids, sync_id))
        self.alive = True

    @classmethod
    def build(cls, actors: SyncActors, connections: PairConnections, shape: tuple) -> PushGraph:
        """The graph of ``shape`` for a GraphKeeper."""
        return cls(
            actors, connections.sync_id, shape, teardown_s=connections.config.timeout_s + _RAY_TEARDOWN_S
        )

    def describe(self) -> str:
        return f"one compiled Ray graph ({len(self.keys)} actors)"

    @staticmethod
    def shape_of(actors: SyncActors, receivers_of: dict[int, list[int]]) -> tuple:
        """What a graph is compiled for: each sender with its receivers, each plain-actor receiver endpoint with
        its slots. Engine adapters are left out (Note [a push round in a compiled graph])."""
        slots: dict[int, list[int]] = {}
        for js in receivers_of.values():
            for j in js:
                e, slot = actors.slots[j]
                if in_graph(actors.receivers[e]):
                    slots.setdefault(e, []).append(slot)
        return (
            tuple((i, tuple(js)) for i, js in sorted(receivers_of.items())),
            tuple((e, tuple(sorted(set(s)))) for e, s in sorted(slots.items())),
        )

    def run(self, version: int, deadline: float, timeout_s: float) -> dict[Key, Any]:
        """Every member's answer to the round of ``version``, or the error in its place (a RayTaskError, or a
        typed error for an actor Ray lost). Raises GraphTimedOut past ``deadline`` (``timeout_s`` after the
        round began)."""
        import ray

        answers: dict[Key, Any] = {}
        try:
            refs = self._compiled.execute(version)
            for key, ref in zip(self.keys, refs, strict=True):
                try:
                    answers[key] = ray.get(ref, timeout=max(deadline - time.monotonic(), 1e-3))
                except ray.exceptions.RayTaskError as e:  # raised inside the task: the graph goes on
                    answers[key] = e
        except ray.exceptions.RayChannelTimeoutError:
            self.teardown()
            raise GraphTimedOut([k for k in self.keys if k not in answers]) from None
        except ray.exceptions.RayError as e:  # an actor died, or a channel broke: Ray tears the graph down
            logger.warning("the push graph of WeightSync %s failed: %s", self.sync_id, first_line(e))
            self.teardown()
            pending = [k for k in self.keys if k not in answers]
            answers |= self._recover(version, e, pending, deadline, timeout_s)
        return answers

    def _recover(
        self, version: int, error: Exception, keys: list[Key], deadline: float, timeout_s: float
    ) -> dict[Key, Any]:
        """After the graph failed (torn down: every task that began has ended): each member's kept answer, asked
        with an ordinary call; a member that ran no such round answers with the graph's error."""
        import ray

        refs = {
            self._handle(key).__ray_call__.remote(ep.round_answer, self.sync_id, version): key for key in keys
        }
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=max(deadline - time.monotonic(), 1e-3))
        out: dict[Key, Any] = {}
        for ref, key in refs.items():
            name = self.actors.label(key)
            if ref not in done:
                out[key] = PeerTimeout(name, f"push v{version}", timeout_s)
                continue
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayError as e:  # gone, or being restarted by Ray
                out[key] = typed(e, name, f"push v{version}")
                continue
            out[key] = answer if answer is not None else NotRun(error)
        return out

    def _handle(self, key: Key) -> Any:
        role, index = key
        return self.actors.senders[index] if role == "sender" else self.actors.receivers[index].actor

    def teardown(self) -> None:
        """End the graph's loops in the actors (idempotent); bounded: Ray's teardown runs in a thread of its own."""
        if not self.alive:
            return
        self.alive = False
        done = threading.Thread(target=self._compiled.teardown, name="raysync-graph-teardown", daemon=True)
        done.start()
        done.join(self._teardown_s)
        if done.is_alive():
            logger.warning(
                "the push graph of WeightSync %s was not torn down after %gs", self.sync_id, self._teardown_s
            )
            return  # its actors stay held: no other graph is compiled on them
        for actor_id in self._ids:
            if _HELD.get(actor_id) == self.sync_id:
                del _HELD[actor_id]


class NotRun(Exception):
    """A member of a failed graph that ran no part of the round (restarted by Ray, or stopped before it began)."""

    def __init__(self, cause: Exception):
        super().__init__(f"its part of the push was not run: the push graph failed ({first_line(cause)})")


def in_graph(endpoint: Any) -> bool:
    """Whether a receiver endpoint can be a task of the graph: a plain actor (Note [a push round in a compiled
    graph])."""
    return isinstance(endpoint, ep.ActorEndpoint)


def receivers_of_senders(connections: PairConnections) -> dict[int, list[int]]:
    """Each sender's receivers, in the plan's order."""
    receivers_of: dict[int, list[int]] = {}
    for p in connections.plan:
        receivers_of.setdefault(p.sender, []).append(p.receiver)
    return receivers_of


class GraphKeeper:
    """A WeightSync's push graph: compiled for its connections as they are, again when their shape changed or
    the graph was lost; None (ordinary calls) when disabled or when Ray could not compile it.

    The keeper of anything that runs a round for its members the way PushGraph does (``runner``: ``build``,
    ``shape_of``, and on what it builds ``keys``, ``alive``, ``shape``, ``run``, ``teardown``, ``describe``):
    raysync.ray.push_loop.PushKeeper keeps persistent push loops with it."""

    runner: Any = PushGraph
    kind = "graph"  # SyncReport.rounds for a round it ran
    # a round waits for the driver's calls pending on its members (Note [a push after the caller's own calls]):
    # not a graph's, whose actors always run a call of the driver's (Ray's loop that runs the graph's tasks)
    ordered = False
    off = "WeightSync(compiled_graph=False)"  # sync.plan's reason for ordinary calls, when disabled
    refusal = "Ray did not compile the push graph"
    transient: tuple[type[BaseException], ...] = ()  # failures to build that are tried again at the next push

    def __init__(self, actors: SyncActors, connections: PairConnections, *, enabled: bool):
        self._actors, self._connections = actors, connections
        self._graph: Any = None
        # the connections' shape (shape_of), kept rather than made again at each push: only a repair changes the
        # plan, and WeightSync closes the keeper after one, which forgets it
        self._shape: tuple | None = None
        # with it: whether what it builds reaches every endpoint of a round (``whole``), kept the same way
        self._whole = False
        self._members: dict[bytes, Key] = {}  # the graph's members by Ray actor id (call_order.waiting_on)
        self._refused: tuple | None = None  # the shape that could not be built: not tried again
        self._why_not = "" if enabled else self.off

    def current(self) -> Any:
        """What runs the rounds of the connections as they are now, built if need be (at setup, after a repair)."""
        if self._why_not == self.off:
            return None
        shape, whole = self._shape, self._whole
        if shape is None:
            receivers_of = receivers_of_senders(self._connections)
            shape = self.runner.shape_of(self._actors, receivers_of)
            whole = self._reaches_all(receivers_of)
        graph = self._graph
        if graph is not None and graph.alive and graph.shape == shape:
            return graph
        self.close()
        self._shape, self._whole = shape, whole
        if shape == self._refused:
            return None
        try:
            started = time.perf_counter()
            self._graph = self.runner.build(self._actors, self._connections, shape)
            self._members = {call_order.actor_id(self._handle(key)): key for key in self._graph.keys}
            logger.debug("%s built in %.3fs", self._graph.describe(), time.perf_counter() - started)
            self._why_not = ""
        except Exception as e:  # e.g. an actor already runs another WeightSync's graph: ordinary calls then
            self._refused = None if isinstance(e, self.transient) else shape
            self._why_not = f"{self.refusal}: {first_line(e)}"
            logger.warning(
                "WeightSync %s pushes through ordinary Ray calls: %s", self._connections.sync_id, e
            )
        return self._graph

    @property
    def whole(self) -> bool:
        """Whether what ``current()`` built reaches every endpoint of a push round: every sender, every receiver
        (no engine adapter) and no rank of a sharded trainer that follows; PushRound then builds no ordinary call
        beside it (Note [a round with no ordinary call] in raysync.ray.push_round)."""
        return self._whole

    def _reaches_all(self, receivers_of: dict[int, list[int]]) -> bool:
        """``whole`` for the connections as they are (``receivers_of``: receivers_of_senders): what PushRound's
        ordinary calls would be made for, beside a runner of their shape, is nothing. A runner has every sender
        with a receiver (shape_of) and every plain-actor receiver endpoint; the followers are the trainer group's."""
        actors = self._actors
        adapters = any(
            not in_graph(actors.receivers[actors.slots[j][0]]) for js in receivers_of.values() for j in js
        )
        return not adapters and not self._connections.group.followers(receivers_of)

    def settle(self, wait: bool = True) -> None:
        """Take what the last round left owed (push loops: Note [the senders' answers, late] in
        raysync.ray.push_loop): a sender that failed after its receivers applied the push has its pairs reconnected
        before the next push. ``wait=False``: only the answers a round took already."""
        settle = getattr(self._graph, "settle", None)
        if settle is None:
            return
        for key, answer in settle(wait).items():
            logger.warning(
                "WeightSync %s: %s failed after its receivers applied the last push; its pairs reconnect: %s",
                self._connections.sync_id,
                self._actors.label(key),
                answer,
            )
            self._connections.mark_broken(self._connections.pairs_of(key))

    def for_push(self) -> tuple[Any, str]:
        """What runs the next push's round (``current()``, None: ordinary calls) and how, for its report. Push loops
        (``ordered``): ordinary calls while a Ray call of this process is still pending on one of the members,
        queued behind it (Note [a push after the caller's own calls] in raysync.ray.call_order)."""
        graph = self.current()
        if graph is None:
            return None, "calls"
        if not self.ordered:
            return graph, self.kind
        waiting = call_order.waiting_on(self._members)
        if waiting is None:
            return None, "calls (Ray cannot say which calls of the driver are pending)"
        if waiting:
            names = ", ".join(self._actors.label(key) for key in waiting)
            return None, f"calls, queued behind the driver's calls still pending on {names}"
        return graph, self.kind

    def _handle(self, key: Key) -> Any:
        role, index = key
        return self._actors.senders[index] if role == "sender" else self._actors.receivers[index].actor

    def describe(self) -> str:
        """How push rounds reach the actors, for ``sync.plan``."""
        graph = self._graph if self._graph is not None and self._graph.alive else None
        if graph is None:
            why = self._why_not or "none built yet"
            return f"push rounds: one ordinary Ray call per endpoint ({why})"
        outside = [
            j for j, (e, _) in enumerate(self._actors.slots) if not in_graph(self._actors.receivers[e])
        ]
        line = f"push rounds: {graph.describe()}"
        if outside:
            line += (
                f"; receiver(s) {', '.join(f'#{j}' for j in outside)} (engine adapters) through ordinary Ray "
                f"calls, queued with the engine actor's own"
            )
        return line

    def plan(self) -> Plan:
        return RoundPlan(list(self._connections.plan), self._actors, self.describe())

    def close(self) -> None:
        self._shape = None
        if self._graph is not None:
            self._graph.teardown()
            self._graph = None


class RoundPlan(Plan):
    """The per-pair plan, then how the push rounds reach the actors."""

    def __init__(self, plans: list, actors: SyncActors, rounds: str):
        super().__init__(plans, actors.sender_at, actors.receiver_at)
        self.rounds = rounds

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.rounds}"


ROUNDS = ("calls", "graph", "loop")  # how push rounds reach the actors (keeper_for)


def keeper_for(rounds: str, actors: SyncActors, connections: PairConnections) -> GraphKeeper:
    """The keeper of how a WeightSync's push rounds reach its actors: "calls" (one ordinary Ray call per endpoint),
    "graph" (a compiled Ray graph, this module) or "loop" (persistent push loops: raysync.ray.push_loop)."""
    if rounds not in ROUNDS:
        raise ValueError(f"push_rounds={rounds!r}: expected one of {', '.join(map(repr, ROUNDS))}")
    if rounds == "loop":
        from raysync.ray.push_loop import PushKeeper  # it builds on this module

        return PushKeeper(actors, connections, enabled=True)
    return GraphKeeper(actors, connections, enabled=rounds == "graph")
