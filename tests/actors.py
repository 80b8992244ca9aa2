"""Actor classes as a user would write them (no raysync base class), for the Ray tests."""

from __future__ import annotations

import os
import signal

import torch
from workers import digest, perturb

from raysync.models import tiny_qwen2


class Trainer:
    def __init__(self, seed: int = 0):
        self.model = tiny_qwen2(seed)

    def step(self, version: int) -> dict[str, str]:
        perturb(self.model, version)
        return digest(self.model.named_parameters())


class Engine:
    def __init__(self, seed: int = 1):
        self.model = tiny_qwen2(seed)
        self.params = dict(self.model.named_parameters())
        self.fail_at: tuple[int, str] | None = None
        self.calls = 0

    def digest(self) -> dict[str, str]:
        return digest(self.model.named_parameters())

    def pid(self) -> int:
        return os.getpid()

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


def engine_load(actor: Engine):
    """A sink that hands each bucket to the engine's own loader."""
    return actor.load
