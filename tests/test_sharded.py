"""Sharded sources on the CPU: two senders (trainer ranks), each broadcasting its share over its own gloo group
to the same receiver processes, which receive both shares at once."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from workers import digest, perturb, sharded_receiver

from raysync import PeerTimeout, PushIncomplete, RemoteError, SessionSecret, SyncConfig
from raysync.sharded import shares
from raysync.transport.collective import CollectiveSender

pytest.importorskip("transformers")
CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=5, progress=False)  # the embedding spans 4 buckets


def test_shares_are_disjoint_cover_every_tensor_and_balance_bytes():
    from raysync.models import tiny_qwen2

    named = list(tiny_qwen2(seed=0).named_parameters())
    sizes = {n: p.nbytes for n, p in named}
    for k in (1, 2, 3, 7):
        got = shares(named, k)
        flat = [n for share in got for n in share]
        assert len(got) == k and sorted(flat) == sorted(sizes)  # every tensor, once
        order = list(sizes)
        assert all(list(share) == sorted(share, key=order.index) for share in got)  # the tensors' order kept
        loads = [sum(sizes[n] for n in share) for share in got]
        assert max(loads) - min(loads) <= max(sizes.values())
    no_norms = shares(named, 2, SyncConfig(exclude=("*norm*",)))
    assert not any("norm" in n for share in no_norms for n in share)
    with pytest.raises(ValueError):
        shares(named, 0)
    with pytest.raises(ValueError, match="at least one"):  # an empty share would mean "everything"
        shares(named[:2], 3)


def _setup(spawn, receivers: int, pushes: int, die: dict | None = None):
    from raysync.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    senders = []
    for share in shares(model.named_parameters(), 2, CFG):
        secret = SessionSecret.generate()
        config = dataclasses.replace(CFG, include=share)
        senders.append(
            CollectiveSender(secret, config, host="127.0.0.1", num_receivers=receivers, backend="gloo")
        )
    out = spawn.ctx.Queue()
    for rank in range(1, receivers + 1):
        spawn(sharded_receiver, [s._group._secret for s in senders], CFG, rank, [s.rendezvous for s in senders],
              pushes, out, (die or {}).get(rank))  # fmt: skip
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: s.join(), senders))
    return senders, model, out


def _push_all(pool, senders, model, version):
    named = list(model.named_parameters())
    jobs = [pool.submit(s.push, named, version) for s in senders]
    results = []
    for j in jobs:
        try:
            results.append(j.result(timeout=60))
        except Exception as e:
            results.append(e)
    return results


def test_two_senders_each_broadcast_their_share_bit_exact(spawn):
    senders, model, out = _setup(spawn, receivers=2, pushes=3)
    total = len(list(model.parameters()))
    try:
        with ThreadPoolExecutor(2) as pool:
            for version in (1, 2, 3):
                perturb(model, version)
                reports = _push_all(pool, senders, model, version)
                assert sum(r.tensors for r in reports) == total and all(r.tensors for r in reports), reports
                got = [out.get(timeout=60) for _ in range(2)]
                expected = (version, total, digest(model.named_parameters()))
                assert all(r[1] == "ok" and r[2] == expected for r in got), got
    finally:
        for s in senders:
            s.close()


def test_a_receiver_killed_mid_push_fails_both_senders_and_the_other_receiver_in_time(spawn):
    senders, model, out = _setup(spawn, receivers=2, pushes=2, die={2: 2})
    try:
        with ThreadPoolExecutor(2) as pool:
            perturb(model, 1)
            assert all(not isinstance(r, Exception) for r in _push_all(pool, senders, model, 1))
            assert all(out.get(timeout=60)[1] == "ok" for _ in range(2))
            started = time.monotonic()
            results = _push_all(pool, senders, model, 2)
            assert time.monotonic() - started <= CFG.timeout_s + 5
            assert all(isinstance(r, (PeerTimeout, RemoteError, PushIncomplete)) for r in results), results
            rank, error, detail, seconds = out.get(timeout=60)
            assert (rank, error) == (1, "PushIncomplete") and seconds <= CFG.timeout_s + 5, detail
    finally:
        for s in senders:
            s.close()
