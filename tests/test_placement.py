"""The plan as pure functions: placement rules, fallbacks, overrides, topologies."""

from __future__ import annotations

import pytest

from raysync.ray.placement import Placement, PlanError, assign, check_groups, choose, format_plan, probe


def at(node: str, gpu: str | None = None, *, host: str = "h1", ipc: bool = True, visible=("GPU-a", "GPU-b")):
    where = {"node_id": node, "host": host, "ip": "10.0.0.1", "pid": 1}
    if gpu is None:
        return Placement(
            **where,
            device="cpu",
            gpu_uuids=(),
            current_gpu=None,
            cuda_visible_devices=None,
            ipc_ok=False,
            peer_access=(),
        )
    return Placement(
        **where,
        device="cuda",
        gpu_uuids=visible,
        current_gpu=gpu,
        cuda_visible_devices="0,1",
        ipc_ok=ipc,
        peer_access=((True, True), (True, True)),
    )


ALL = ["cuda_ipc", "shm", "collective"]


@pytest.mark.parametrize(
    "s, r, built, transport, why",
    [
        (at("n1", "GPU-a"), at("n1", "GPU-a"), ALL, "cuda_ipc", "same GPU"),
        (at("n1", "GPU-a"), at("n1", "GPU-b"), ALL, "cuda_ipc", "peer access"),
        (at("n1", "GPU-a", ipc=False), at("n1", "GPU-a"), ALL, "shm", "no CUDA IPC"),
        (at("n1"), at("n1"), ALL, "shm", "same node"),
        (at("n1"), at("n2", host="h2"), ALL, "collective", "other nodes"),
        (at("n1", "GPU-a"), at("n1", "GPU-a"), ["shm"], "shm", "cuda_ipc not built yet, shm instead"),
        (at("n1"), at("n2"), ["shm"], "shm", "collective not built yet, shm instead (same host)"),
    ],
)
def test_rules_and_fallbacks(s, r, built, transport, why):
    plan = choose(0, 1, s, r, built)
    assert plan.transport == transport and why in plan.reason


def test_gpus_are_matched_by_uuid_not_index():
    # the receiver sees only GPU-b, as its device 0; the sender works on GPU-b too (its device 1)
    s = at("n1", "GPU-b")
    r = Placement(
        node_id="n1",
        host="h1",
        ip="10.0.0.1",
        pid=2,
        device="cuda",
        gpu_uuids=("GPU-b",),
        current_gpu="GPU-b",
        cuda_visible_devices="1",
        ipc_ok=True,
        peer_access=((True,),),
    )
    assert choose(0, 0, s, r, ALL).reason == "same GPU"


def test_no_transport_for_other_hosts_is_a_clear_error():
    with pytest.raises(PlanError, match=r"want collective \(other nodes\), built so far: \['shm'\]"):
        choose(0, 0, at("n1"), at("n2", host="h2"), ["shm"])
    with pytest.raises(PlanError, match="override 'shm' cannot serve"):
        choose(0, 0, at("n1"), at("n2", host="h2"), ["shm"], override="shm")


def test_assign_colocated_disaggregated_and_mixed():
    trainers = [at("n1", "GPU-a"), at("n1", "GPU-b")]
    engines = [at("n1", "GPU-b"), at("n1", "GPU-a"), at("n2", "GPU-a", host="h2")]
    assert assign(trainers, engines) == [(1, 0), (0, 1), (0, 2)]  # same GPU first, else sender 0
    assert assign([at("n1")], [at("n1"), at("n2")]) == [(0, 0), (0, 1)]


def test_plan_table():
    table = format_plan([choose(0, 0, at("n1"), at("n1"), ["shm"])], [at("n1")], [at("n1")])
    assert table.splitlines()[0].split() == ["sender", "receiver", "transport", "why"]
    assert "shm" in table.splitlines()[2]


def test_probe_reports_this_process_as_torch_sees_it():
    """What probe() says, checked against torch and the OS on whatever machine runs it (CPU or GPUs)."""
    import os
    import socket

    import torch

    me = probe()
    assert (me.pid, me.host) == (os.getpid(), socket.gethostname())
    assert me.cuda_visible_devices == os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    uuids = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(gpus))
    assert me.gpu_uuids == uuids and len(me.peer_access) == gpus
    assert me.current_gpu == (uuids[torch.cuda.current_device()] if gpus else None)
    assert (me.device == "cuda") if torch.cuda.is_available() else (me.device in ("cpu", "npu"))
    assert not me.ipc_ok or me.device == "cuda"  # the CUDA IPC probe passes only where there is CUDA
    if me.device == "cuda":
        assert all(me.peer_access[i][i] for i in range(gpus))  # a GPU reaches its own memory


def test_a_group_with_two_ranks_on_one_gpu_is_refused_at_planning():
    """NCCL refuses two ranks of one group on a GPU (issue 20): a plan that makes one is a PlanError naming
    them, while the same placements over gloo (CPU), or on different GPUs, are fine."""
    trainer, engine, other = at("n1", "GPU-a"), at("n1", "GPU-a"), at("n1", "GPU-b")
    forced = [
        choose(0, 0, trainer, engine, ALL, "collective"),
        choose(0, 1, trainer, other, ALL, "collective"),
    ]
    with pytest.raises(PlanError, match=r"sender #0 and receiver #0 .* same GPU GPU-a"):
        check_groups(forced, [trainer], [engine, other])
    two_engines = [choose(0, j, at("n0", "GPU-a"), r, ALL) for j, r in enumerate([engine, at("n1", "GPU-a")])]
    assert {p.transport for p in two_engines} == {"collective"}  # other nodes: one group for both
    with pytest.raises(PlanError, match=r"receiver #0 and receiver #1"):
        check_groups(two_engines, [at("n0", "GPU-a")], [engine, at("n1", "GPU-a")])
    check_groups(forced[1:], [trainer], [engine, other])  # different GPUs
    check_groups([choose(0, 0, trainer, engine, ALL)], [trainer], [engine])  # cuda_ipc: no group
    cpu = [at("n1"), at("n1")]
    check_groups([choose(0, 0, cpu[0], cpu[1], ALL, "collective")], cpu[:1], cpu[1:])  # gloo
    cpu_sender = [choose(0, j, at("n0"), r, ALL) for j, r in enumerate([engine, at("n1", "GPU-a")])]
    check_groups(cpu_sender, [at("n0")], [engine, at("n1", "GPU-a")])  # host tensors: the group runs gloo
