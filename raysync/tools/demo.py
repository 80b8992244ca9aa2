"""`raysync demo`: a local Ray, a trainer actor with a small model made locally, engine actors (vLLM engines
when vLLM is installed, torch modules otherwise), WeightSync planning and running several pushes, and a check
that the engines got the trainer's weights. Nothing is downloaded.

With vLLM the check is what a user sees: the engines' greedy tokens equal transformers' on the trainer's
weights (and differ from the engines' tokens before the first push). With torch modules it is a fingerprint
of every parameter, bit for bit. The demo first says which engines and which model it uses (``--tied``: a
model whose output head is its embedding, as Qwen2.5-0.5B and Llama-3.2-1B have).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import tempfile

import torch

from raysync import SyncConfig, WeightSync
from raysync.tools.models import describe

PROMPT = [(7 * i) % 8000 + 1 for i in range(48)]
TOKENS = 8
ENGINE_ARGS = dict(
    skip_tokenizer_init=True,
    enforce_eager=True,
    dtype="float32",
    max_model_len=160,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    kv_cache_memory_bytes=64 << 20,
)


def make_model(seed: int, tied: bool = False) -> torch.nn.Module:
    """A small Qwen2 (transformers, random init) if transformers is installed, else a small torch module."""
    try:
        from raysync.tools.models import tiny_qwen2

        return tiny_qwen2(seed, hidden=256, layers=4, vocab=8192, tied=tied)
    except ImportError:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Embedding(8192, 256), *[torch.nn.Linear(256, 256) for _ in range(8)]
        )


def fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Trainer:
    """A stand-in for a trainer rank: holds ``self.model`` (WeightSync's default source)."""

    def __init__(self, tied: bool = False) -> None:
        self.model = make_model(seed=0, tied=tied)

    def describe(self) -> str:
        return describe(self.model)

    def step(self, version: int) -> str:
        """Stands in for an optimizer step: new weights, deterministic per version."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g))
        return fingerprint(self.model)

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        ids = self.model.generate(
            torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
        )
        return ids[0, len(prompt) :].tolist()


class Engine:
    """A stand-in for a rollout engine: holds ``self.model`` (WeightSync's default destination)."""

    def __init__(self, tied: bool = False) -> None:
        self.model = make_model(seed=1, tied=tied)  # different weights until the first push

    def fingerprint(self) -> str:
        return fingerprint(self.model)


class VllmRollout:
    """A rollout actor holding a vLLM engine made with raysync's worker extension."""

    def __init__(self, checkpoint: str) -> None:
        from vllm import LLM

        self.llm = LLM(checkpoint, worker_extension_cls="raysync.engines.vllm.WorkerExtension", **ENGINE_ARGS)

    def greedy(self, prompt: list[int], tokens: int) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
        return list(
            self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        )

    def shutdown(self) -> None:
        # vLLM's own shared memory goes with it, given the time (its default, 5 s, can cut that short)
        self.llm.llm_engine.engine_core.shutdown(timeout=60)


def vllm_usable() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("vllm", "transformers"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raysync demo", description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=4)
    ap.add_argument(
        "--engine",
        choices=["auto", "vllm", "torch"],
        default="auto",
        help="auto: vLLM engines when vLLM is installed, else torch modules",
    )
    ap.add_argument("--tied", action="store_true", help="a model whose output head is its embedding")
    args = ap.parse_args(argv)
    use_vllm = args.engine == "vllm" or (args.engine == "auto" and vllm_usable())

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        with tempfile.TemporaryDirectory(prefix="raysync-demo-") as checkpoint:
            return run(ray, args, use_vllm, checkpoint)
    finally:
        ray.shutdown()


def run(ray, args, use_vllm: bool, checkpoint: str) -> int:
    trainer = ray.remote(num_cpus=0.25)(Trainer).remote(args.tied)
    if use_vllm:
        import vllm

        from raysync.engines.vllm import VllmEngine

        make_model(seed=1, tied=args.tied).save_pretrained(checkpoint)
        one_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        layout = "one process each" if one_process == "0" else "EngineCore and worker processes each"
        print(
            f"engines: {args.engines} x vLLM {vllm.__version__} (LLM with raysync's worker extension, {layout}), "
            f"started from a local checkpoint of other random weights"
        )
        print(f"model: {ray.get(trainer.describe.remote())}")
        env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": one_process}}
        actors = [
            ray.remote(num_cpus=0.5)(VllmRollout).options(runtime_env=env).remote(checkpoint)
            for _ in range(args.engines)
        ]
        receivers = [VllmEngine(a) for a in actors]
        before = ray.get([a.greedy.remote(PROMPT, TOKENS) for a in actors])
    else:
        print(f"engines: {args.engines} x torch module (an actor's model, written in place)")
        print(f"model: {ray.get(trainer.describe.remote())}")
        actors = receivers = [
            ray.remote(num_cpus=0.25)(Engine).remote(args.tied) for _ in range(args.engines)
        ]
    ok = True
    try:
        with WeightSync(
            [trainer], receivers, SyncConfig(bucket_bytes=args.bucket_mb << 20, timeout_s=60)
        ) as sync:
            print(f"plan:\n{sync.plan}\n")
            for version in range(1, args.pushes + 1):
                expected = ray.get(trainer.step.remote(version))
                print(sync.push(version))
                if not use_vllm:
                    got = ray.get([e.fingerprint.remote() for e in actors])
                    ok &= all(g == expected for g in got)
                    print(f"  trainer weights {expected}; engines {', '.join(got)}\n")
            print(f"engine versions: {sync.versions()}")
        if use_vllm:
            expected = ray.get(trainer.greedy.remote(PROMPT, TOKENS))
            got = ray.get([a.greedy.remote(PROMPT, TOKENS) for a in actors])
            print(f"greedy tokens, transformers on the trainer's weights: {expected}")
            for i, (b, g) in enumerate(zip(before, got, strict=True)):
                print(f"  engine {i}: before the pushes {b}, after {g}")
            ok = all(g == expected for g in got) and all(b != g for b, g in zip(before, got, strict=True))
    finally:
        if use_vllm:
            ray.get([a.shutdown.remote() for a in actors])
    what = "generates the trainer's tokens" if use_vllm else "holds the trainer's weights, bit for bit"
    print(f"OK: every engine {what}" if ok else f"FAILED: not every engine {what}")
    return 0 if ok else 1
