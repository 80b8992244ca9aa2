"""`raysync demo`: a local Ray, a trainer actor with a small model made locally, engine actors with their own
copy, several pushes over the shm ring, and a check that every engine holds the trainer's weights bit for bit.

Until the Ray coordinator lands, the demo wires the two halves by hand: the driver makes the session secret,
the trainer binds a WeightSender, each engine connects a WeightReceiver, and the driver runs the push on the
trainer and the receive on the engine at the same time.
"""

from __future__ import annotations

import argparse
import hashlib

import torch

from raysync import PushReport, SessionSecret, SyncConfig, WeightReceiver, WeightSender


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
    def __init__(self, secrets: list[SessionSecret], config: SyncConfig):
        self.model = make_model(seed=0)
        self.senders = [WeightSender(s, config) for s in secrets]  # one session per engine

    def endpoints(self) -> list[str]:
        return [s.endpoint for s in self.senders]

    def step(self, version: int) -> str:
        """Stands in for an optimizer step: new weights, deterministic per version."""
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        return fingerprint(self.model)

    def push(self, engine: int, version: int) -> PushReport:
        return self.senders[engine].push(self.model.named_parameters(), version)

    def close(self) -> None:
        for s in self.senders:
            s.close()


class Engine:
    def __init__(self, endpoint: str, secret: SessionSecret, config: SyncConfig):
        self.model = make_model(seed=1)  # different weights until the first push
        self.receiver = WeightReceiver(endpoint, secret, config)

    def receive(self) -> PushReport:
        return self.receiver.receive(into=dict(self.model.named_parameters()))

    def fingerprint(self) -> str:
        return fingerprint(self.model)

    def close(self) -> None:
        self.receiver.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raysync demo", description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=4)
    args = ap.parse_args(argv)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        config = SyncConfig(bucket_bytes=args.bucket_mb << 20, timeout_s=60)
        secrets = [SessionSecret.generate() for _ in range(args.engines)]
        trainer = ray.remote(num_cpus=0.5)(Trainer).remote(secrets, config)
        endpoints = ray.get(trainer.endpoints.remote())
        engines = [
            ray.remote(num_cpus=0.5)(Engine).remote(ep, s, config)
            for ep, s in zip(endpoints, secrets, strict=True)
        ]
        print(
            f"trainer + {args.engines} engine actors up; engines start at {ray.get(engines[0].fingerprint.remote())}"
        )
        ok = True
        for version in range(1, args.pushes + 1):
            expected = ray.get(trainer.step.remote(version))
            for i, engine in enumerate(engines):
                got = engine.receive.remote()
                report = ray.get(trainer.push.remote(i, version))
                ray.get(got)
                actual = ray.get(engine.fingerprint.remote())
                ok &= actual == expected
                print(
                    f"  engine {i}: {report}  weights {actual} {'==' if actual == expected else '!='} trainer"
                )
        ray.get([e.close.remote() for e in engines] + [trainer.close.remote()])
        print("OK: every engine holds the trainer's weights, bit for bit" if ok else "FAILED: weights differ")
        return 0 if ok else 1
    finally:
        ray.shutdown()
