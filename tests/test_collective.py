"""The collective transport on the CPU: a gloo group of one sender and 2-3 receiver processes."""

from __future__ import annotations

import time

import pytest
from workers import collective_receiver, digest, perturb

from raysync import PeerUnavailable, RemoteError, SessionSecret, SyncConfig
from raysync.transport.collective import CollectiveSender

pytest.importorskip("transformers")
CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets


def _group(spawn, receivers: int, pushes: int, special: dict | None = None):
    from raysync.models import tiny_qwen2

    secret = SessionSecret.generate()
    sender = CollectiveSender(secret, CFG, host="127.0.0.1", num_receivers=receivers, backend="gloo")
    out = spawn.ctx.Queue()
    for rank in range(1, receivers + 1):
        spawn(
            collective_receiver,
            secret,
            CFG,
            rank,
            sender.rendezvous,
            pushes,
            out,
            *(special or {}).get(rank, (None, False)),
        )
    sender.join()
    return sender, tiny_qwen2(seed=0), out


@pytest.mark.parametrize("receivers", [2, 3])
def test_broadcast_bit_exact_over_several_pushes(spawn, receivers):
    sender, model, out = _group(spawn, receivers, pushes=4)
    try:
        for version in (1, 2, 3):
            perturb(model, version)
            report = sender.push(model.named_parameters(), version)
            assert report.transport == "collective" and report.buckets > 4
            got = [out.get(timeout=60) for _ in range(receivers)]
            assert all(r[1] == "ok" and r[2] == (version, digest(model.named_parameters())) for r in got), got
        assert sender.push(model.named_parameters(), 3).skipped  # every receiver has version 3 already
        got = [out.get(timeout=60) for _ in range(receivers)]
        assert all(r[1] == "ok" and r[2][0] == 3 for r in got), got
    finally:
        sender.close()


def test_a_manifest_mismatch_is_a_clear_error_on_every_rank(spawn):
    sender, model, out = _group(spawn, 2, pushes=1, special={2: (None, 1)})
    try:
        started = time.monotonic()
        with pytest.raises(RemoteError, match=r"rank 2.*model.norm.weight.*float32\[128\].*float32\[3\]"):
            sender.push(model.named_parameters(), 1)
        got = sorted(out.get(timeout=30) for _ in range(2))
        assert [g[1] for g in got] == ["PushIncomplete", "PushIncomplete"], got
        assert "rank 2 refused" in got[0][2] and "model.norm.weight" in got[1][2]
        assert time.monotonic() - started < CFG.timeout_s  # told, not timed out
    finally:
        sender.close()


def test_a_receiver_killed_mid_broadcast_fails_everyone_within_timeout(spawn):
    sender, model, out = _group(spawn, 2, pushes=2, special={2: ((2, 2), False)})
    try:
        perturb(model, 1)
        sender.push(model.named_parameters(), 1)
        assert sorted(out.get(timeout=60)[1] for _ in range(2)) == ["ok", "ok"]
        perturb(model, 2)
        started = time.monotonic()
        with pytest.raises(PeerUnavailable):
            sender.push(model.named_parameters(), 2)
        assert time.monotonic() - started <= CFG.timeout_s + 1
        rank, kind, detail, seconds = out.get(timeout=30)  # the survivor
        assert (rank, kind) == (1, "PushIncomplete") and seconds <= CFG.timeout_s + 1, detail
    finally:
        sender.close()


def test_destinations_that_change_between_pushes_are_refused_without_touching_them(spawn):
    """After pushes that everyone applied, receivers do not confirm first (Note [when receivers confirm]):
    a receiver whose destinations stopped fitting takes part in the broadcast and reports at the end."""
    sender, model, out = _group(spawn, 2, pushes=4, special={2: (None, 3)})
    try:
        for version in (1, 2):
            perturb(model, version)
            sender.push(model.named_parameters(), version)
            assert sorted(r[1] for r in (out.get(timeout=60), out.get(timeout=60))) == ["ok", "ok"]
        perturb(model, 3)
        with pytest.raises(RemoteError, match=r"rank 2.*model.norm.weight"):
            sender.push(model.named_parameters(), 3)
        got = dict((r[0], r) for r in (out.get(timeout=60), out.get(timeout=60)))
        assert got[1][1] == "ok" and got[1][2] == (3, digest(model.named_parameters()))  # rank 1 applied it
        assert got[2][1] == "PushIncomplete" and "model.norm.weight" in got[2][2]
        perturb(model, 4)  # the next push confirms first again: rank 2 refuses before any data moves
        with pytest.raises(RemoteError, match="rank 2"):
            sender.push(model.named_parameters(), 4)
        assert sorted(r[1] for r in (out.get(timeout=60), out.get(timeout=60))) == ["PushIncomplete"] * 2
    finally:
        sender.close()
