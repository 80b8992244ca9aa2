"""Delta pushes through the push session (SyncConfig.delta, raysync.core.delta_push): bit-exact after every
push, a fraction of the bytes, a full push in the same round for a receiver that cannot take the delta,
anchors and ``full=True``, verify on the result, and a sender killed mid-delta leaves MIXED, not wrong
weights."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
import torch
from conftest import same_bits, session_pair
from workers import digest

from raysync import PushIncomplete, RemoteError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.errors import IntegrityError, SchemaError
from raysync.core.frames import _decode_body
from raysync.core.version import MIXED
from raysync.core.wire import PushStart

CFG = SyncConfig(
    bucket_bytes=64 << 10, timeout_s=30, progress=False, delta=True, verify=True, delta_by_time=False
)
LR = 3e-6  # an RL learning rate: most bf16 elements keep their bits


def rl_step(master: dict[str, torch.Tensor], step: int) -> None:
    """An Adam-like step on fp32 master weights: every element moves by about LR (the sign of a random
    gradient), so only elements near a bf16 rounding boundary change their bf16 bits."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g).sign_().mul_(LR))


def small_model(seed: int) -> dict[str, torch.Tensor]:
    """fp32 master weights with a checkpoint's magnitudes: matrices ~N(0, 0.02), norm weights ~1."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.mlp.weight": torch.randn(256, 512, generator=g) * 0.02 for i in range(3)}
    out["embed.weight"] = torch.randn(1000, 64, generator=g) * 0.02  # 128 KB in bf16: sliced over buckets
    out["norm.weight"] = 1.0 + torch.randn(512, generator=g) * 0.01
    return out


def bf16(master: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


def delta_receiver(endpoint: str, secret: SessionSecret, config: SyncConfig, pushes: int, out) -> None:
    """An engine in its own process: bf16 weights of another seed, ``pushes`` receives into them."""
    dest = bf16(small_model(seed=99))
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            report = receiver.receive(into=dest)
            out.put((report.version, report.base_version, report.bytes, digest(dest.items())))


def test_rl_steps_over_shm_arrive_bit_exact_as_a_fraction_of_the_bytes(private_tmp, spawn):
    """fp32 master weights cast to bf16 on the way (the compare is on the wire dtype's bits): push 1 is full,
    then deltas, ``full=True`` forces one; the engine process holds the trainer's bf16 bits after each."""
    master, secret, out = small_model(seed=0), SessionSecret.generate(), spawn.ctx.Queue()
    config = dataclasses.replace(CFG, cast_dtype="bfloat16")
    full_bytes = sum(t.numel() * 2 for t in master.values())
    with WeightSender(secret, config) as sender:
        engine = spawn(delta_receiver, sender.endpoint, secret, config, 5, out)
        for version in range(1, 6):
            rl_step(master, version)
            report = sender.push(master.items(), version, full=version == 4)
            got_version, got_base, got_bytes, got = out.get(timeout=60)
            assert got_version == version and got == digest(bf16(master).items())  # bit for bit
            if version in (1, 4):  # the first push, and the forced one
                assert report.base_version is None and got_base is None
                assert report.bytes == report.sent_as_full == full_bytes and report.sent_as_delta == 0
            else:
                assert report.base_version == got_base == version - 1
                assert 0 < report.density < 0.15  # ~10% of the elements change their bf16 bits per step
                assert report.bytes == got_bytes == report.sent_as_delta + report.sent_as_full
                assert report.bytes < full_bytes / 4
        engine.join(timeout=30)
        assert engine.exitcode == 0


def test_buckets_of_tensors_in_the_wire_dtype_are_encoded_in_place_the_others_through_the_scratch(
    private_tmp, in_thread
):
    """Note [a delta read in place]: a bucket of contiguous bf16 tensors is compared and gathered straight from
    the trainer's tensors, a bucket holding a cast (fp32 -> bf16) or a non-contiguous tensor is packed into the
    scratch first; both arrive bit-exact as deltas, push after push, with the tensors changed in place."""
    g = torch.Generator().manual_seed(11)
    model = {
        "a.weight": (torch.randn(256, 512, generator=g) * 0.02).to(torch.bfloat16),  # 4 buckets, in place
        "b.master": torch.randn(64, 256, generator=g) * 0.02,  # fp32, cast on the way
        "c.weight": (torch.randn(256, 128, generator=g) * 0.02).to(torch.bfloat16).t(),  # not contiguous
    }
    dest = {n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in model.items()}
    config = dataclasses.replace(CFG, cast_dtype="bfloat16")
    with session_pair(config) as (sender, receiver):
        for version in range(1, 5):
            for t in model.values():
                t.view(-1)[version::61].add_(0.01) if t.is_contiguous() else t.t().reshape(-1)[::59].add_(
                    0.01
                )
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(model.items(), version)
            assert got.result(timeout=30).version == version
            assert report.base_version == (None if version == 1 else version - 1)
            assert all(same_bits(dest[n], t.to(torch.bfloat16)) for n, t in model.items()), version
        in_place = [pairs is not None for pairs in sender._delta._in_place]
    assert in_place[:4] == [True] * 4 and not any(in_place[4:]), in_place


def test_anchors_every_n_pushes(private_tmp, in_thread):
    master = small_model(seed=1)
    dest = bf16(small_model(seed=2))
    config = dataclasses.replace(CFG, cast_dtype="bfloat16", delta_full_every=3)
    bases = []
    with session_pair(config) as (sender, receiver):
        for version in range(1, 8):
            rl_step(master, version)
            got = in_thread(receiver.receive, into=dest)
            bases.append(sender.push(master.items(), version).base_version)
            assert got.result(timeout=30).base_version == bases[-1]
            assert all(same_bits(dest[n], t) for n, t in bf16(master).items())
    assert bases == [None, 1, 2, None, 4, 5, None]  # a full push, then two deltas, again and again


def test_a_receiver_at_another_version_gets_a_full_push_in_the_same_round(private_tmp, in_thread):
    """The engine dropped its weights (what raysync.ray.endpoint does after a sleep that discards them: its
    version becomes None), then takes one push with a load function (which cannot take a delta): each push is
    full, in the same call, and bit-exact; the next one is a delta again."""
    master = bf16(small_model(seed=3))
    dest = bf16(small_model(seed=4))
    loaded: dict[str, torch.Tensor] = {}
    with session_pair(CFG) as (sender, receiver):
        for version in range(1, 6):
            for t in master.values():  # a change of a few elements per tensor
                t.view(-1)[version::97].add_(1.0)
            if version == 3:
                for t in dest.values():
                    t.zero_()
                receiver.version = None
            kwargs = (
                {"load_fn": lambda b: loaded.update((n, t.clone()) for n, t in b)} if version == 4 else {}
            )
            got = in_thread(receiver.receive, **(kwargs or {"into": dest}))
            report = sender.push(master.items(), version)
            assert got.result(timeout=30).version == version
            assert report.base_version == (None if version in (1, 3, 4) else version - 1), version
            held = loaded if version == 4 else dest
            assert all(same_bits(held[n], t) for n, t in master.items()), version
            if version == 4:
                for n, t in loaded.items():
                    dest[n].copy_(t)  # the engine's weights are the pushed ones again


def test_a_fanout_reader_at_another_version_gets_a_full_push_after_the_others_delta(private_tmp, in_thread):
    """N readers of one shm ring: the reader that lost its version waits while the other takes the delta,
    then gets a full push, in the same push; both bit-exact; the next push is a delta for both again."""
    master = bf16(small_model(seed=5))
    dests = [bf16(small_model(seed=6)), bf16(small_model(seed=7))]
    secret = SessionSecret.generate()
    full_bytes = sum(t.nbytes for t in master.values())
    with WeightSender(secret, CFG, receivers=2) as sender:
        receivers = [WeightReceiver(e, secret, CFG) for e in sender.endpoints]
        try:
            for version in (1, 2, 3, 4):
                for t in master.values():
                    t.view(-1)[version::89].add_(1.0)
                if version == 3:
                    receivers[1].version = None  # one reader lost its weights' version
                got = [in_thread(r.receive, into=d) for r, d in zip(receivers, dests, strict=True)]
                report = sender.push(master.items(), version)
                bases = [g.result(timeout=30).base_version for g in got]
                assert all(same_bits(d[n], t) for d in dests for n, t in master.items()), version
                if version == 1:
                    assert bases == [None, None] and report.base_version is None
                elif version == 3:  # in turns: the delta to reader 0, then a full push to reader 1
                    assert bases == [2, None] and report.base_version is None
                    assert full_bytes < report.bytes < 1.5 * full_bytes  # both turns' bytes
                else:
                    assert bases == [version - 1] * 2 == [report.base_version] * 2
                    assert sender.packed_buckets == report.buckets  # packed once for both
        finally:
            for r in receivers:
                r.close()


def test_verify_checks_the_result_not_the_delta(private_tmp, in_thread):
    """A delta applied on top of weights that are not what their version says lands a wrong result: verify
    compares the result with the sender's and refuses it; the next push is full and repairs it."""
    master = bf16(small_model(seed=8))
    dest = bf16(small_model(seed=9))
    with session_pair(CFG) as (sender, receiver):
        for version in (1, 2, 3):
            for t in master.values():
                t.view(-1)[version::101].add_(1.0)
            if version == 2:
                dest["norm.weight"][0] += 1.0  # behind the version's back
            got = in_thread(receiver.receive, into=dest)
            if version == 2:
                with pytest.raises(RemoteError, match="verify"):  # the receiver's Abort
                    sender.push(master.items(), version)
                with pytest.raises(PushIncomplete) as e:
                    got.result(timeout=30)
                assert isinstance(e.value.__cause__, IntegrityError) and receiver.version == MIXED
                assert "norm.weight" in e.value.undelivered
                continue
            report = sender.push(master.items(), version)
            assert got.result(timeout=30).version == version and report.base_version is None
            assert all(same_bits(dest[n], t) for n, t in master.items())


def forever_sender(secret: SessionSecret, config: SyncConfig, out) -> None:
    """Pushes deltas forever (until killed), a few elements changed per push; tells the parent its endpoint."""
    master = bf16(small_model(seed=10))
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        for version in range(1, 1000):
            for t in master.values():
                t.view(-1)[version::53].add_(1.0)
            sender.push(master.items(), version)


def test_a_sender_killed_mid_delta_push_leaves_mixed_not_wrong_weights(private_tmp, spawn):
    config = dataclasses.replace(CFG, timeout_s=3, verify=False)
    secret, out = SessionSecret.generate(), spawn.ctx.Queue()
    sender = spawn(forever_sender, secret, config, out)
    dest = bf16(small_model(seed=11))
    with WeightReceiver(out.get(timeout=60), secret, config) as receiver:
        assert receiver.receive(into=dest).base_version is None
        assert receiver.receive(into=dest).base_version == 1
        steps = receiver.receiving(into=dest)
        next(steps)  # the first bucket of the third push (a delta from 2) is in
        os.kill(sender.pid, signal.SIGKILL)
        with pytest.raises(PushIncomplete) as e:
            for _ in steps:
                pass
        assert e.value.mixed and receiver.version == MIXED  # says what it holds: no version
    sender.join(timeout=10)
    assert sender.exitcode == -signal.SIGKILL


@pytest.mark.parametrize(
    "body, ok",
    [
        ({"delta": True, "base_version": 3}, True),
        ({"delta": False, "base_version": 0}, True),
        ({"delta": False, "base_version": 3}, False),
        ({"delta": 1, "base_version": 3}, False),
        ({"delta": True, "base_version": -1}, False),
    ],
)
def test_push_start_schema_refuses_a_base_version_without_a_delta(body, ok):
    frame = {"push_id": 1, "version": 4, "layout_id": 1, "verify": False, "checks": False, **body}
    if ok:
        assert _decode_body(PushStart, frame, "PushStart").base_version == body["base_version"]
    else:
        with pytest.raises(SchemaError):
            _decode_body(PushStart, frame, "PushStart")
