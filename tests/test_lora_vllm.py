"""LoRA adapters through WeightSync into a real vLLM engine (its CPU build, LoRA enabled, vLLM's default processes:
EngineCore and a worker), issue 23: ``VllmEngine(actor, lora="adapters")``. The trainer is a transformers Qwen2
with PEFT-style adapters built by hand (tests/test_lora.py; PEFT is no dependency); after each push vLLM's greedy
tokens with the adapter equal the trainer's. One engine for the module (its start costs tens of seconds here)."""

from __future__ import annotations

import pytest
from vllm_cpu import require_vllm_cpu

ray = require_vllm_cpu()

import torch  # noqa: E402
from actors import ENGINE_ARGS, greedy  # noqa: E402
from test_lora import PROMPTS, QWEN_LORA, lora_qwen2, train_qwen2  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.engines.vllm import VllmEngine  # noqa: E402
from raysync.sources.lora import AdapterOf, LoraConfig, LoraSource  # noqa: E402
from raysync.tools.models import tiny_qwen2  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=120, progress=False)
WIDE = LoraConfig(r=16, alpha=16, target_modules=("q_proj", "v_proj"))  # over the engine's max_lora_rank 8
TOKENS = 8


class PeftStyle(torch.nn.Module):
    """PEFT's naming of a wrapped model: ``base_model.model.<the model's names>``."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = model


class LoraPolicy:
    """A user's trainer actor: a Qwen2 with an adapter of rank 4 (``model``), another of rank 16 (``wide``)."""

    def __init__(self, seed: int):
        self.model = PeftStyle(lora_qwen2(seed))
        self.wide = PeftStyle(lora_qwen2(seed, config=WIDE))

    def train(self, steps: int, seed: int) -> None:
        train_qwen2(self.model.base_model.model, steps, seed)

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return greedy(self.model.base_model.model, prompts, tokens)

    def adapter_bytes(self) -> int:
        source = LoraSource(self.model.named_parameters(), QWEN_LORA)
        return source.adapter_bytes() + source.manifest_bytes


class LoraRollout:
    """A user's rollout actor: vLLM with LoRA enabled and raysync's LoRA worker extension; requests take the
    latest adapter version (``adapters``)."""

    def __init__(self, model_dir: str):
        from vllm import LLM

        from raysync.engines.vllm_lora import VllmAdapters

        self.llm = LLM(
            model_dir,
            worker_extension_cls="raysync.engines.vllm_lora.LoraWorkerExtension",
            enable_lora=True,
            max_lora_rank=8,
            max_loras=2,
            max_cpu_loras=3,
            **ENGINE_ARGS,
        )
        self.adapters = VllmAdapters(self.llm)
        self.running = None

    def generate(self, prompts, tokens: int, adapter: bool = True) -> tuple[int | None, list[list[int]]]:
        """Greedy tokens, with the latest adapter version (and that version) or the base weights alone."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        lease = self.adapters.request() if adapter else None
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                params,
                use_tqdm=False,
                lora_request=lease.lora_request if lease else None,
            )
        finally:
            if lease is not None:
                lease.close()
        return lease.version if lease else None, [list(o.outputs[0].token_ids) for o in outs]

    def start(self, prompt: list[int], tokens: int, steps: int) -> int:
        """A request on the latest version, run for ``steps`` engine steps (not finished): its version."""
        from vllm import SamplingParams

        lease = self.adapters.request()
        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        engine = self.llm.llm_engine
        engine.add_request("running", {"prompt_token_ids": prompt}, params, lora_request=lease.lora_request)
        for _ in range(steps):
            assert not any(o.finished for o in engine.step())
        self.running = lease
        return lease.version

    def finish(self) -> list[int]:
        """Step the running request to its end; its tokens."""
        engine = self.llm.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    self.running.close()
                    return list(out.outputs[0].token_ids)
        raise AssertionError("the running request is gone")

    def state(self) -> tuple[dict[int, int], list[int]]:
        """The adapter versions held (requests on each) and the adapter ids vLLM's worker holds."""
        return self.adapters.versions(), self.llm.collective_rpc("raysync_lora_held")[0]

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown(timeout=60)


@pytest.fixture(scope="module")
def rollout(ray_local, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("tiny-qwen2"))
    tiny_qwen2(seed=1).save_pretrained(model_dir)  # the trainer's base weights
    host = ray.remote(num_cpus=0.5)(LoraRollout).remote(model_dir)
    yield host
    ray.get(host.shutdown.remote())
    ray.kill(host)


@pytest.fixture(scope="module")
def policy(ray_local):
    trainer = ray.remote(num_cpus=0.25)(LoraPolicy).remote(seed=1)  # the engine's base weights
    yield trainer
    ray.kill(trainer)


def test_each_push_is_served_from_tensors_and_a_running_request_keeps_its_version(rollout, policy):
    """After each push vLLM's greedy tokens with the adapter equal the trainer's (transformers, the adapter
    unmerged); a push moves the adapter's bytes; a request started on version 1 finishes on version 1 while
    version 2 is loaded, and version 1 leaves vLLM when that request ends."""
    engine = VllmEngine(rollout, lora="adapters")
    adapter_bytes = ray.get(policy.adapter_bytes.remote())
    with WeightSync([policy], [engine], CFG, source=AdapterOf(QWEN_LORA)) as sync:
        assert [p.transport for p in sync.plan] == ["shm"], str(sync.plan)
        _, base = ray.get(rollout.generate.remote(PROMPTS, TOKENS, adapter=False))
        expected = {}
        for version in (1, 2):
            ray.get(policy.train.remote(steps=3, seed=version))
            expected[version] = ray.get(policy.greedy.remote(PROMPTS, TOKENS))
            report = sync.push(version)
            assert [p.bytes for p in report.pairs] == [adapter_bytes]  # the adapter and its manifest only
            assert sync.versions() == [version]
            if version == 1:
                assert ray.get(rollout.generate.remote(PROMPTS, TOKENS)) == (1, expected[1]) != (1, base)
                assert ray.get(rollout.start.remote(PROMPTS[1], TOKENS, steps=2)) == 1  # runs through push 2
        versions, held = ray.get(rollout.state.remote())
        assert versions == {1: 1, 2: 0} and len(held) == 2
        assert ray.get(rollout.finish.remote()) == expected[1][1]  # finished on version 1
        versions, held = ray.get(rollout.state.remote())
        assert versions == {2: 0} and len(held) == 1
        assert ray.get(rollout.generate.remote(PROMPTS, TOKENS)) == (2, expected[2])
        assert expected[2] != expected[1]
        # the base weights are untouched: without an adapter the engine generates what it did
        assert ray.get(rollout.generate.remote(PROMPTS, TOKENS, adapter=False))[1] == base


def test_an_adapter_over_max_lora_rank_is_refused_before_a_byte_moves(rollout, policy):
    engine = VllmEngine(rollout, lora="adapters")
    versions, held = ray.get(rollout.state.remote())
    before = ray.get(rollout.generate.remote(PROMPTS, TOKENS))
    with WeightSync([policy], [engine], CFG, source=AdapterOf(WIDE, attr="wide")) as sync:
        with pytest.raises(SyncError, match="max_lora_rank 8") as refused:
            sync.push(3)
        assert {f.stage for f in refused.value.failures} == {"accept"} and not refused.value.mixed
        assert sync.versions() == [None]
    assert ray.get(rollout.state.remote()) == (versions, held)  # refused before a byte moved
    assert ray.get(rollout.generate.remote(PROMPTS, TOKENS)) == before


def test_the_adapter_travels_to_vllm_over_the_collective(rollout, policy):
    engine = VllmEngine(rollout, lora="adapters")
    with WeightSync([policy], [engine], CFG, source=AdapterOf(QWEN_LORA), transport="collective") as sync:
        assert [p.transport for p in sync.plan] == ["collective"], str(sync.plan)
        ray.get(policy.train.remote(steps=2, seed=4))
        sync.push(4)
        expected = ray.get(policy.greedy.remote(PROMPTS, TOKENS))
        assert ray.get(rollout.generate.remote(PROMPTS, TOKENS)) == (4, expected)
        assert ray.get(rollout.state.remote())[0] == {4: 0}


def test_an_engine_named_without_its_adapters_is_refused_at_set_up(rollout, policy):
    with pytest.raises(TypeError, match="names the actor's VllmAdapters, not a LLM"):
        WeightSync([policy], [VllmEngine(rollout, lora="llm")], CFG, source=AdapterOf(QWEN_LORA))
