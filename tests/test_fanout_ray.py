"""Fan-out through WeightSync (issue 20, item 3): one trainer serving three engines over shm on one host makes
ONE session whose ring the three read (raysync.ray.fanout_group), each bucket packed once for all of them."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Engine, Trainer  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.ray.endpoint import packed_buckets  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets
ACTOR = {"num_cpus": 0.25}
FAN_OUT = "fan-out: one shm ring read by 3 engines"


def packed(trainer, sync: WeightSync) -> dict[tuple[int, ...], int]:
    return ray.get(trainer.__ray_call__.remote(packed_buckets, sync._sync_id), timeout=30)


def test_one_trainer_to_three_engines_packs_each_bucket_once(ray_local, no_leftovers, made):
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(**ACTOR)(Engine).remote() for _ in range(3)]
    made += [trainer, *engines]
    with WeightSync([trainer], engines, CFG, fan_out=True) as sync:
        assert [p.transport for p in sync.plan] == ["shm"] * 3 and all(p.mode != "direct" for p in sync.plan)
        assert all(FAN_OUT in p.reason for p in sync.plan) and FAN_OUT in str(sync.plan)
        fanned = []
        for version in (1, 2):
            expected = ray.get(trainer.step.remote(version))
            report = sync.push(version)
            assert all(ray.get(e.digest.remote()) == expected for e in engines)
            assert len(report.pairs) == 3 and sync.versions() == [version] * 3
            fanned.append(packed(trainer, sync))
    # the same pushes with the knob off: one session per pair, each packing every bucket for its one engine
    with WeightSync([trainer], engines, CFG) as per_pair:  # fan_out=False, the default
        assert not any("fan-out" in p.reason for p in per_pair.plan)
        expected = ray.get(trainer.step.remote(3))
        per_pair.push(3)
        assert all(ray.get(e.digest.remote()) == expected for e in engines)
        pairs = packed(trainer, per_pair)
    [buckets] = set(pairs.values())  # a pair session packs each bucket once: the bucket count of a push
    assert buckets > 1 and sorted(pairs) == [(0,), (1,), (2,)]
    assert fanned == [{(0, 1, 2): buckets}] * 2  # one session, each bucket packed once for all three


def test_an_engine_killed_fails_its_fan_out_and_the_next_push_rebuilds_it(ray_local, no_leftovers, made):
    """The killed reader fails the push for its whole fan-out, each receiver naming the stage; the others
    hold what their results say (their weights too), and the next push rebuilds the fan-out with the engine
    Ray restarted, full weights to it."""
    trainer = ray.remote(**ACTOR)(Trainer).remote()
    engines = [ray.remote(max_restarts=1, **ACTOR)(Engine).remote() for _ in range(3)]
    made += [trainer, *engines]
    with WeightSync([trainer], engines, CFG, fan_out=True) as sync:
        digests = {1: ray.get(trainer.step.remote(1))}
        sync.push(1)
        first_pid = ray.get(engines[1].pid.remote())
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(engines[1].die.remote())  # SIGKILLed; Ray restarts it (max_restarts=1)
        digests[2] = ray.get(trainer.step.remote(2))
        with pytest.raises(SyncError) as raised:
            sync.push(2)
        failures = raised.value.failures
        named = {f.endpoint.split(" (")[0] for f in failures if f.endpoint.startswith("receiver")}
        assert "receiver #1" in named, failures
        from_sender = [f for f in failures if f.endpoint.startswith("sender #0")]
        assert sorted(f.endpoint.rsplit("#", 1)[1] for f in from_sender) == ["0)", "1)", "2)"], failures
        assert all(f.stage for f in failures) and len({f.stage for f in from_sender}) == 1, failures
        versions = sync.versions()
        assert versions[1] is None  # restarted: it holds no version, and says so
        for j in (0, 2):  # whatever each says, its weights are that version
            assert versions[j] in (1, 2) and ray.get(engines[j].digest.remote()) == digests[versions[j]]
        expected = ray.get(trainer.step.remote(3))
        sync.push(3)  # the whole fan-out rebuilt, the restarted engine with it
        assert ray.get(engines[1].pid.remote()) != first_pid
        assert all(ray.get(e.digest.remote()) == expected for e in engines) and sync.versions() == [3] * 3
        assert all(FAN_OUT in p.reason for p in sync.plan)
        [(readers, count)] = packed(trainer, sync).items()  # one session again, no pair session beside it
        assert readers == (0, 1, 2) and count > 1
