"""GPU paths of the core (run on the device machine; skipped where there is no CUDA)."""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits, session_pair

from raysync import SyncConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
    dest = {k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() and k != "w" else v.dtype,
                           device="cuda") for k, v in src.items()}  # fmt: skip
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
        assert all(m._pinned for m in sender._ring._maps) and all(m._pinned for m in receiver._ring._maps)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_between_two_gpus_bit_exact(spawn):
    from workers import digest, nccl_receiver

    from raysync import SessionSecret
    from raysync.models import tiny_qwen2
    from raysync.transport.collective import CollectiveSender

    torch.cuda.set_device(0)
    config = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)  # the embedding is sliced
    secret = SessionSecret.generate()
    sender = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=1, backend="nccl")
    out = spawn.ctx.Queue()
    spawn(nccl_receiver, secret, config, 1, sender.rendezvous, 2, out)
    sender.join()
    model = tiny_qwen2(seed=0).cuda()
    try:
        for version in (1, 2):
            perturb_on_gpu(model, version)
            sender.push(model.named_parameters(), version)
            rank, got_version, got = out.get(timeout=120)
            assert (rank, got_version) == (1, version)
            assert got == digest((n, p.cpu()) for n, p in model.named_parameters())
    finally:
        sender.close()


def perturb_on_gpu(model, version: int) -> None:
    with torch.no_grad():
        g = torch.Generator(device="cuda").manual_seed(version)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device="cuda"))
