"""The plan as pure functions: placement rules, fallbacks, overrides, topologies."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from raysync.core.config import MiB, SyncConfig
from raysync.ray.connections import assign, format_plan, plan_pairs
from raysync.ray.placement import (
    Placement,
    PlanError,
    SourceReport,
    check_groups,
    choose,
    probe,
    report_source,
)


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
    assert table.splitlines()[0].split() == ["sender", "receiver", "transport", "mode", "why"]
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
    assert (me.gpu_free_bytes is not None) is (me.device == "cuda")  # the memory a ring could take there
    assert (
        me.gpu_free_bytes is None
        or 0 < me.gpu_free_bytes <= torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    )
    assert me.host_free_bytes is None or 0 < me.host_free_bytes
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


# --- the plan picks the mode and the ring (issue 19, item 1) -------------------------------------------------------
GiB = 1 << 30
IN_PLACE = SourceReport(push_bytes=15 * GiB, not_in_place="", stable=True)  # a 7B model on its GPU, bf16
CAST = SourceReport(
    15 * GiB, "'lm_head.weight' is torch.float32, sent as torch.bfloat16 (a cast needs the ring)", True
)


def gpu(gpu_id: str = "GPU-a", *, free: int | None = 100 * GiB, **kw) -> Placement:
    return dataclasses.replace(at("n1", gpu_id, **kw), gpu_free_bytes=free, host_free_bytes=200 * GiB)


def plan(s, r, *, source=IN_PLACE, override=None, rings=None, **config):
    return choose(0, 0, s, r, ALL, override, config=SyncConfig(**config), source=source, rings=rings)


@pytest.mark.parametrize(
    "s, r, source, transport, mode, why",
    [
        (gpu(), gpu(), IN_PLACE, "cuda_ipc", "direct", "read in place"),  # same device
        (gpu(), gpu("GPU-b"), IN_PLACE, "cuda_ipc", "direct", "read in place"),  # peer access
        (gpu(), gpu(), CAST, "cuda_ipc", "ring 2 x 2048 MiB", "'lm_head.weight' is torch.float32"),  # cast
        (gpu(), gpu("GPU-b"), CAST, "cuda_ipc", "ring 2 x 1024 MiB", "a cast needs the ring"),
        (
            gpu(),
            gpu(),
            dataclasses.replace(IN_PLACE, stable=False),
            "cuda_ipc",
            "ring 2 x 2048 MiB",
            "new tensors",
        ),
        (gpu(), gpu(), None, "cuda_ipc", "ring 2 x 2048 MiB", "not reported"),
        (gpu(ipc=False), gpu(), IN_PLACE, "shm", "ring 2 x 512 MiB", "no CUDA IPC"),  # no IPC
        (at("n1"), at("n1"), IN_PLACE, "shm", "ring 2 x 8 MiB", "shm, CPU endpoints"),  # host tensors
        (gpu(), at("n2", "GPU-a", host="h2"), IN_PLACE, "collective", "ring 2 x 512 MiB", "other nodes"),
    ],
)
def test_the_plan_picks_direct_wherever_it_is_correct_and_the_ring_otherwise(
    s, r, source, transport, mode, why
):
    p = plan(s, r, source=source)
    assert (p.transport, p.mode) == (transport, mode) and why in p.reason + p.how, p
    cfg = p.config(SyncConfig())  # what the pair's endpoints run: plain values, nothing left to a plan
    assert not any(cfg.is_auto(f) for f in ("transport", "bucket_bytes", "num_buffers", "direct"))
    assert (cfg.transport, cfg.direct) == (transport, mode == "direct")
    assert mode == "direct" or (cfg.num_buffers, cfg.bucket_bytes) == (p.num_buffers, p.bucket_bytes)


def test_same_node_other_gpus_by_what_the_receiver_sees_and_reaches():
    """Issue 20's visibility cases: cuda_ipc only where the receiver sees the sender's GPU and reaches it;
    NCCL where it cannot see it (Ray's default: each GPU actor sees its own GPU), shm where NCCL is not built."""
    own_only = dataclasses.replace(
        gpu("GPU-b"), gpu_uuids=("GPU-b",), peer_access=((True,),)
    )  # Ray's default
    p = plan(gpu(), own_only)
    assert (p.transport, p.mode) == (
        "collective",
        "ring 2 x 512 MiB",
    ) and "not visible to the receiver" in p.reason
    no_nccl = choose(0, 0, gpu(), own_only, ["cuda_ipc", "shm"], config=SyncConfig(), source=IN_PLACE)
    assert no_nccl.transport == "shm" and "collective not built yet, shm instead" in no_nccl.reason
    no_peer = dataclasses.replace(gpu("GPU-b"), peer_access=((True, False), (False, True)))
    assert plan(gpu(), no_peer).reason == "same node, no peer access between the GPUs"
    for unreachable in (own_only, no_peer, gpu(ipc=False)):
        with pytest.raises(PlanError, match="override 'cuda_ipc'"):
            plan(gpu(), unreachable, transport="cuda_ipc")


def test_engines_that_cannot_see_the_trainers_gpu_get_one_nccl_rank_per_gpu():
    """Engines on GPUs the trainer's actor cannot see go over NCCL, one rank per GPU in the trainer's group
    (NCCL refuses two): a second engine on a GPU that already has a rank goes over shm, with the reason; the
    same placements with the collective forced are refused, naming both ranks."""

    def own_only(uuid: str) -> Placement:
        return dataclasses.replace(gpu(uuid), gpu_uuids=(uuid,), peer_access=((True,),))

    trainer = own_only("GPU-a")
    engines = [own_only("GPU-b"), own_only("GPU-b"), own_only("GPU-c"), own_only("GPU-a")]
    plans = [
        choose(0, j, trainer, e, ALL, config=SyncConfig(), source=IN_PLACE) for j, e in enumerate(engines)
    ]
    check_groups(plans, [trainer], engines)
    assert [p.transport for p in plans] == ["collective", "shm", "collective", "cuda_ipc"]
    assert "receiver #0 holds GPU GPU-b in this sender's NCCL group: shm" in plans[1].reason
    forced = [choose(0, j, trainer, e, ALL, "collective") for j, e in enumerate(engines[:2])]
    with pytest.raises(PlanError, match=r"receiver #0 and receiver #1 .* same GPU GPU-b"):
        check_groups(forced, [trainer], engines[:2])


def test_syncconfig_leaves_the_data_path_to_the_plan_until_a_field_is_set(monkeypatch):
    """Note [left to the plan]: SyncConfig() plans; a field set is forced, through dataclasses.replace too; a
    session without a plan reads the standalone defaults; nothing left to a plan reaches the wire."""
    import pickle

    fields = ("transport", "bucket_bytes", "num_buffers", "direct")
    auto = SyncConfig()
    assert all(auto.is_auto(f) for f in fields)
    assert (auto.transport, auto.bucket_bytes, auto.num_buffers, bool(auto.direct)) == (
        "shm",
        512 * MiB,
        2,
        False,
    )
    kept = dataclasses.replace(auto, verify=True)
    assert all(kept.is_auto(f) for f in fields)
    assert pickle.loads(pickle.dumps(kept)).is_auto("bucket_bytes")  # noqa: S301 - our own object, as Ray ships it
    forced = dataclasses.replace(auto, bucket_bytes=512 * MiB, transport="shm", direct=False, num_buffers=2)
    assert not any(forced.is_auto(f) for f in fields)  # the same values, set: forced
    assert dataclasses.replace(forced, bucket_bytes=None).is_auto("bucket_bytes")
    assert SyncConfig(transport="auto").is_auto("transport")
    plain = dataclasses.asdict(auto)  # what a frame's encoding copies: exact ints and strs
    assert type(plain["bucket_bytes"]) is int and type(plain["transport"]) is str
    resolved = auto.resolved(bucket_bytes=MiB)
    assert (type(resolved.num_buffers), resolved.bucket_bytes, resolved.direct) == (int, MiB, False)
    with pytest.raises(ValueError, match="transport='tcp': one of"):
        SyncConfig(transport="tcp")
    with pytest.raises(TypeError, match="direct="):
        SyncConfig(direct="yes")
    monkeypatch.setenv("RAYSYNC_DIRECT", "auto")
    monkeypatch.setenv("RAYSYNC_BUCKET_BYTES", str(MiB))
    env = SyncConfig.from_env()
    assert env.is_auto("direct") and not env.is_auto("bucket_bytes") and env.bucket_bytes == MiB


def test_the_ring_fits_the_push_and_the_memory_free_where_it_lives():
    small = SourceReport(push_bytes=100 * MiB + 5, not_in_place="", stable=True)
    p = plan(gpu(), gpu(), source=dataclasses.replace(small, stable=False))
    assert (p.num_buffers, p.bucket_bytes) == (1, 101 * MiB) and "the push in one bucket" in p.how
    p = plan(gpu(free=4 * GiB), gpu(free=4 * GiB), source=CAST)  # a ring of at most 1/4 of 4 GiB
    assert (p.num_buffers, p.bucket_bytes) == (
        2,
        512 * MiB,
    ) and "1/4 of the 4096 MiB free on GPU GPU-a" in p.how
    p = plan(gpu(free=4 * GiB), gpu(free=4 * GiB), source=CAST, rings={"GPU GPU-a": 2})  # two rings share it
    assert p.num_buffers * p.bucket_bytes * 4 <= 2 * GiB and p.bucket_bytes == 256 * MiB
    p = plan(gpu(free=4 * GiB), gpu(free=4 * GiB), source=CAST, bucket_bytes=1 * GiB)  # set: kept as set
    assert (p.num_buffers, p.bucket_bytes) == (2, 1 * GiB)
    p = plan(gpu(free=None), gpu(free=None), source=CAST, num_buffers=3)  # memory not reported
    assert (p.num_buffers, p.bucket_bytes) == (3, 2048 * MiB)


@pytest.mark.parametrize(
    "s, r, source, config, match",
    [
        (at("n1"), at("n1"), IN_PLACE, {"direct": True}, r"direct=True .* runs shm"),
        (gpu(ipc=False), gpu(), IN_PLACE, {"direct": True}, r"direct=True .* runs shm"),
        (gpu(), gpu(), CAST, {"direct": True}, r"direct=True, but .* 'lm_head.weight' is torch.float32"),
        (
            at("n1"),
            at("n1"),
            IN_PLACE,
            {"transport": "cuda_ipc"},
            r"override 'cuda_ipc' \(SyncConfig.transport\)",
        ),
        (at("n1"), at("n2", host="h2"), IN_PLACE, {"transport": "shm"}, "override 'shm'"),
        (
            gpu(free=GiB),
            gpu(free=GiB),
            CAST,
            {"bucket_bytes": GiB},
            r"2 x 1024 MiB .* does not fit the 1024 MiB",
        ),
    ],
)
def test_a_forced_mode_that_cannot_work_is_refused_by_the_plan(s, r, source, config, match):
    with pytest.raises(PlanError, match=match):
        plan(s, r, source=source, **config)


def test_what_the_user_sets_is_forced_where_it_can_work():
    assert plan(gpu(), gpu(), direct=False).mode == "ring 2 x 2048 MiB"
    p = plan(gpu(), gpu(), source=dataclasses.replace(IN_PLACE, stable=False), direct=True)
    assert p.direct and "re-exported every push" in p.how  # correct, if slower: the user's call
    p = plan(gpu(), gpu(), transport="shm")
    assert (p.transport, p.reason, p.mode) == ("shm", "override (SyncConfig.transport)", "ring 2 x 512 MiB")
    assert plan(gpu(), gpu(), override="shm", transport="collective").transport == "shm"  # per pair first


def test_rings_that_share_a_memory_are_sized_together():
    trainer, engines = gpu(free=8 * GiB), [gpu(free=8 * GiB) for _ in range(3)]
    plans = plan_pairs([(0, j) for j in range(3)], [trainer], engines, ALL, SyncConfig(), {0: CAST})
    assert all(p.num_buffers * p.bucket_bytes * 3 * 4 <= 8 * GiB for p in plans)  # 3 rings on GPU-a
    direct = plan_pairs([(0, j) for j in range(3)], [trainer], engines, ALL, SyncConfig(), {0: IN_PLACE})
    assert all(p.direct for p in direct)


def test_report_source_says_what_the_plan_needs_from_the_senders_tensors():
    """Run in this process as it runs inside a sender; host tensors are never read in place (CPU or GPU machine)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
    actor = types.SimpleNamespace(model=model)
    params = lambda a: a.model.named_parameters()  # noqa: E731
    plain = report_source(actor, params, SyncConfig())
    assert plain.push_bytes == sum(p.numel() * 4 for p in model.parameters()) and plain.stable
    assert plain.not_in_place in ("the sender has no GPU", "'0.weight' is not on a GPU")
    cast = report_source(actor, params, SyncConfig(cast_dtype="bfloat16", keep_dtype=("1.*",)))
    assert cast.push_bytes == (64 * 64 + 64) * 2 + 2 * 64 * 4
    fresh = report_source(actor, lambda a: ((n, p.clone()) for n, p in params(a)), SyncConfig())
    assert not fresh.stable  # new tensors at every call
    assert report_source(actor, params, SyncConfig(exclude=("1.*",))).push_bytes == (64 * 64 + 64) * 4
    from raysync.sources import LazySource

    lazy = report_source(actor, lambda a: LazySource.from_module(a.model, lambda n: None), SyncConfig())
    assert lazy == SourceReport(
        plain.push_bytes, "the source is lazy", False
    )  # made bucket by bucket: the ring


@pytest.mark.gpu
def test_report_source_on_a_gpu_names_what_direct_mode_cannot_read():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)).cuda()
    actor = types.SimpleNamespace(model=model)
    params = lambda a: a.model.named_parameters()  # noqa: E731
    assert report_source(actor, params, SyncConfig()) == SourceReport((64 * 64 + 64 + 128) * 4, "", True)
    cast = report_source(actor, params, SyncConfig(cast_dtype="bfloat16"))
    assert cast.not_in_place == "'0.weight' is torch.float32, sent as torch.bfloat16 (a cast needs the ring)"
    strided = report_source(actor, lambda a: [("t", a.model[0].weight.t())], SyncConfig())
    assert strided.not_in_place == "'t' is not contiguous"


# --- through WeightSync on Ray: the default plan, and a forced mode refused before any session opens ---------------
def _sessions(actor) -> dict:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda a: dict(a.__dict__.get("_raysync_sessions", {}))))


def test_weightsync_default_config_plans_each_pair_and_pushes_bit_exact(ray_local, no_leftovers):
    import ray
    from actors import Engine, Trainer

    from raysync import WeightSync

    trainer = ray.remote(num_cpus=0.25)(Trainer).remote()
    engine = ray.remote(num_cpus=0.25)(Engine).remote()
    with pytest.raises(PlanError, match=r"direct=True .* runs shm"):
        WeightSync([trainer], [engine], SyncConfig(direct=True, progress=False))
    assert _sessions(trainer) == {} and _sessions(engine) == {}  # refused before any session opened
    with WeightSync([trainer], [engine], SyncConfig(progress=False)) as sync:
        [p] = sync.plan
        push = ray.get(
            trainer.__ray_call__.remote(lambda a: sum(t.numel() * 4 for t in a.model.parameters()))
        )
        assert (p.transport, p.direct, p.num_buffers) == ("shm", False, 1)  # the tiny model: one bucket
        assert p.bucket_bytes == -(-push // MiB) * MiB and "the push in one bucket" in str(sync.plan)
        expected = ray.get(trainer.step.remote(1))
        sync.push(1)
        assert ray.get(engine.digest.remote()) == expected


def test_fan_outs_group_each_senders_pairs_of_one_kind_on_its_host():
    """issue 20, item 3: a sender's engines on its host that its plan reaches the same way share one session;
    pairs planned otherwise, or on other hosts, keep their own."""
    from raysync.ray.fanout_group import groups, plan_fan_outs

    trainer = gpu()
    engines = [gpu(), gpu(), gpu("GPU-b"), gpu(ipc=False), gpu(ipc=False), at("n2", "GPU-a", host="h2")]
    pairs = [(0, j) for j in range(len(engines))]
    plans = plan_pairs(pairs, [trainer], engines, ALL, SyncConfig(), {0: IN_PLACE})
    assert [(p.transport, p.direct) for p in plans] == [("cuda_ipc", True)] * 3 + [("shm", False)] * 2 + [
        ("collective", False)
    ]
    fanned = plan_fan_outs(plans, [trainer], engines)
    assert groups(fanned) == {0: [0, 1, 2]}  # three read the trainer's tensors; the two shm pairs are fewer
    assert all(
        p.reason.endswith("fan-out: the trainer's tensors (cuda_ipc direct) read by 3 engines")
        for p in fanned[:3]
    )
    assert fanned[3:] == plans[3:]  # unchanged: their own sessions
    cast = plan_pairs([(0, j) for j in range(3)], [trainer], engines[:3], ALL, SyncConfig(), {0: CAST})
    ring = plan_fan_outs(cast, [trainer], engines[:3])
    assert groups(ring) == {0: [0, 1, 2]} and "fan-out: one cuda_ipc ring read by 3 engines" in ring[0].reason
    assert len({(p.bucket_bytes, p.num_buffers) for p in ring}) == 1  # one ring: one shape
    alone = plan_fan_outs(plans[:1] + plans[5:], [trainer], engines)
    assert groups(alone) == {}  # one pair per kind: nothing to share
