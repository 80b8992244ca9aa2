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
from vllm_cpu import EngineProcesses, engine, require_vllm_cpu, stop

ray = require_vllm_cpu()

import torch  # noqa: E402
from actors import ENGINE_ARGS, VllmHost, greedy  # noqa: E402
from test_vllm import CFG, ONE_PROCESS, PROMPTS, TOKENS, refusal  # noqa: E402
from workers import perturb  # noqa: E402

from raysync import WeightSync  # noqa: E402
from raysync.engines.vllm import VllmEngine, WorkerExtension  # noqa: E402
from raysync.engines.vllm_reload import refusal as reload_refusal  # noqa: E402

pytestmark = pytest.mark.vllm


def tiny_moe(seed: int) -> torch.nn.Module:
    """A small Qwen2-MoE (transformers, random init): 4 experts, 2 per token, a shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
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


class SwitchableLoads(WorkerExtension):
    """raysync's worker extension, with the way it loads a push chosen by the test (one engine serves every test
    of this module): "staged" (the CPU default), "bucket-by-bucket" (through vLLM's layerwise reload, the GPU
    path), or "without-layerwise" (the refusal raysync's rule gives this engine on a vLLM without layerwise
    reload)."""

    def raysync_test_load(self, how: str) -> None:
        assert how in ("staged", "bucket-by-bucket", "without-layerwise"), how
        self.raysync_cpu_staged = how == "staged"
        self._raysync_test_without_layerwise = how == "without-layerwise"

    def raysync_reload_refusal(self) -> str | None:
        if self.__dict__.get("_raysync_test_without_layerwise"):
            return reload_refusal(self.model_runner, layerwise=False, on_cpu=self.device.type == "cpu")
        return super().raysync_reload_refusal()


class MoeHost(VllmHost):
    def __init__(self, model_dir: str):
        from vllm import LLM

        self.llm = LLM(model_dir, worker_extension_cls="test_vllm_reload.SwitchableLoads", **ENGINE_ARGS)

    def load(self, how: str) -> None:
        self.llm.collective_rpc("raysync_test_load", args=(how,))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """The engines' starting checkpoint: another random init than the trainer's."""
    path = str(tmp_path_factory.mktemp("tiny-qwen2-moe"))
    tiny_moe(seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_engine(ray_local, moe_dir):
    """The module's MoE engine (pushed to by every test: one engine start), and what it generated at its start."""
    host = engine(moe_dir, ONE_PROCESS, host=MoeHost)
    yield host, ray.get(host.generate.remote(PROMPTS, TOKENS))
    stop([host], EngineProcesses())


@pytest.fixture(scope="module")
def from_disk(ray_local, tmp_path_factory) -> list[list[int]]:
    """What an engine started from the trainer's weights after versions 1 and 2 generates: vLLM's own load and
    processing of them (that engine is stopped before the tests run)."""
    trainer = MoePolicy(seed=0)
    for version in (1, 2):
        trainer.step(version)
    path = str(tmp_path_factory.mktemp("tiny-qwen2-moe-v2"))
    trainer.save(path)
    loaded = engine(path, ONE_PROCESS)
    try:
        return ray.get(loaded.generate.remote(PROMPTS, TOKENS))
    finally:
        stop([loaded], EngineProcesses())


@pytest.mark.parametrize("how", ["staged", "bucket-by-bucket"], ids=["staged", "layerwise-bucket-by-bucket"])
def test_a_pushed_moe_engine_generates_as_one_started_from_the_same_weights_on_disk(
    how, ray_local, moe_engine, from_disk, no_leftovers
):
    pushed, start = moe_engine
    ray.get(pushed.load.remote(how))
    trainer = ray.remote(num_cpus=0.25)(MoePolicy).remote(seed=0)
    with WeightSync([trainer], [VllmEngine(pushed)], CFG) as sync:
        for version in (1, 2):  # the second reloads what the first processed
            ray.get(trainer.step.remote(version))
            assert sync.push(version).pairs[0].bytes > 0
        assert sync.versions() == [2]
    got = ray.get(pushed.generate.remote(PROMPTS, TOKENS))
    assert got == from_disk
    assert got == ray.get(trainer.greedy.remote(PROMPTS, TOKENS))  # and both are transformers' tokens
    assert got != start


def test_an_engine_whose_processing_cannot_be_redone_refuses_every_push_untouched(
    ray_local, moe_engine, moe_dir, no_leftovers
):
    host, _ = moe_engine
    before = ray.get(host.generate.remote(PROMPTS, TOKENS))
    held = ray.get(host.weight_version.remote())
    ray.get(host.load.remote("without-layerwise"))
    try:
        trainer = ray.remote(num_cpus=0.25)(MoePolicy).remote(seed=0)
        with WeightSync([trainer], [VllmEngine(host)], CFG) as sync:
            ray.get(trainer.step.remote(3))
            text = refusal(sync, 3, "accept")  # before a byte moved
            assert "no layerwise reload" in text and "CPU backend" in text and moe_dir in text, text
            assert sync.versions() == [None]  # refused at accept: this session applied nothing, not mixed
    finally:
        ray.get(host.load.remote("staged"))
    assert ray.get(host.weight_version.remote()) == held  # the version the engine held, untouched
    assert ray.get(host.generate.remote(PROMPTS, TOKENS)) == before
