"""A two-node Ray cluster on this machine (ray.cluster_utils.Cluster): two raylets, distinct node ids."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from actors import Engine, Trainer  # noqa: E402

from raysync import SyncConfig, WeightSync  # noqa: E402

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=10, progress=False)


@pytest.mark.slow
def test_plan_across_nodes_and_bit_exact_pushes(no_leftovers):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 10}})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 10})
        here = os.path.dirname(os.path.abspath(__file__))
        ray.init(
            address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": here}}, logging_level="warning"
        )
        on = {n: {"num_cpus": 0.25, "resources": {n: 1}} for n in ("node_a", "node_b")}
        trainer = ray.remote(**on["node_a"])(Trainer).remote()
        engines = [ray.remote(**on["node_a"])(Engine).remote(), ray.remote(**on["node_b"])(Engine).remote()]
        with WeightSync([trainer], engines, CFG) as sync:
            local, remote = sync.plan
            assert (local.transport, local.reason) == ("shm", "same node")
            # the rules want the collective across nodes; until it is built the plan falls back, and says so
            assert (remote.wanted, remote.transport) == ("collective", "shm")
            assert "collective not built yet, shm instead (same host)" in str(sync.plan)
            for version in (1, 2):
                expected = ray.get(trainer.step.remote(version))
                sync.push(version)
                assert ray.get([e.digest.remote() for e in engines]) == [expected, expected]
    finally:
        ray.shutdown()
        cluster.shutdown()
