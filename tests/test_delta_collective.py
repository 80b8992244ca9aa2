"""Delta pushes over the collective (gloo on the CPU, the stand-in for other nodes; Note [deltas over a
broadcast] in raysync.transport.collective): a group of receiver processes gets the Adam steps of a tiny
Qwen2 as deltas, bit-exact, moving a fraction of the bytes; a receiver not at the base makes that round full
for the whole group, and the next round is a delta again."""

from __future__ import annotations

import dataclasses

import pytest
from test_delta_training import CFG, Trainer, engine_weights
from workers import digest

from raysync import SessionSecret
from raysync.transport.collective import CollectiveReceiver, CollectiveSender

pytest.importorskip("transformers")
CONFIG = dataclasses.replace(CFG, cast_dtype="bfloat16")


def delta_rank(secret, config, rank, rendezvous, pushes, forget_at, out) -> None:
    """A rank of the group: bf16 weights of its own, ``pushes`` receives; before push ``forget_at`` it drops
    its version (as an engine that slept its weights away does). Reports each push."""
    dest = engine_weights()
    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    try:
        receiver = group.join()
        for push in range(1, pushes + 1):
            if push == forget_at:
                receiver.version = None
            report = receiver.receive(into=dest)
            out.put((rank, report.version, report.base_version, report.bytes, digest(dest.items())))
    finally:
        group.close()


def test_collective_deltas_over_gloo_are_bit_exact_and_a_stale_rank_makes_one_round_full(spawn):
    trainer, secret, out = Trainer(seed=0), SessionSecret.generate(), spawn.ctx.Queue()
    group = CollectiveSender(secret, CONFIG, host="127.0.0.1", num_receivers=2, backend="gloo")
    ranks = [
        spawn(delta_rank, secret, CONFIG, r, group.rendezvous, 5, 4 if r == 2 else 0, out) for r in (1, 2)
    ]
    full_bytes = trainer.nbytes_bf16()
    try:
        sender = group.join(timeout_s=120)
        for version in range(1, 6):
            trainer.step()
            report = sender.push(trainer.params(), version)
            got = sorted(out.get(timeout=60) for _ in ranks)
            want = digest(trainer.bf16().items())
            assert [g[1] for g in got] == [version, version] and all(g[4] == want for g in got), version
            assert [g[2] for g in got] == [report.base_version] * 2  # the whole group, the same way
            if version in (1, 4):  # the first push; rank 2 forgot its version: full for the group
                assert report.base_version is None and report.bytes == full_bytes
                continue
            assert report.base_version == version - 1 and report.transport == "collective"
            assert [g[3] for g in got] == [report.bytes] * 2  # what crossed is what was encoded
            assert report.bytes < full_bytes / 2 and 0 < report.density < 0.25
        assert sender.delta_off is None
    finally:
        group.close()
    for p in ranks:
        p.join(timeout=30)
        assert p.exitcode == 0
