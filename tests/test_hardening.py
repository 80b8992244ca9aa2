"""Hostile input, at a small size (benchmarks/fuzz_wire.py runs the same generator at full size for
docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os

import msgpack
import pytest
import torch

from raysync import SessionSecret

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
    from raysync.core.version import MIXED

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
class HostileSender:
    """The sender's end of a control channel, held by a peer that has the session key but sends what it likes:
    a raw stream socket (raysync.core.stream's frames) signing frames as the wire is specified (docs/design.md,
    "The wire"), not through raysync's encoder, so a Layout that raysync's own Layout class refuses to build still
    reaches the receiver. Its ring is a real shm ring (raysync's ShmRingSender), so the receiver under test sets
    up as it would."""

    def __init__(self, secret, endpoint: str):
        from raysync.core import stream
        from raysync.core.frames import FrameCodec
        from raysync.transport.shm import ShmRingSender

        self.secret, self.seq, self.conn = secret, 0, None
        self.key = hmac.new(secret.key, b"raysync/rs1/sender", hashlib.sha256).digest()
        self.codec = FrameCodec(secret, "sender", "receiver", 1 << 20)  # reads the receiver's frames
        self.listener = stream.listen(endpoint)
        self.ring = ShmRingSender(1, 4096)

    def send(self, kind: str, body: dict) -> None:
        self.seq += 1
        payload = msgpack.packb(["rs1", self.secret.session_id, self.seq, kind, body])
        self.conn.send(payload + hmac.new(self.key, payload, hashlib.sha256).digest(), 30)

    def send_message(self, msg) -> None:
        self.send(type(msg).__name__, dataclasses.asdict(msg))

    def recv(self, timeout_s: float = 30):
        from raysync.core import stream

        if self.conn is None:
            self.listener.settimeout(timeout_s)
            self.conn = stream.Connection(self.listener.accept()[0], 1 << 20)
        frame = self.conn.recv(timeout_s)
        if frame is None:
            raise TimeoutError(f"the receiver sent nothing within {timeout_s} s")
        return self.codec.decode(frame)

    def set_up(self) -> None:
        """Answer the receiver's Hello with the ring, as a sender does."""
        from raysync.core.wire import Attached, Hello

        assert isinstance(self.recv(), Hello)
        self.send_message(self.ring.info())
        assert isinstance(self.recv(), Attached)
        self.ring.receiver_attached()

    def close(self) -> None:
        self.ring.close()
        self.listener.close()
        if self.conn is not None:
            self.conn.close()


def _layout(layout_id: int, specs: list[tuple[str, str, list[int]]], bucket_bytes: int = 4096) -> dict:
    return {
        "layout_id": layout_id,
        "bucket_bytes": bucket_bytes,
        "align_bytes": 256,
        "tensors": [{"name": n, "dtype": d, "shape": shape} for n, d, shape in specs],
    }


def _stream_one_bucket(peer: HostileSender, push_id: int, data: bytes) -> None:
    """The rest of an accepted push of one tensor in one bucket: ``data`` into the ring, then the receiver
    frees the buffer and says it applied the push."""
    from raysync.core.wire import BucketFreed, BucketReady, PushDone

    peer.ring.buffers[0][: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    peer.send_message(BucketReady(push_id, 0, 0))
    assert isinstance(peer.recv(), BucketFreed) and isinstance(peer.recv(), PushDone)


@pytest.mark.parametrize(
    "why, specs, refusal",
    [
        ("duplicate names", [("w", "float32", [4]), ("w", "float32", [4])], "more than once"),
        ("unknown dtype", [("w", "float128", [4])], "'float128' is not in the allowlist"),
        ("negative dimension", [("w", "float32", [-4])], "integer -4 out of range"),
        ("absurd size", [("w", "float32", [1 << 40, 1 << 20])], "beyond any real tensor"),
        ("empty name", [("", "float32", [4])], "1..1024 characters, got 0"),
        ("a bucket larger than the ring", [("w", "float32", [4])], "do not fit buffers of 4096 bytes"),
    ],
)
def test_hostile_layouts_are_refused_before_anything_is_touched(private_tmp, in_thread, why, specs, refusal):
    """A sender holding the session key sends a Layout that no honest sender makes, then starts a push of it.
    The receiver refuses the layout (when it decodes it, or, for one that decodes but does not fit its ring,
    when the push starts), answers the push with an Abort instead of an Accept, touches nothing, keeps its
    version, and serves the next, valid layout and push over the same channel."""
    from raysync import PushIncomplete, SyncConfig, WeightReceiver
    from raysync.core.errors import WireError
    from raysync.core.wire import Abort, Accept, PushStart

    config = SyncConfig(bucket_bytes=4096, timeout_s=30, progress=False)
    secret = SessionSecret.generate()
    peer = HostileSender(secret, f"ipc://{private_tmp}/hostile.sock")
    dest = {"w": torch.zeros(4)}
    try:
        with WeightReceiver(f"ipc://{private_tmp}/hostile.sock", secret, config) as receiver:
            got = in_thread(receiver.receive, into=dest)
            peer.set_up()
            bucket = 8192 if why == "a bucket larger than the ring" else 4096
            peer.send("Layout", _layout(1, specs, bucket))
            peer.send_message(PushStart(1, 1, 1))
            errors = [got.exception(timeout=30)]
            if not isinstance(
                errors[0], PushIncomplete
            ):  # refused when decoded: the next receive takes the push
                errors.append(in_thread(receiver.receive, into=dest).exception(timeout=30))
            answer = peer.recv()
            assert isinstance(answer, Abort) and answer.push_id == 1 and answer.stage == "accept", answer
            assert isinstance(errors[0], (WireError, PushIncomplete)) and refusal in str(errors[0]), errors[0]
            assert isinstance(errors[-1], PushIncomplete) and errors[-1].stage == "accept", errors[-1]
            assert receiver.version is None and not dest["w"].any()  # nothing touched
            peer.send("Layout", _layout(2, [("w", "float32", [4])]))  # the channel still serves its sender
            got = in_thread(receiver.receive, into=dest)
            peer.send_message(PushStart(2, 7, 2))
            assert isinstance(peer.recv(), Accept)
            _stream_one_bucket(peer, 2, torch.arange(4, dtype=torch.float32).numpy().tobytes())
            assert got.result(timeout=30).version == 7 == receiver.version
            assert torch.equal(dest["w"], torch.arange(4, dtype=torch.float32))
    finally:
        peer.close()


# --- crashes ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_crash_loop_every_transport_both_sides(private_tmp, capfd, monkeypatch, gloo_warm):
    """Its gloo groups wait 2 s at most: gloo_warm has paid a cold machine's first group (over 5 s) already."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # spawned victims import crash_loop too
    import crash_loop

    r = crash_loop.run(cycles=8, timeout_s=2.0, seed=3)  # each (transport, side) twice
    assert r["untyped"] == [], r["rows"]  # every survivor raised a typed error (each wait is bounded)
    assert all(row["victim_exit"] == -9 for row in r["rows"]), r["rows"]  # and the victim was SIGKILLed
    assert r["leftovers"] == [] and r["clean_session_after"]
    assert r["fds_at_end"] <= r["fds_after_first_round"] + 2
    assert "resource_tracker" not in capfd.readouterr().err


# --- integrity: an end-to-end digest per tensor (SyncConfig.verify) --------------------------------------------------
@pytest.mark.parametrize("mode", ["into", "load_fn"])
def test_a_corrupted_byte_is_detected_and_the_version_rejected(private_tmp, in_thread, monkeypatch, mode):
    import torch
    from conftest import session_pair

    from raysync import PushIncomplete, RemoteError, SyncConfig
    from raysync.core.errors import IntegrityError
    from raysync.core.version import MIXED
    from raysync.transport.shm import ShmRingReceiver

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
