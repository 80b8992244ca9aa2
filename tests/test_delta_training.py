"""Delta pushes of a real training run (issue 24): a small transformers model trained with Adam at an RL
learning rate (3e-6), pushed after every step, is bit-exact at the engine after each delta push, in both
ways trainers keep bf16 weights (fp32 master weights cast to bf16 on the way; bf16 parameters updated in
place), and from a lazy source; the density each push measured is reported. The helpers here (``Trainer``)
serve the other delta test modules too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import same_bits, session_pair

from raysync import SyncConfig
from raysync.sources.lazy import LazySource

pytest.importorskip("transformers")
LR = 3e-6  # an RL learning rate: most bf16 elements keep their bits from one step to the next
CFG = SyncConfig(
    bucket_bytes=256 << 10, timeout_s=60, progress=False, delta=True, verify=True, delta_by_time=False
)


class Trainer:
    """A tiny Qwen2 (raysync.tools.models.tiny_qwen2) trained with torch.optim.Adam on next-token loss over
    random tokens. ``master="fp32"``: fp32 parameters, pushed cast to bf16; ``"bf16"``: bf16 parameters,
    updated in place."""

    def __init__(self, seed: int, master: str = "fp32"):
        from raysync.tools.models import tiny_qwen2

        self.model = tiny_qwen2(seed=seed).train()
        if master == "bf16":
            self.model = self.model.to(torch.bfloat16)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR)
        self._gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        vocab = self.model.config.vocab_size
        tokens = torch.randint(0, vocab, (2, 32), generator=self._gen)
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def bf16(self) -> dict[str, torch.Tensor]:
        """What an engine holds: the parameters in bf16."""
        return {n: t.to(torch.bfloat16) for n, t in self.params()}

    def nbytes_bf16(self) -> int:
        return sum(t.numel() * 2 for _, t in self.params())


def engine_weights(seed: int = 99) -> dict[str, torch.Tensor]:
    """An engine's own bf16 weights, of another seed than the trainer's."""
    return Trainer(seed).bf16()


@pytest.mark.parametrize("master", ["fp32", "bf16"])
def test_adam_steps_at_rl_lr_arrive_bit_exact_as_deltas(private_tmp, in_thread, master):
    trainer, dest = Trainer(seed=0, master=master), engine_weights()
    config = dataclasses.replace(CFG, cast_dtype="bfloat16")
    full_bytes, densities = trainer.nbytes_bf16(), []
    with session_pair(config) as (sender, receiver):
        for version in range(1, 5):
            trainer.step()
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(trainer.params(), version)
            received = got.result(timeout=60)
            assert all(same_bits(dest[n], t) for n, t in trainer.bf16().items()), version
            assert received.version == version and received.base_version == report.base_version
            if version == 1:
                assert report.base_version is None and report.sent_as_full == full_bytes
                continue
            assert report.base_version == version - 1
            assert report.bytes == received.bytes < full_bytes / 2
            densities.append(report.density)
    print(f"{master} master: bf16 elements changed per Adam step at lr {LR}: {densities}")
    assert all(0 < d < 0.25 for d in densities), densities


def test_a_lazy_source_pushes_deltas_bit_exact(private_tmp, in_thread):
    """Each tensor made when its bucket is packed (LazySource): packed into the reference's scratch, then
    encoded; the first push (and a new source object) is full."""
    trainer, dest = Trainer(seed=1), engine_weights()
    config = dataclasses.replace(CFG, cast_dtype="bfloat16")
    params = dict(trainer.params())
    made: list[str] = []

    def load(name: str) -> torch.Tensor:
        made.append(name)
        return params[name].clone()

    source = LazySource.from_module(trainer.model, load)
    bases = []
    with session_pair(config) as (sender, receiver):
        for version in range(1, 5):
            trainer.step()
            if version == 3:
                source = LazySource.from_module(trainer.model, load)  # a new source: a full push
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(source, version)
            assert got.result(timeout=60).base_version == report.base_version
            assert all(same_bits(dest[n], t) for n, t in trainer.bf16().items()), version
            bases.append(report.base_version)
            assert sender.delta_off is None
    assert bases == [None, 1, None, 3]
    assert len(made) == 4 * len(params)  # every tensor made once per push, delta or not
