"""Delta pushes through WeightSync to a mixed fleet of Ray actors (issue 24): an engine whose weights are
dropped (as a level-2 sleep or a reload does: it holds no version) and an engine that is killed and
restarted by Ray (it comes back with no weights) each get a full push and are bit-exact afterwards, while
the other engines keep getting deltas in the same rounds (WeightSync makes one session per pair)."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from test_delta_training import CFG, Trainer  # noqa: E402
from workers import digest  # noqa: E402

from raysync import SyncConfig, SyncError, WeightSync  # noqa: E402
from raysync.ray.endpoint import forget_version  # noqa: E402

CONFIG: SyncConfig = dataclasses.replace(CFG, cast_dtype="bfloat16", timeout_s=10, transport="shm")
ACTOR = {"num_cpus": 0.25}


class TrainerActor:
    """A trainer as a user writes it: ``model`` (fp32 master weights, pushed cast to bf16), ``step``."""

    def __init__(self):
        self.trainer = Trainer(seed=0)
        self.model = self.trainer.model

    def step(self) -> dict[str, str]:
        self.trainer.step()
        return digest(self.trainer.bf16().items())

    def nbytes_bf16(self) -> int:
        return self.trainer.nbytes_bf16()


class BF16Engine:
    """An engine holding bf16 weights in ``model`` (WeightSync's default sink writes into them)."""

    def __init__(self):
        from raysync.tools.models import tiny_qwen2

        self.model = tiny_qwen2(seed=99).to(torch.bfloat16)

    def digest(self) -> dict[str, str]:
        return digest((n, p.detach()) for n, p in self.model.named_parameters())

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def test_stale_and_restarted_engines_get_full_pushes_while_the_others_keep_deltas(ray_local, no_leftovers):
    trainer = ray.remote(**ACTOR)(TrainerActor).remote()
    engines = [ray.remote(**ACTOR)(BF16Engine).remote() for _ in range(2)]
    engines.append(ray.remote(max_restarts=1, **ACTOR)(BF16Engine).remote())
    full = ray.get(trainer.nbytes_bf16.remote())

    def round_(sync: WeightSync, version: int) -> dict[int, int]:
        """One step and one push; every engine bit-exact; the bytes each pair moved."""
        want = ray.get(trainer.step.remote())
        report = sync.push(version)
        assert ray.get([e.digest.remote() for e in engines]) == [want] * 3, version
        assert sync.versions() == [version] * 3
        return {p.receiver: p.bytes for p in report.pairs}

    try:
        with WeightSync([trainer], engines, CONFIG) as sync:
            assert round_(sync, 1) == {0: full, 1: full, 2: full}  # the first push is full
            sent = round_(sync, 2)
            assert all(0 < b < full / 2 for b in sent.values()), sent  # deltas for all
            ray.get(engines[1].__ray_call__.remote(forget_version))  # its weights hold no version now
            sent = round_(sync, 3)
            assert sent[1] == full and sent[0] < full / 2 and sent[2] < full / 2, sent
            first_pid = ray.get(engines[2].pid.remote())
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(engines[2].die.remote())
            want = ray.get(trainer.step.remote())
            with pytest.raises(SyncError) as e:  # the restarted actor has no session: its pair fails ...
                sync.push(4)
            assert all("receiver #2" in f.endpoint for f in e.value.failures), e.value
            assert (
                ray.get([e.digest.remote() for e in engines[:2]]) == [want] * 2
            )  # ... the others go through
            sent = round_(sync, 5)  # the pair is repaired: a full push to it, deltas to the others
            assert ray.get(engines[2].pid.remote()) != first_pid
            assert sent[2] == full and sent[0] < full / 2 and sent[1] < full / 2, sent
    finally:
        for actor in [trainer, *engines]:
            ray.kill(actor)
