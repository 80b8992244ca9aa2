"""Two real processes: a transformers model pushed bit-exact, and SIGKILLs of either side mid-push."""

from __future__ import annotations

import os
import signal
import socket

import pytest
import torch
from conftest import session_pair
from workers import StagingLoader, digest, model_receiver, pausing_receiver, perturb, plain_sender

from raysync import (
    PeerLost,
    PushIncomplete,
    SessionSecret,
    SyncConfig,
    WeightReceiver,
    WeightSender,
)
from raysync.core.version import MIXED

pytest.importorskip("transformers")


@pytest.mark.parametrize("mode", ["into", "load_fn"])
def test_transformers_model_bit_exact_over_several_pushes(private_tmp, spawn, mode):
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    embed = model.model.embed_tokens.weight
    config = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)
    assert embed.nbytes > 3 * config.bucket_bytes  # the embedding is sliced over several buckets
    secret = SessionSecret.generate()
    out = spawn.ctx.Queue()
    with WeightSender(secret, config) as sender:
        receiver = spawn(model_receiver, sender.endpoint, secret, config, 3, mode, out)
        for version in (1, 2, 3):
            perturb(model, version)
            report = sender.push(model.named_parameters(), version)
            got_version, got = out.get(timeout=60)
            assert got_version == version and report.tensors == len(got)
            assert got == digest(model.named_parameters())  # every tensor, bit for bit
        receiver.join(timeout=30)
        assert receiver.exitcode == 0


def test_sigkill_receiver_mid_push(private_tmp, spawn, in_thread, capfd):
    config = SyncConfig(bucket_bytes=16 << 10, timeout_s=2, progress=False)
    src = {f"t{i}": torch.randn(4096) for i in range(8)}
    secret = SessionSecret.generate()
    out, release = spawn.ctx.Queue(), spawn.ctx.Event()
    with WeightSender(secret, config) as sender:
        child = spawn(pausing_receiver, sender.endpoint, secret, config, 2, out, release)
        assert out.get(timeout=60) == "connecting"
        sender.push(src.items(), 1)
        assert out.get(timeout=30) == "first push done"

        def kill_when_paused():
            assert out.get(timeout=30) == "paused"
            os.kill(child.pid, signal.SIGKILL)

        killer = in_thread(kill_when_paused)
        with pytest.raises(PeerLost, match="receiver.*wait for buffer|receiver.*finish") as e:
            sender.push(src.items(), 2)  # its connection ended: told at once, not after timeout_s
        killer.result(timeout=30)
        assert e.value.peer == f"receiver(pid {child.pid} on {socket.gethostname()})"  # the one that died
    child.join(timeout=10)
    assert child.exitcode == -signal.SIGKILL
    _next_session_works(in_thread)
    assert "resource_tracker" not in capfd.readouterr().err


class Killer:
    """Called in every bucket a load function gets: SIGKILLs the sender (a real process) in the second."""

    def __init__(self, victim: int, at: int = 2):
        self.victim, self.at, self.calls = victim, at, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            os.kill(self.victim, signal.SIGKILL)


def loader_that_kills(dest: dict[str, torch.Tensor], kill: Killer, staged: bool):
    """A load function writing ``dest`` in place as buckets land, or a staging one (applied by ``finish``)."""
    if staged:

        class Staging(StagingLoader):
            def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
                kill()
                super().__call__(batch)

        return Staging(dest)

    def in_place(batch: list[tuple[str, torch.Tensor]]) -> None:
        kill()
        with torch.no_grad():
            for name, t in batch:
                dest[name].copy_(t)

    return in_place


def _receive_while_the_sender_dies(
    receiver: WeightReceiver, dest: dict[str, torch.Tensor], victim: int, staged: bool
) -> None:
    """The second push of a session, the sender SIGKILLed in its second bucket: the receiver's wait for the
    next bucket ends at once (its connection ended) with a PushIncomplete caused by a PeerLost naming the
    sender, and its version says what the destinations hold (Note [versions never lie])."""
    kill = Killer(victim)
    with pytest.raises(PushIncomplete, match="not delivered") as e:
        receiver.receive(load_fn=loader_that_kills(dest, kill, staged))
    assert kill.calls >= kill.at  # the sender died inside this push, not before it
    cause = e.value.__cause__
    assert isinstance(cause, PeerLost) and cause.peer.startswith("sender")
    assert e.value.undelivered and e.value.mixed is (not staged)
    assert receiver.version == (1 if staged else MIXED)
    assert ("mix of old and new weights" in str(e.value)) is (not staged)


@pytest.mark.parametrize("staged", [False, True], ids=["in place", "staged load_fn"])
def test_sigkill_sender_mid_push(private_tmp, spawn, in_thread, capfd, staged):
    config = SyncConfig(bucket_bytes=16 << 10, timeout_s=2, progress=False)
    secret = SessionSecret.generate()
    out = spawn.ctx.Queue()
    child = spawn(plain_sender, secret, config, out)
    endpoint = out.get(timeout=30)
    dest = {f"t{i}": torch.zeros(4096) for i in range(8)}
    with WeightReceiver(endpoint, secret, config) as receiver:
        receiver.receive(into=dest)
        assert out.get(timeout=30) == 1
        _receive_while_the_sender_dies(receiver, dest, child.pid, staged)
    child.join(timeout=10)
    assert child.exitcode == -signal.SIGKILL
    _next_session_works(in_thread)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("staged", [False, True], ids=["in place", "staged load_fn"])
def test_cuda_ipc_sender_sigkilled_mid_push_leaves_mixed_unless_staged(spawn, no_leftovers, staged):
    from workers import ipc_sender_forever

    from raysync.tools.models import allocate

    config = SyncConfig(transport="cuda_ipc", bucket_bytes=64 << 10, timeout_s=3, progress=False)
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    child = spawn(ipc_sender_forever, secret, config, "qwen2-tiny", out)
    torch.cuda.set_device(0)
    dest = allocate("qwen2-tiny", device="cuda", fill=False)
    with WeightReceiver(out.get(timeout=120), secret, config) as receiver:
        receiver.receive(into=dest)
        assert receiver.version == 1
        _receive_while_the_sender_dies(receiver, dest, child.pid, staged)
    child.join(timeout=30)


def _next_session_works(in_thread) -> None:
    config = SyncConfig(bucket_bytes=4096, timeout_s=5, progress=False)
    src = {"w": torch.randn(3000)}
    dest = {"w": torch.zeros(3000)}
    with session_pair(config) as (sender, receiver):
        got = in_thread(receiver.receive, into=dest)
        sender.push(src.items(), 1)
        assert got.result(timeout=30).version == 1
    assert torch.equal(dest["w"], src["w"])
