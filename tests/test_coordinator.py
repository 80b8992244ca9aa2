"""WeightSync on a real local Ray: user actors, bit-exact pushes, errors surfacing once, restarts."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Engine, Trainer, engine_load  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.placement import PlanError  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets
ACTOR = {"num_cpus": 0.25}


def test_trainer_to_two_engines_bit_exact(ray_local, no_leftovers):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    with WeightSync([trainer], engines, CFG) as sync:
        assert [p.transport for p in sync.plan] == ["shm", "shm"] and "same node" in str(sync.plan)
        assert sync.versions() == [None, None]
        for version in (1, 2):
            expected = ray.get(trainer.step.remote(version))
            report = sync.push(version)
            assert all(ray.get(e.digest.remote()) == expected for e in engines)
            assert len(report.pairs) == 2 and report.slowest.bytes == report.bytes // 2 > 0
        assert sync.versions() == [2, 2]


def test_colocated_pairs_with_a_load_function(ray_local, no_leftovers):
    trainers = [ray.remote(**ACTOR)(Trainer).remote(seed) for seed in (10, 20)]
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    with WeightSync(trainers, engines, CFG, pairs=[(0, 0), (1, 1)], sink=engine_load) as sync:
        expected = ray.get([t.step.remote(1) for t in trainers])
        sync.push(1)
        assert ray.get([e.digest.remote() for e in engines]) == expected
        assert expected[0] != expected[1]


def test_a_remote_error_surfaces_once_and_the_old_version_stays(ray_local, no_leftovers):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    with WeightSync([trainer], [engine], CFG, sink=engine_load) as sync:
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
        assert sync.versions() == [1]
        assert ray.get(engine.digest.remote()) != good  # partly written ... but never reported as version 2
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)  # the pair was repaired: a full push
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


def test_an_engine_killed_mid_push_is_detected_and_restarted(ray_local, no_leftovers):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(max_restarts=1, **ACTOR)(Engine).remote()
    with WeightSync([trainer], [engine], CFG, sink=engine_load) as sync:
        ray.get(trainer.step.remote(1))
        sync.push(1)
        first_pid = ray.get(engine.pid.remote())
        ray.get(engine.fail_at_call.remote(2, "die"))
        started = time.monotonic()
        with pytest.raises(SyncError) as e:
            sync.push(2)
        assert time.monotonic() - started <= CFG.timeout_s + 3
        labels = " | ".join(f"{f.endpoint}: {f.error}" for f in e.value.failures)
        assert "receiver #0" in labels and "Actor" in labels and "PeerTimeout" in labels, labels
        assert sync.versions() == [None]  # the restarted actor has applied nothing yet, and says so
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)  # re-planned for the restarted actor, full weights
        assert ray.get(engine.pid.remote()) != first_pid
        assert ray.get(engine.digest.remote()) == expected and sync.versions() == [3]


def test_overrides_that_cannot_work_are_refused(ray_local):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engine = ray.remote(**ACTOR)(Engine).remote()
    with pytest.raises(PlanError, match="override 'cuda_ipc'"):  # not built yet
        WeightSync([trainer], [engine], CFG, transport="cuda_ipc")
    with WeightSync([trainer], [engine], CFG, transport={(0, 0): "shm"}) as sync:
        assert sync.plan[0].reason == "override"


def test_sharded_sources_every_trainer_broadcasts_its_share_to_every_engine(ray_local, no_leftovers):
    trainers = [ray.remote(**ACTOR)(Trainer).remote() for _ in range(2)]  # ranks holding the same model
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(2)]
    with WeightSync(trainers, engines, CFG, sink=engine_load, shard_sources=True) as sync:
        assert [(p.sender, p.receiver, p.transport) for p in sync.plan] == [
            (0, 0, "collective"), (0, 1, "collective"), (1, 0, "collective"), (1, 1, "collective")
        ]  # fmt: skip
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
        started = time.monotonic()
        with pytest.raises(SyncError) as e:
            sync.push(3)
        assert time.monotonic() - started <= CFG.timeout_s + 5  # the other engine times out in that group
        assert any("bad weights" in f.error for f in e.value.failures if f.endpoint.startswith("sender")), [
            (f.endpoint, f.error[:100]) for f in e.value.failures
        ]  # the failing share's sender names the cause, not the symptom
        assert sync.versions()[1] != 3
        expected = ray.get([t.step.remote(4) for t in trainers])[0]
        sync.push(4)  # both groups rebuilt: a full push to everyone
        assert all(ray.get(e.digest.remote()) == expected for e in engines) and sync.versions() == [4, 4]
