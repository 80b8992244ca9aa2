"""Sharded sources on the CPU: two senders (trainer ranks), each broadcasting its share over its own gloo group
to the same receiver processes, which receive both shares at once."""

from __future__ import annotations

import dataclasses
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from workers import digest, perturb, sharded_checker, sharded_receiver, sharded_stager

from raysync import PeerTimeout, PushIncomplete, RaysyncError, RemoteError, SessionSecret, SyncConfig
from raysync.core.session import PushSender
from raysync.core.sharded import ShardedReceiver, combined_version, shares
from raysync.core.version import MIXED
from raysync.transport.collective import CollectiveReceiver, CollectiveSender, Rendezvous

pytest.importorskip("transformers")
# The embedding spans 4 buckets. No wait is meant to run out under CFG (failures are told apart by their errors);
# DIES keeps short the waits that a dead rank's peers wait out (as in test_collective).
CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)
DIES = dataclasses.replace(CFG, timeout_s=5)


def test_shares_are_disjoint_cover_every_tensor_and_balance_bytes():
    from raysync.tools.models import tiny_qwen2

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


def test_an_engine_is_one_version_only_when_every_share_is():
    """An engine's version over every combination of its shares' versions that matters (Note [versions never
    lie]): shares that differ, or one MIXED, make the engine's weights a mix."""
    table = {
        (None, None): None,
        (3, 3): 3,
        (3, 4): MIXED,
        (3, MIXED): MIXED,
        (MIXED, 3): MIXED,
        (MIXED, MIXED): MIXED,
        (None, 3): MIXED,
        (3,): 3,
        (MIXED,): MIXED,
    }
    for versions, want in table.items():
        assert combined_version(versions) == want, versions


def test_a_rebuilt_group_keeps_what_the_destinations_hold():
    """WeightSync makes an engine's groups one at a time and rebuilds a failed one: each share of a
    ShardedReceiver keeps its version across ``replace``, and nothing is received before every share's group
    has joined."""
    # never joined: only versions and refusals are read here
    rdv = Rendezvous("127.0.0.1", 9, 2, "gloo", ("tcp://127.0.0.1:9",))
    groups = [CollectiveReceiver(SessionSecret.generate(), CFG, rank=1, rendezvous=rdv) for _ in range(3)]
    engine = ShardedReceiver([None, None])
    try:
        engine.version = 5  # what the engine held before (endpoint.py carries it over)
        engine.replace(0, groups[0])
        assert engine.version == 5
        with pytest.raises(RaysyncError, match=r"shares \[1\] have no group yet"):
            engine.receive(into={})
        engine.replace(1, groups[1])
        with pytest.raises(RaysyncError, match=r"shares \[0, 1\] have not joined"):
            engine.receive(into={})
        engine.version = MIXED  # a push failed part-way
        engine.replace(1, groups[2])  # share 1's group rebuilt: the same destinations, still a mix
        assert engine.version == MIXED and engine.groups == [groups[0], groups[2]]
        engine.version = 7
        assert engine.version == 7
    finally:
        engine.close()
        groups[1].close()  # closed by replace already: closing again is harmless


def _groups(
    model, receivers: int, base: SyncConfig = CFG
) -> tuple[list[CollectiveSender], list[SessionSecret]]:
    """One group per share of ``model``, rank 0 of each in this process, and each group's secret."""
    groups, secrets = [], []
    for share in shares(model.named_parameters(), 2, base):
        secrets.append(SessionSecret.generate())
        groups.append(
            CollectiveSender(
                secrets[-1],
                dataclasses.replace(base, include=share),
                host="127.0.0.1",
                num_receivers=receivers,
                backend="gloo",
            )
        )
    return groups, secrets


def _join(groups: list[CollectiveSender]) -> list[PushSender]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(lambda g: g.join(), groups))


def _setup(spawn, receivers: int, pushes: int, die: dict | None = None):
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    groups, secrets = _groups(model, receivers)
    out = spawn.ctx.Queue()
    for rank in range(1, receivers + 1):
        spawn(
            sharded_receiver,
            secrets,
            CFG,
            rank,
            [g.rendezvous for g in groups],
            pushes,
            out,
            (die or {}).get(rank),
        )
    return groups, _join(groups), model, out


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
    groups, senders, model, out = _setup(spawn, receivers=2, pushes=3)
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
        for g in groups:
            g.close()


def sharded_survivor(secrets, config, rendezvous, out, inbox) -> None:
    """An engine (rank 1 of both shares' groups) whose peer engine dies in push 2: receives push 1, fails push
    2 (reports its version), then takes both rebuilt groups as WeightSync does (``replace``: each share keeps
    what its destinations hold) and receives once more."""
    from raysync.tools.models import tiny_qwen2

    params = dict(tiny_qwen2(seed=99).named_parameters())
    engine = ShardedReceiver(
        [
            CollectiveReceiver(s, config, rank=1, rendezvous=r)
            for s, r in zip(secrets, rendezvous, strict=True)
        ]
    )
    engine.join()
    report = engine.receive(into=params, wait_s=60)  # the parent may still be starting
    out.put(("ok", report.version, digest(params.items())))
    try:
        engine.receive(into=params)
        out.put(("ok", engine.version, None, ""))
    except Exception as e:
        out.put((type(e).__name__, engine.version, getattr(e, "mixed", None), str(e)))
    secrets, rendezvous = inbox.get(timeout=60)
    for k, (s, r) in enumerate(zip(secrets, rendezvous, strict=True)):
        engine.replace(k, CollectiveReceiver(s, config, rank=1, rendezvous=r))
    engine.join()
    engine.receive(into=params)
    out.put((engine.version, digest(params.items())))
    engine.close()


def test_a_receiver_killed_mid_push_fails_everyone_and_the_survivor_says_mixed(spawn, gloo_warm):
    """The other engine SIGKILLs itself in push 2: both senders and the surviving engine fail, typed, the
    survivor's version is MIXED (its destinations took part of push 2 in place), and after both groups are
    rebuilt the same version 2 lands bit-exact and the version says 2."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    groups, secrets = _groups(model, receivers=2, base=DIES)
    rendezvous = [g.rendezvous for g in groups]
    out, dead_out, inbox = spawn.ctx.Queue(), spawn.ctx.Queue(), spawn.ctx.Queue()
    spawn(sharded_survivor, secrets, DIES, rendezvous, out, inbox)
    dead = spawn(sharded_receiver, secrets, DIES, 2, rendezvous, 2, dead_out, 2)
    senders = _join(groups)
    rebuilt: list[CollectiveSender] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            perturb(model, 1)
            assert all(not isinstance(r, Exception) for r in _push_all(pool, senders, model, 1))
            assert out.get(timeout=60) == ("ok", 1, digest(model.named_parameters()))
            assert dead_out.get(timeout=60)[1] == "ok"
            perturb(model, 2)
            results = _push_all(pool, senders, model, 2)
            assert all(isinstance(r, (PeerTimeout, RemoteError, PushIncomplete)) for r in results), results
            dead.join(timeout=30)
            assert dead.exitcode == -signal.SIGKILL  # it died where the test made it die
            error, version, mixed, detail = out.get(timeout=60)
            assert (error, version, mixed) == ("PushIncomplete", MIXED, True), detail
            rebuilt, rebuilt_secrets = _groups(model, receivers=1, base=DIES)
            inbox.put((rebuilt_secrets, [g.rendezvous for g in rebuilt]))
            assert all(not isinstance(r, Exception) for r in _push_all(pool, _join(rebuilt), model, 2))
            assert out.get(timeout=60) == (2, digest(model.named_parameters()))
    finally:
        for g in groups + rebuilt:
            g.close()


@pytest.mark.parametrize("fails", ["ValueError", "WeightsMixed"])
def test_a_staging_loader_applies_every_share_once_and_a_failed_apply_is_told(spawn, fails):
    """A staging loader (``finish``) is handed every share's tensors and applies them once, after the last
    share: push 1 lands bit-exact. Its apply fails in push 2: the engine raises one PushIncomplete at stage
    'apply'; a loader that kept the old weights (its contract) leaves version 1 and the destinations as they
    were, one that says WeightsMixed leaves MIXED."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    groups, secrets = _groups(model, receivers=1)
    out = spawn.ctx.Queue()
    spawn(sharded_stager, secrets, CFG, [g.rendezvous for g in groups], out, fails)
    senders = _join(groups)
    try:
        with ThreadPoolExecutor(2) as pool:
            perturb(model, 1)
            assert all(not isinstance(r, Exception) for r in _push_all(pool, senders, model, 1))
            v1 = digest(model.named_parameters())
            assert out.get(timeout=60) == ("ok", 1, v1)
            perturb(model, 2)
            _push_all(pool, senders, model, 2)  # every share lands; the engine applies after the last
            kind, version, mixed, held, message = out.get(timeout=60)
    finally:
        for g in groups:
            g.close()
    assert kind == "PushIncomplete" and "stage 'apply'" in message, message
    if fails == "WeightsMixed":
        assert (version, mixed) == (MIXED, True), message
    else:
        assert (version, mixed, held) == (1, False, v1), message


def test_a_loaders_check_refuses_every_share_before_any_byte_moves(spawn):
    """A load function's ``check(specs)`` runs at each share's accept (it is kept when the shares' loads are
    serialised): it sees every tensor of the model across the shares, refuses, and nothing is loaded."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    groups, secrets = _groups(model, receivers=1)
    out = spawn.ctx.Queue()
    spawn(sharded_checker, secrets, CFG, [g.rendezvous for g in groups], out)
    senders = _join(groups)
    try:
        with ThreadPoolExecutor(2) as pool:
            results = _push_all(pool, senders, model, 1)
            kind, message, version, seen, loads = out.get(timeout=60)
    finally:
        for g in groups:
            g.close()
    assert all(isinstance(r, Exception) for r in results), results
    assert "cannot take these weights" in message, (kind, message)
    assert version is None and loads == []
    assert seen == sorted(n for n, _ in model.named_parameters())
