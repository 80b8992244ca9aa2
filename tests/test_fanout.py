"""Fan-out (issue 20, item 3): one sender, N receivers reading one ring (shm; cuda_ipc on a GPU) or, direct, the
trainer's tensors; each bucket packed once."""

from __future__ import annotations

import pytest
import torch

from raysync import PushIncomplete, RemoteError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core import stream

CFG = SyncConfig(bucket_bytes=4096, num_buffers=2, timeout_s=30, progress=False, transport="shm")
NAMES = [f"w{i}" for i in range(7)]  # 7 tensors of 4 KB and one of 10 KB: sliced over buckets


def weights(v: float) -> dict[str, torch.Tensor]:
    out = {n: torch.full((1024,), v + i) for i, n in enumerate(NAMES)}
    out["big"] = torch.arange(2560, dtype=torch.float32) * v
    return out


def zeros() -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in weights(1.0).items()}


@pytest.mark.parametrize("verify", [False, True])
def test_one_pack_per_bucket_serves_three_receivers_bit_exact(in_thread, verify):
    config = SyncConfig(**{**CFG.__dict__, "verify": verify})
    secret = SessionSecret.generate()
    with WeightSender(secret, config, receivers=3) as sender:
        receivers = [WeightReceiver(e, secret, config) for e in sender.endpoints]
        dests = [zeros() for _ in receivers]
        try:
            for version in (1, 2, 3):
                got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
                report = sender.push(weights(float(version)).items(), version)
                assert [g.result(timeout=30).version for g in got] == [version] * 3
                assert report.buckets > 2 * CFG.num_buffers  # the ring wrapped around: frees came from all 3
                assert sender.packed_buckets == report.buckets  # packed once, not once per receiver
                for d in dests:
                    assert all(torch.equal(d[n], t) for n, t in weights(float(version)).items())
            got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
            assert sender.push(weights(3.0).items(), 3).skipped  # all three have version 3
            assert all(g.result(timeout=30).skipped for g in got)
        finally:
            for r in receivers:
                r.close()


def test_a_receiver_that_refuses_stops_the_push_for_all_before_any_byte(in_thread):
    secret = SessionSecret.generate()
    with WeightSender(secret, CFG, receivers=3) as sender:
        receivers = [WeightReceiver(e, secret, CFG) for e in sender.endpoints]
        dests = [zeros() for _ in receivers]
        try:
            got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
            sender.push(weights(1.0).items(), 1)
            assert [g.result(timeout=30).version for g in got] == [1, 1, 1]
            dests[1]["w3"] = torch.zeros(5)  # receiver 1's destinations no longer fit
            got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
            with pytest.raises(RemoteError, match="w3"):
                sender.push(weights(2.0).items(), 2)
            errors = [g.exception(timeout=30) for g in got]
            assert all(isinstance(e, PushIncomplete) and e.stage.endswith("accept") for e in errors), errors
            assert [r.version for r in receivers] == [1, 1, 1]  # nothing touched anywhere
            assert all(torch.equal(d["w0"], weights(1.0)["w0"]) for d in dests)
            dests[1]["w3"] = torch.zeros(1024)  # fixed: the next push lands everywhere
            got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
            sender.push(weights(3.0).items(), 3)
            assert [g.result(timeout=30).version for g in got] == [3, 3, 3]
            assert all(torch.equal(d["big"], weights(3.0)["big"]) for d in dests)
        finally:
            for r in receivers:
                r.close()


def test_fan_out_is_refused_where_it_is_not_built():
    secret = SessionSecret.generate()
    with pytest.raises(ValueError, match="1 when an endpoint is given"):
        WeightSender(secret, CFG, endpoint="ipc:///tmp/x", receivers=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "direct, verify", [(False, False), (True, False), (True, True)], ids=["ring", "direct", "direct verified"]
)
def test_three_engines_read_one_cuda_ipc_ring_or_the_trainers_tensors(spawn, no_leftovers, direct, verify):
    """Fan-out over CUDA IPC: three engine processes on the trainer's GPU read one ring (each bucket packed
    once) or, direct, the trainer's own tensors, in turns; every push lands bit-exact in all three."""
    from workers import digest, ipc_receiver

    from raysync.tools.models import allocate

    torch.cuda.set_device(0)
    config = SyncConfig(
        transport="cuda_ipc",
        direct=direct,
        bucket_bytes=64 << 20,
        timeout_s=120,
        progress=False,
        verify=verify,
    )
    src = allocate("qwen2.5-0.5b", device="cuda")
    secret, out, pushes = SessionSecret.generate(), spawn.ctx.Queue(), 3
    with WeightSender(secret, config, receivers=3) as sender:
        for e in sender.endpoints:
            spawn(ipc_receiver, e, secret, config, 0, None, "qwen2.5-0.5b", pushes, out)
        for version in range(1, pushes + 1):
            for i, t in enumerate(src.values()):
                t.add_(version + i % 3)
            report = sender.push(src.items(), version)
            assert sender.packed_buckets == (0 if direct else report.buckets)  # once for all three
        want = digest(src.items(), on_device=True)
        got = [out.get(timeout=300) for _ in range(3 * 3)]
    last = [m[2] for m in got if m[0] == "digest" and m[1] == pushes - 1]
    assert len(last) == 3 and all(d == want for d in last)
    assert sum(m[0] == "done" for m in got) == 3


def test_readers_of_the_trainers_tensors_take_turns_only_all_on_one_gpu():
    """Note [readers in turns]: the chain the DirectSources name, from the readers' Attached."""
    from raysync.core.wire import Attached
    from raysync.transport.cuda_ipc_direct import turns

    a, b, c = (Attached((bytes([i]) * 64,), "GPU-a") for i in range(3))
    assert turns([a, b, c], 3) == (a.events[0], b.events[0], c.events[0])  # in reader order
    assert turns([a], 1) == ()  # one reader: nobody to wait for
    assert turns([a, b], 3) == ()  # not all attached
    assert turns([a, Attached(b.events, "GPU-b"), c], 3) == ()  # readers on two GPUs copy at once
    assert turns([a, Attached(b.events, ""), c], 3) == ()  # a reader that did not say its GPU
    assert turns([a, Attached((), "GPU-a"), c], 3) == ()  # nor its event


def _direct_readers(n: int):
    """The sender's half of direct mode over ``n`` real control channels, the readers' Attached on one GPU: only
    what taking turns uses of it (no GPU here, so the CUDA half of the plane is not made)."""
    import os
    import socket

    from raysync.core.control import ReceiverChannel, SenderChannel
    from raysync.core.fanout import Fanout
    from raysync.core.wire import Attached, Hello
    from raysync.transport.cuda_ipc_direct import CudaIpcDirectSender

    secret = SessionSecret.generate()
    ends = [
        SenderChannel(secret, endpoint=None, allow_any_interface=False, timeout_s=5, max_frame_bytes=1 << 20)
        for _ in range(n)
    ]
    readers = [
        ReceiverChannel(secret, endpoint=e.endpoint, timeout_s=5, max_frame_bytes=1 << 20) for e in ends
    ]
    for r, e in zip(readers, ends, strict=True):
        r.send(Hello(os.getpid(), socket.gethostname()), "handshake")
        e.accept()
    plane = object.__new__(CudaIpcDirectSender)
    plane.readers, plane._channel = n, Fanout(ends)
    plane._attached = [Attached((bytes([k]) * 64,), "GPU-a") for k in range(n)]
    return plane, readers


def test_readers_in_turns_hear_the_go_one_after_another_and_a_failed_turn_aborts_the_rest(in_thread):
    """Note [readers in turns], the sender's half over real channels: reader k hears the go only once reader
    k - 1 said Queued; a reader that fails instead stops the push for those still waiting."""
    from raysync.core.wire import Accept, Queued

    plane, readers = _direct_readers(3)
    try:
        go = Accept(7, False, False)
        relay = in_thread(plane.send_go, go, "accept: the go")
        assert readers[0].expect(Accept, 7, "the go") == go
        assert not stream.ready([readers[1].conn], 0)  # not before reader 0 has queued its copies
        readers[0].send(Queued(7), "queued")
        assert readers[1].expect(Accept, 7, "the go") == go
        assert not stream.ready([readers[2].conn], 0)
        readers[1].send(Queued(7), "queued")
        assert readers[2].expect(Accept, 7, "the go") == go
        assert relay.result(timeout=10) is None

        relay = in_thread(plane.send_go, Accept(8, False, False), "accept: the go")
        assert readers[0].expect(Accept, 8, "the go").push_id == 8
        readers[0].abort(8, "unpack", RuntimeError("reader 0 broke"))
        with pytest.raises(RemoteError, match="reader 0 broke"):
            relay.result(timeout=10)
        with pytest.raises(RemoteError, match="reader 0 broke"):  # told, not left to wait for its go
            readers[2].expect(Accept, 8, "the go")
    finally:
        for r in readers:
            r.close()
        for c in plane._channel.channels:
            c.close()
