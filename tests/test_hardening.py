"""Hostile input, at a small size (benchmarks/fuzz_wire.py runs the same generator at full size for
docs/reliability.md)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("seed", [1, 2])
def test_hostile_frames_are_all_refused_and_nothing_runs(seed, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import fuzz_wire

    r = fuzz_wire.run(1400, seed=seed)  # 100 frames of each of the 14 kinds
    assert r["crashes"] == [] and r["accepted"] == []
    assert r["pickle_side_effect"] is False and r["receiver_usable_after"] is True
    assert len(r["rejections"]) == 14 and sum(sum(k.values()) for k in r["rejections"].values()) == 1400
    assert r["rss_growth_bytes"] < 64 << 20


# --- atomicity: a failed push never leaves a mix (SyncConfig.staged) -----------------------------------------------
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_push_that_fails_part_way_leaves_no_mix_when_staged(private_tmp, in_thread, staged, fail_at):
    """A "model" whose output reveals a mix: every tensor of version v is filled with v, and the output is the
    set of values in the weights. Without staging the failed push leaves {1, 2} behind; staged, {1}."""
    import torch
    from conftest import session_pair

    from raysync import PushIncomplete, RemoteError, SyncConfig
    from raysync.version import MIXED

    config = SyncConfig(bucket_bytes=4096, timeout_s=5, progress=False, staged=staged)
    names = [f"w{i}" for i in range(6)]  # 6 tensors of 4 KB: one bucket each

    def weights(v: float) -> dict[str, torch.Tensor]:
        return {n: torch.full((1024,), v) for n in names}

    def output(dest: dict[str, torch.Tensor]) -> set[float]:
        return set(torch.cat(list(dest.values())).unique().tolist())

    with session_pair(config) as (sender, receiver):
        dest = weights(0.0)
        got = in_thread(receiver.receive, into=dest)
        sender.push(weights(1.0).items(), 1)
        got.result(timeout=10)
        assert output(dest) == {1.0}
        bad = weights(2.0)
        bad[names[fail_at + 2]] = torch.empty(1024, device="meta")  # packing fails at that bucket
        got = in_thread(receiver.receive, into=dest)
        with pytest.raises(NotImplementedError):
            sender.push(bad.items(), 2)
        with pytest.raises(PushIncomplete) as e:
            got.result(timeout=10)
        assert isinstance(e.value.__cause__, RemoteError) and receiver.version == (1 if staged else MIXED)
        assert output(dest) == ({1.0} if staged else {1.0, 2.0})
        got = in_thread(receiver.receive, into=dest)  # and the next complete push applies all of it
        sender.push(weights(3.0).items(), 3)
        got.result(timeout=10)
        assert output(dest) == {3.0} and receiver.version == 3


# --- hostile layouts: refused before any byte moves -----------------------------------------------------------------
@pytest.mark.parametrize(
    "why, specs",
    [
        ("duplicate names", [("w", "float32", (4,)), ("w", "float32", (4,))]),
        ("unknown dtype", [("w", "float128", (4,))]),
        ("negative dimension", [("w", "float32", (-4,))]),
        ("absurd size", [("w", "float32", (1 << 40, 1 << 20))]),
    ],
)
def test_hostile_layouts_are_refused_before_anything_is_touched(why, specs):
    from raysync.errors import WireError
    from raysync.wire import FrameCodec, Layout, SessionSecret, TensorSpec

    secret = SessionSecret.generate()
    tx = FrameCodec(secret, "sender", "receiver", 1 << 16)
    rx = FrameCodec(secret, "receiver", "sender", 1 << 16)
    with pytest.raises((WireError, ValueError)):  # refused when built, or when decoded
        rx.decode(tx.encode(Layout(1, 4096, 256, tuple(TensorSpec(*s) for s in specs))))


# --- crashes ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_crash_loop_every_transport_both_sides(private_tmp, capfd, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # spawned victims import crash_loop too
    import crash_loop

    r = crash_loop.run(cycles=8, timeout_s=2.0, seed=3)  # each (transport, side) twice
    assert r["untyped"] == [] and r["late"] == [], r["rows"]
    assert r["leftovers"] == [] and r["clean_session_after"]
    assert r["fds_at_end"] <= r["fds_after_first_round"] + 2
    assert "resource_tracker" not in capfd.readouterr().err


# --- integrity: an end-to-end digest per tensor (SyncConfig.verify) --------------------------------------------------
@pytest.mark.parametrize("mode", ["into", "load_fn"])
def test_a_corrupted_byte_is_detected_and_the_version_rejected(private_tmp, in_thread, monkeypatch, mode):
    import torch
    from conftest import session_pair

    from raysync import PushIncomplete, RemoteError, SyncConfig
    from raysync.errors import IntegrityError
    from raysync.transport.shm import ShmRingReceiver
    from raysync.version import MIXED

    config = SyncConfig(bucket_bytes=4096, timeout_s=5, progress=False, verify=True, staged=True)
    src = {f"w{i}": torch.randn(700) for i in range(5)}  # 2.8 KB each: one bucket each
    dest = {k: torch.zeros_like(v) for k, v in src.items()}
    loaded: dict[str, torch.Tensor] = {}
    kwargs = (
        {"into": dest}
        if mode == "into"
        else {"load_fn": lambda b: loaded.update((n, t.clone()) for n, t in b)}
    )
    with session_pair(config) as (sender, receiver):
        got = in_thread(receiver.receive, **kwargs)
        sender.push(src.items(), 1)  # verified and clean
        assert got.result(timeout=10).version == 1
        calls = []
        original = ShmRingReceiver.before_unpack

        def corrupt_third_bucket(self, slot):  # a byte flips in the ring between the sender and the receiver
            calls.append(slot)
            if len(calls) == 3:
                self.buffers[slot][100] ^= 0x10
            original(self, slot)

        monkeypatch.setattr(ShmRingReceiver, "before_unpack", corrupt_third_bucket)
        got = in_thread(receiver.receive, **kwargs)
        with pytest.raises(RemoteError, match="differ from what the sender packed"):
            sender.push({k: v + 1 for k, v in src.items()}.items(), 2)
        with pytest.raises(PushIncomplete) as e:
            got.result(timeout=10)
        assert isinstance(e.value.__cause__, IntegrityError) and e.value.undelivered == ["w2"]
        assert receiver.version == (1 if mode == "into" else MIXED)  # the load function loaded what landed
        if mode == "into":  # staged: the corrupted push never reached the destinations
            assert all(torch.equal(dest[k], src[k]) for k in src)
