"""LoRA adapters through WeightSync over CUDA IPC (issue 23): a trainer actor and a torch engine actor sharing one
GPU (num_gpus=0.5 each), so the plan picks cuda_ipc. Self-contained: torch, Ray and raysync only (the PEFT-style
model is built by hand in tests/test_lora.py: no PEFT, no transformers, no vLLM)."""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits
from test_lora import LORA
from test_lora_sync import LoraServer, LoraTrainer

from raysync import SyncConfig, WeightSync
from raysync.engines.torch_lora import TorchLoraEngine
from raysync.sources.lora import AdapterOf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_adapter_over_cuda_ipc_lands_bit_exact_and_a_running_request_keeps_its_version(ray_gpu):
    import ray

    opts = {"num_gpus": 0.5, "num_cpus": 0.25}
    trainer = ray.remote(**opts)(LoraTrainer).remote(seed=7, device="cuda")
    server = ray.remote(**opts)(LoraServer).remote(seed=7, device="cuda")
    config = SyncConfig(bucket_bytes=4096, timeout_s=120, progress=False)
    with WeightSync([trainer], [TorchLoraEngine(server)], config, source=AdapterOf(LORA)) as sync:
        assert [(p.transport, p.reason) for p in sync.plan] == [("cuda_ipc", "same GPU")], str(sync.plan)
        adapter, manifest = ray.get(trainer.adapter_bytes.remote())
        outputs = {}
        for version in (1, 2):
            ray.get(trainer.train.remote(steps=2, seed=version))
            report = sync.push(version)
            assert [p.bytes for p in report.pairs] == [adapter + manifest], str(sync.plan)
            sent, got = ray.get([trainer.lora_tensors.remote(), server.lora_tensors.remote()])
            assert sent.keys() == got.keys() and all(same_bits(got[n], t) for n, t in sent.items())
            outputs[version] = ray.get(trainer.forward.remote())
            got_version, out = ray.get(server.forward.remote())
            assert got_version == version
            torch.testing.assert_close(out, outputs[version])  # kernels of two processes: close, not equal
            if version == 1:
                first_step = ray.get(server.start.remote())  # a request on version 1, through push 2
                assert first_step[0] == 1
        assert ray.get(server.versions.remote()) == {1: 1, 2: 0}
        version, out = ray.get(server.step.remote())
        assert version == 1 and same_bits(out, first_step[1])  # its next step: still version 1
        assert not same_bits(out, ray.get(server.forward.remote())[1])  # new requests: version 2
        ray.get(server.finish.remote())
        assert ray.get(server.versions.remote()) == {2: 0}
        assert sync.versions() == [2]
    for actor in (trainer, server):
        ray.kill(actor)
