"""The shared-memory ring: private, exclusive, checked, and gone from /dev/shm once mapped."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import raysync_shm_entries

from raysync.errors import LayoutError, ShmSpaceError
from raysync.transport import registry
from raysync.transport.shm import ShmRingReceiver, ShmRingSender
from raysync.wire import RingInfo


def test_segments_are_0600_exclusive_and_unlinked_once_mapped():
    before = raysync_shm_entries()
    sender = ShmRingSender(2, 1 << 16)
    try:
        names = set(sender.info().handles)
        assert raysync_shm_entries() - before == names and len(names) == 2
        for name in names:
            assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
        sender.buffers[1][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        receiver = ShmRingReceiver(sender.info())
        assert raysync_shm_entries() - before == set()  # unlinked the moment they were mapped
        assert receiver.buffers[1][:4].tolist() == [1, 2, 3, 4]  # the same memory
        receiver.buffers[0][-1] = 9
        assert sender.buffers[0][-1] == 9
        receiver.close()
    finally:
        sender.close()
    assert raysync_shm_entries() == before


def test_free_space_is_checked_first():
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    before = raysync_shm_entries()
    wanted = free // 2 + (1 << 20)
    with pytest.raises(ShmSpaceError) as e:
        ShmRingSender(2, wanted)
    message = str(e.value)  # the sizes wanted and free, and the fix
    assert f"2 x {wanted} bytes" in message and "MiB free" in message
    assert "bucket_bytes or num_buffers" in message and "--shm-size" in message
    assert raysync_shm_entries() == before


@pytest.mark.parametrize(
    "why, info",
    [
        ("not ours", lambda name: RingInfo("shm", 1, 1 << 16, ("../../etc/passwd",))),
        ("wrong size", lambda name: RingInfo("shm", 1, 1 << 20, (name,))),  # a longer map would SIGBUS
        ("count mismatch", lambda name: RingInfo("shm", 2, 1 << 16, (name,))),
        ("other transport", lambda name: RingInfo("cuda_ipc", 1, 1 << 16, (name,))),
        (
            "group-readable",
            lambda name: os.chmod(f"/dev/shm/{name}", 0o640) or RingInfo("shm", 1, 1 << 16, (name,)),
        ),
    ],
)
def test_receiver_refuses_what_it_did_not_expect(why, info):
    before = raysync_shm_entries()
    sender = ShmRingSender(1, 1 << 16)
    try:
        with pytest.raises(LayoutError):
            ShmRingReceiver(info(sender.info().handles[0]))
    finally:
        sender.close()
    assert raysync_shm_entries() == before


def test_registry_names_and_availability():
    assert registry.available() == ["shm", "collective"]
    assert registry.sender_class("shm") is ShmRingSender
    from raysync.errors import TransportUnavailable

    with pytest.raises(TransportUnavailable, match="built so far"):
        registry.sender_class("carrier-pigeon")
    with pytest.raises(TransportUnavailable, match="not a ring"):
        registry.receiver_class("collective")  # a name off the wire never builds a group half
