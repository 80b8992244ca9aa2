"""A two-node Ray cluster on this machine (ray.cluster_utils.Cluster): two raylets, distinct node ids; shm
inside a node, the collective (gloo) across nodes."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Engine, Trainer, engine_load  # noqa: E402
from conftest import worker_pythonpath  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)


@pytest.mark.slow
def test_plan_across_nodes_and_bit_exact_pushes(private_tmp, monkeypatch, gloo_warm):
    from ray.cluster_utils import Cluster

    # the cluster's files in this test's own temp dir: Cluster writes the address that a bare ray.init() joins
    # (ray_current_cluster) and removes it at shutdown, which must touch no other Ray's on the machine
    monkeypatch.setenv("RAY_TMPDIR", private_tmp)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 10}})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 10})
        ray.init(
            address=cluster.address,
            runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath()}},
            logging_level="warning",
        )
        on = {n: {"num_cpus": 0.25, "resources": {n: 1}} for n in ("node_a", "node_b")}
        trainer = ray.remote(**on["node_a"])(Trainer).remote()
        engines = [
            ray.remote(**on["node_a"])(Engine).remote(),
            ray.remote(max_restarts=1, **on["node_b"])(Engine).remote(),
        ]
        with WeightSync([trainer], engines, CFG, sink=engine_load) as sync:
            local, remote = sync.plan
            assert (local.transport, local.reason) == ("shm", "same node")
            assert (remote.transport, remote.reason) == ("collective", "other nodes")  # gloo on CPUs
            for version in (1, 2):
                expected = ray.get(trainer.step.remote(version))
                report = sync.push(version)
                assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
            assert [p.transport for p in report.pairs] == ["shm", "collective"]

            # the engine on the other node dies inside a push: a typed error naming it, then recovery
            ray.get(engines[1].fail_at_call.remote(2, "die"))
            expected = ray.get(trainer.step.remote(3))
            with pytest.raises(SyncError) as e:
                sync.push(3)
            assert any(f.endpoint.startswith("receiver #1") for f in e.value.failures), e.value
            assert not any(f.endpoint.startswith("receiver #0") for f in e.value.failures), e.value
            assert ray.get(engines[0].digest.remote()) == expected  # the shm pair on node a is unaffected
            assert sync.versions() == [3, None]  # ... and the restarted engine on node b holds nothing yet
            expected = ray.get(trainer.step.remote(4))
            sync.push(4)  # the group is rebuilt with the restarted actor, which gets the full weights
            assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
            assert sync.versions() == [4, 4]
    finally:
        ray.shutdown()
        cluster.shutdown()
