"""A sender and a receiver in one process, two threads: the protocol, its errors and its versions."""

from __future__ import annotations

import os
import re
import stat
import struct
import tempfile

import pytest
import torch
from conftest import same_bits, session_pair
from workers import StagingLoader

from raysync import (
    LayoutError,
    PeerTimeout,
    PushIncomplete,
    RemoteError,
    SessionClosed,
    SessionSecret,
    ShmSpaceError,
    SyncConfig,
    WeightReceiver,
    WeightSender,
)
from raysync.core import leftovers, stream
from raysync.core.errors import EndpointError, SchemaError
from raysync.core.frames import FrameCodec
from raysync.core.version import MIXED
from raysync.core.wire import Hello
from raysync.transport.shm import ring_memory_bytes

CFG = SyncConfig(bucket_bytes=4096, timeout_s=3, progress=False)


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(100, 32, generator=g),  # 12.8 KB: sliced over 4 buckets
        "layer.0.weight": torch.randn(32, 32, generator=g),
        "layer.0.bias": torch.randn(32, generator=g),
        "scale": torch.tensor(3.0),
        "empty": torch.empty(0, 4),
        "steps": torch.arange(5),
    }


def zeros_like(m: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in m.items()}


def test_pushes_are_bit_exact_and_versioned(private_tmp, in_thread):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        for version in (1, 2, 3):
            src = model(version)
            got = in_thread(receiver.receive, into=dest)
            report = sender.push(src.items(), version)
            assert got.result(timeout=10).version == version == receiver.version
            assert report.bytes == sum(t.nbytes for t in src.values()) and report.buckets > 4
            assert all(same_bits(dest[k], v) for k, v in src.items())


@pytest.mark.parametrize("verify", [False, True])
def test_same_tensor_objects_updated_in_place_or_given_new_data(private_tmp, in_thread, verify):
    """A training loop passes the same tensor objects every push: the sender packs them before it checks
    them. Updated in place, that packing is the push; given new storage (``p.data = ...``) it is stale and
    must be packed again (and, verified, its digests dropped)."""
    cfg = SyncConfig(bucket_bytes=4096, timeout_s=3, progress=False, verify=verify)
    with session_pair(cfg) as (sender, receiver):
        src = model(1)
        dest = zeros_like(src)
        for version in (1, 2, 3, 4, 5):
            if version == 2:
                for t in src.values():
                    t.add_(1)  # in place: same storage
            if version == 3:
                src["embed.weight"].data = src["embed.weight"] * 3  # same object, new storage
                src["layer.0.bias"].data = torch.full((32,), 7.0)
            if version == 4:
                w = src["layer.0.weight"]
                w.data = w.data.t()  # same object, same storage and data pointer, another stride
            if version == 5:
                src["layer.0.bias"].data = torch.randn(16)  # same object, another shape: a new layout
                dest["layer.0.bias"] = torch.zeros(16)
            got = in_thread(receiver.receive, into=dest)
            sender.push(src.items(), version)
            assert got.result(timeout=10).version == version
            assert all(same_bits(dest[k], v) for k, v in src.items()), version


class CheckingSender(WeightSender):
    """Checks its tensors after PushStart, as direct mode's sender does for the same tensor objects (Note [start,
    then check] in raysync.core.session), here over shm: the receiver's half of that protocol runs on the CPU."""

    _checks_after_start = True


@pytest.mark.parametrize("verify", [False, True])
def test_a_push_checked_after_its_start_commits_only_on_the_senders_word(private_tmp, in_thread, verify):
    """Note [start, then check]: the receiver commits once the sender's Checked says the tensors are the same,
    and when they moved (new storage, another stride, another shape with the destinations changed to match,
    which the receiver refuses until the sender takes the start back) it drops the push within the same receive
    and takes it again, bit-exact. A staged sink waits for Checked before its first read, so a ring plane can
    carry this here (an in-place sink reads first: only direct mode, whose reads ask nothing more of the
    sender, runs it so)."""
    from raysync.core.wire import Checked

    cfg = SyncConfig(bucket_bytes=4096, timeout_s=5, progress=False, verify=verify, staged=True)
    secret = SessionSecret.generate()
    with CheckingSender(secret, cfg) as sender, WeightReceiver(sender.endpoint, secret, cfg) as receiver:
        channel = sender._channel.channels[0]
        send, checks = channel.send, []

        def send_and_note(msg, stage):  # every message still goes out
            if isinstance(msg, Checked):
                checks.append((msg.push_id, msg.same))
            send(msg, stage)

        channel.send = send_and_note
        src = model(1)
        dest = zeros_like(src)
        for version in (1, 2, 3, 4, 5):
            if version == 2:
                for t in src.values():
                    t.add_(1)  # in place: the same tensors
            if version == 3:
                src["embed.weight"].data = src["embed.weight"] * 3  # same object, new storage
            if version == 4:
                w = src["layer.0.weight"]
                w.data = w.data.t()  # same object and data pointer, another stride
            if version == 5:
                src["layer.0.bias"].data = torch.randn(16)  # same object, another shape: a new layout
                dest["layer.0.bias"] = torch.zeros(16)
            got = in_thread(receiver.receive, into=dest)
            sender.push(src.items(), version)
            assert got.result(timeout=10).version == version == receiver.version
            assert all(same_bits(dest[k], v) for k, v in src.items()), version
    # push ids: one per push, and one more for each that started again
    assert checks == [(2, True), (3, False), (5, False), (7, False)]


def test_load_fn_gets_whole_tensors(private_tmp, in_thread):
    loaded: dict[str, torch.Tensor] = {}
    calls: list[int] = []

    def load_weights(batch):
        calls.append(len(batch))
        loaded.update((n, t.clone()) for n, t in batch)

    src = model(5)
    with session_pair(CFG) as (sender, receiver):
        got = in_thread(receiver.receive, load_fn=load_weights)
        sender.push(src.items(), 1)
        got.result(timeout=10)
    assert all(same_bits(loaded[k], v) for k, v in src.items())
    assert sum(calls) == len(src) and len(calls) > 1  # one call per bucket that completes tensors


def test_same_version_twice_is_a_no_op(private_tmp, in_thread):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        got = in_thread(receiver.receive, into=dest)
        report = sender.push(model(2).items(), 1)
        assert report.skipped and report.bytes == 0
        assert got.result(timeout=10).skipped
        assert same_bits(dest["embed.weight"], model(1)["embed.weight"])  # version 1 stays


def test_layout_change_and_cast(private_tmp, in_thread):
    cfg = SyncConfig(
        bucket_bytes=4096, timeout_s=3, progress=False, cast_dtype="bfloat16", keep_dtype=("scale",)
    )
    with session_pair(cfg) as (sender, receiver):
        src = model(1)
        dest = {
            k: torch.zeros_like(
                v, dtype=torch.bfloat16 if v.is_floating_point() and k != "scale" else v.dtype
            )
            for k, v in src.items()
        }
        got = in_thread(receiver.receive, into=dest)
        sender.push(src.items(), 1)
        assert got.result(timeout=10).version == 1
        assert same_bits(dest["embed.weight"], src["embed.weight"].to(torch.bfloat16))
        assert same_bits(dest["scale"], src["scale"])
        part = {k: src[k] * 2 for k in ("layer.0.bias", "steps")}  # a new layout: two tensors only
        got = in_thread(receiver.receive, into=dest)
        sender.push(part.items(), 2)
        assert got.result(timeout=10).tensors == 2
        assert same_bits(dest["layer.0.bias"], part["layer.0.bias"].to(torch.bfloat16))


def test_destination_mismatch_fails_before_any_byte_moves(private_tmp, in_thread):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        dest["layer.0.weight"] = torch.zeros(32, 31)
        got = in_thread(receiver.receive, into=dest)
        with pytest.raises(RemoteError, match=r"layer.0.weight.*float32\[32, 32\].*float32\[32, 31\]") as e:
            sender.push(model(1).items(), 1)
        assert e.value.stage == "accept"
        with pytest.raises(PushIncomplete) as inc:
            got.result(timeout=10)
        assert isinstance(inc.value.__cause__, LayoutError) and len(inc.value.undelivered) == 6
        assert all(not v.any() for v in dest.values()) and receiver.version is None
        del dest["layer.0.weight"]  # unknown name on the receiver
        got = in_thread(receiver.receive, into=dest)
        with pytest.raises(RemoteError, match="'layer.0.weight' has no destination"):
            sender.push(model(1).items(), 1)
        with pytest.raises(PushIncomplete):
            got.result(timeout=10)


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_a_load_fn_failing_at_bucket_k_leaves_mixed_and_the_next_push_is_full(
    private_tmp, in_thread, fail_at
):
    """A load function writes the engine's weights as buckets land: failing at bucket k leaves them a mix, the
    version says "mixed" (not the old number), and the next push, even of the old version, is a full one."""
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        calls = []

        def flaky(batch):
            calls.append(batch)
            if len(calls) == fail_at + 1:
                raise RuntimeError("loader exploded")

        got = in_thread(receiver.receive, load_fn=flaky)
        with pytest.raises(RemoteError, match="loader exploded") as e:
            sender.push(model(2).items(), 2)
        assert "Traceback" in e.value.remote_traceback and "unpack bucket" in e.value.stage
        with pytest.raises(PushIncomplete, match="mix of old and new weights") as inc:
            got.result(timeout=10)
        assert receiver.version == MIXED and inc.value.mixed is True and inc.value.version == 2
        assert set(inc.value.undelivered) >= {n for n, _ in calls[-1]} and inc.value.undelivered
        got = in_thread(receiver.receive, into=dest)  # the old version's number again: still a full push
        report = sender.push(model(1).items(), 1)
        assert not report.skipped and report.bytes > 0
        assert got.result(timeout=10).version == 1 == receiver.version
        assert all(same_bits(dest[k], v) for k, v in model(1).items())


@pytest.mark.parametrize("staged", [False, True])
def test_a_sender_failing_mid_push_leaves_mixed_unless_staged(private_tmp, in_thread, staged):
    cfg = SyncConfig(bucket_bytes=4096, timeout_s=3, progress=False, staged=staged)
    with session_pair(cfg) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        bad = model(2)
        bad["layer.0.bias"] = torch.empty(32, device="meta")  # cannot be copied out: packing fails part-way
        bad["scale"] = torch.tensor(4.0)  # after the failing tensor: never sent
        got = in_thread(receiver.receive, into=dest)
        with pytest.raises(NotImplementedError, match="meta"):
            sender.push(bad.items(), 2)
        with pytest.raises(PushIncomplete, match="layer.0.bias") as inc:
            got.result(timeout=10)
        assert isinstance(inc.value.__cause__, RemoteError) and "pack bucket" in inc.value.stage
        assert "embed.weight" not in inc.value.undelivered and inc.value.mixed is (not staged)
        if staged:  # landed in the staging copy only: the weights are version 1, whole
            assert receiver.version == 1 and "not touched" in str(inc.value)
            assert all(same_bits(dest[k], v) for k, v in model(1).items())
        else:  # a mix: the new embedding, the old scale
            assert receiver.version == MIXED and "mix of old and new" in str(inc.value)
            assert same_bits(dest["embed.weight"], bad["embed.weight"]) and dest["scale"].item() == 3.0
        got = in_thread(receiver.receive, into=dest)
        report = sender.push(model(1).items(), 1)
        assert report.skipped is staged  # only intact weights may skip a push of the version they hold
        assert got.result(timeout=10).version == 1 == receiver.version
        assert all(same_bits(dest[k], v) for k, v in model(1).items())


@pytest.mark.parametrize("fail", ["call", "restore", "mixed"])
def test_a_staging_load_fn_keeps_the_old_version_unless_its_apply_says_mixed(private_tmp, in_thread, fail):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, load_fn=StagingLoader(dest))
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        got = in_thread(receiver.receive, load_fn=StagingLoader(dest, fail))
        with pytest.raises(RemoteError, match="exploded|old weights are back|cannot undo"):
            sender.push(model(2).items(), 2)
        with pytest.raises(PushIncomplete) as inc:
            got.result(timeout=10)
        if fail == "mixed":
            assert receiver.version == MIXED and inc.value.mixed is True and inc.value.stage == "apply"
            assert same_bits(dest["embed.weight"], model(2)["embed.weight"])
        else:
            assert receiver.version == 1 and inc.value.mixed is False
            assert all(same_bits(dest[k], v) for k, v in model(1).items())
        got = in_thread(receiver.receive, load_fn=StagingLoader(dest))
        sender.push(model(3).items(), 3)
        assert got.result(timeout=10).version == 3
        assert all(same_bits(dest[k], v) for k, v in model(3).items())


def test_a_load_fn_check_refuses_a_push_before_any_byte_moves(private_tmp, in_thread):
    seen: list[list[str]] = []

    class Checked(StagingLoader):
        def check(self, specs) -> None:  # the engine's own check of names, dtypes, shapes
            seen.append([s.name for s in specs])
            if any(s.name == "steps" for s in specs):
                raise ValueError("the model has no tensor 'steps'")

    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, load_fn=Checked(dest))
        with pytest.raises(
            RemoteError, match="refused the push: ValueError: the model has no tensor 'steps'"
        ):
            sender.push(model(1).items(), 1)
        with pytest.raises(PushIncomplete) as inc:
            got.result(timeout=10)
        assert isinstance(inc.value.__cause__, LayoutError) and inc.value.stage == "accept"
        assert receiver.version is None and not inc.value.mixed and all(not v.any() for v in dest.values())
        got = in_thread(receiver.receive, load_fn=Checked(dest))
        src = {k: v for k, v in model(1).items() if k != "steps"}
        sender.push(src.items(), 1)
        assert got.result(timeout=10).version == 1 and seen[-1] == list(src)
        assert all(same_bits(dest[k], v) for k, v in src.items())


def _raising_source(tensors: dict[str, torch.Tensor], at: int):
    """The trainer's source, failing at its ``at``-th tensor (a gather that fails, a tensor that is gone)."""
    for k, item in enumerate(tensors.items()):
        if k == at:
            raise KeyError(f"no tensor number {at}: the source broke")
        yield item


def test_a_source_that_raises_ends_the_receivers_wait_at_once(private_tmp, in_thread):
    """The sender knows its source failed before the push starts: the receiver hears it then (an Abort),
    not after timeout_s (120 s here; each wait below is bounded by 10 s), and nothing is touched."""
    cfg = SyncConfig(bucket_bytes=4096, timeout_s=120, progress=False)
    with session_pair(cfg) as (sender, receiver):
        dest = zeros_like(model(0))
        for version, first in ((1, True), (2, False)):  # before the session is up, and during it
            got = in_thread(receiver.receive, into=dest)
            with pytest.raises(KeyError, match="the source broke"):
                sender.push(_raising_source(model(version), at=1), version)
            with pytest.raises(RemoteError, match="KeyError.*the source broke") as e:
                got.result(timeout=10)
            assert e.value.stage == "source" and receiver.version == (None if first else 1)
            assert all(
                same_bits(dest[k], v) for k, v in (zeros_like(model(0)) if first else model(1)).items()
            )
            got = in_thread(receiver.receive, into=dest)  # the session goes on
            sender.push(model(version).items(), version)
            assert got.result(timeout=10).version == version


def test_timeouts_name_peer_and_stage(private_tmp):
    secret = SessionSecret.generate()
    cfg = SyncConfig(timeout_s=0.5, progress=False)
    with WeightSender(secret, cfg) as sender:
        with pytest.raises(PeerTimeout, match=r"receiver.*handshake") as e:
            sender.push(model(0).items(), 1)
        assert e.value.timeout_s == 0.5
    with WeightReceiver("ipc:///nonexistent/raysync-test", secret, cfg) as receiver:
        with pytest.raises(PeerTimeout, match=r"sender at ipc:///nonexistent.*handshake"):
            receiver.receive(into={})


def test_private_endpoint_is_0700_and_removed_once_connected(private_tmp, in_thread):
    secret = SessionSecret.generate()
    with WeightSender(secret, CFG) as sender:
        path = sender.endpoint.removeprefix("ipc://")
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        with WeightReceiver(sender.endpoint, secret, CFG) as receiver:
            got = in_thread(receiver.receive, into=zeros_like(model(0)))
            sender.push(model(0).items(), 1)
            got.result(timeout=10)
            assert not os.path.exists(os.path.dirname(path))  # gone while the session runs


def test_endpoint_rules(private_tmp, in_thread):
    secret = SessionSecret.generate()
    taken = os.path.join(private_tmp, "taken.sock")
    open(taken, "w").close()
    with pytest.raises(EndpointError, match="exists already"):
        WeightSender(secret, CFG, endpoint=f"ipc://{taken}")
    os.unlink(taken)
    for anywhere in ("tcp://0.0.0.0:*", "tcp://*:*"):
        with pytest.raises(EndpointError, match="every interface"):
            WeightSender(secret, CFG, endpoint=anywhere)
    with WeightSender(
        secret, CFG, endpoint="tcp://127.0.0.1:*"
    ) as sender:  # other nodes: tcp on one interface
        assert sender.endpoint.startswith("tcp://127.0.0.1:")
        with WeightReceiver(sender.endpoint, secret, CFG) as receiver:
            dest = zeros_like(model(0))
            got = in_thread(receiver.receive, into=dest)
            sender.push(model(4).items(), 1)
            got.result(timeout=10)
            assert same_bits(dest["embed.weight"], model(4)["embed.weight"])


def test_intruders_without_the_key_are_closed_unanswered(private_tmp, in_thread):
    """Connections to the sender's endpoint that send a Hello signed with another key, a frame that is no
    frame of the wire, or a length over the bound are closed, never answered; the receiver's push goes on."""
    secret = SessionSecret.generate()
    with WeightSender(secret, CFG) as sender:
        forged = FrameCodec(SessionSecret(secret.session_id, b"k" * 32), "receiver", "sender", 1 << 16)
        intruders = [stream.connect(sender.endpoint, 1 << 16, 10) for _ in range(3)]
        intruders[0].send(forged.encode(Hello(1, "evil")), 10)  # right session id, wrong key
        intruders[1].send(b"\x80\x04garbage", 10)
        intruders[2].sock.sendall(struct.pack("!I", 1 << 30))  # a frame of 1 GiB announced
        with WeightReceiver(sender.endpoint, secret, CFG) as receiver:
            dest = zeros_like(model(0))
            got = in_thread(receiver.receive, into=dest)
            sender.push(model(6).items(), 1)
            got.result(timeout=10)
            assert same_bits(dest["embed.weight"], model(6)["embed.weight"])
        for intruder in intruders:  # closed by the sender, nothing sent
            with pytest.raises(ConnectionError):  # the end (or a reset: its frame was left unread)
                intruder.recv(10)
            intruder.close()


def test_long_temp_dir_falls_back_to_tmp(private_tmp, monkeypatch, in_thread):
    long_dir = os.path.join(private_tmp, "x" * 90)
    os.mkdir(long_dir)
    monkeypatch.setattr(tempfile, "tempdir", long_dir)  # a socket path there would pass 107 bytes
    secret = SessionSecret.generate()
    with WeightSender(secret, CFG) as sender:
        assert sender.endpoint.startswith("ipc:///tmp/raysync-") and len(sender.endpoint) < 107
        with WeightReceiver(sender.endpoint, secret, CFG) as receiver:
            got = in_thread(receiver.receive, into=zeros_like(model(0)))
            sender.push(model(0).items(), 1)
            got.result(timeout=10)
    os.rmdir(long_dir)


def test_a_sender_that_cannot_build_its_ring_fails_both_sides_at_once(private_tmp, in_thread):
    free = ring_memory_bytes()  # memfds: the memory a ring may take, not /dev/shm's size
    cfg = SyncConfig(bucket_bytes=(free // 2 + (1 << 20)) // 256 * 256, timeout_s=30, progress=False)
    with session_pair(cfg) as (sender, receiver):
        got = in_thread(receiver.receive, into={})
        with pytest.raises(ShmSpaceError):
            sender.push(model(0).items(), 1)
        with pytest.raises(RemoteError, match="ShmSpaceError") as e:
            got.result(timeout=10)  # told, not left to time out after 30 s
        assert e.value.stage == "handshake: ring"


def test_bad_versions_are_refused_before_sending(private_tmp, in_thread):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        for bad in (-1, "7", 2**64):
            with pytest.raises(SchemaError):
                sender.push(model(1).items(), bad)
        sender.push(model(1).items(), 1)  # the session is still fine
        assert got.result(timeout=10).version == 1


def test_close_ends_the_receivers_wait(private_tmp, in_thread):
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        got = in_thread(receiver.receive, into=dest)
        sender.close()
        with pytest.raises(SessionClosed):
            got.result(timeout=10)


def test_destinations_are_checked_again_when_they_change(private_tmp, in_thread):
    """Refused destinations, then a new tensor (its bytes must land in it, not the old one), then refused again
    and the same tensor given back (the same addresses, as a new tensor can also get: the views dropped with
    the refusal are made again, not reused; they were, the receiver raised AttributeError and the sender waited
    timeout_s)."""
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        for version in (1, 2):  # the second push reuses the checked views
            got = in_thread(receiver.receive, into=dest)
            sender.push(model(version).items(), version)
            got.result(timeout=10)
        assert same_bits(dest["embed.weight"], model(2)["embed.weight"])
        for version, after in ((4, torch.zeros(32, 32)), (6, None)):
            kept = dest["layer.0.weight"]
            dest["layer.0.weight"] = torch.zeros(32, 31)
            got = in_thread(receiver.receive, into=dest)
            with pytest.raises(RemoteError, match=r"float32\[32, 31\]"):
                sender.push(model(version - 1).items(), version - 1)
            with pytest.raises(PushIncomplete):
                got.result(timeout=10)
            dest["layer.0.weight"] = kept if after is None else after
            got = in_thread(receiver.receive, into=dest)
            sender.push(model(version).items(), version)
            assert got.result(timeout=10).version == version
            assert same_bits(dest["layer.0.weight"], model(version)["layer.0.weight"])


def test_config_checks_and_environment(monkeypatch):
    with pytest.raises(ValueError, match="multiple of align_bytes"):
        SyncConfig(bucket_bytes=1000)
    with pytest.raises(TypeError, match="tuple of names"):
        SyncConfig(keep_dtype="*.norm")
    monkeypatch.setenv("RAYSYNC_BUCKET_BYTES", str(1 << 20))
    monkeypatch.setenv("RAYSYNC_TIMEOUT_S", "7.5")
    monkeypatch.setenv("RAYSYNC_CUDA_GRAPHS", "0")
    monkeypatch.setenv("RAYSYNC_VERIFY", "Yes")
    cfg = SyncConfig.from_env(num_buffers=3)
    assert (cfg.bucket_bytes, cfg.timeout_s, cfg.num_buffers) == (1 << 20, 7.5, 3)
    assert (cfg.cuda_graphs, cfg.verify, cfg.staged) == (False, True, False)
    monkeypatch.setenv("RAYSYNC_STAGED", "maybe")
    with pytest.raises(ValueError, match="RAYSYNC_STAGED='maybe'"):
        SyncConfig.from_env()


def _ring_mappings() -> set[str]:
    """The shared-memory segments this process has mapped whose names say this process made them."""
    tag = re.escape(leftovers.owner_tag())
    with open("/proc/self/maps") as maps:
        return {m.group(0) for line in maps if (m := re.search(tag + r"-\S+", line))}


def test_a_failed_push_the_caller_keeps_does_not_keep_the_ring_mapped(private_tmp, in_thread):
    """The receiver's cached copies hold views of the ring. An exception the caller keeps holds the frames of
    the failed receive; nothing in them may hold those copies, or closing the session would not unmap the
    ring (a GPU test caught this: the dead sender's ring memory did not come back)."""
    before = _ring_mappings()
    with session_pair(CFG) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        got.result(timeout=10)

        def boom(batch):
            raise RuntimeError("loader exploded")

        got = in_thread(receiver.receive, load_fn=boom)
        with pytest.raises(RemoteError):
            sender.push(model(2).items(), 2)
        kept = got.exception(timeout=10)
        assert isinstance(kept, PushIncomplete) and kept.__traceback__ is not None
        assert _ring_mappings() - before  # the ring, mapped here (by both sides)
    assert _ring_mappings() - before == set()  # closed: unmapped, while the caller still holds the error
    assert kept.__traceback__ is not None


def test_a_tensor_the_layout_refuses_ends_the_receivers_wait_at_once(private_tmp, in_thread):
    """Once the session is up, a tensor the sender's own checks refuse (17 dimensions: over the wire's bound)
    reaches the receiver as an Abort naming it, not as a timeout (120 s here; each wait is bounded by 10 s)."""
    from raysync.core.errors import RaysyncError

    cfg = SyncConfig(bucket_bytes=4096, timeout_s=120, progress=False)
    with session_pair(cfg) as (sender, receiver):
        dest = zeros_like(model(0))
        got = in_thread(receiver.receive, into=dest)
        sender.push(model(1).items(), 1)
        assert got.result(timeout=10).version == 1
        bad = [*model(2).items(), ("too_many_dims", torch.zeros([1] * 17))]
        got = in_thread(receiver.receive, into=dest)
        with pytest.raises(RaysyncError, match="too_many_dims.*bad shape"):
            sender.push(bad, 2)
        with pytest.raises(RemoteError, match="too_many_dims.*bad shape") as e:
            got.result(timeout=10)
        assert e.value.stage in ("select", "layout") and receiver.version == 1
        assert all(same_bits(dest[k], v) for k, v in model(1).items())
        got = in_thread(receiver.receive, into=dest)  # the session goes on
        sender.push(model(3).items(), 3)
        assert got.result(timeout=10).version == 3


def test_a_kept_error_keeps_no_ring_buffer_alive_after_close(private_tmp, in_thread):
    """Note [a kept error keeps nothing mapped]: a caller that keeps the PushIncomplete of a push that failed
    mid-stream (its traceback holds the receiver's frames) must not keep the ring's memory once it closed the
    receiver (on a GPU: the ring's, or a dead sender's tensors; caught there by test_gpu)."""
    import gc
    import weakref

    cfg = SyncConfig(bucket_bytes=4096, timeout_s=10, progress=False)
    with session_pair(cfg) as (sender, receiver):
        got = in_thread(receiver.receive, into=zeros_like(model(0)))
        sender.push(model(1).items(), 1)
        got.result(timeout=10)
        buffers = [weakref.ref(b) for b in receiver.ring.buffers]
        calls = []

        def fail_at_second_bucket(batch):
            calls.append(len(batch))
            if len(calls) == 2:
                raise RuntimeError("the loader broke")

        got = in_thread(receiver.receive, load_fn=fail_at_second_bucket)
        with pytest.raises(RemoteError, match="the loader broke"):
            sender.push(model(2).items(), 2)
        with pytest.raises(PushIncomplete) as e:
            got.result(timeout=20)
        kept = e.value  # the caller keeps the error, traceback and all
        receiver.close()
        gc.collect()
        assert kept.__traceback__ is not None and all(ref() is None for ref in buffers)
