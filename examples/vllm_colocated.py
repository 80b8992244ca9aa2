"""raysync into a vLLM engine on the trainer's own GPU (colocated RL): the weights move over CUDA IPC.

    python examples/vllm_colocated.py        # needs one CUDA GPU, vLLM (GPU build), transformers, Ray

NOT RUN by this project yet: the GPU machine it has does not have vLLM. The same flow is tested on vLLM's CPU
build (examples/vllm_cpu.py, tests/test_vllm.py), and CUDA IPC between two Ray actors sharing one GPU is
tested without vLLM (tests/test_gpu.py).

1. A trainer actor and a rollout actor share one GPU (num_gpus=0.5 each, so both see the same device).
2. The rollout actor holds a vLLM engine made with raysync's worker extension, started from a checkpoint of
   other random weights (a small Qwen2 made here: nothing is downloaded).
3. WeightSync plans the pair over cuda_ipc ("same GPU", devices matched by UUID) and pushes the trainer's
   weights into vLLM's worker through vLLM's model.load_weights.
4. The visible check: vLLM's greedy tokens equal transformers' on the trainer's weights, and differ from the
   engine's tokens before the push.
"""

import tempfile

import ray
import torch

from raysync import SyncConfig, WeightSync
from raysync.engines.vllm import VllmEngine, weight_version
from raysync.tools.models import tiny_qwen2

PROMPT = [(7 * i) % 500 + 1 for i in range(48)]
TOKENS = 8


def small_model(seed):
    return tiny_qwen2(seed, hidden=256, layers=2, vocab=512)  # head_dim 64


@ray.remote(num_gpus=0.5)
class Trainer:
    def __init__(self):
        self.model = small_model(seed=0).cuda()

    def train_step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p))

    def greedy(self, prompt, tokens):
        ids = self.model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=tokens,
                                  min_new_tokens=tokens, do_sample=False)  # fmt: skip
        return ids[0, len(prompt) :].tolist()


@ray.remote(num_gpus=0.5)
class Rollout:
    def __init__(self, checkpoint):
        from vllm import LLM

        self.llm = LLM(checkpoint, worker_extension_cls="raysync.engines.vllm.WorkerExtension", skip_tokenizer_init=True,
                       dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256)  # fmt: skip

    def greedy(self, prompt, tokens):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def version(self):
        return weight_version(self.llm)

    def shutdown(self):
        self.llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    ray.init()
    with tempfile.TemporaryDirectory() as checkpoint:
        small_model(seed=1).save_pretrained(checkpoint)
        trainer, rollout = Trainer.remote(), Rollout.remote(checkpoint)
        before = ray.get(rollout.greedy.remote(PROMPT, TOKENS))
        try:
            with WeightSync([trainer], [VllmEngine(rollout)], SyncConfig(bucket_bytes=64 << 20)) as sync:
                print(sync.plan)  # expected: cuda_ipc, same GPU
                for step in (1, 2):
                    ray.get(trainer.train_step.remote())
                    print(sync.push(version=step))
                expected = ray.get(trainer.greedy.remote(PROMPT, TOKENS))
                got = ray.get(rollout.greedy.remote(PROMPT, TOKENS))
                version = ray.get(rollout.version.remote())
        finally:
            ray.get(rollout.shutdown.remote())
    print(f"engine weight version {version}; tokens before {before}, after {got}, transformers {expected}")
    print(f"vLLM generates with the pushed weights: {got == expected}; changed: {got != before}")
    assert got == expected and got != before and version == 2
    print("OK")
