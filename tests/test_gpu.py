"""GPU paths of the core (run on the device machine; skipped where there is no CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits, session_pair

from raysync import SyncConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_copies_on_one_gpu_are_replayed_from_a_cuda_graph_that_follows_in_place_updates():
    from raysync.core.copies import CopyList

    torch.cuda.set_device(0)
    src = [torch.randn(n, device="cuda") for n in (7, 1 << 20, 3 << 18, 5)]  # fused and one-by-one copies
    dst = [torch.zeros_like(t) for t in src]
    copies = CopyList(list(zip(dst, src, strict=True)))
    for push in range(5):
        for t in src:
            t.add_(push + 1)  # the trainer's step, in place
        copies.run()
        torch.cuda.current_stream().synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True)), push
    assert copies.graph_captured  # captured at the second run, replayed since
    eager = CopyList(list(zip(dst, src, strict=True)), graph=False)  # SyncConfig(cuda_graphs=False)
    for _ in range(3):
        eager.run()
    assert not eager.graph_captured
    mixed = CopyList([(torch.zeros(4), src[0][:4].cpu()), (torch.zeros(4, device="cuda"), src[0][:4])])
    for _ in range(3):
        mixed.run()
    assert not mixed.graph_captured  # host memory in the list: launched one by one
    big = [
        torch.ones(10 << 20, device="cuda") for _ in range(2)
    ]  # 40 MB each: launching costs the GPU nothing
    large = CopyList([(torch.zeros_like(t), t) for t in big])
    for _ in range(3):
        large.run()
    assert not large.graph_captured


def test_gpu_to_shm_to_gpu_bit_exact_and_pinned(private_tmp, in_thread):
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(0)
    src = {
        "embed": torch.randn(3000, 512, device="cuda", generator=g, dtype=torch.bfloat16),  # sliced
        "w": torch.randn(512, 512, device="cuda", generator=g),
        "w.t": torch.randn(256, 512, device="cuda", generator=g).t(),  # non-contiguous
        "ids": torch.arange(77, device="cuda"),
    }
    config = SyncConfig(
        bucket_bytes=1 << 20, timeout_s=30, progress=False, cast_dtype="bfloat16", keep_dtype=("w",)
    )
    dest = {
        k: torch.zeros(
            v.shape, dtype=torch.bfloat16 if v.is_floating_point() and k != "w" else v.dtype, device="cuda"
        )
        for k, v in src.items()
    }
    with session_pair(config) as (sender, receiver):
        for version in (1, 2):
            for t in src.values():
                t.add_(1)
            got = in_thread(receiver.receive, into=dest)
            sender.push(src.items(), version)
            got.result(timeout=60)
            torch.cuda.synchronize()
            for k, v in src.items():
                expect = v if k in ("w", "ids") else v.to(torch.bfloat16)
                assert same_bits(dest[k], expect), k
        # registered with CUDA (cudaHostRegister): torch sees the ring's host memory as pinned, on both sides
        assert all(b.is_pinned() for b in sender.ring.buffers) and all(
            b.is_pinned() for b in receiver.ring.buffers
        )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_between_two_gpus_bit_exact(spawn):
    from workers import digest, nccl_receiver

    from raysync import SessionSecret
    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveSender

    torch.cuda.set_device(0)
    config = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)  # the embedding is sliced
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=1, backend="nccl")
    out = spawn.ctx.Queue()
    spawn(nccl_receiver, secret, config, 1, group.rendezvous, 2, out)
    sender = group.join()
    model = tiny_qwen2(seed=0).cuda()
    try:
        for version in (1, 2):
            perturb_on_gpu(model, version)
            sender.push(model.named_parameters(), version)
            rank, got_version, got = out.get(timeout=120)
            assert (rank, got_version) == (1, version)
            assert got == digest((n, p.cpu()) for n, p in model.named_parameters())
    finally:
        group.close()


def perturb_on_gpu(model, version: int) -> None:
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(version)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda"))


# --- cuda_ipc ----------------------------------------------------------------------------------------------------
IPC = SyncConfig(
    transport="cuda_ipc", timeout_s=120, progress=False
)  # 2 x 512 MiB: the 7B embedding is sliced


def _ipc_push(
    spawn,
    *,
    sender_gpu: int,
    receiver_gpu: int,
    visible: str | None,
    layout: str,
    pushes: int,
    config: SyncConfig = IPC,
):
    """Sender here on ``sender_gpu``, receiver spawned; returns the receiver's messages and the sender's
    reserved memory after each push."""
    from workers import digest, ipc_receiver

    from raysync import SessionSecret, WeightSender
    from raysync.tools.models import allocate

    torch.cuda.set_device(sender_gpu)
    src = allocate(layout, device="cuda")
    secret = SessionSecret.generate()
    out = spawn.ctx.Queue()
    reserved = []
    with WeightSender(secret, config) as sender:
        spawn(ipc_receiver, sender.endpoint, secret, config, receiver_gpu, visible, layout, pushes, out)
        digests = {}
        for version in range(1, pushes + 1):
            if version in (1, pushes):
                for i, t in enumerate(src.values()):
                    t.add_(version + i % 3)
                digests[version - 1] = digest(src.items(), on_device=True)
            sender.push(src.items(), version)
            reserved.append(torch.cuda.memory_reserved())
        got = [out.get(timeout=600) for _ in range(3 if pushes > 1 else 2)]
    return got, digests, reserved


def test_ipc_same_gpu_7b_bit_exact_memory_flat_over_200_pushes(spawn, no_leftovers):
    got, digests, reserved = _ipc_push(
        spawn, sender_gpu=0, receiver_gpu=0, visible=None, layout="qwen2.5-7b", pushes=200
    )
    received = {i: d for kind, i, d in got[:-1]}
    assert received == digests  # bit-exact after the first and the last push
    _, ring_gpu, receiver_gpu, receiver_reserved = got[-1]
    assert ring_gpu == receiver_gpu
    for side in (reserved, receiver_reserved):
        assert max(side[1:]) - min(side[1:]) <= IPC.bucket_bytes, side[:3] + side[-3:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ipc_devices_matched_by_uuid_across_visible_devices(spawn, no_leftovers):
    """Sender sees "0,1" and works on GPU 1; the receiver sees only "1" (its GPU 0): same physical GPU."""
    got, digests, _ = _ipc_push(
        spawn, sender_gpu=1, receiver_gpu=0, visible="1", layout="qwen2.5-0.5b", pushes=1
    )
    assert got[0][2] == digests[0]
    _, ring_gpu, receiver_gpu, _ = got[-1]
    assert ring_gpu == receiver_gpu == str(torch.cuda.get_device_properties(1).uuid)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ipc_ring_on_a_gpu_the_receiver_cannot_see_is_a_clear_error(spawn, no_leftovers):
    from raysync import RemoteError

    with pytest.raises(RemoteError, match="cannot see") as e:
        _ipc_push(spawn, sender_gpu=1, receiver_gpu=0, visible="0", layout="qwen2.5-0.5b", pushes=1)
    assert str(torch.cuda.get_device_properties(1).uuid) in str(e.value)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ipc_cross_gpu_pair_reads_the_ring_over_nvlink(spawn, no_leftovers):
    got, digests, _ = _ipc_push(
        spawn, sender_gpu=0, receiver_gpu=1, visible=None, layout="qwen2.5-1.5b", pushes=3
    )
    assert {i: d for _, i, d in got[:-1]} == digests
    _, ring_gpu, receiver_gpu, _ = got[-1]  # the ring lives on GPU 0, mapped into GPU 1 (a peer mapping)
    assert ring_gpu == receiver_gpu == str(torch.cuda.get_device_properties(1).uuid)


def test_ipc_probe_and_plan(ray_gpu):
    """Two Ray actors sharing one GPU (num_gpus=0.5) through WeightSync: planned over cuda_ipc, bit-exact."""
    import ray
    from actors import Engine, Trainer

    from raysync import WeightSync

    opts = {"num_gpus": 0.5, "num_cpus": 0.25}
    trainer = ray.remote(**opts)(Trainer).remote(on_gpu=True)
    engine = ray.remote(**opts)(Engine).remote(on_gpu=True)
    with WeightSync([trainer], [engine], SyncConfig(bucket_bytes=64 << 10, progress=False)) as sync:
        assert [(p.transport, p.reason) for p in sync.plan] == [("cuda_ipc", "same GPU")], str(sync.plan)
        for version in (1, 2):
            expected = ray.get(trainer.step.remote(version))
            sync.push(version)
            assert ray.get(engine.digest.remote()) == expected


def test_weightsync_fans_out_to_three_engines_on_the_trainers_gpu(ray_gpu):
    """issue 20, item 3, through WeightSync: three engine actors on the trainer's GPU read one session's
    export of the trainer's tensors (cuda_ipc direct) or one cuda_ipc ring (ring forced), bit-exact."""
    import ray
    from actors import Engine, Trainer

    from raysync import WeightSync

    opts = {"num_gpus": 0.25, "num_cpus": 0.25}
    trainer = ray.remote(**opts)(Trainer).remote(on_gpu=True)
    engines = [ray.remote(**opts)(Engine).remote(on_gpu=True) for _ in range(3)]
    for direct, kind in ((None, "the trainer's tensors (cuda_ipc direct)"), (False, "one cuda_ipc ring")):
        config = SyncConfig(bucket_bytes=64 << 10, progress=False, direct=direct)
        with WeightSync([trainer], engines, config, fan_out=True) as sync:
            assert all(f"fan-out: {kind} read by 3 engines" in p.reason for p in sync.plan), str(sync.plan)
            for version in (1, 2):
                expected = ray.get(trainer.step.remote(version))
                sync.push(version)
                assert [ray.get(e.digest.remote()) for e in engines] == [expected] * 3
                assert sync.versions() == [version] * 3


def test_ipc_1000_pushes_with_memory_flat(spawn, no_leftovers):
    got, digests, reserved = _ipc_push(
        spawn, sender_gpu=0, receiver_gpu=0, visible=None, layout="qwen2.5-0.5b", pushes=1000
    )
    assert {i: d for _, i, d in got[:-1]} == digests
    for side in (reserved, got[-1][3]):
        assert max(side[1:]) - min(side[1:]) <= IPC.bucket_bytes, side[:3] + side[-3:]


def test_ipc_sender_killed_mid_push_the_receiver_fails_in_time_and_unmaps(spawn, no_leftovers):
    import os
    import signal

    from workers import ipc_sender_forever

    from raysync import PeerLost, PushIncomplete, SessionSecret, WeightReceiver
    from raysync.core.version import MIXED
    from raysync.tools.models import allocate

    config = SyncConfig(transport="cuda_ipc", bucket_bytes=64 << 20, timeout_s=3, progress=False)
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    child = spawn(ipc_sender_forever, secret, config, "qwen2.5-0.5b", out)
    torch.cuda.set_device(0)
    dest = allocate("qwen2.5-0.5b", device="cuda", fill=False)
    receiver = WeightReceiver(out.get(timeout=120), secret, config)
    calls = []

    def kill_inside_push(batch):  # a load function: SIGKILL the sender while the third bucket lands
        calls.append(len(batch))
        if len(calls) == 3:
            os.kill(child.pid, signal.SIGKILL)
        for name, t in batch:
            dest[name].copy_(t)

    try:
        for _ in range(2):
            receiver.receive(into=dest)
        with pytest.raises(PushIncomplete) as e:
            receiver.receive(load_fn=kill_inside_push)
        cause = e.value.__cause__
        assert len(calls) >= 3  # the sender died inside this push
        assert isinstance(cause, PeerLost) and cause.peer.startswith(
            "sender"
        )  # its connection ended: at once
        assert receiver.version == MIXED and e.value.mixed
        free_before = torch.cuda.mem_get_info()[0]
    finally:
        receiver.close()
    torch.cuda.synchronize()
    child.join(timeout=30)
    free_after = torch.cuda.mem_get_info()[0]  # the dead sender's ring goes once we unmap it
    assert free_after - free_before >= config.num_buffers * config.bucket_bytes, (free_before, free_after)


# --- cuda_ipc, direct mode ---------------------------------------------------------------------------------------
DIRECT = SyncConfig(transport="cuda_ipc", direct=True, timeout_s=120, progress=False)


def test_direct_same_gpu_7b_bit_exact_allocates_nothing_per_push(spawn, no_leftovers):
    got, digests, reserved = _ipc_push(
        spawn, sender_gpu=0, receiver_gpu=0, visible=None, layout="qwen2.5-7b", pushes=200, config=DIRECT
    )
    assert {i: d for _, i, d in got[:-1]} == digests
    _, storage_gpu, receiver_gpu, receiver_reserved = got[-1]
    assert storage_gpu == receiver_gpu
    for side in (reserved, receiver_reserved):  # no ring, and a push allocates nothing
        assert max(side[1:]) - min(side[1:]) <= 2 << 20, side[:3] + side[-3:]


def test_direct_sender_killed_mid_push_the_push_lands_whole_then_the_next_fails_and_unmaps(
    spawn, no_leftovers
):
    """Direct mode reads the trainer's memory in place: a sender SIGKILLed after its PushStart leaves that
    memory mapped here, so the push it started lands whole (its values were ready, and its tensors checked,
    before PushStart: new tensor objects every push, Note [start, then check]); the next one fails (PeerLost:
    the sender's end of the channel closed), and closing gives the dead sender's memory back."""
    import os
    import signal

    from workers import ipc_sender_forever

    from raysync import PeerLost, SessionSecret, WeightReceiver
    from raysync.tools.models import allocate

    config = SyncConfig(transport="cuda_ipc", direct=True, timeout_s=3, progress=False)
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    child = spawn(ipc_sender_forever, secret, config, "qwen2.5-0.5b", out, True)
    torch.cuda.set_device(0)
    expected = allocate("qwen2.5-0.5b", device="cuda")  # what the sender pushes, every version
    dest = allocate("qwen2.5-0.5b", device="cuda", fill=False)
    receiver = WeightReceiver(out.get(timeout=120), secret, config)

    def kill_then_load(batch):  # direct mode: one load call per push, with every tensor
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
        assert not child.is_alive()
        for name, t in batch:
            dest[name].copy_(t)

    try:
        for _ in range(2):
            receiver.receive(into=dest)
        for t in dest.values():
            t.zero_()
        receiver.receive(load_fn=kill_then_load)
        assert receiver.version == 3
        assert all(torch.equal(dest[k], v) for k, v in expected.items())
        with pytest.raises(PeerLost) as e:  # the dead sender's end of the control channel is closed
            receiver.receive(into=dest)
        assert e.value.peer.startswith("sender")
        assert receiver.version == 3  # nothing of the push that never came was touched
        free_before = torch.cuda.mem_get_info()[0]
    finally:
        receiver.close()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]  # the dead trainer's tensors go once we unmap them
    model_bytes = sum(t.nbytes for t in expected.values())
    assert free_after - free_before >= model_bytes, (free_before, free_after, model_bytes)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_direct_cross_gpu_and_uuid_matching(spawn, no_leftovers):
    """The receiver on GPU 1 reads the trainer's tensors on GPU 0 over NVLink; then a sender working on
    GPU 1 of "0,1" and a receiver that sees only "1": the same physical GPU, found by UUID."""
    got, digests, _ = _ipc_push(
        spawn, sender_gpu=0, receiver_gpu=1, visible=None, layout="qwen2.5-1.5b", pushes=3, config=DIRECT
    )
    assert {i: d for _, i, d in got[:-1]} == digests
    got, digests, _ = _ipc_push(
        spawn, sender_gpu=1, receiver_gpu=0, visible="1", layout="qwen2.5-0.5b", pushes=1, config=DIRECT
    )
    assert got[0][2] == digests[0]
    assert got[-1][1] == got[-1][2] == str(torch.cuda.get_device_properties(1).uuid)


def test_direct_tensors_that_move_are_shared_again_verified_and_a_strided_one_is_refused(spawn, no_leftovers):
    import dataclasses

    from workers import digest, ipc_receiver

    from raysync import LayoutError, SessionSecret, WeightSender
    from raysync.tools.models import allocate

    torch.cuda.set_device(0)
    config = dataclasses.replace(DIRECT, verify=True)
    src = allocate("qwen2.5-0.5b", device="cuda")
    moved = {k: v + 1 for k, v in src.items()}  # new storages, same layout (a model rebuilt by the trainer)
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    with WeightSender(secret, config) as sender:
        spawn(ipc_receiver, sender.endpoint, secret, config, 0, None, "qwen2.5-0.5b", 2, out)
        sender.push(src.items(), 1)
        sender.push(moved.items(), 2)
        got = [out.get(timeout=300) for _ in range(3)]
        assert got[0][2] == digest(src.items(), on_device=True)
        assert got[1][2] == digest(moved.items(), on_device=True)
        strided = {k: v.t() if v.ndim == 2 else v for k, v in src.items()}
        with pytest.raises(LayoutError, match="direct mode .* is not contiguous"):
            sender.push(strided.items(), 3)


def test_direct_tensors_that_move_under_the_same_objects_are_caught_after_push_start(spawn, no_leftovers):
    """Note [start, then check]: the trainer pushes the same tensor objects, so their check runs after PushStart;
    when some moved meanwhile (``.data`` given new storages), the receiver drops what it read, within the same
    receive, and the push starts again with the new storages: verified, and bit-exact after the third receive."""
    import dataclasses

    from workers import digest, ipc_receiver

    from raysync import SessionSecret, WeightSender
    from raysync.core.wire import Checked
    from raysync.tools.models import allocate

    torch.cuda.set_device(0)
    config = dataclasses.replace(DIRECT, verify=True)
    src = allocate("qwen2.5-0.5b", device="cuda")
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    with WeightSender(secret, config) as sender:
        spawn(ipc_receiver, sender.endpoint, secret, config, 0, None, "qwen2.5-0.5b", 3, out)
        sender.push(src.items(), 1)
        checks = []  # the Checked the sender sends (read, not replaced: every message still goes out)
        channel = sender._channel.channels[0]
        send = channel.send

        def send_and_note(msg, stage):
            if isinstance(msg, Checked):
                checks.append(msg)
            send(msg, stage)

        channel.send = send_and_note
        sender.push(src.items(), 2)
        for name in list(src)[:3]:
            t = src[name]
            t.data = t.data + 1  # the same object, new storage
        sender.push(src.items(), 3)
        got = [out.get(timeout=300) for _ in range(3)]
    assert [(c.push_id, c.same) for c in checks] == [(2, True), (3, False)]
    assert got[1][:2] == ("digest", 2)
    assert got[1][2] == digest(src.items(), on_device=True)


def test_the_quick_ipc_probe_agrees_with_torchs_and_a_wrong_offset_is_not_ok():
    """Note [the quick IPC probe]: the child without torch opens the same export as the torch child, and reads
    the bytes the parent wrote (a wrong offset reads other bytes: not "ipc ok")."""
    import dataclasses

    from raysync.transport.cuda_ipc import _quick_probe, _torch_probe, export

    torch.cuda.set_device(0)
    probe = torch.arange(256, dtype=torch.uint8, device="cuda")
    event = torch.cuda.Event(interprocess=True)
    event.record()
    shared = export(probe, event)
    torch.cuda.current_stream().synchronize()
    assert _quick_probe(shared, 0, 60) and _torch_probe(shared, 60)
    moved = dataclasses.replace(shared, tensor_offset=shared.tensor_offset + 1)
    assert not _quick_probe(moved, 0, 60)
