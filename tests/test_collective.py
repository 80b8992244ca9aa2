"""The collective transport on the CPU: a gloo group of one sender and 2-3 receiver processes, and its
rendezvous store under attack."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import struct
import threading
import time

import msgpack
import pytest
import zmq
from workers import collective_engine, collective_receiver, digest, perturb

from raysync import PeerUnavailable, RemoteError, SessionSecret, SyncConfig
from raysync.core.errors import EndpointError, PeerTimeout, RaysyncError, WireError
from raysync.core.version import MIXED
from raysync.transport.collective import CollectiveSender
from raysync.transport.rendezvous import CurveKeys, StoreClient
from raysync.transport.rendezvous_server import StoreServer

pytest.importorskip("transformers")
# The embedding spans 4 buckets. No wait is meant to run out under CFG: a failure is told, and the tests tell
# failures apart by their errors, never by the clock, so a slow (cold, loaded) machine costs only time.
CFG = SyncConfig(bucket_bytes=64 << 10, timeout_s=60, progress=False)
# Where a rank dies the others learn it only when their wait runs out: DIES keeps that wait short (and such
# tests start after gloo_warm, so that a cold machine's first group does not run it out before the death).
DIES = dataclasses.replace(CFG, timeout_s=5)


def _group(spawn, receivers: int, pushes: int, special: dict | None = None, config: SyncConfig = CFG):
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)  # before the group is up: receivers wait timeout_s for the first push
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=receivers, backend="gloo")
    out = spawn.ctx.Queue()
    for rank in range(1, receivers + 1):
        spawn(
            collective_receiver,
            secret,
            CFG,
            rank,
            group.rendezvous,
            pushes,
            out,
            *(special or {}).get(rank, (None, False)),
        )
    return group, group.join(), model, out


@pytest.mark.parametrize("receivers, verify", [(2, False), (3, False), (2, True)])
def test_broadcast_bit_exact_over_several_pushes(spawn, receivers, verify):
    """verify: every receiver compares the digests of what landed with the sender's (the one push session's
    verify stage, which the collective runs like every plane): a mismatch or a missing digest fails the push."""
    config = dataclasses.replace(CFG, verify=verify)
    group, sender, model, out = _group(spawn, receivers, pushes=4, config=config)
    try:
        for version in (1, 2, 3):
            perturb(model, version)
            report = sender.push(model.named_parameters(), version)
            assert report.transport == "collective" and report.buckets > 4
            got = [out.get(timeout=60) for _ in range(receivers)]
            assert all(r[1] == "ok" and r[2] == (version, digest(model.named_parameters())) for r in got), got
        assert sender.push(model.named_parameters(), 3).skipped  # every receiver has version 3 already
        got = [out.get(timeout=60) for _ in range(receivers)]
        assert all(r[1] == "ok" and r[2][0] == 3 for r in got), got
    finally:
        group.close()


def test_a_manifest_mismatch_is_a_clear_error_on_every_rank(spawn):
    group, sender, model, out = _group(spawn, 2, pushes=1, special={2: (None, 1)})
    try:  # told: a RemoteError with rank 2's reason (a wait that ran out would be a PeerTimeout)
        with pytest.raises(RemoteError, match=r"rank 2.*model.norm.weight.*float32\[128\].*float32\[3\]"):
            sender.push(model.named_parameters(), 1)
        got = sorted(out.get(timeout=120) for _ in range(2))
        assert [g[1] for g in got] == ["PushIncomplete", "PushIncomplete"], got
        assert "rank 2 (pid" in got[0][2] and "model.norm.weight" in got[1][2]
        assert "no answer" not in got[0][2] + got[1][2]  # nobody waited for timeout_s
    finally:
        group.close()


def survivor(secret, config, rendezvous, out, inbox) -> None:
    """Rank 1 of a group whose rank 2 dies in push 2: receives push 1, fails push 2 (reports its version and a
    digest of its destinations), then joins the group the parent rebuilds, as an engine whose session is
    replaced does (the new receiver keeps the old one's version), and receives once more."""
    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveReceiver

    params = dict(tiny_qwen2(seed=99).named_parameters())
    group = CollectiveReceiver(secret, config, rank=1, rendezvous=rendezvous)
    receiver = group.join()
    report = receiver.receive(into=params, wait_s=60)  # the parent may still be starting
    out.put(("ok", report.version, digest(params.items())))
    try:
        receiver.receive(into=params)
        out.put(("ok", receiver.version, digest(params.items())))
    except Exception as e:
        out.put(
            (type(e).__name__, receiver.version, digest(params.items()), getattr(e, "mixed", None), str(e))
        )
    secret, rendezvous = inbox.get(timeout=60)
    held = receiver.version
    group.close()  # the failed group and its session, before the new group's buffers are made
    rebuilt_group = CollectiveReceiver(secret, config, rank=1, rendezvous=rendezvous)
    rebuilt = rebuilt_group.join()
    rebuilt.version = held  # the same destinations (what ShardedReceiver.replace does for WeightSync)
    report = rebuilt.receive(into=params)
    out.put((report.skipped, rebuilt.version, digest(params.items())))
    rebuilt_group.close()


@pytest.mark.parametrize("staged", [False, True])
def test_a_receiver_killed_mid_broadcast_fails_everyone_and_the_survivor_says_mixed(spawn, gloo_warm, staged):
    """Rank 2 SIGKILLs itself inside push 2. The sender fails at once, typed; the survivor when its wait runs
    out, and its destinations, which took part of push 2 in place, say MIXED (staged: untouched, still version
    1). The failed group is gone for good; a rebuilt group's push of the same version 2 is not skipped and
    leaves the survivor bit-exact at version 2."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, DIES, host="127.0.0.1", num_receivers=2, backend="gloo")
    out, dead_out, inbox = spawn.ctx.Queue(), spawn.ctx.Queue(), spawn.ctx.Queue()
    spawn(survivor, secret, dataclasses.replace(DIES, staged=staged), group.rendezvous, out, inbox)
    dead = spawn(collective_receiver, secret, DIES, 2, group.rendezvous, 2, dead_out, (2, 2), False)
    sender = group.join()
    rebuilt = None
    try:
        perturb(model, 1)
        sender.push(model.named_parameters(), 1)
        v1 = digest(model.named_parameters())
        assert out.get(timeout=60) == ("ok", 1, v1) and dead_out.get(timeout=60)[1] == "ok"
        perturb(model, 2)
        with pytest.raises(PeerUnavailable) as e:
            sender.push(model.named_parameters(), 2)
        assert "broadcast bucket" in e.value.stage or "finish" in e.value.stage, e.value
        dead.join(timeout=30)
        assert dead.exitcode == -signal.SIGKILL  # it died where the test made it die
        kind, version, held, mixed, message = out.get(timeout=60)
        assert kind == "PushIncomplete", message
        if staged:  # atomic: the destinations are version 1's, and the error says they were not touched
            assert (version, held, mixed) == (1, v1, False), message
        else:
            assert (version, mixed) == (MIXED, True), message
        with pytest.raises(RaysyncError, match="aborted by an earlier failure; make a new one"):
            sender.push(model.named_parameters(), 3)  # what is left of the failed group: nothing to push on
        rebuilt_secret = SessionSecret.generate()
        rebuilt = CollectiveSender(rebuilt_secret, DIES, host="127.0.0.1", num_receivers=1, backend="gloo")
        inbox.put((rebuilt_secret, rebuilt.rendezvous))
        # MIXED is no version: never skipped
        assert not rebuilt.join().push(model.named_parameters(), 2).skipped
        assert out.get(timeout=60) == (False, 2, digest(model.named_parameters()))
    finally:
        group.close()
        if rebuilt is not None:
            rebuilt.close()


def test_a_sender_whose_source_fails_tells_every_receiver_and_the_next_push_lands(spawn):
    """The group's session aborts (the trainer's source raised before the push started): every receiver
    raises the source's error (a RemoteError, not a timeout), touches nothing, and the group serves the next
    push."""
    group, sender, model, out = _group(spawn, 2, pushes=2)
    try:
        sender.abort(ValueError("the trainer's source raised"))
        got = [out.get(timeout=60) for _ in range(2)]
        assert all(
            r[1] == "RemoteError" and "ValueError: the trainer's source raised" in r[2] for r in got
        ), got
        perturb(model, 1)
        assert not sender.push(model.named_parameters(), 1).skipped
        got = [out.get(timeout=60) for _ in range(2)]
        assert all(r[1] == "ok" and r[2] == (1, digest(model.named_parameters())) for r in got), got
    finally:
        group.close()


def test_destinations_that_change_between_pushes_are_refused_without_touching_them(spawn):
    """Every push is accepted by every receiver before any data moves (a broadcast moves all ranks together):
    a receiver whose destinations stopped fitting refuses, and no rank's destinations are touched."""
    group, sender, model, out = _group(spawn, 2, pushes=4, special={2: (None, 3)})
    try:
        for version in (1, 2):
            perturb(model, version)
            sender.push(model.named_parameters(), version)
            assert sorted(r[1] for r in (out.get(timeout=60), out.get(timeout=60))) == ["ok", "ok"]
        for version in (3, 4):
            perturb(model, version)
            with pytest.raises(RemoteError, match=r"rank 2.*model.norm.weight"):
                sender.push(model.named_parameters(), version)
            got = dict((r[0], r) for r in (out.get(timeout=60), out.get(timeout=60)))
            assert got[1][1] == "PushIncomplete" and "not touched" in got[1][2] and "rank 2" in got[1][2]
            assert got[2][1] == "PushIncomplete" and "model.norm.weight" in got[2][2]
    finally:
        group.close()


def test_close_ends_the_session_first_then_the_group_and_the_store(spawn):
    """A group's close() ends what its set-up made, in order: the session's Close reaches every receiver, whose
    waiting receive raises SessionClosed (told, not a timeout), then the group goes (no process group left)
    and the store stops (its port refuses connections). A set-up that never joined closes its store too."""
    group, sender, model, out = _group(spawn, 2, pushes=2)
    try:
        sender.push(model.named_parameters(), 1)
        got = [out.get(timeout=60) for _ in range(2)]
        assert all(r[1] == "ok" for r in got), got
    finally:
        group.close()
    got = [out.get(timeout=60) for _ in range(2)]
    assert all(r[1] == "SessionClosed" for r in got), got
    assert group.group is None
    unjoined = CollectiveSender(
        SessionSecret.generate(), CFG, host="127.0.0.1", num_receivers=1, backend="gloo"
    )
    unjoined.close()
    for port in (group.rendezvous.port, unjoined.rendezvous.port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()


def test_an_engine_keeps_its_version_across_the_groups_weightsync_makes(spawn):
    """Inside an actor (raysync.ray.endpoint, as WeightSync drives it) an engine's group is replaced by a new
    one (WeightSync rebuilds a failed group whole): the engine's version carries over, so the new group's push
    of the version it holds is skipped, and the next version lands bit-exact."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    inbox, out = spawn.ctx.Queue(), spawn.ctx.Queue()
    spawn(collective_engine, CFG, inbox, out)
    try:
        for held, version, skipped in ((None, 1, False), (1, 1, True), (1, 2, False)):
            if not skipped:
                perturb(model, version)
            secret = SessionSecret.generate()
            group = CollectiveSender(secret, CFG, host="127.0.0.1", num_receivers=1, backend="gloo")
            try:
                inbox.put((secret, group.rendezvous))
                assert group.join().push(model.named_parameters(), version).skipped == skipped
                got = out.get(timeout=60)
            finally:
                group.close()
            assert got == (held, version, skipped, version, digest(model.named_parameters())), got
    finally:
        inbox.put(None)


# --- the rendezvous store: strangers on its port -------------------------------------------------------------------
_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00"  # ZMTP 3.0, then the mechanism's name padded to 20 bytes
HOSTILE = {  # what a local process can write to the port: nothing of it may stall or grow the store
    "garbage": os.urandom(4096),
    "huge length prefix (ZMTP 1.0 framing)": b"\xff" + struct.pack(">Q", (1 << 63) - 1) + b"x" * 64,
    "huge value (TCPStore's SET)": b"\x00"
    + struct.pack("<Q", 1)
    + b"k"
    + struct.pack("<Q", 1 << 40)
    + b"v" * 64,
    "NULL greeting, then a 4 EiB frame": _GREETING
    + b"NULL".ljust(20, b"\0")
    + bytes(32)
    + b"\x06"
    + struct.pack(">Q", 1 << 62),
    "CURVE greeting, then a 4 EiB frame": _GREETING
    + b"CURVE".ljust(20, b"\0")
    + bytes(32)
    + b"\x06"
    + struct.pack(">Q", 1 << 62),
}


def _hit(port: int, payload: bytes) -> str:
    """Connect, write ``payload``, read until the server closes: "closed", or "open" after 10 s."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            conn.sendall(payload)
            while conn.recv(1 << 16):
                pass
        except (ConnectionResetError, BrokenPipeError):
            pass
        except TimeoutError:
            return "open"
    return "closed"


def _stranger_with_a_key(port: int, server_public: bytes) -> zmq.Socket:
    """A zmq client that knows the server's public key (as if it leaked) but not the session's client key."""
    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    for option, value in (
        (zmq.LINGER, 0),
        (zmq.CURVE_SERVERKEY, server_public),
        (zmq.CURVE_PUBLICKEY, public),
        (zmq.CURVE_SECRETKEY, secret),
    ):
        sock.setsockopt(option, value)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def test_strangers_flooding_the_rendezvous_port_leave_a_session_unaffected(spawn):
    """Attackers write garbage, huge length prefixes and a leaked-key client's requests to the rendezvous port
    from the start of the group's set-up to the end of its second push: the session completes bit-exact, the
    server closed every hostile connection (none held it), and no stranger's key landed in the store."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=0)
    secret = SessionSecret.generate()
    group = CollectiveSender(secret, CFG, host="127.0.0.1", num_receivers=2, backend="gloo")
    port, stop, results = group.rendezvous.port, threading.Event(), []
    stranger = _stranger_with_a_key(port, CurveKeys.of(secret).server_public)

    def attack(with_key: bool) -> None:
        while not stop.is_set():
            for name, payload in HOSTILE.items():
                results.append((name, _hit(port, payload)))
            if with_key:  # zmq sockets are not thread-safe: one attacker owns this one
                try:
                    stranger.send(msgpack.packb([len(results), "set", ["1/start", b"forged"]]), zmq.NOBLOCK)
                except zmq.Again:
                    pass

    attackers = [threading.Thread(target=attack, args=(k == 0,), daemon=True) for k in range(2)]
    for a in attackers:
        a.start()
    out = spawn.ctx.Queue()
    for rank in (1, 2):
        spawn(collective_receiver, secret, CFG, rank, group.rendezvous, 2, out)
    try:
        sender = group.join()
        for version in (1, 2):
            perturb(model, version)
            sender.push(model.named_parameters(), version)
            got = [out.get(timeout=60) for _ in range(2)]
            assert all(r[1] == "ok" and r[2] == (version, digest(model.named_parameters())) for r in got), got
        stop.set()
        for a in attackers:
            a.join(timeout=30)
        assert not any(a.is_alive() for a in attackers)
        session = StoreClient(secret, "127.0.0.1", port, timeout_s=10, max_value_bytes=CFG.max_frame_bytes)
        try:  # "1/start" was deleted by push 2: a stranger's set would have made it again
            forged = session.check(["1/start"])
        finally:
            session.close()
        answered = stranger.poll(0)
    finally:
        stop.set()
        for a in attackers:
            a.join(timeout=30)  # before closing the socket one of them uses
        stranger.close()
        group.close()
    assert {name for name, _ in results} == set(HOSTILE)  # every kind of attack ran during the session
    assert [r for r in results if r[1] != "closed"] == []  # the server closed every hostile connection
    assert not forged and not answered  # the leaked-key client got nothing in, and no answer


def test_the_store_answers_its_session_and_refuses_what_it_must():
    secret = SessionSecret.generate()
    server = StoreServer(secret, "127.0.0.1", max_value_bytes=4096)
    client = StoreClient(secret, "127.0.0.1", server.port, timeout_s=5, max_value_bytes=4096)
    other = StoreClient(SessionSecret.generate(), "127.0.0.1", server.port, timeout_s=1, max_value_bytes=4096)
    try:
        client.set("a", b"1")
        assert client.get("a") == b"1" and client.add("n", 2) == 2 and client.add("n", 3) == 5
        assert client.compare_set("c", b"", b"x") == b"x" and client.compare_set("c", b"y", b"z") == b"x"
        assert client.check(["a", "n"]) and not client.check(["a", "missing"])
        assert client.multi_get(["a", "c"]) == [b"1", b"x"]
        client.delete_keys(["a", "c", "gone"])  # not answered: the next request is served after it
        assert not client.check(["a"]) and not client.check(["c"])
        with pytest.raises(PeerTimeout, match="store get missing"):  # bounded, named
            client.wait_get("missing", 0.5)
        with pytest.raises(WireError, match="5000 bytes exceed max_frame_bytes=4096"):
            client.set("big", b"v" * 5000)
        with pytest.raises(PeerTimeout):  # another session's client never completes the handshake
            other.set("a", b"forged")
        stranger = _stranger_with_a_key(server.port, CurveKeys.of(secret).server_public)
        try:  # knows the server's key (leaked), not the session's client key: refused by the server's ZAP
            stranger.send(msgpack.packb([1, "set", ["a", b"forged"]]))
            deadline = time.monotonic() + 30
            while server.refused == 0 and time.monotonic() < deadline:
                assert not stranger.poll(50)  # never answered
        finally:
            stranger.close()
        assert server.refused >= 1
        assert _hit(server.port, HOSTILE["CURVE greeting, then a 4 EiB frame"]) == "closed"
        assert client.get("n") == b"5" and client.num_keys() == 1  # still serving, nothing forged
    finally:
        other.close()
        client.close()
        server.close()
    with pytest.raises(PeerTimeout):  # the server is gone: every call ends in time
        StoreClient(secret, "127.0.0.1", server.port, timeout_s=0.5, max_value_bytes=4096).get("n")


@pytest.mark.parametrize(
    "host", ["0", "0.0.0.0", "0x0", "000.000.000.000", "0.0", "::", "[::]", "::0", "::ffff:0.0.0.0", "*", ""]
)
def test_the_rendezvous_never_listens_on_every_interface(host):
    with pytest.raises(EndpointError, match="every interface"):
        CollectiveSender(SessionSecret.generate(), CFG, host=host, num_receivers=1, backend="gloo")


def test_the_store_table_refuses_malformed_requests_without_dying():
    """Requests a key holder could send that once ended the store's thread (an IndexError on too few
    arguments, an OverflowError past int64 while answering an add): refused, and the table goes on."""
    from raysync.transport.rendezvous_table import StoreTable

    table = StoreTable(1 << 10)
    with pytest.raises(ValueError, match="takes 2 arguments, got 0"):
        table.apply(b"p", 1, "set", [], 0.0)
    assert table.apply(b"p", 2, "add", ["n", (1 << 63) - 1], 0.0) == (1 << 63) - 1
    with pytest.raises(ValueError):
        table.apply(b"p", 3, "add", ["n", 1], 0.0)
    assert table.apply(b"p", 4, "add", ["n", 0], 0.0) == (1 << 63) - 1  # the refused add left it alone
