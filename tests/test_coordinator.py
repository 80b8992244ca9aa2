"""WeightSync on a real local Ray: user actors, bit-exact pushes, errors surfacing once, restarts."""

from __future__ import annotations

import dataclasses

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Adapter, Engine, Trainer, breakable_source, engine_load  # noqa: E402

from raysync import PushIncomplete, PushReport, RemoteError, SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.core.errors import PeerLost  # noqa: E402
from raysync.core.version import MIXED  # noqa: E402
from raysync.ray.coordinator import ActorGone, SyncClosed  # noqa: E402
from raysync.ray.endpoint import applied_version  # noqa: E402
from raysync.ray.placement import PlanError  # noqa: E402
from raysync.ray.results import EndpointResult, RemoteFailure  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets
ACTOR = {"num_cpus": 0.25}
REPORT = PushReport(version=3, transport="shm", bytes=1024, buckets=2, tensors=5, seconds=0.5)


# --- what the actors answer the driver ----------------------------------------------------------------------------
def test_an_endpoint_result_holds_a_report_or_a_failure_never_both_nor_neither():
    failure = RemoteFailure("receive", "ValueError: bad", "Traceback ...")
    assert EndpointResult(report=REPORT).ok and not EndpointResult(failure=failure).ok
    for both_or_neither in ({"report": REPORT, "failure": failure}, {}):
        with pytest.raises(ValueError, match="exactly one of them"):
            EndpointResult(**both_or_neither)


@pytest.mark.parametrize(
    "result",
    [
        EndpointResult(report=REPORT, version=3),
        EndpointResult(
            failure=RemoteFailure("unpack bucket 1", "ValueError: bad", "Traceback ..."), version=MIXED
        ),
        EndpointResult(failure=RemoteFailure("session", "RuntimeError: no session", "")),
    ],
)
def test_a_receive_result_crosses_vllms_channel_as_it_was(result):
    """What a receiver answers crosses vLLM's channel as plain values, rebuilt as the same typed result on the
    driver's side (Note [what crosses vLLM's channel] in raysync.engines.vllm)."""
    import json

    from raysync.engines.vllm import from_plain, to_plain

    plain = to_plain(result)
    assert json.loads(json.dumps(plain)) == plain  # plain values only: no class crosses
    assert from_plain(plain) == result


def test_a_remote_failure_names_the_stage_and_the_cause_where_they_happened():
    try:
        raise ValueError("bad weights")
    except ValueError as e:
        own = RemoteFailure.of("receive", e)
    assert (own.stage, own.error) == ("receive", "ValueError: bad weights")
    assert "raise ValueError" in own.traceback
    heard = RemoteFailure.of(
        "push", RemoteError("receiver", "unpack bucket 2", "ValueError: bad", "Traceback (r)")
    )
    assert heard == RemoteFailure("unpack bucket 2", "ValueError: bad", "Traceback (r)")  # the peer's cause
    stopped = RemoteFailure.of("push", PushIncomplete(3, "stream bucket 1", "the peer left", ["w"]))
    assert stopped.stage == "stream bucket 1" and stopped.error.startswith("PushIncomplete: ")
    gone = PeerLost("trainer rank 1 of 2", "the all-gather of bucket 2 of 30", "the connection closed")
    lost = RemoteFailure.of("push", gone)  # a sharded source's walk names the rank and the bucket
    assert lost.stage == "the all-gather of bucket 2 of 30" and "trainer rank 1 of 2" in lost.error


# --- WeightSync on Ray --------------------------------------------------------------------------------------------
GRAPH = [pytest.param(False, id="ordinary_calls"), pytest.param(True, id="compiled_graph")]


@pytest.mark.parametrize("compiled_graph", GRAPH)
def test_trainer_to_two_engines_bit_exact(ray_local, no_leftovers, made, compiled_graph):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    made += [trainer, *engines]
    with WeightSync([trainer], engines, CFG, push_rounds="graph" if compiled_graph else "calls") as sync:
        assert [p.transport for p in sync.plan] == ["shm", "shm"] and "same node" in str(sync.plan)
        rounds = (
            "one compiled Ray graph (3 actors)" if compiled_graph else "one ordinary Ray call per endpoint"
        )
        assert f"push rounds: {rounds}" in str(sync.plan)
        assert sync.versions() == [None, None]
        for version in (1, 2):
            expected = ray.get(trainer.step.remote(version))
            report = sync.push(version)
            assert all(ray.get(e.digest.remote()) == expected for e in engines)
            assert len(report.pairs) == 2 and report.slowest.bytes == report.bytes // 2 > 0
        assert sync.versions() == [2, 2]
    if compiled_graph:  # close() tore the graph down: the same actors take another WeightSync's graph
        with WeightSync([trainer], engines, CFG, compiled_graph=True) as again:
            assert "one compiled Ray graph (3 actors)" in str(again.plan)
            expected = ray.get(trainer.step.remote(3))
            again.push(3)
            assert all(ray.get(e.digest.remote()) == expected for e in engines)


def test_a_graph_round_and_an_adapters_ordinary_call_make_one_push(ray_local, no_leftovers, made):
    """An engine adapter stays out of the graph (its calls queue with its actor's own): the plan says so, and a
    push reaches it and the plain actor in the graph alike."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    made += [trainer, *engines]
    with WeightSync([trainer], [engines[0], Adapter(engines[1])], CFG, compiled_graph=True) as sync:
        assert "one compiled Ray graph (2 actors); receiver(s) #1 (engine adapters) through ordinary" in str(
            sync.plan
        )
        for version in (1, 2):
            expected = ray.get(trainer.step.remote(version))
            sync.push(version)
            assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
        assert sync.versions() == [2, 2]


def test_an_actor_in_another_syncs_graph_is_pushed_to_through_ordinary_calls(ray_local, no_leftovers, made):
    """An actor runs one compiled graph at a time: the second WeightSync over it says so, and still pushes."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    made += [trainer, engine]
    with WeightSync([trainer], [engine], CFG, compiled_graph=True) as first:
        with WeightSync([trainer], [engine], CFG, compiled_graph=True) as second:
            assert "one compiled Ray graph" in str(first.plan)
            assert "push rounds: one ordinary Ray call per endpoint (Ray did not compile" in str(second.plan)
            expected = ray.get(trainer.step.remote(1))
            second.push(1)
            assert ray.get(engine.digest.remote()) == expected
        expected = ray.get(trainer.step.remote(2))
        first.push(2)
        assert ray.get(engine.digest.remote()) == expected and first.versions() == [2]


def test_colocated_pairs_with_a_load_function(ray_local, no_leftovers):
    trainers = [ray.remote(**ACTOR)(Trainer).remote(seed) for seed in (10, 20)]
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    with WeightSync(trainers, engines, CFG, pairs=[(0, 0), (1, 1)], sink=engine_load) as sync:
        expected = ray.get([t.step.remote(1) for t in trainers])
        sync.push(1)
        assert ray.get([e.digest.remote() for e in engines]) == expected
        assert expected[0] != expected[1]


@pytest.mark.parametrize("compiled_graph", GRAPH)
def test_a_remote_error_surfaces_once_and_the_engine_says_its_weights_are_mixed(
    ray_local, no_leftovers, made, compiled_graph
):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    made += [trainer, engine]
    with WeightSync(
        [trainer], [engine], CFG, sink=engine_load, push_rounds="graph" if compiled_graph else "calls"
    ) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        good = ray.get(engine.digest.remote())
        ray.get(engine.fail_at_call.remote(2, "raise"))
        ray.get(trainer.step.remote(2))
        with pytest.raises(SyncError, match="bad weights") as e:
            sync.push(2)
        stages = {f.stage for f in e.value.failures}
        assert any("unpack bucket" in s for s in stages), stages
        assert any(
            f.endpoint.startswith("receiver #0") and "ValueError" in f.traceback for f in e.value.failures
        )
        assert e.value.mixed == (0,) and "receiver(s) #0 now hold a mix of two versions" in str(e.value)
        assert ray.get(engine.digest.remote()) != good  # partly written: neither version 1 nor 2 ...
        assert sync.versions() == [MIXED]  # ... and said so, to the driver and inside the engine's actor
        assert ray.get(engine.__ray_call__.remote(applied_version)) == MIXED
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)  # the pair was repaired: a full push
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]
        assert ray.get(engine.__ray_call__.remote(applied_version)) == 3


@pytest.mark.parametrize("compiled_graph", GRAPH)
def test_an_engine_killed_mid_push_is_detected_and_restarted(ray_local, no_leftovers, made, compiled_graph):
    """In a compiled graph too: Ray tears the graph down, the driver names the dead actor and hears the
    sender's own failure (its connection to the engine ended), and the next push compiles a graph with the restarted actor."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(max_restarts=1, **ACTOR)(Engine).remote()
    made += [trainer, engine]
    with WeightSync(
        [trainer], [engine], CFG, sink=engine_load, push_rounds="graph" if compiled_graph else "calls"
    ) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        first_pid = ray.get(engine.pid.remote())
        ray.get(engine.fail_at_call.remote(2, "die"))
        with pytest.raises(SyncError) as e:
            sync.push(2)
        labels = " | ".join(f"{f.endpoint}: {f.error}" for f in e.value.failures)
        assert "receiver #0" in labels and "Actor" in labels, labels
        assert "PeerLost: lost the connection to receiver" in labels, labels  # the sender's own: at once
        assert sync.versions() == [None]  # the restarted actor has applied nothing yet, and says so
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)  # re-planned for the restarted actor, full weights
        assert ray.get(engine.pid.remote()) != first_pid
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]
        assert ("one compiled Ray graph" in str(sync.plan)) == compiled_graph


@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_a_source_that_raises_fails_the_push_at_once_with_its_own_error(ray_local, no_leftovers, transport):
    """The trainer's source raises at its second tensor: the sender tells its receivers at once, so every
    receiver fails with the source's own exception (a receiver left to wait would fail with a PeerTimeout,
    after timeout_s: 120 s here); nothing was touched, and the next push goes through."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    config = dataclasses.replace(CFG, timeout_s=120)
    with WeightSync([trainer], engines, config, source=breakable_source, transport=transport) as sync:
        assert {p.transport for p in sync.plan} == {transport}
        ray.get(trainer.step.remote(1))
        sync.push(1)
        ray.get(trainer.break_source.remote(1))
        ray.get(trainer.step.remote(2))
        with pytest.raises(SyncError) as raised:
            sync.push(2)
        error = raised.value
        assert error.failures[0].endpoint.startswith("sender #0")
        assert "at stage 'source': ValueError: the source broke at tensor 1" in str(error)
        receivers = [f for f in error.failures if f.endpoint.startswith("receiver")]
        assert len(receivers) == 2 and all("ValueError: the source broke" in f.error for f in receivers)
        assert not any("PeerTimeout" in f.error for f in receivers), [f.error for f in receivers]
        assert sync.versions() == [1, 1] and not error.mixed
        ray.get(trainer.break_source.remote(None))
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)
        assert all(ray.get(e.digest.remote()) == expected for e in engines) and sync.versions() == [3, 3]


def test_a_closed_sync_says_it_was_closed(ray_local, no_leftovers):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    with WeightSync([trainer], [engine], CFG) as sync:
        sync.push(1)
    for call in (lambda: sync.push(2), sync.versions):
        with pytest.raises(SyncClosed, match=r"WeightSync \w+, which was closed .* make a new WeightSync"):
            call()


def test_versions_and_pushes_across_an_engine_killed_then_gone_for_good(ray_local, no_leftovers):
    """Killed and restarted by Ray: versions() waits for the restart and says None, the next push repairs.
    Killed for good: versions() says None (no weights anywhere), the push fails naming it, and repairing it is
    a typed error (ActorGone), not one of Ray's."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(max_restarts=1, **ACTOR)(Engine).remote()
    with WeightSync([trainer], [engine], CFG) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engine.die.remote())  # SIGKILLed; Ray restarts it (max_restarts=1)
        assert sync.versions() == [None]
        with pytest.raises(SyncError, match="receiver #0"):
            sync.push(2)  # its session died with it
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engine.die.remote())  # no restart left
        assert sync.versions() == [None]
        with pytest.raises(SyncError, match="receiver #0"):
            sync.push(4)
        with pytest.raises(ActorGone, match="receiver #0 .* died .* Ray will not restart it"):
            sync.push(5)


def test_overrides_that_cannot_work_are_refused(ray_local):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    with pytest.raises(PlanError, match="override 'cuda_ipc'"):  # the actors have no GPU (on any machine)
        WeightSync([trainer], [engine], CFG, transport="cuda_ipc")
    with WeightSync([trainer], [engine], CFG, transport={(0, 0): "shm"}) as sync:
        assert sync.plan[0].reason == "override"


def test_sharded_sources_every_trainer_broadcasts_its_share_to_every_engine(
    ray_local, no_leftovers, gloo_warm
):
    trainers = [ray.remote(**ACTOR)(Trainer).remote() for _ in range(2)]  # ranks holding the same model
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    with WeightSync(trainers, engines, CFG, sink=engine_load, shard_sources=True) as sync:
        assert [(p.sender, p.receiver, p.transport) for p in sync.plan] == [
            (0, 0, "collective"),
            (0, 1, "collective"),
            (1, 0, "collective"),
            (1, 1, "collective"),
        ]
        assert "sharded sources: share 1 of 2" in str(sync.plan)
        for version in (1, 2):
            expected = ray.get([t.step.remote(version) for t in trainers])[0]
            report = sync.push(version)
            assert all(ray.get(e.digest.remote()) == expected for e in engines)
            shares = {p.sender: p.bytes for p in report.pairs if p.receiver == 0}
            assert (
                len(report.pairs) == 4 and all(shares.values()) and sum(shares.values()) == report.bytes // 2
            )
        assert sync.versions() == [2, 2]
        ray.get(engines[1].fail_at_call.remote(2, "raise"))  # one engine fails part-way through a push
        ray.get([t.step.remote(3) for t in trainers])
        with pytest.raises(SyncError) as e:
            sync.push(3)  # the other engine waits out timeout_s in the failing share's group
        assert any("bad weights" in f.error for f in e.value.failures if f.endpoint.startswith("sender")), [
            (f.endpoint, f.error[:100]) for f in e.value.failures
        ]  # the failing share's sender names the cause, not the symptom
        assert sync.versions()[1] != 3
        expected = ray.get([t.step.remote(4) for t in trainers])[0]
        sync.push(4)  # both groups rebuilt: a full push to everyone
        assert all(ray.get(e.digest.remote()) == expected for e in engines) and sync.versions() == [4, 4]
