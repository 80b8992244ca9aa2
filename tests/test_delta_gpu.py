"""Delta pushes on one GPU (issue 24): over a cuda_ipc ring they arrive bit-exact as a fraction of the bytes;
in direct mode (the receiver copies the trainer's tensors in place) every push goes full, and the session
says why (Note [the delta reference] in raysync.core.delta_push)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from workers import digest, ipc_receiver

from raysync import SessionSecret, SyncConfig, WeightSender
from raysync.core import delta, delta_workspace
from raysync.core.delta_encode import encode
from raysync.core.errors import BadDelta
from raysync.tools.models import allocate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LAYOUT = "qwen2.5-0.5b"


@contextlib.contextmanager
def engine_on_gpu0(spawn, config: SyncConfig, pushes: int):
    """A sender here and an engine process, both on GPU 0, for ``pushes`` pushes of LAYOUT: (the sender, its
    tensors, their bytes, the engine's queue, the engine's process)."""
    torch.cuda.set_device(0)
    named = allocate(LAYOUT, device="cuda")
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    with WeightSender(secret, config) as sender:
        child = spawn(ipc_receiver, sender.endpoint, secret, config, 0, None, LAYOUT, pushes, out)
        yield sender, named, sum(t.nbytes for t in named.values()), out, child


@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_deltas_over_a_cuda_ipc_ring_and_full_pushes_in_direct_mode(spawn, no_leftovers, direct):
    config = SyncConfig(
        transport="cuda_ipc", direct=direct, delta=True, timeout_s=120, progress=False, delta_by_time=False
    )
    with engine_on_gpu0(spawn, config, 3) as (sender, named, full, out, child):
        for version in (1, 2, 3):
            for t in named.values():  # a few elements of every tensor change
                t.view(-1)[version::997].add_(1.0)
            report = sender.push(named.items(), version)
            if direct:
                assert report.base_version is None and report.bytes == full
                assert "direct mode" in sender.delta_off
            elif version > 1:
                assert report.base_version == version - 1 and report.bytes < full / 4
        assert sender.delta_off is None or direct
        got = [out.get(timeout=120) for _ in range(3)]
    assert got[1][:2] == ("digest", 2) and got[1][2] == digest(named.items(), on_device=True)
    child.join(timeout=60)
    assert child.exitcode == 0


def test_under_the_time_rule_a_ring_read_on_the_trainers_gpu_pushes_full_without_a_measuring_delta(
    spawn, no_leftovers
):
    """On one GPU a cuda_ipc ring's full push is two device copies, which a delta's compare costs alone: the
    session says so at set-up and sends no delta, not even the one that would measure (Note [the delta
    reference])."""
    config = SyncConfig(transport="cuda_ipc", delta=True, timeout_s=120, progress=False)
    with engine_on_gpu0(spawn, config, 4) as (sender, named, full, out, child):
        for version in (1, 2, 3, 4):
            for t in named.values():
                t.view(-1)[version::997].add_(1.0)
            report = sender.push(named.items(), version)
            assert report.base_version is None and report.bytes == full, version
        assert "two device copies" in sender.delta_off
        got = [out.get(timeout=120) for _ in range(3)]
    assert got[1][:2] == ("digest", 3) and got[1][2] == digest(named.items(), on_device=True)
    child.join(timeout=60)
    assert child.exitcode == 0


@pytest.mark.parametrize("buffers", [1, 2])
def test_deltas_over_shm_from_the_trainers_gpu_find_each_next_buckets_changes_while_a_bucket_crosses(
    spawn, no_leftovers, buffers
):
    """bf16 tensors on the GPU, read in place, to an engine over a host ring of one or two buffers: every
    bucket after the first has its changes found while the one before crosses to the host (Note [the next
    bucket's compare overlaps this one's copy]) and is encoded into a staging buffer before the one before is
    published (Note [a bucket is encoded while the one before crosses]), and each verified push arrives
    bit-exact as a delta on the last version."""
    config = SyncConfig(
        num_buffers=buffers,
        transport="shm",
        delta=True,
        delta_by_time=False,
        verify=True,
        bucket_bytes=64 << 20,
        timeout_s=120,
        progress=False,
    )
    with engine_on_gpu0(spawn, config, 4) as (sender, named, full, out, child):
        for version in (1, 2, 3, 4):
            for t in named.values():
                t.view(-1)[version::997].add_(1.0)
            report = sender.push(named.items(), version)
            if version > 1:
                assert report.base_version == version - 1 and report.bytes < full / 4, report
                assert sender._delta.stages  # Note [a bucket is encoded while the one before crosses]
                assert sender._delta.found_ahead == report.buckets - 1 > 1, (
                    sender._delta.found_ahead,
                    report,
                )
        got = [out.get(timeout=120) for _ in range(3)]
    assert got[1][:2] == ("digest", 3) and got[1][2] == digest(named.items(), on_device=True)
    child.join(timeout=60)
    assert child.exitcode == 0


def test_a_bucket_copied_in_ahead_decodes_as_decode_copies_it_and_a_header_past_the_buffer_starts_no_copy():
    """``delta.copy_in`` starts the host -> GPU copy before the destinations are made (the receiver's sink), on
    a copy stream: decoding with it writes what decoding without it writes, also when that stream is held back
    (decode's kernels wait for the copy, not for the host); a header that claims more bytes than its buffer starts
    no copy, and decode refuses the bucket before writing anything."""
    gen = torch.Generator().manual_seed(5)
    old = torch.randn(3 * delta.GAP_SPAN + 7, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[::13] += 1.0
    buffer = torch.zeros(delta.capacity([(new.numel(), 2)]), dtype=torch.uint8).pin_memory()
    encode([(old, new)], buffer, base_version=1)
    cuda = torch.device("cuda", 0)
    ahead, plain = old.to(cuda), old.to(cuda)
    stream = delta_workspace.side_stream("copy in", cuda)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: the copy in queues behind it
    moved = delta.copy_in(buffer, cuda)
    assert moved is not None and moved[0].device.type == "cuda"
    delta.decode(buffer, [ahead], held_version=1, moved=moved)
    delta.decode(buffer, [plain], held_version=1)
    torch.cuda.synchronize()
    assert torch.equal(ahead.view(torch.int16), new.to(cuda).view(torch.int16))
    assert torch.equal(plain.view(torch.int16), ahead.view(torch.int16))
    buffer[24:32].view(torch.int64)[0] = buffer.numel() + 16  # the header's count of bytes used
    assert delta.copy_in(buffer, cuda) is None
    dest = old.to(cuda)
    with pytest.raises(BadDelta):
        delta.decode(buffer, [dest], held_version=1)
    assert torch.equal(dest.view(torch.int16), old.to(cuda).view(torch.int16))


def test_the_copies_in_of_a_delta_push_are_cut_from_one_reservation():
    """``reserve_copy_in`` (a session's first delta, the receiver's sink) has torch's caching allocator hold the
    bytes for the copy-in stream at once: the copies in of buckets of varied sizes, two in flight, then take
    nothing more from the driver, where each size not cached yet took a cudaMalloc of its own in the first delta
    push (Note [the first delta push's one-time work])."""
    cuda = torch.device("cuda", 0)
    delta_workspace._RESERVED.pop(cuda, None)  # this process's earlier tests may have reserved and freed
    torch.cuda.empty_cache()
    delta_workspace.reserve_copy_in(cuda, 128 << 20)
    reserved = torch.cuda.memory_reserved(cuda)
    host = torch.empty(32 << 20, dtype=torch.uint8).pin_memory()
    host[::4096] = 7
    in_flight = []
    for mib in (3, 7, 5, 31, 29, 30, 11):  # bytes used of a push's buckets, as a delta's vary
        moved, copied = delta_workspace.copy_in_stream(host[: mib << 20], cuda)
        copied.synchronize()
        assert int(moved[::4096].sum()) == 7 * ((mib << 20) // 4096)
        in_flight = [*in_flight, moved][-2:]
    assert torch.cuda.memory_reserved(cuda) == reserved
    delta_workspace.reserve_copy_in(cuda, 32 << 20)  # no more than held already: nothing new
    assert torch.cuda.memory_reserved(cuda) == reserved
