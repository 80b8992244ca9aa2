"""Shared memory that nobody can take away, crashes mid-handshake, and the control endpoint's guards.

Proved here, each against the real parts (real processes, memfds, unix sockets, zmq):
- no process can resize a ring segment: a peer process that tries (ftruncate smaller or larger, fallocate past
  the end, another seal), through its own fd of the segment or through the victim's /proc/<pid>/fd, between
  pushes and mid-push, gets EPERM each time, and every push before and after is bit-exact (Note [no SIGBUS]
  in raysync.transport.shm);
- a receiver refuses, typed (LayoutError), every fd it is handed that is not a memfd of the ring's size sealed
  against resizing, and closes it; a connection without the session's token gets nothing and does not use up
  the handoff;
- /dev/shm does not matter any more: with a 4 MiB /dev/shm that is full (no block, no inode left), a ring
  larger than all of it is made and every page written and read back (in a private tmpfs: a user + mount
  namespace, where the machine allows one);
- a sender SIGKILLed between binding and the end of the handshake (before its ring exists, or with its ring
  made and not yet fetched) leaves only a private directory that the next session on the machine removes
  (Note [names that outlive a crash] in raysync.core.leftovers), and a receiver that comes late gets a typed error;
- every spelling of the unspecified address is refused by the bind guard; a clean close of an explicit ipc://
  endpoint frees its path.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import fds_of_segment
from hypothesis import given, settings
from hypothesis import strategies as st

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.control import (
    ReceiverChannel,
    SenderChannel,
    binds_every_interface,
    bound_to_every_interface,
)
from raysync.core.errors import EndpointError, LayoutError, PeerLost, RaysyncError
from raysync.core.leftovers import OWNED, Owner, is_dead, owner_of, sweep, this_process
from raysync.core.wire import Hello, RingInfo
from raysync.transport.fd_handoff import FdHandoff
from raysync.transport.shm import ShmRingReceiver, ShmRingSender

TESTS = os.path.dirname(os.path.abspath(__file__))
CFG = SyncConfig(bucket_bytes=16 << 10, timeout_s=20, progress=False)
BUCKETS = 8  # per push: 8 tensors of 16 KiB, one bucket each, through 2 buffers
PAGE = 4096


def _source(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((4096,), float(version * 10 + i)) for i in range(BUCKETS)}


def _dest() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(4096) for i in range(BUCKETS)}


def _bit_exact(dest: dict[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(dest[k], v) for k, v in _source(version).items())


def _entries_of(pid: int) -> set[str]:
    """Every entry in /dev/shm and the temp dir whose name says process ``pid`` made it."""
    found = set()
    for d in ("/dev/shm", tempfile.gettempdir()):
        for name in os.listdir(d):
            owner = owner_of(name)
            if owner is not None and owner.pid == pid:
                found.add(os.path.join(d, name))
    return found


def _outcome(conn, child) -> tuple:
    """What the victim reported, or how it died (the parent's end of its pipe is closed: EOF when it dies)."""
    try:
        if conn.poll(60):
            return conn.recv()
    except EOFError:
        pass
    child.join(timeout=30)
    return ("died", child.exitcode)  # -7: SIGBUS


def _report(conn, e: BaseException) -> None:
    cause = type(e.__cause__).__name__ if e.__cause__ is not None else ""
    conn.send(("error", type(e).__name__, str(e), cause))


# --- a segment nobody can resize ------------------------------------------------------------------------------------
def victim_sender(secret: SessionSecret, config: SyncConfig, conn) -> None:
    """Pushes version 1, 2, ...; waits for "go" before each push; reports every push and the error it ends with."""
    try:
        with WeightSender(secret, config) as sender:
            conn.send(("endpoint", sender.endpoint))
            for version in range(1, 5):
                conn.recv()  # "go"
                sender.push(_source(version).items(), version)
                conn.send(("pushed", version))
    except RaysyncError as e:
        _report(conn, e)


def victim_receiver(endpoint: str, secret: SessionSecret, config: SyncConfig, conn) -> None:
    """Receives 4 pushes, and reports each with whether its bytes are exactly the sender's."""
    try:
        with WeightReceiver(endpoint, secret, config) as receiver:
            for _ in range(4):
                dest = _dest()
                version = receiver.receive(into=dest).version
                conn.send(("received", version, _bit_exact(dest, version)))
    except RaysyncError as e:
        _report(conn, e)


def _try_to_resize(fd: int) -> dict[str, int]:
    """What a hostile holder of a segment tries; the errno each attempt got (0: it worked), and the size after."""
    size = os.fstat(fd).st_size
    attempts = {
        "shrink to a page": lambda: os.ftruncate(fd, PAGE),
        "shrink to 0": lambda: os.ftruncate(fd, 0),
        "grow": lambda: os.ftruncate(fd, size + PAGE),
        "grow by fallocate": lambda: os.posix_fallocate(fd, size, PAGE),
        "add a seal": lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
    }
    got = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            got[what] = 0
        except OSError as e:
            got[what] = e.errno
    got["size unchanged"] = int(os.fstat(fd).st_size == size)
    return got


REFUSED = {
    "shrink to a page": errno.EPERM,
    "shrink to 0": errno.EPERM,
    "grow": errno.EPERM,
    "grow by fallocate": errno.EPERM,
    "add a seal": errno.EPERM,
    "size unchanged": 1,
}


def _memfds_of(pid: int) -> list[int]:
    """The ring segments process ``pid`` holds, opened through /proc/<pid>/fd as any process of this user can."""
    fds = []
    for name in sorted(os.listdir(f"/proc/{pid}/fd"), key=int):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:raysync-"):
                fds.append(os.open(f"/proc/{pid}/fd/{name}", os.O_RDWR))
        except FileNotFoundError:  # an fd closed meanwhile
            continue
    return fds


def test_a_receiver_cannot_resize_the_senders_ring_and_every_push_stays_bit_exact(
    private_tmp, spawn, in_thread
):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    child = spawn(victim_sender, secret, CFG, theirs)
    theirs.close()
    _, endpoint = _outcome(mine, child)
    tries, exact = [], []
    with WeightReceiver(endpoint, secret, CFG) as receiver:
        mine.send("go")
        dest = _dest()
        exact.append(_bit_exact(dest, receiver.receive(into=dest).version))
        ring = receiver.ring
        assert _outcome(mine, child) == ("pushed", 1)
        victims = _memfds_of(child.pid)  # the sender's own fds of its segments
        assert len(victims) >= CFG.num_buffers  # each segment: our fd, and the dup that Python's mmap keeps
        ours = [fds_of_segment(b)[0] for b in ring.buffers]  # this side's fd of each segment
        attackers = {2: ours[0], 3: victims[0], 4: victims[-1]}
        tries.append(_try_to_resize(ours[1]))  # between pushes, through this side's fd
        unpacked = ring.after_unpack
        for version in (2, 3, 4):  # mid-push: after this side read bucket 2, while the sender packs on
            count = itertools.count()
            ring.after_unpack = lambda slot, v=version, c=count: (
                unpacked(slot),
                next(c) == 2 and tries.append(_try_to_resize(attackers[v])),
            )
            dest = _dest()
            got = in_thread(receiver.receive, into=dest)
            mine.send("go")
            assert got.result(timeout=60).version == version
            exact.append(_bit_exact(dest, version))
            assert _outcome(mine, child) == ("pushed", version)
        for fd in victims:
            os.close(fd)
    child.join(timeout=30)
    assert child.exitcode == 0 and exact == [True] * 4
    assert tries == [REFUSED] * 4


def test_a_sender_cannot_resize_the_receivers_ring_and_every_push_stays_bit_exact(private_tmp, spawn):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    tries, outcomes = [], []
    with WeightSender(secret, CFG) as sender:
        child = spawn(victim_receiver, sender.endpoint, secret, CFG, theirs)
        theirs.close()
        sender.push(_source(1).items(), 1)
        outcomes.append(_outcome(mine, child))
        ring = sender.ring
        victims = _memfds_of(child.pid)  # the receiver's fds of the segments
        assert len(victims) >= CFG.num_buffers  # each segment: our fd, and the dup that Python's mmap keeps
        tries.append(_try_to_resize(victims[1]))  # between pushes, through the victim's fd
        ours = [fds_of_segment(b)[0] for b in ring.buffers]  # this side's fd of each segment
        attackers = {2: ours[0], 3: victims[0], 4: ours[1]}
        packed = ring.after_pack
        for version in (2, 3, 4):  # mid-push: right after packing bucket 3, while the receiver unpacks
            count = itertools.count()
            ring.after_pack = lambda slot, v=version, c=count: (
                packed(slot),
                next(c) == 3 and tries.append(_try_to_resize(attackers[v])),
            )
            sender.push(_source(version).items(), version)
            outcomes.append(_outcome(mine, child))
        for fd in victims:
            os.close(fd)
    child.join(timeout=30)
    assert child.exitcode == 0 and outcomes == [("received", v, True) for v in (1, 2, 3, 4)]
    assert tries == [REFUSED] * 4


# --- fds a receiver must refuse -------------------------------------------------------------------------------------
def _memfd(nbytes: int, seals: int | None, flags: int = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING) -> int:
    fd = os.memfd_create("raysync-test-forged", flags)
    os.ftruncate(fd, nbytes)
    if seals is not None:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _regular_file(nbytes: int) -> int:
    fd, path = tempfile.mkstemp(prefix="forged")
    os.unlink(path)
    os.ftruncate(fd, nbytes)
    return fd


def _read_only(nbytes: int) -> int:
    fd = _memfd(nbytes, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    finally:
        os.close(fd)


def _pipe(nbytes: int) -> int:
    r, w = os.pipe()
    os.close(w)
    return r


ALL_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
FORGED = {
    "memfd that cannot be sealed": (lambda n: _memfd(n, None, os.MFD_CLOEXEC), "without F_SEAL_SHRINK"),
    "memfd, no seals": (lambda n: _memfd(n, None), "without F_SEAL_SHRINK"),
    "memfd, shrink sealed only": (lambda n: _memfd(n, fcntl.F_SEAL_SHRINK), "without F_SEAL_SHRINK"),
    "memfd, seals not sealed": (lambda n: _memfd(n, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW), "without"),
    "memfd sealed against writes": (lambda n: _memfd(n, ALL_SEALS | fcntl.F_SEAL_WRITE), "against writing"),
    "memfd, sealed, too small": (lambda n: _memfd(n - PAGE, ALL_SEALS), f"has {16 * 1024 - PAGE} bytes"),
    "memfd, sealed, read-only fd": (_read_only, "not open for reading and writing"),
    "regular file": (_regular_file, "not a memfd"),
    "pipe": (_pipe, "not a file"),
}


@pytest.mark.parametrize("forged", sorted(FORGED))
def test_a_receiver_refuses_an_fd_that_is_not_a_sealed_memfd(private_tmp, forged):
    make, reason = FORGED[forged]
    nbytes = 16 << 10
    fds_before = set(os.listdir("/proc/self/fd"))
    fd = make(nbytes)
    handoff = FdHandoff([fd], timeout_s=30)  # a hostile sender: the real handoff, serving a forged fd
    os.close(fd)
    try:
        with pytest.raises(LayoutError, match="refusing buffer 0 of the shm ring") as e:
            ShmRingReceiver(RingInfo("shm", 1, nbytes, (handoff.path, handoff.token.hex())), timeout_s=30)
        assert reason in str(e.value) and "SIGBUS" in str(e.value)
    finally:
        handoff.close()
    assert set(os.listdir("/proc/self/fd")) == fds_before  # the refused fd was closed, like the handoff's


def test_a_receiver_refuses_more_fds_than_the_ring_has(private_tmp):
    sender = ShmRingSender(2, 16 << 10)
    try:
        info = sender.info()
        with pytest.raises(LayoutError, match="handed over 2 fds .* the ring has 1 buffers"):
            ShmRingReceiver(RingInfo("shm", 1, info.buffer_bytes, info.handles), timeout_s=30)
    finally:
        sender.close()


def test_a_connection_without_the_token_gets_nothing_and_the_receiver_still_gets_the_ring(private_tmp):
    sender = ShmRingSender(2, 16 << 10)
    try:
        info = sender.info()
        stranger = RingInfo("shm", 2, info.buffer_bytes, (info.handles[0], "ab" * 32))
        with pytest.raises(PeerLost, match="refused this receiver"):
            ShmRingReceiver(stranger, timeout_s=30)
        receiver = ShmRingReceiver(info, timeout_s=30)  # the handoff was not used up
        sender.buffers[0][:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
        assert receiver.buffers[0][:3].tolist() == [7, 8, 9]
        receiver.close()
    finally:
        sender.close()


# --- /dev/shm does not matter ---------------------------------------------------------------------------------------
def _namespaces_work() -> bool:
    try:
        done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def full_dev_shm_case() -> None:
    """In a child whose /dev/shm is 4 MiB and 64 inodes: fill both, then make a ring larger than all of it."""
    for i in itertools.count():  # every inode
        try:
            open(f"/dev/shm/f{i}", "wb").close()
        except OSError:
            break
    os.unlink("/dev/shm/f0")
    with open("/dev/shm/f0", "wb") as f:  # every block
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    st_ = os.statvfs("/dev/shm")
    sender = ShmRingSender(2, 8 << 20)  # 16 MiB
    receiver = ShmRingReceiver(sender.info())
    for k, buffer in enumerate(sender.buffers):  # every page of both buffers, written and read back
        buffer.fill_(k + 1)
    same = all(int(r.sum()) == (k + 1) * r.numel() for k, r in enumerate(receiver.buffers))
    receiver.close()
    sender.close()
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith("raysync-"))
    print(json.dumps({"free_blocks": st_.f_bavail, "free_inodes": st_.f_favail, "same": same, "left": left}))


def test_a_full_dev_shm_does_not_stop_a_ring_larger_than_all_of_it():
    if not _namespaces_work():
        pytest.skip("no user + mount namespace here (unshare -rm): cannot give a child a small /dev/shm")
    code = f"import sys; sys.path.insert(0, {TESTS!r}); import test_shm_hardening as t; t.full_dev_shm_case()"
    script = 'mount -t tmpfs -o size=4m,nr_inodes=64 tmpfs /dev/shm && exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"free_blocks": 0, "free_inodes": 0, "same": True, "left": []}


# --- SIGKILL inside the handshake: the next session removes what was left --------------------------------------------
def sender_waiting(secret: SessionSecret, config: SyncConfig, conn) -> None:
    """Binds, says where, then waits in its first push for a Hello (killed there, or at the ring)."""
    with WeightSender(secret, config) as sender:
        conn.send(sender.endpoint)
        sender.push(_source(1).items(), 1)


def _killed_and_unreaped(child) -> None:
    """SIGKILL ``child`` and wait until it has exited, leaving it a zombie (not reaped), as a crashed process
    whose parent is busy is: its entries must count as dead all the same."""
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)


def test_a_sender_killed_after_binding_leaves_a_directory_the_next_session_removes(private_tmp, spawn):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    child = spawn(sender_waiting, secret, CFG, theirs)
    assert mine.poll(60)
    private_dir = os.path.dirname(mine.recv().removeprefix("ipc://"))
    assert owner_of(os.path.basename(private_dir)).pid == child.pid
    _killed_and_unreaped(child)
    assert _entries_of(child.pid) == {private_dir}  # left behind
    with WeightSender(SessionSecret.generate(), CFG):  # the next session on the machine
        assert _entries_of(child.pid) == set()
    child.join(timeout=10)


def test_a_sender_killed_between_making_its_ring_and_the_attach_leaves_only_what_the_next_session_removes(
    private_tmp, spawn
):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    child = spawn(sender_waiting, secret, CFG, theirs)
    assert mine.poll(60)
    endpoint = mine.recv()
    # a receiver that says Hello and never fetches the ring: the sender waits for Attached
    channel = ReceiverChannel(secret, endpoint=endpoint, timeout_s=CFG.timeout_s, max_frame_bytes=1 << 20)
    try:
        channel.send(Hello(os.getpid(), "test"), "handshake")
        info = channel.expect(RingInfo, 0, "handshake: waiting for the ring description")
    finally:
        channel.close()
    _killed_and_unreaped(child)
    handoff_dir = os.path.dirname(info.handles[0])
    assert _entries_of(child.pid) == {
        handoff_dir
    }  # the segments died with it (memfds); its socket's directory
    with pytest.raises(PeerLost, match="handoff socket"):  # a receiver that comes late: typed, at once
        ShmRingReceiver(info, timeout_s=30)
    with WeightReceiver("ipc:///nonexistent/raysync-test", SessionSecret.generate(), CFG):  # the next session
        assert _entries_of(child.pid) == set()
    child.join(timeout=10)


def test_only_dead_owners_entries_are_swept(private_tmp):
    me = this_process()
    d = os.path.join(private_tmp, "sweep")
    os.mkdir(d)
    names = {
        "live": f"raysync-{me.pid}-{me.start}-{me.ns}-{'a' * 32}",  # this process
        "pid reused": f"raysync-{me.pid}-{me.start + 1}-{me.ns}-{'b' * 32}",  # our pid, another start time
        "other namespace": f"raysync-{me.pid}-{me.start + 1}-{me.ns + 1}-{'c' * 32}",  # cannot be judged
        "unknown start": f"raysync-{me.pid}-0-{me.ns}-{'d' * 32}",
        "other scheme": f"raysync-{'e' * 32}",  # raysync < 0.2's names: no owner, never touched
        "not ours": "raysync-demo-x",
    }
    for name in names.values():
        open(os.path.join(d, name), "w").close()
    os.mkdir(os.path.join(d, f"raysync-{me.pid}-{me.start + 2}-{me.ns}-abcd1234"))  # a socket's directory
    removed = sweep(d)
    assert {os.path.basename(p) for p in removed} == {
        names["pid reused"],
        f"raysync-{me.pid}-{me.start + 2}-{me.ns}-abcd1234",
    }
    assert sorted(os.listdir(d)) == sorted(set(names.values()) - {names["pid reused"]})
    assert not is_dead(Owner(me.pid, me.start, me.ns)) and OWNED.fullmatch(names["live"])


# --- the control endpoint ------------------------------------------------------------------------------------------
def _ipv4_zero_spellings() -> list[str]:
    """inet_aton's forms of 0.0.0.0: 1 to 4 parts, each decimal, octal (leading 0) or hex (0x, 0X)."""
    part = ["0", "00", "000", "0000000000", "0x0", "0X0", "0x00", "0x0000000000"]
    return [".".join(p) for n in range(1, 5) for p in itertools.product(part, repeat=n)]


def _ipv6_zero_spellings() -> list[str]:
    group = ["0", "00", "0000"]
    out = ["::", "::0", "0::", "0::0", "::0.0.0.0", "::ffff:0.0.0.0", "::ffff:0:0", "0:0:0:0:0:ffff:0.0.0.0"]
    out += [":".join(g) for g in itertools.product(group, repeat=8)][:200]
    out += [f"{':'.join(g)}::" for n in range(1, 7) for g in itertools.product(group[:2], repeat=n)]
    out += [f"::{':'.join(g)}" for n in range(1, 7) for g in itertools.product(group[:2], repeat=n)]
    return out


def _every_interface_spellings() -> list[str]:
    hosts = (
        ["*", "0.0.0.0", "000.000.000.000", "0", "0x0", "0.0"]
        + _ipv4_zero_spellings()
        + _ipv6_zero_spellings()
    )
    decorated = (
        [f"[{h}]" for h in hosts[:50]] + [f"{h}%lo" for h in hosts[:50]] + [f"[{h}%1]" for h in hosts[-50:]]
    )
    return sorted(set(hosts + decorated))


def _try_bind(host: str, allow: bool = False) -> str:
    """The endpoint a SenderChannel bound for tcp://HOST:*, or the EndpointError's message."""
    try:
        channel = SenderChannel(
            SessionSecret.generate(),
            endpoint=f"tcp://{host}:*",
            allow_any_interface=allow,
            timeout_s=1,
            max_frame_bytes=1 << 16,
        )
    except EndpointError as e:
        return f"refused: {e}"
    channel.close()
    return channel.endpoint


def test_every_spelling_of_every_interface_is_refused(private_tmp):
    spellings = _every_interface_spellings()
    assert len(spellings) > 4000
    assert [h for h in spellings if not binds_every_interface(h)] == []  # the guard, on all of them
    sample = spellings[::20] + ["*", "0", "0x0", "000.000.000.000", "::", "0:0::0", "[::]", "::ffff:0.0.0.0"]
    bound = {h: _try_bind(h) for h in sample}  # and the channel that binds, on a sample (4 ms each)
    assert [h for h, got in bound.items() if "every interface" not in got] == []


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "127.1", "127.0.1", "2130706433", "0x7f000001", "0x7f.1", "017700000001", "0177.0.0.01"],
)
def test_one_interface_in_any_spelling_is_bound(private_tmp, host):
    assert _try_bind(host).startswith("tcp://127.0.0.1:")


@st.composite
def _ipv4_spelling(draw) -> tuple[str, int]:
    """An IPv4 address (zero half the time) spelled in inet_aton's forms with random leading zeros and case."""
    value = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 4))
    sizes = [1] * (n - 1) + [5 - n]  # bytes per part: the last part holds what is left
    parts, shift = [], 32
    for size in sizes:
        shift -= 8 * size
        v = (value >> shift) & ((1 << (8 * size)) - 1)
        style = draw(st.sampled_from(["dec", "oct", "hex", "HEX"]))
        zeros = "0" * draw(st.integers(0, 12))
        if style == "dec":
            parts.append(str(v) if v else zeros + "0")
        elif style == "oct":
            parts.append("0" + zeros + format(v, "o"))
        else:
            parts.append(
                ("0x" if style == "hex" else "0X") + zeros + format(v, "x" if style == "hex" else "X")
            )
    return ".".join(parts), value


@settings(max_examples=300, deadline=None)
@given(_ipv4_spelling())
def test_the_guard_refuses_exactly_the_spellings_of_zero(spelling):
    host, value = spelling
    assert binds_every_interface(host) == (value == 0), host
    if value == 0:  # and the channel, the code that binds, refuses it
        assert "every interface" in _try_bind(host)


def test_the_address_zmq_reports_is_checked_after_binding():
    for bound in ("tcp://0.0.0.0:5555", "tcp://[::]:5555", "tcp://[::ffff:0.0.0.0]:1"):
        assert bound_to_every_interface(bound), bound
    for bound in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", "ipc:///tmp/x", "tcp://eth0:1"):
        assert not bound_to_every_interface(bound), bound


def test_a_closed_ipc_endpoint_frees_its_path_for_the_next_sender(private_tmp, in_thread):
    path = os.path.join(private_tmp, "ctl.sock")
    secret = SessionSecret.generate()
    WeightSender(secret, CFG, endpoint=f"ipc://{path}").close()  # bound, never connected, closed
    assert not os.path.lexists(path)
    for version in (1, 2):  # the same path again, with a push through it, twice
        with WeightSender(secret, CFG, endpoint=f"ipc://{path}") as sender:
            with WeightReceiver(sender.endpoint, secret, CFG) as receiver:
                dest = _dest()
                got = in_thread(receiver.receive, into=dest)
                sender.push(_source(version).items(), version)
                assert got.result(timeout=30).version == version
                assert all(torch.equal(dest[k], v) for k, v in _source(version).items())
        assert not os.path.lexists(path)


def test_close_never_removes_a_file_that_replaced_the_socket(private_tmp):
    path = os.path.join(private_tmp, "ctl.sock")
    sender = WeightSender(SessionSecret.generate(), CFG, endpoint=f"ipc://{path}")
    os.unlink(path)
    with open(path, "w") as f:  # someone else's file now
        f.write("keep")
    sender.close()
    with open(path) as f:
        assert f.read() == "keep"
