"""Shared memory that goes away under a process, crashes mid-handshake, and the control endpoint's guards.

Proved here, each against the real parts (real processes, /dev/shm, zmq):
- a peer that shrinks a ring segment (ftruncate through the ring's own fd), between pushes or mid-push, makes
  the other side raise a typed error, never die of SIGBUS (Note [no SIGBUS] in raysync.transport.shm);
- a full /dev/shm or one without inodes is a ShmSpaceError at setup naming the sizes and the fix, and leaves
  nothing behind; a /dev/shm that fills after setup does not matter (pages reserved): in a private tmpfs
  (a user + mount namespace) where the machine allows one;
- a sender SIGKILLed between binding and the end of the handshake leaves entries that the next session on the
  machine removes (Note [names that outlive a crash] in raysync.leftovers);
- every spelling of the unspecified address is refused by the bind guard; a clean close of an explicit ipc://
  endpoint frees its path.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raysync import RaysyncError, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.control import ReceiverChannel, SenderChannel, binds_every_interface, bound_to_every_interface
from raysync.errors import EndpointError, PushIncomplete, ShmSegmentResized, ShmSpaceError
from raysync.leftovers import OWNED, Owner, is_dead, owner_of, sweep, this_process
from raysync.transport.shm import ShmRingReceiver, ShmRingSender, create_segment
from raysync.wire import Hello, RingInfo

TESTS = os.path.dirname(os.path.abspath(__file__))
CFG = SyncConfig(bucket_bytes=16 << 10, timeout_s=20, progress=False)
BUCKETS = 8  # per push: 8 tensors of 16 KiB, one bucket each, through 2 buffers


def _source(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((4096,), float(version * 10 + i)) for i in range(BUCKETS)}


def _dest() -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.zeros(4096) for i in range(BUCKETS)}


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


# --- a segment shrunk under a process: a typed error, never SIGBUS ---------------------------------------------------
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
    try:
        with WeightReceiver(endpoint, secret, config) as receiver:
            for _ in range(4):
                conn.send(("received", receiver.receive(into=_dest()).version))
    except RaysyncError as e:
        _report(conn, e)


def _shrink(segment_fd: int) -> None:
    """What a hostile or buggy peer does to a segment it has mapped: cut it to one page."""
    os.ftruncate(segment_fd, 4096)


@pytest.mark.parametrize("when", ["between pushes", "mid-push"])
def test_a_receiver_that_shrinks_the_ring_makes_the_sender_raise_not_sigbus(
    private_tmp, spawn, in_thread, when
):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    child = spawn(victim_sender, secret, CFG, theirs)
    theirs.close()
    kind, endpoint = _outcome(mine, child)
    with WeightReceiver(endpoint, secret, CFG) as receiver:
        mine.send("go")
        assert receiver.receive(into=_dest()).version == 1
        assert _outcome(mine, child) == ("pushed", 1)
        segments = receiver._ring._segments
        if when == "between pushes":
            _shrink(segments[0].fd)
        else:  # after the receiver has read bucket 0 of push 2, before the sender packs bucket 2 into buffer 0
            unpack_done = receiver._ring.after_unpack

            def unpack_then_cut(slot: int) -> None:
                unpack_done(slot)
                if slot == 0:
                    _shrink(segments[0].fd)

            receiver._ring.after_unpack = unpack_then_cut
            got = in_thread(receiver.receive, into=_dest())
        mine.send("go")
        outcome = _outcome(mine, child)
        if when == "mid-push":
            with pytest.raises(PushIncomplete):  # told by the sender, or timed out: typed here too
                got.result(timeout=60)
    child.join(timeout=30)
    assert outcome[:2] == ("error", "ShmSegmentResized") and child.exitcode == 0, outcome
    assert "pack into buffer 0" in outcome[2] and "the receiver" in outcome[2] and "4096 bytes" in outcome[2]


@pytest.mark.parametrize("when", ["between pushes", "mid-push"])
def test_a_sender_that_shrinks_the_ring_makes_the_receiver_raise_not_sigbus(private_tmp, spawn, when):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    with WeightSender(secret, CFG) as sender:
        child = spawn(victim_receiver, sender.endpoint, secret, CFG, theirs)
        theirs.close()
        sender.push(_source(1).items(), 1)
        assert _outcome(mine, child) == ("received", 1)
        # the hostile sender cuts a buffer right after packing into it, before telling the receiver: bucket 0
        # of push 2 is packed before PushStart (the receiver is between pushes), bucket 3 while it streams
        cut_at = 0 if when == "between pushes" else 3
        packed = []
        pack_done = sender._ring.after_pack

        def pack_then_cut(slot: int) -> None:
            pack_done(slot)
            if len(packed) == cut_at:
                _shrink(sender._ring._segments[slot].fd)
            packed.append(slot)

        sender._ring.after_pack = pack_then_cut
        with pytest.raises(RaysyncError):  # the receiver's Abort, or this side's own check: typed either way
            sender.push(_source(2).items(), 2)
        outcome = _outcome(mine, child)
    child.join(timeout=30)
    assert outcome[0] == "error" and child.exitcode == 0, outcome
    assert (outcome[1], outcome[3]) == ("PushIncomplete", "ShmSegmentResized")
    assert f"the sender (pid {os.getpid()})" in outcome[2] and "unpack from buffer" in outcome[2]


def test_the_ring_checks_every_segment_on_both_sides(private_tmp):
    sender = ShmRingSender(2, 1 << 16)
    receiver = ShmRingReceiver(sender.info())
    try:
        sender.check("setup")
        receiver.check("setup")
        os.ftruncate(
            sender._segments[1].fd, 1 << 17
        )  # larger is refused too: the size is not what was mapped
        for use, stage in (
            (sender.before_pack, "pack into buffer 1"),
            (receiver.before_unpack, "unpack from"),
        ):
            with pytest.raises(ShmSegmentResized, match=stage) as e:
                use(1)
            assert (e.value.expected_bytes, e.value.actual_bytes) == (1 << 16, 1 << 17)
        with pytest.raises(ShmSegmentResized, match="the sender"):
            receiver.check("a stage")
        receiver.before_unpack(0)  # the other buffer is fine
    finally:
        receiver.close()
        sender.close()


# --- a full /dev/shm ------------------------------------------------------------------------------------------------
def test_a_segment_larger_than_all_of_dev_shm_is_refused_when_reserved(private_tmp):
    st_ = os.statvfs("/dev/shm")
    if st_.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit here")
    wanted = st_.f_blocks * st_.f_frsize + (1 << 20)  # posix_fallocate fails at once: nothing is filled
    before = _entries_of(os.getpid())
    with pytest.raises(ShmSpaceError) as e:
        create_segment(wanted, pin=False)
    message = str(e.value)
    assert f"cannot reserve {wanted} bytes" in message and "MiB free of" in message
    assert "bucket_bytes or num_buffers" in message and "--shm-size" in message
    assert _entries_of(os.getpid()) == before


def _namespaces_work() -> bool:
    try:
        done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def small_dev_shm() -> dict:
    """Runs the ``case_*`` functions below in one child that sees its own 4 MiB tmpfs of 64 inodes at
    /dev/shm (a user + mount namespace), and returns what each found."""
    if not _namespaces_work():
        pytest.skip("no user + mount namespace here (unshare -rm): cannot give a child a small /dev/shm")
    code = (
        f"import sys; sys.path.insert(0, {TESTS!r}); import test_shm_hardening as t; t.small_dev_shm_cases()"
    )
    script = 'mount -t tmpfs -o size=4m,nr_inodes=64 tmpfs /dev/shm && exec "$0" -c "$1"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, sys.executable, code],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def small_dev_shm_cases() -> None:
    found = {}
    for case in (case_full, case_no_inodes, case_fills_after_setup):
        found[case.__name__] = case()
        for name in os.listdir("/dev/shm"):  # the case's own fillers
            if not name.startswith("raysync-"):
                os.unlink(f"/dev/shm/{name}")
    print(json.dumps(found))


def _fill_dev_shm(name: str) -> None:
    """Write one file until /dev/shm has no room left."""
    with open(f"/dev/shm/{name}", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def _raysync_names() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("raysync-"))


def case_full() -> dict:
    with open("/dev/shm/filler", "wb") as f:
        f.write(b"\0" * (3 << 20))  # of 4 MiB
    out = {}
    try:
        ShmRingSender(2, 1 << 20)
    except ShmSpaceError as e:
        out["ring"] = str(e)
    try:
        create_segment(2 << 20, pin=False)  # the reservation itself fails part-way: 1 MiB free
    except ShmSpaceError as e:
        out["segment"] = str(e)
    out["left"] = _raysync_names()
    return out


def case_no_inodes() -> dict:
    for i in itertools.count():
        try:
            open(f"/dev/shm/f{i}", "wb").close()
        except OSError:
            break
    out = {}
    try:
        ShmRingSender(1, 4096)
    except ShmSpaceError as e:
        out["ring"] = str(e)
    out["left"] = _raysync_names()
    return out


def case_fills_after_setup() -> dict:
    sender = ShmRingSender(2, 1 << 20)  # of 4 MiB
    receiver = ShmRingReceiver(sender.info())
    _fill_dev_shm("filler")
    free = os.statvfs("/dev/shm").f_bavail
    for k, buffer in enumerate(sender.buffers):  # every page of both buffers, written and read back
        sender.before_pack(k)
        buffer.fill_(k + 1)
        receiver.before_unpack(k)
    same = all(int(r.sum()) == (k + 1) * r.numel() for k, r in enumerate(receiver.buffers))
    receiver.close()
    sender.close()
    return {"free_blocks": free, "same": same, "left": _raysync_names()}


def test_a_full_dev_shm_is_a_typed_error_naming_sizes_and_leaves_nothing(small_dev_shm):
    out = small_dev_shm["case_full"]
    assert "2 x 1048576 bytes" in out["ring"] and "MiB free of 4.0 MiB" in out["ring"]
    assert "cannot reserve 2097152 bytes" in out["segment"] and "--shm-size" in out["segment"]
    assert out["left"] == []


def test_no_inode_left_is_a_typed_error_with_the_fix(small_dev_shm):
    out = small_dev_shm["case_no_inodes"]
    assert "no inode left" in out["ring"] and "0 of 64 inodes free" in out["ring"]
    assert "nr_inodes" in out["ring"]
    assert out["left"] == []


def test_a_dev_shm_that_fills_after_setup_does_not_kill_the_ring(small_dev_shm):
    out = small_dev_shm["case_fills_after_setup"]
    assert out["free_blocks"] == 0 and out["same"] and out["left"] == []


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


def test_a_sender_killed_after_making_its_ring_leaves_segments_the_next_session_removes(private_tmp, spawn):
    secret = SessionSecret.generate()
    mine, theirs = spawn.ctx.Pipe()
    child = spawn(sender_waiting, secret, CFG, theirs)
    assert mine.poll(60)
    endpoint = mine.recv()
    # a receiver that says Hello and never maps the ring: the sender stops waiting for Attached
    channel = ReceiverChannel(secret, endpoint=endpoint, timeout_s=CFG.timeout_s, max_frame_bytes=1 << 20)
    try:
        channel.send(Hello(os.getpid(), "test"), "handshake")
        info = channel.expect(RingInfo, 0, "handshake: waiting for the ring description")
    finally:
        channel.close()
    _killed_and_unreaped(child)
    segments = {f"/dev/shm/{name}" for name in info.handles}
    assert len(segments) == CFG.num_buffers and _entries_of(child.pid) == segments  # left behind
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
        channel = SenderChannel(SessionSecret.generate(), endpoint=f"tcp://{host}:*", allow_any_interface=allow,
                                timeout_s=1, max_frame_bytes=1 << 16)  # fmt: skip
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
