"""The shared-memory ring: sealed memfds handed over once, over a private socket, never named in /dev/shm."""

from __future__ import annotations

import dataclasses
import os
import stat

import pytest
import torch
from conftest import mapping_of, own_entries

from raysync.core import leftovers
from raysync.core.errors import LayoutError, PeerLost, ShmSpaceError
from raysync.core.wire import RingInfo
from raysync.transport import registry
from raysync.transport.shm import ShmRingReceiver, ShmRingSender, _room_in, ring_memory_bytes


def own_dev_shm_entries() -> set[str]:
    """What raysync named in /dev/shm for this test's processes (other programs' entries are not looked at)."""
    return {p for p in own_entries() if os.path.dirname(p) == leftovers.SHM_DIR}


def test_the_receiver_maps_the_same_memory_and_nothing_is_ever_named_in_dev_shm(private_tmp):
    before = own_dev_shm_entries()
    sender = ShmRingSender(2, 1 << 16)
    try:
        path, _ = sender.info().handles
        directory = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700 and stat.S_ISSOCK(os.stat(path).st_mode)
        assert own_dev_shm_entries() == before
        sender.buffers[1][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        receiver = ShmRingReceiver(sender.info())
        assert receiver.buffers[1][:4].tolist() == [1, 2, 3, 4]  # the same memory
        for buffer in sender.buffers + receiver.buffers:  # memfds, which have no name in any directory
            assert mapping_of(buffer)[0].startswith("/memfd:raysync-"), mapping_of(buffer)
        assert [mapping_of(b) for b in receiver.buffers] == [mapping_of(b) for b in sender.buffers]
        receiver.buffers[0][-1] = 9
        assert sender.buffers[0][-1] == 9
        sender.receiver_attached()
        assert not os.path.lexists(directory)  # the handoff socket is gone once the receiver has the ring
        receiver.close()
    finally:
        sender.close()
    assert own_dev_shm_entries() == before


def test_the_ring_is_handed_over_once(private_tmp):
    sender = ShmRingSender(1, 1 << 16)
    try:
        first = ShmRingReceiver(sender.info())
        first.close()
        with pytest.raises(PeerLost, match="handoff socket"):  # nobody serves it any more
            ShmRingReceiver(sender.info(), timeout_s=5)
    finally:
        sender.close()


def test_a_ring_larger_than_the_memory_left_is_refused_before_anything_is_made(private_tmp):
    # each buffer alone more than the memory left: other programs free memory meanwhile, but not that much
    wanted = (ring_memory_bytes() // 4096 + 1) * 4096
    with pytest.raises(ShmSpaceError) as e:
        ShmRingSender(2, wanted)
    message = str(e.value)  # the sizes wanted and available, and the fix
    assert f"2 x {wanted} bytes" in message and "MiB available" in message
    assert "bucket_bytes or num_buffers" in message and "--memory" in message


@pytest.mark.parametrize(
    "files, room",
    [  # cgroup v2 and v1 files as the kernel writes them: limit - usage + inactive page cache, or no limit
        ({"max": "1048576", "current": "524288", "stat": "anon 1\ninactive_file 4096\n"}, 528384),
        ({"max": "max", "current": "524288", "stat": "inactive_file 0\n"}, None),
        ({"max": "1048576", "current": "2097152", "stat": "inactive_file 0\n"}, 0),
        (
            {
                "limit_in_bytes": "9223372036854771712",
                "usage_in_bytes": "1",
                "stat": "total_inactive_file 0\n",
            },
            None,
        ),
    ],
)
def test_the_room_under_a_memory_cgroup_limit(private_tmp, files, room):
    for name, text in files.items():
        with open(os.path.join(private_tmp, f"memory.{name}"), "w") as f:
            f.write(text + "\n")
    v2 = "max" in files
    names = (
        ("max", "current", "inactive_file")
        if v2
        else ("limit_in_bytes", "usage_in_bytes", "total_inactive_file")
    )
    assert _room_in(private_tmp, *names) == room


@pytest.mark.parametrize(
    "why, forge",
    [
        ("a path not ours", lambda info: dataclasses.replace(info, handles=("/etc/passwd", info.handles[1]))),
        (
            "a path that climbs",
            lambda info: dataclasses.replace(info, handles=(info.handles[0] + "/../fds", info.handles[1])),
        ),
        ("a short token", lambda info: dataclasses.replace(info, handles=(info.handles[0], "abcd"))),
        ("one handle", lambda info: dataclasses.replace(info, handles=info.handles[:1])),
        ("another transport", lambda info: dataclasses.replace(info, transport="cuda_ipc")),
        ("more buffers than handed over", lambda info: dataclasses.replace(info, num_buffers=2)),
        (
            "another size",
            lambda info: dataclasses.replace(info, buffer_bytes=1 << 20),
        ),  # a longer map: SIGBUS
    ],
)
def test_receiver_refuses_a_ring_it_did_not_expect(private_tmp, why, forge):
    sender = ShmRingSender(1, 1 << 16)
    try:
        forged: RingInfo = forge(sender.info())
        with pytest.raises(LayoutError):
            ShmRingReceiver(forged, timeout_s=5)
    finally:
        sender.close()


def test_registry_names_and_availability():
    import torch

    gpu = torch.cuda.is_available()
    assert registry.available() == (["cuda_ipc"] if gpu else []) + ["shm", "collective"]
    assert registry.sender_class("shm") is ShmRingSender
    from raysync.core.errors import TransportUnavailable

    with pytest.raises(TransportUnavailable, match="built so far"):
        registry.sender_class("carrier-pigeon")
    with pytest.raises(TransportUnavailable, match="not a ring"):
        registry.receiver_class("collective")  # a name off the wire never builds a group half
