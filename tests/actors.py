"""Actor classes as a user would write them (no raysync base class), for the Ray tests."""

from __future__ import annotations

import os
import signal

import torch
from workers import digest, perturb

from raysync.tools.models import tiny_qwen2


class Trainer:
    def __init__(self, seed: int = 0, on_gpu: bool = False):
        self.model = tiny_qwen2(seed).to("cuda" if on_gpu else "cpu")
        self.break_at: int | None = None  # breakable_source raises at this tensor

    def step(self, version: int) -> dict[str, str]:
        perturb(self.model, version)
        return digest(self.model.named_parameters())

    def break_source(self, at: int | None) -> None:
        self.break_at = at


def breakable_source(actor: Trainer):
    """The trainer's parameters, raising at tensor ``actor.break_at`` once it is set (a gather that fails)."""
    for k, item in enumerate(actor.model.named_parameters()):
        if k == actor.break_at:
            raise ValueError(f"the source broke at tensor {k}")
        yield item


class Engine:
    def __init__(self, seed: int = 1, on_gpu: bool = False):
        self.model = tiny_qwen2(seed).to("cuda" if on_gpu else "cpu")
        self.params = dict(self.model.named_parameters())
        self.fail_at: tuple[int, str] | None = None
        self.calls = 0

    def digest(self) -> dict[str, str]:
        return digest(self.model.named_parameters())

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def fail_at_call(self, n: int, how: str) -> None:
        """Make the n-th load call of the next push fail: how = "raise" or "die" (SIGKILL this process)."""
        self.fail_at, self.calls = (n, how), 0

    def load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        if self.fail_at and self.calls == self.fail_at[0]:
            if self.fail_at[1] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("bad weights in this bucket")
        with torch.no_grad():
            for name, t in batch:
                self.params[name].copy_(t)


class Adapter:
    """An engine adapter over a plain actor, the way raysync.engines.vllm.VllmEngine is one over a vLLM host (its own
    ``call``): WeightSync reaches it through ordinary Ray calls, also when the rest of a push is a compiled graph."""

    def __init__(self, actor):
        self.actor = actor

    def call(self, fn, args=()):
        return self.actor.__ray_call__.remote(on_slots, fn, args if isinstance(args, dict) else {0: args})


def on_slots(actor, fn, args: dict) -> dict:
    return {slot: fn(actor, *a) for slot, a in args.items()}


def engine_load(actor: Engine):
    """A sink that hands each bucket to the engine's own loader."""
    return actor.load


ENGINE_ARGS = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=160,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    kv_cache_memory_bytes=32 << 20,
    block_size=32,
    enable_prefix_caching=True,
)


def greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations from a transformers model."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens
            )
            out.append(ids[0, len(p) :].tolist())
    return out


class Policy(Trainer):
    """A trainer that can also say what its weights generate (the reference for the engines)."""

    def greedy(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        return greedy(self.model, prompts, tokens)


class VllmHost:
    """A user's rollout actor holding a vLLM engine made with raysync's worker extension."""

    def __init__(self, model_dir: str, **overrides):
        from vllm import LLM

        self.llm = LLM(
            model_dir,
            worker_extension_cls="raysync.engines.vllm.WorkerExtension",
            **{**ENGINE_ARGS, **overrides},
        )

    def generate(self, prompts: list[list[int]], tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def weight_version(self) -> int | None:
        from raysync.engines.vllm import weight_version

        return weight_version(self.llm)

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()  # else vLLM's own /dev/shm segments stay behind
