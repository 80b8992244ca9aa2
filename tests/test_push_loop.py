"""Push rounds through persistent push loops (raysync.ray.push_loop) on a real local Ray: bit-exact pushes and
versions, an actor killed mid-push reaching the driver as a typed error, nothing left behind by close(), and the
loop channel's frames (signed, numbered, checked) refusing what is not theirs."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Adapter, Engine, Trainer, engine_load  # noqa: E402
from conftest import own_entries  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.core.errors import BadSignature, ReplayedFrame, SchemaError  # noqa: E402
from raysync.core.report import PushReport  # noqa: E402
from raysync.core.version import MIXED  # noqa: E402
from raysync.ray.loop_wire import Codec, from_wire, to_wire  # noqa: E402
from raysync.ray.push_graph import keeper_for  # noqa: E402
from raysync.ray.results import EndpointResult, RemoteFailure  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets
ACTOR = {"num_cpus": 0.25}
LOOPS = "push rounds: persistent push loops in"


def loop_sync(senders: list, receivers: list, config: SyncConfig, **kwargs) -> WeightSync:
    """A WeightSync whose rounds run through push loops."""
    return WeightSync(senders, receivers, config, push_rounds="loop", **kwargs)


def threads_of(actor=None) -> tuple[int, list[str]]:
    """zmq's I/O threads (named by libzmq) and the push loops' threads of this process (or ``actor``'s)."""
    if actor is not None:
        return ray.get(actor.__ray_call__.remote(lambda _: threads_of()))
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # ended meanwhile
            continue
    loops = [t.name for t in threading.enumerate() if t.name.startswith("raysync-push-loop")]
    return sum(n.startswith("ZMQbg") for n in names), loops


def thread_of_sink(actor: Engine) -> dict:
    """The default sink, noting which thread of the actor called it."""
    actor.sink_thread = threading.current_thread().name
    return dict(actor.model.named_parameters())


# --- through Ray ---------------------------------------------------------------------------------------------------
def test_pushes_through_the_loops_are_bit_exact_and_each_engine_holds_the_version(
    ray_local, no_leftovers, made
):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    made += [trainer, *engines]
    with loop_sync([trainer], engines, CFG, sink=thread_of_sink) as sync:
        assert f"{LOOPS} 3 actors" in str(sync.plan)
        assert sync.versions() == [None, None]
        for version in (1, 2, 3):
            expected = ray.get(trainer.step.remote(version))
            report = sync.push(version)
            assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
            assert report.version == version and len(report.pairs) == 2 and report.slowest.bytes > 0
        assert sync.versions() == [3, 3]
        for engine in engines:  # the round ran on the loop's thread, not through an ordinary call
            thread = ray.get(engine.__ray_call__.remote(lambda a: a.sink_thread))
            assert thread == f"raysync-push-loop-receiver-{engines.index(engine)}"


class Signal:
    """An async actor a trainer's call can wait on (released by ``send``)."""

    def __init__(self):
        import asyncio

        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def send(self) -> None:
        self.event.set()


def step_when_signalled(actor: Trainer, signal, version: int) -> dict[str, str]:
    """A train step that starts once ``signal`` is sent (bounded: the test fails rather than hang)."""
    ray.get(signal.wait.remote(), timeout=60)
    return actor.step(version)


def test_a_push_behind_a_pending_step_goes_through_ordinary_calls_queued_behind_it(
    ray_local, no_leftovers, made
):
    """Note [a push after the caller's own calls]: while a call of the driver is still pending on a member, the
    round goes through ordinary calls (a loop would read beside the step); once nothing is pending, the loops."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    signal = ray.remote(num_cpus=0)(Signal).remote()
    made += [trainer, engine, signal]
    with WeightSync([trainer], [engine], CFG) as sync:  # loops: the default
        assert f"{LOOPS} 2 actors" in str(sync.plan)
        step = trainer.__ray_call__.remote(step_when_signalled, signal, 1)
        graph, how = sync._graphs.for_push()
        assert graph is None and how.startswith(
            "calls, queued behind the driver's calls still pending on sender #0"
        )
        ray.get(signal.send.remote())
        expected = ray.get(step)
        graph, how = sync._graphs.for_push()
        assert graph is not None and how == "loop"
        # end to end: a step not waited for, then a push: the engine holds the step's weights, whichever way the
        # round went (the step may have ended before the push looked)
        step = trainer.step.remote(2)
        report = sync.push(2)
        assert ray.get(engine.digest.remote()) == ray.get(step) != expected
        assert report.rounds == "loop" or report.rounds.startswith(
            "calls, queued behind the driver's calls still"
        )
        report = sync.push(3)
        assert report.rounds == "loop" and sync.versions() == [3]


def wait_for_signal(actor, signal) -> None:
    ray.get(signal.wait.remote(), timeout=60)


def test_a_pending_call_of_raysync_that_touches_no_weights_does_not_divert_the_round(
    ray_local, no_leftovers, made
):
    """A liveness probe of raysync's (call_order.weightless) still pending on a member (in the CI, one sent to an
    actor Ray was restarting stayed pending for the rest of the test) leaves the rounds to the loops; an ordinary
    call of the driver's, pending on the same member, does not."""
    from raysync.ray import call_order

    trainer = ray.remote(max_concurrency=2, **ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    signal = ray.remote(num_cpus=0)(Signal).remote()
    made += [trainer, engine, signal]
    with WeightSync([trainer], [engine], CFG) as sync:
        probe = call_order.weightless(trainer.__ray_call__.remote(wait_for_signal, signal))
        assert sync.push(1).rounds == "loop" and ray.wait([probe], timeout=0)[0] == []
        blocked = trainer.__ray_call__.remote(wait_for_signal, signal)
        graph, how = sync._graphs.for_push()
        assert graph is None and how.startswith(
            "calls, queued behind the driver's calls still pending on sender #0"
        )
        ray.get(signal.send.remote())
        ray.get([probe, blocked], timeout=60)
        assert sync.push(2).rounds == "loop" and sync.versions() == [2]


def test_an_adapter_keeps_its_ordinary_call_beside_the_loops(ray_local, no_leftovers, made):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    made += [trainer, *engines]
    with loop_sync([trainer], [engines[0], Adapter(engines[1])], CFG) as sync:
        assert f"{LOOPS} 2 actors" in str(sync.plan) and "receiver(s) #1 (engine adapters)" in str(sync.plan)
        expected = ray.get(trainer.step.remote(1))
        sync.push(1)
        assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
        assert sync.versions() == [1, 1]


def test_an_engine_killed_mid_push_is_a_typed_error_then_the_loops_start_again(ray_local, no_leftovers, made):
    """The engine dies in its second bucket: the driver names it with Ray's verdict, a SyncError rather than the
    PeerTimeout of push_timeout_s (12 x timeout_s here), and the next push starts a loop in the restarted actor."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(max_restarts=1, **ACTOR)(Engine).remote()
    made += [trainer, engine]
    with loop_sync([trainer], [engine], CFG, sink=engine_load, push_timeout_s=12 * CFG.timeout_s) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        first_pid = ray.get(engine.pid.remote())
        ray.get(engine.fail_at_call.remote(2, "die"))
        with pytest.raises(SyncError) as e:
            sync.push(2)
        receiver = [f for f in e.value.failures if f.endpoint.startswith("receiver #0")]
        assert receiver and receiver[0].error.startswith(("ActorGone", "ActorUnavailable")), e.value.failures
        assert sync.versions() == [None]  # the restarted actor has applied nothing yet, and says so
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)
        assert ray.get(engine.pid.remote()) != first_pid
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]
        assert f"{LOOPS} 2 actors" in str(sync.plan)


def test_a_repair_after_a_round_of_ordinary_calls_starts_new_loops(ray_local, no_leftovers, made):
    """The engine is killed and restarted between pushes; a full push (ordinary calls) fails on it and marks its
    pair broken: the next push repairs the pair and starts new loops (the restarted actor has none), rather than
    send its go to the loop of the process that died."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(max_restarts=1, **ACTOR)(Engine).remote()
    made += [trainer, engine]
    with WeightSync([trainer], [engine], CFG) as sync:
        assert sync.push(1).rounds == "loop"
        first = sync._graphs._graph
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engine.die.remote())
        with pytest.raises(SyncError):
            sync.push(2, full=True)  # through ordinary calls: the loops are not the ones that failed
        expected = ray.get(trainer.step.remote(3))
        assert sync.push(3).rounds == "loop" and sync._graphs._graph is not first
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


def test_an_engine_gone_between_pushes_fails_the_next_push_naming_it(ray_local, no_leftovers, made):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    made += [trainer, engine]
    with loop_sync([trainer], [engine], CFG) as sync:
        sync.push(1)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engine.die.remote())
        with pytest.raises(SyncError) as e:
            sync.push(2)
        receiver = [f for f in e.value.failures if f.endpoint.startswith("receiver #0")]
        assert receiver and receiver[0].error.startswith("ActorGone"), e.value.failures


def test_members_on_another_node_are_reached_over_tcp_on_the_drivers_node_ip(ray_local, no_leftovers, made):
    """The engine is said to run on another node (its placement as the plan knows it; really on this machine):
    the driver's end binds tcp on its node's IP, not ipc, and the pushes go through as before."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    made += [trainer, engine]
    with WeightSync([trainer], [engine], CFG) as sync:
        at = sync._actors.receiver_at
        at[0] = dataclasses.replace(at[0], node_id="another node")
        loops = keeper_for("loop", sync._actors, sync._connections).current()
        try:
            assert loops._end.address.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
            for version in (1, 2):
                expected = ray.get(trainer.step.remote(version))
                answers = loops.run(version, time.monotonic() + 60, 60)
                assert answers[("receiver", 0)][0].version == version, answers
                assert ray.get(engine.digest.remote()) == expected
                assert loops.settle() == {}  # the sender's own answer, when run() did not wait for it
        finally:
            loops.teardown()


def test_close_leaves_no_threads_sockets_or_files(ray_local, no_leftovers, made, caplog):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    made += [trainer, engine]
    before = threads_of(), threads_of(trainer), threads_of(engine)
    files = own_entries()
    with loop_sync([trainer], [engine], CFG) as sync:
        sync.push(1)
        assert own_entries() == files  # the loops' socket directory is gone once they are connected
        assert threads_of(engine)[1] == ["raysync-push-loop-receiver-0"]
        assert threads_of(trainer)[1] == ["raysync-push-loop-sender-0"]
    assert (threads_of(), threads_of(trainer), threads_of(engine)) == before
    assert (
        "not stopped" not in caplog.text
    )  # each loop ended at its stop call, none was left to its driver's end


def test_actors_are_released_when_their_last_handle_goes(ray_local, no_leftovers):
    """Unlike a compiled graph's (Note [a push round in a compiled graph]), actors whose loops were closed end
    when the user drops them: their processes exit."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    with loop_sync([trainer], [engine], CFG) as sync:
        sync.push(1)
    pids = ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in (trainer, engine)])
    del trainer, engine, sync
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a condition (Ray ends the processes in its own time), bounded
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


# --- the loop channel's frames --------------------------------------------------------------------------------------
REPORT = PushReport(version=3, transport="shm", bytes=1024, buckets=2, tensors=5, seconds=0.5)
ANSWER = {
    0: EndpointResult(report=REPORT, version=3),
    1: EndpointResult(
        failure=RemoteFailure("unpack bucket 1", "ValueError: bad", "Traceback ..."), version=MIXED
    ),
    2: EndpointResult(failure=RemoteFailure("session", "RuntimeError: no session", "")),
}


def pair() -> tuple[Codec, Codec]:
    secret = os.urandom(32)
    return Codec(secret, "receiver-0", "actor"), Codec(secret, "receiver-0", "driver")


def test_an_answer_crosses_the_loop_channel_as_it_was():
    actor, driver = pair()
    kind, body = driver.decode(actor.encode("answer", [7, to_wire(ANSWER)]))
    assert kind == "answer" and body[0] == 7 and from_wire(body[1]) == ANSWER


def test_a_frame_forged_replayed_or_for_another_member_is_refused():
    actor, driver = pair()
    frame = actor.encode("answer", [1, to_wire(ANSWER)])
    with pytest.raises(BadSignature):
        driver.decode(frame[:-1] + bytes([frame[-1] ^ 1]))
    with pytest.raises(BadSignature):  # another member's key (same secret)
        Codec(b"k" * 32, "receiver-1", "driver").decode(frame)
    with pytest.raises(BadSignature):  # reflected back at its sender: each direction has its own key
        actor.decode(frame)
    driver.decode(frame)
    with pytest.raises(ReplayedFrame):
        driver.decode(frame)


@pytest.mark.parametrize(
    "item",
    [
        [
            0,
            [3, "shm", 1024, 2, 5, 0.5, False, 0, 1024, None, {"x": 1}],
            None,
            3,
        ],  # a map where a scalar goes
        [0, [3, "shm"], None, 3],  # a report of two fields
        [0, None, None, 3],  # neither a report nor a failure
        [0, None, ["receive", "E", ""], "a version"],  # a version that is no version
        ["0", None, ["receive", "E", ""], None],  # an index that is not an int
    ],
)
def test_a_signed_answer_that_is_not_an_endpoint_result_is_refused(item):
    actor, driver = pair()
    _, body = driver.decode(actor.encode("answer", [1, [item]]))
    with pytest.raises(SchemaError):
        from_wire(body[1])


def test_the_drivers_end_drops_what_is_not_a_members_signed_frame_and_reads_what_follows(ray_local, caplog):
    """A member's connection sends its name, then a frame that is no signed frame, then a frame signed with another
    key, then its hello, then an answer: the driver's end drops the first two and reads the hello and the answer as
    they were sent; a connection under a name that is no member's is closed; one that sends a frame over the
    bound is closed and the driver's end says a connection dropped."""
    import socket
    import struct

    from raysync.ray.push_loop import _driver_end

    def frame(data: bytes) -> bytes:
        return struct.pack("!I", len(data)) + data

    key = ("receiver", 0)
    end, secret = _driver_end([key], {ray.get_runtime_context().get_node_id()})
    path = end.address.removeprefix("ipc://")
    stranger, member = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
    try:
        stranger.connect(path)
        stranger.sendall(frame(b"receiver-7") + frame(b"anything"))
        member.connect(path)
        codec = Codec(secret, "receiver-0", "actor")
        member.sendall(frame(b"receiver-0") + frame(b"one two three"))
        member.sendall(frame(Codec(os.urandom(32), "receiver-0", "actor").encode("hello", [1])))
        member.sendall(frame(codec.encode("hello", [os.getpid()])))
        end.hellos(30, str)  # returns once the signed hello is read
        assert caplog.text.count("push loops: dropped a frame") == 2, caplog.text
        member.sendall(frame(codec.encode("answer", [1, to_wire(ANSWER)])))
        assert end.wait(30)
        (got,) = end.frames()
        assert got[:2] == (key, "answer") and from_wire(got[2][1]) == ANSWER
        assert end.frames() == [] and not end.dropped  # nothing waits
        member.sendall(struct.pack("!I", 1 << 30))  # a frame over the bound
        while not end.dropped:
            assert end.wait(30)
            assert end.frames() == []
        with pytest.raises(ConnectionError):
            end.send(key, "go", [1, 1])
    finally:
        stranger.close()
        member.close()
        end.close()


def test_an_unknown_way_to_run_rounds_is_refused():
    with pytest.raises(ValueError, match="push_rounds='loops': expected one of 'calls', 'graph', 'loop'"):
        keeper_for("loops", None, None)  # type: ignore[arg-type]


def test_a_sender_pushes_one_session_on_its_own_thread_and_several_sessions_at_once():
    from raysync.ray.endpoint import _each

    me = threading.current_thread()
    assert _each(lambda x: (x, threading.current_thread()), ["one"]) == [("one", me)]
    barrier = threading.Barrier(3, timeout=10)  # broken unless all three run at the same time

    def meet(x: int) -> tuple[int, threading.Thread]:
        barrier.wait()
        return x, threading.current_thread()

    out = _each(meet, [0, 1, 2])
    assert [x for x, _ in out] == [0, 1, 2] and out[0][1] is me
    assert len({t for _, t in out}) == 3


def test_a_round_is_over_once_every_receiver_holds_the_version_and_the_senders_answers_are_then_owed():
    """Note [the senders' answers, late]: the rule on answers made here (sender 0 -> receivers 0 and 1 of endpoint
    0's two slots; sender 1 -> receiver 2, an adapter's, outside the loops)."""
    from raysync.ray.push_loop import PushLoops

    loops = object.__new__(PushLoops)
    loops._sender_keys = [("sender", 0), ("sender", 1)]
    loops._receiver_keys = [("receiver", 0)]
    loops._receivers_of = {("sender", 0): [(0, (0, 0)), (1, (0, 1))], ("sender", 1): [(2, (1, 0))]}
    ok = EndpointResult(report=PushReport(7, "shm", bytes=10, buckets=1, tensors=1, seconds=0.5), version=7)
    stale = dataclasses.replace(ok, version=6)
    failed = EndpointResult(failure=RemoteFailure("receive", "ValueError: no", ""), version=MIXED)
    receivers = {("receiver", 0): {0: ok, 1: ok}}
    assert not loops._early({}, 7)  # no receiver answered
    assert not loops._early(receivers, 7)  # sender 1's receiver is not in the loops: sender 1 is waited for
    answered_1 = receivers | {("sender", 1): {2: ok}}
    assert loops._early(answered_1, 7)  # sender 0 is owed: both of its receivers hold version 7
    assert loops._theirs(("sender", 0), answered_1) == {0: ok, 1: ok}
    assert not loops._early({("receiver", 0): {0: ok, 1: stale}, ("sender", 1): {2: ok}}, 7)
    assert not loops._early({("receiver", 0): {0: ok, 1: failed}, ("sender", 1): {2: ok}}, 7)
    assert not loops._early({("receiver", 0): ValueError("lost"), ("sender", 1): {2: ok}}, 7)


def test_a_senders_late_answer_is_taken_in_the_next_round_and_one_that_never_comes_is_a_timeout():
    """Note [the senders' answers, late]: the next round through the loops waits for the senders' answers to the
    last round; one not in timeout_s into the round is a PeerTimeout, also as that sender's answer to this round
    (its loop has not started it), unless Ray's verdict came first."""
    from types import SimpleNamespace

    from raysync.core.errors import PeerTimeout
    from raysync.ray.push_loop import PushLoops

    loops = object.__new__(PushLoops)
    loops.actors, loops._timeout_s = SimpleNamespace(label=lambda key: f"{key[0]} #{key[1]}"), 2.0
    owed, now = {("sender", 0), ("sender", 1)}, time.monotonic()
    ok = {
        0: EndpointResult(report=PushReport(6, "shm", bytes=1, buckets=1, tensors=1, seconds=0.1), version=6)
    }
    loops._late, answers = (owed, {("sender", 0): ok}, 6), {}
    assert not loops._late_in(answers, now + 60)  # sender 1's answer may still come
    assert answers == {}
    verdict = ValueError("Ray says: gone")
    answers[("sender", 1)] = verdict
    assert loops._late_in(answers, now)  # overdue: the verdict Ray gave stands
    assert loops._late[1][("sender", 1)] is verdict and answers[("sender", 1)] is verdict
    loops._late, answers = (owed, {("sender", 0): ok}, 6), {}
    assert loops._late_in(answers, now)
    late = loops._late[1][("sender", 1)]
    assert isinstance(late, PeerTimeout) and answers == {("sender", 1): late} and "sender #1" in str(late)
    loops._late = (owed, {("sender", 0): ok, ("sender", 1): ok}, 6)
    assert loops._late_in({}, now + 60)  # both in
