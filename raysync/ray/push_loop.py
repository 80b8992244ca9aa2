"""Push rounds through persistent push loops: at setup every sender and every plain-actor receiver starts a loop (a
thread) that waits on raysync's own control channel for the driver's "push version v": a round costs the driver a
signed frame out and one back per actor, not a Ray call's submission, scheduling and answer.

    driver (PushLoops, loop_channel.DriverEnd)      each member actor (loop_member._serve, a thread of its own)
    listens ─── go [round, version] ─────────>  MemberEnd  endpoint.sender_round / endpoint.receiver_round, as
            <── answer [round, results] ──────             a compiled graph's tasks run them: EndpointResults

# Note [push loops]
# - The channel (raysync.ray.loop_channel, Note [the loops' channel]): the driver listens on a Unix socket in a
#   private directory (removed once every loop has said hello) when every member runs on the driver's node, else
#   on TCP on the driver's node IP; each loop connects, names its member and says hello. Frames are msgpack
#   signed with HMAC-SHA256 under a key per member and direction (from a secret Ray hands each actor at start),
#   numbered (a replay is refused), and decode to scalars only: a result is rebuilt as EndpointResult, PushReport,
#   RemoteFailure from checked values. Nothing pickled.
# - Ray keeps supervising: it starts the loops, and the driver asks it about the members that have not answered
#   as soon as a member's connection closes (a read finds its end) or a send finds no one, and every timeout_s
#   otherwise: an actor that died is ActorGone, one Ray restarted (no loop in it) ActorUnavailable; a busy loop is
#   waited for, up to push_timeout_s. A member lost, or a round past its deadline, ends every loop (each once its
#   part of the push has ended, bounded by timeout_s); the next push starts new ones.
# - A loop runs beside the actor's ordinary calls, as a graph's tasks do (Note [a push round in a compiled graph]),
#   so the driver waits for its own calls (below). Idle, it sleeps in recv, waking each second to see whether
#   close() stopped it; it ends when told to, or when the driver's end closes. Engine adapters keep their calls.
#   The driver sends a round through the loops only when none of its own calls is pending on their actors (Note
#   [a push after the caller's own calls] in raysync.ray.call_order).
#
# Note [the senders' answers, late]
# A receiver answers the driver as it sends its sender PushDone; the sender answers once PushDone reached it, one
# hop of the session's control channel later (130-210 us on the H200, docs/benchmarks.md section 10). When every receiver
# of a sender answered that it holds the pushed version, the round is over for the driver: push() returns
# without waiting for that sender, whose pair reports are made of its receivers' (the bytes and the seconds of
# the same session). The sender's own answer is owed. The next push through the loops sends its gos first and
# takes it during its round: a loop runs one round at a time (it reads the next go once it has answered the
# last), and that answer was sent before the sender's next PushStart, so it is in before the receivers' next
# answers; one not in within timeout_s of the round's start is a PeerTimeout (``_late_in``), as ``settle`` makes it. Anything else (a staged or full push, ordinary calls, a repair) first takes it (``settle``, bounded by
# timeout_s), so that nothing else runs in that sender's sessions while its loop finishes the round. A sender
# that failed after its receivers applied the push (e.g. closing its round) has its pairs reconnected, with a
# warning, before the next push; found during a round through the loops, that round has run on its pairs
# already (it failed there, or went through) and the push after it reconnects them. On the 2-core VM
# (benchmarks/bench_ray_share.py --rounds loop --pushes 300, three runs of each, in turn) the driver took 175-357
# us from push() until its gos were sent when it took that answer first, 104-161 us taking it during the round.
# The sender's tensors are free when push() returns: a receiver answers after its reads ended (direct mode) and
# the sender packs every bucket before PushDone (a ring).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from raysync.core import errors
from raysync.ray import call_order
from raysync.ray.actors import Key, SyncActors
from raysync.ray.connections import PairConnections
from raysync.ray.loop_channel import DriverEnd
from raysync.ray.loop_member import loop_alive, start_loop, stop_loops
from raysync.ray.loop_wire import Codec, from_wire
from raysync.ray.push_graph import GraphKeeper, GraphTimedOut, PushGraph
from raysync.ray.results import EndpointResult

logger = logging.getLogger(__name__)

_MAX_ANSWER_FRAME = 64 << 20  # what the driver takes from a loop (failures carry tracebacks)


# --- on the driver ----------------------------------------------------------------------------------------------------
def _driver_end(keys: list[Key], nodes: set[str]) -> tuple[DriverEnd, bytes]:
    """The driver's end of the loops' channel (raysync.ray.loop_channel): a Unix socket when every member runs
    on the driver's node, else TCP on its node IP; a secret of its own, each member's codec under it."""
    import ray

    secret = secrets.token_bytes(32)
    codecs = {key: Codec(secret, _member(key), "driver") for key in keys}
    local = nodes <= {ray.get_runtime_context().get_node_id()}
    host = "" if local else ray.util.get_node_ip_address()
    return DriverEnd(codecs, {key: _member(key) for key in keys}, local, host, _MAX_ANSWER_FRAME), secret


class PushLoops:
    """The push loops of one set of connections (``shape``: PushGraph.shape_of); ``run`` keeps PushGraph.run's
    contract. ``timeout_s`` (SyncConfig.timeout_s) bounds the start, each question to Ray, the stop."""

    shape_of = staticmethod(PushGraph.shape_of)

    def __init__(self, actors: SyncActors, sync_id: str, shape: tuple, *, timeout_s: float):
        self.actors, self.sync_id, self.shape, self._timeout_s = actors, sync_id, shape, timeout_s
        jobs = {("sender", i): ("sender", js) for i, js in shape[0]}
        jobs |= {("receiver", e): ("receiver", slots) for e, slots in shape[1]}
        self.keys: list[Key] = list(jobs)
        # the receivers hear "go" first: a sender's session starts by waiting for its receivers
        self._go_order = sorted(self.keys, key=lambda k: k[0] != "receiver")
        nodes = {actors.sender_at[i].node_id for i, _ in shape[0]}
        nodes |= {
            actors.receiver_at[j].node_id for j, (e, _) in enumerate(actors.slots) if ("receiver", e) in jobs
        }
        self._end: DriverEnd | None
        self._end, secret = _driver_end(self.keys, nodes)
        self._round, self.alive = 0, False
        self._version, self._owed, self._check_now = 0, set(), False  # Note [the senders' answers, late]
        # the last round's owed keys, their answers taken during this round, its version
        self._late: tuple[set, dict, int] = (set(), {}, 0)
        self._found: dict[Key, Any] = {}  # those of them that are not a success, for ``settle``
        self._sender_keys = [k for k in self.keys if k[0] == "sender"]
        self._receiver_keys = [k for k in self.keys if k[0] == "receiver"]
        self._receivers_of = {
            ("sender", i): [(j, actors.slots[j]) for j in js] for i, js in shape[0]
        }  # a sender with a receiver outside the loops (an adapter's) is waited for: _theirs finds no answer
        try:
            end = self._end
            calls = {k: self._call(k, start_loop, job, end.address, secret) for k, job in jobs.items()}
            for answer in actors.ask(calls, "push loop start", timeout_s).values():
                if isinstance(answer, BaseException):
                    raise answer
            end.hellos(timeout_s, actors.label)
        except BaseException:
            self.teardown()
            raise
        self.alive = True

    @classmethod
    def build(cls, actors: SyncActors, connections: PairConnections, shape: tuple) -> PushLoops:
        return cls(actors, connections.sync_id, shape, timeout_s=connections.config.timeout_s)

    def describe(self) -> str:
        return f"persistent push loops in {len(self.keys)} actors, triggered over raysync's control channel"

    def run(self, version: int, deadline: float, timeout_s: float) -> dict[Key, Any]:
        """Every member's answer to the round of ``version``, or a typed error in its place (an actor Ray lost,
        a loop gone); raises GraphTimedOut past ``deadline``. Any error ends the loops (Note [push loops]).
        A sender whose receivers all answered that they hold ``version`` is not waited for (Note [the senders'
        answers, late]): its answer here is made of theirs, and ``settle`` takes its own."""
        late, self._owed = self._owed, set()  # the last round's, taken during this one (Note [... late])
        self._round += 1
        end, answers = self._end, {}
        for key in self._go_order:
            try:
                end.send(key, "go", [self._round, version])
            except ConnectionError:  # no connection to that loop: ask Ray why, now
                self._check_now = True
        self._late, by = (late, {}, self._version), time.monotonic() + self._timeout_s
        try:
            self._await(
                answers,
                version,
                deadline,
                lambda: self._late_in(answers, by) and self._early(answers, version),
            )
        finally:
            self._found |= {k: a for k, a in self._late[1].items() if not _all_ok(a)}
            self._late = (set(), {}, 0)
        self._owed = {k for k in self.keys if k not in answers}
        for key in self._owed:
            answers[key] = {j: EndpointResult(report=r.report) for j, r in self._theirs(key, answers).items()}
        if any(isinstance(a, Exception) for a in answers.values()):
            self.teardown()
        return answers

    def settle(self, wait: bool = True) -> dict[Key, Any]:
        """The owed answers of the last round (Note [the senders' answers, late]), waited for up to timeout_s: those
        that are not a success, by key (a typed error for one that did not come: the loops are then ended); and
        those a round took meanwhile. ``wait=False``: only those taken already."""
        found, self._found = self._found, {}
        if not self._owed or not wait:
            return found
        answers: dict[Key, Any] = {}
        owed, self._owed = self._owed, set()
        try:
            self._await(
                answers, self._version, time.monotonic() + self._timeout_s, lambda: owed <= set(answers)
            )
        except GraphTimedOut as e:
            answers |= {
                k: errors.PeerTimeout(self.actors.label(k), "the answer to the last push", self._timeout_s)
                for k in e.keys
            }
        bad = {k: a for k, a in answers.items() if k in owed and not _all_ok(a)}
        if bad and self.alive:
            self.teardown()
        return found | bad

    def _await(self, answers: dict[Key, Any], version: int, deadline: float, enough) -> None:
        """Take the answers to this round until ``enough()``; members lost get Ray's verdict in their place."""
        self._version, end = version, self._end
        next_check = 0.0 if self._check_now else time.monotonic() + self._timeout_s
        self._check_now = False
        while len(answers) < len(self.keys) and not enough():
            now = time.monotonic()
            if now >= deadline:
                self.teardown()
                raise GraphTimedOut([k for k in self.keys if k not in answers])
            if end.wait(min(deadline, next_check) - now):
                self._take(answers, version)
            if end.dropped:  # a member's connection closed: ask Ray at once
                end.dropped = False
                next_check = 0.0
            if time.monotonic() >= next_check:
                verdicts = self._check([k for k in self.keys if k not in answers], version)
                self._take(answers, version)  # an answer that came meanwhile wins over a verdict
                answers.update({k: v for k, v in verdicts.items() if k not in answers})
                next_check = time.monotonic() + self._timeout_s

    def _late_in(self, answers: dict[Key, Any], by: float) -> bool:
        """Whether every sender's answer to the last round is in (Note [the senders' answers, late]). One not in
        by ``by`` (timeout_s into this round) is a PeerTimeout, as ``settle`` makes it, and this round's answer
        of that sender too: its loop has not started this round."""
        owed, taken, _ = self._late
        missing = owed - taken.keys()
        if missing and time.monotonic() >= by:
            for key in missing:
                late = errors.PeerTimeout(
                    self.actors.label(key), "the answer to the last push", self._timeout_s
                )
                taken[key] = answers.setdefault(key, late)
            return True
        return not missing

    def _early(self, answers: dict[Key, Any], version: int) -> bool:
        """Every receiver answered, and every sender did or need not (its receivers all hold ``version``)."""
        for key in self._receiver_keys:
            if key not in answers:
                return False
        for key in self._sender_keys:
            if key not in answers:
                theirs = self._theirs(key, answers)
                if theirs is None or not all(r.ok and r.version == version for r in theirs.values()):
                    return False
        return True

    def _theirs(self, key: Key, answers: dict[Key, Any]) -> dict[int, EndpointResult] | None:
        """Sender ``key``'s receivers' answers, by receiver j; None where one is missing or not an answer."""
        out = {}
        for j, (e, slot) in self._receivers_of[key]:
            answer = answers.get(("receiver", e))
            if not isinstance(answer, dict) or not isinstance(answer.get(slot), EndpointResult):
                return None
            out[j] = answer[slot]
        return out

    def _take(self, answers: dict[Key, Any], version: int) -> None:
        owed, late, late_version = self._late
        for key, kind, body in self._end.frames():
            if kind not in ("answer", "failed") or not body:
                continue  # a hello
            into, of = answers, version
            if body[0] != self._round:
                if body[0] != self._round - 1 or key not in owed:
                    continue  # the answer of an earlier round that timed out
                into, of = late, late_version  # a sender's answer to the last round (Note [... late])
            try:
                if kind == "answer" and len(body) == 2 and type(body[1]) is list:
                    into[key] = from_wire(body[1])
                elif kind == "failed" and len(body) == 3 and all(type(s) is str for s in body[1:]):
                    into[key] = errors.RemoteError(self.actors.label(key), f"push v{of}", *body[1:])
                else:
                    raise errors.SchemaError(f"{self.actors.label(key)} answered a malformed {kind}")
            except errors.SchemaError as e:
                into[key] = e

    def _check(self, keys: list[Key], version: int) -> dict[Key, Exception]:
        """Ask Ray about ``keys`` (Note [push loops]): a typed error for each one lost; none for those whose loop
        runs, or that did not answer within timeout_s (Ray's ``ask`` waits for an actor it is restarting)."""
        stage = f"push v{version}"
        probes = {k: self._call(k, loop_alive, weightless=True) for k in keys}
        said = self.actors.ask(probes, stage, self._timeout_s)
        out: dict[Key, Exception] = {}
        for key, alive in said.items():
            name = self.actors.label(key)
            if alive is False:
                why = f"{name} runs no push loop at stage '{stage}': Ray restarted it, or its loop ended"
                out[key] = errors.ActorUnavailable(name, stage, why)
            elif isinstance(alive, Exception) and not isinstance(alive, errors.PeerTimeout):
                out[key] = alive
        return out

    def _call(self, key: Key, fn: Any, *args: Any, weightless: bool = False) -> Any:
        """The Ray call of ``fn(actor, sync_id, member, *args)`` in ``key``'s actor (call it to make it);
        ``weightless``: ``fn`` touches no weights (call_order.weightless)."""
        role, index = key
        actor = self.actors.senders[index] if role == "sender" else self.actors.receivers[index].actor
        mark = call_order.weightless if weightless else (lambda ref: ref)
        return lambda: mark(actor.__ray_call__.remote(fn, self.sync_id, _member(key), *args))

    def teardown(self) -> None:
        """End every loop (idempotent), each once its part of a push has ended; bounded by timeout_s."""
        self._owed = set()
        if self._end is None:
            return
        self.alive = False
        self._end.close()
        self._end = None
        calls = {k: self._call(k, stop_loops, self._timeout_s) for k in self.keys}
        said = self.actors.ask(calls, "push loop stop", self._timeout_s + 5.0)
        running = {k: a for k, a in said.items() if a is not False and not isinstance(a, errors.ActorGone)}
        if running:  # busy past timeout_s, or not answering: their next push fails
            logger.warning("push loops of WeightSync %s not stopped: %s", self.sync_id, running)


def _all_ok(answer: Any) -> bool:
    return isinstance(answer, dict) and all(isinstance(r, EndpointResult) and r.ok for r in answer.values())


def _member(key: Key) -> str:
    """How a member's loop is named, in its actor and on the channel."""
    return f"{key[0]}-{key[1]}"


class PushKeeper(GraphKeeper):
    """A WeightSync's push loops (made by ``push_graph.keeper_for("loop", ...)``), kept as GraphKeeper keeps its
    graph; when they cannot start, ordinary calls, and another try at the next push when an actor was why."""

    runner = PushLoops
    kind = "loop"
    ordered = True
    off = "WeightSync(push_rounds='calls')"
    refusal = "the push loops did not start"
    transient = (errors.PeerUnavailable,)
