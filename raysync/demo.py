"""`raysync demo`: a local Ray, a trainer actor with a small model made locally, engine actors with their own
copy, WeightSync planning and running several pushes, and a check that every engine holds the trainer's
weights bit for bit. Nothing is downloaded."""

from __future__ import annotations

import argparse
import hashlib

import torch

from raysync import SyncConfig, WeightSync


def make_model(seed: int) -> torch.nn.Module:
    """A tiny Qwen2 (transformers, random init) if transformers is installed, else a small torch module."""
    try:
        from raysync.models import tiny_qwen2

        return tiny_qwen2(seed, hidden=256, layers=4, vocab=8192)
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

    def __init__(self) -> None:
        self.model = make_model(seed=0)

    def step(self, version: int) -> str:
        """Stands in for an optimizer step: new weights, deterministic per version."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        return fingerprint(self.model)


class Engine:
    """A stand-in for a rollout engine: holds ``self.model`` (WeightSync's default destination)."""

    def __init__(self) -> None:
        self.model = make_model(seed=1)  # different weights until the first push

    def fingerprint(self) -> str:
        return fingerprint(self.model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raysync demo", description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=4)
    args = ap.parse_args(argv)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        trainer = ray.remote(num_cpus=0.25)(Trainer).remote()
        engines = [ray.remote(num_cpus=0.25)(Engine).remote() for _ in range(args.engines)]
        ok = True
        with WeightSync(
            [trainer], engines, SyncConfig(bucket_bytes=args.bucket_mb << 20, timeout_s=60)
        ) as sync:
            print(f"plan:\n{sync.plan}\n")
            for version in range(1, args.pushes + 1):
                expected = ray.get(trainer.step.remote(version))
                print(sync.push(version))
                got = ray.get([e.fingerprint.remote() for e in engines])
                ok &= all(g == expected for g in got)
                print(f"  trainer weights {expected}; engines {', '.join(got)}\n")
            print(f"engine versions: {sync.versions()}")
        print("OK: every engine holds the trainer's weights, bit for bit" if ok else "FAILED: weights differ")
        return 0 if ok else 1
    finally:
        ray.shutdown()
