"""The collective's rendezvous store: a ``torch.distributed.Store`` whose server no stranger can talk to.

A process group (gloo, NCCL) meets through a key-value store. torch's TCPStore serves anyone who connects
and trusts the lengths they send, so one local process that writes garbage or a huge length prefix to its
port stalls rank 0's store thread and every rank with it. raysync's store instead runs over zmq with CURVE:

    rank 0 (sender) process                              every rank (0..N), one StoreClient each
    StoreServer thread: ROUTER on tcp://host:port  <---  DEALER, CURVE client key derived from the session key
      ZAP handler: admits only the session's client key  (a stranger's handshake is refused: no byte of
      MAXMSGSIZE: a frame larger than the cap            what it sends is ever queued or parsed)
      drops the connection before it is allocated; a handshake not done within 5 s is closed
      a dict of at most MAX_KEYS keys, values capped; set / get / add / wait / check ... answered per request

This module holds the keys, the limits and the client; the server is raysync.transport.rendezvous_server (its
sockets, the ZAP handler, its thread) over raysync.transport.rendezvous_table (what a request means, the keys
and values within their limits, the requests that wait for keys; no socket, no thread).

# Note [who may talk to the rendezvous store]
# Both key pairs are derived from the session key (HMAC-SHA256 with a fixed label), so only a holder of the
# session key can complete the CURVE handshake (the client must know the server's public key) and pass the
# ZAP check (its public key must be the session's client key). Until both succeed zmq passes nothing to the
# server thread, and every frame before and after is bounded by MAXMSGSIZE, so a stranger costs at most one
# refused handshake per connection, held at most _HANDSHAKE_MS. After the handshake every message is encrypted and authenticated by
# CURVE (no replay, no tampering). Every client call waits at most the store's timeout and raises PeerTimeout
# naming the store, the operation and the key.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass

import msgpack
import torch.distributed as dist
import zmq
from zmq.utils import z85

from raysync.core.control import binds_every_interface
from raysync.core.errors import EndpointError, MalformedFrame, PeerTimeout, RaysyncError, WireError
from raysync.core.wire import SessionSecret

logger = logging.getLogger(__name__)

MAX_KEYS = 4096  # the group's bootstrap writes a few keys per rank; no push writes any
MAX_KEY_CHARS = 1024
MAX_WAITERS = 1024  # blocked get / wait requests held by the server at once
_ENVELOPE_BYTES = 64 << 10  # a request's key, op and msgpack framing on top of its value
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP protocol (RFC 27), one per zmq context
# a connection that has not completed its handshake by then is closed (one of ours reconnects by itself)
_HANDSHAKE_MS = 5000


# --- keys ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurveKeys:
    """The store's two CURVE key pairs (z85), both derived from the session key: Note [who may talk to the
    rendezvous store]."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def of(cls, secret: SessionSecret) -> CurveKeys:
        server_secret = _derived_secret(secret, "server")
        client_secret = _derived_secret(secret, "client")
        return cls(
            zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret
        )


def _derived_secret(secret: SessionSecret, role: str) -> bytes:
    label = b"raysync/rendezvous/curve/" + role.encode() + b"/" + secret.session_id
    return z85.encode(hmac.new(secret.key, label, hashlib.sha256).digest())


def interface_address(host: str) -> str:
    """The numeric address of the one interface ``host`` names (a name is resolved here). Every spelling of
    "all interfaces" is refused, decided by what it resolves to (raysync.core.control's guard, and any resolved
    address that is unspecified, IPv4-mapped too), never by how the string looks."""
    bare = host[1:-1] if len(host) >= 2 and host[0] == "[" and host[-1] == "]" else host
    try:
        infos = (
            [] if binds_every_interface(host) else socket.getaddrinfo(bare, None, proto=socket.IPPROTO_TCP)
        )
    except (OSError, UnicodeError, ValueError) as e:
        raise EndpointError(f"collective host {host!r} does not resolve ({e}); give this node's IP") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses or any(_unspecified(a) for a in addresses):
        raise EndpointError(
            f"collective host {host!r} is every interface; give the address of the one interface the "
            f"receivers reach (this node's IP)"
        )
    return str(addresses[0])


def _unspecified(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:0.0.0.0 is 0.0.0.0 to a dual-stack socket
    return address.is_unspecified or (mapped is not None and mapped.is_unspecified)


def _endpoint(address: str, port: int | str) -> str:
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


_NO_REPLY = 0  # the request id of a request whose sender does not wait for an answer


# --- the client ------------------------------------------------------------------------------------------------------
class StoreClient(dist.Store):
    """One rank's handle on the rendezvous store, usable by ProcessGroupGloo / ProcessGroupNCCL.

    torch calls these methods from its own threads too: ProcessGroupNCCL's heartbeat monitor calls ``check``
    about once a second (seen on an H200, torch 2.11). Requests go one at a time, under a lock, so while this
    rank waits for a key (up to that wait's timeout) the monitor's check waits too; it only looks for debug
    dump signals, which raysync never sets."""

    def __init__(
        self, secret: SessionSecret, host: str, port: int, *, timeout_s: float, max_value_bytes: int
    ):
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.max_value_bytes = max_value_bytes
        address = interface_address(host)
        self.endpoint = _endpoint(address, port)
        keys = CurveKeys.of(secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.MAXMSGSIZE, max_value_bytes + _ENVELOPE_BYTES),
            (zmq.CURVE_SERVERKEY, keys.server_public),
            (zmq.CURVE_PUBLICKEY, keys.client_public),
            (zmq.CURVE_SECRETKEY, keys.client_secret),
        ):
            self._sock.setsockopt(option, value)
        self._sock.ipv6 = ":" in address
        self._sock.connect(self.endpoint)
        self._lock = threading.Lock()
        self._request_id = 0
        self._closed = False

    # torch.distributed.Store ---------------------------------------------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", [key, self._bytes(key, value)], key)

    def get(self, key: str) -> bytes:
        return self.wait_get(key, self._timeout_s())

    def wait_get(self, key: str, timeout_s: float) -> bytes:
        """``get`` bounded by ``timeout_s`` instead of the store's timeout: one round trip."""
        return self._call("get", [key, int(timeout_s * 1000)], key, timeout_s)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", [list(keys), int(self._timeout_s() * 1000)], ",".join(keys))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call(
            "multi_set",
            [list(keys), [self._bytes(k, v) for k, v in zip(keys, values, strict=True)]],
            ",".join(keys),
        )

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", [key, self._bytes(key, value)], key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", [key, int(amount)], key)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", [key, self._bytes(key, expected), self._bytes(key, desired)], key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", [list(keys)], ",".join(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        # gloo passes torch's default (300 s) here: the store's own timeout bounds every wait too
        wait_s = self._timeout_s() if timeout is None else min(timeout.total_seconds(), self._timeout_s())
        self._call("wait", [list(keys), int(wait_s * 1000)], ",".join(keys), wait_s)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", [key], key)

    def delete_keys(self, keys: list[str]) -> None:
        """Delete every key of ``keys`` that exists, without waiting for the answer (a push's clean-up need
        not cost it a round trip; zmq keeps this client's requests in order, so a later set lands after)."""
        with self._lock:
            self._send(_NO_REPLY, "delete_keys", [list(keys)], ",".join(keys))

    def num_keys(self) -> int:
        return self._call("num_keys", [], "")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._sock.close(linger=0)
                self._ctx.term()

    # one request ---------------------------------------------------------------------------------------------------
    def _timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def _bytes(self, key: str, value: bytes | str) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        if len(data) > self.max_value_bytes:
            raise WireError(
                f"store value for key {key!r}: {len(data)} bytes exceed max_frame_bytes="
                f"{self.max_value_bytes}; raise SyncConfig.max_frame_bytes"
            )
        return data

    def _call(self, op: str, args: list, key: str, wait_s: float | None = None) -> object:
        """Send one request and wait for its answer: ``wait_s`` for a get / wait (the server answers "timeout"
        then too; a late answer is dropped by its request id), the store's timeout for anything else."""
        limit_s = self._timeout_s() if wait_s is None else wait_s
        stage = f"store {op} {key}"
        with self._lock:
            self._request_id += 1
            request_id = self._request_id
            self._send(request_id, op, args, key)
            ok, result = self._answer(request_id, stage, limit_s)
        if not ok:
            if str(result).startswith("timeout"):
                raise PeerTimeout(f"the rendezvous store at {self.endpoint}", stage, limit_s)
            raise WireError(f"the rendezvous store at {self.endpoint} refused {stage}: {result}")
        return result

    def _send(self, request_id: int, op: str, args: list, key: str) -> None:
        if self._closed:
            raise RaysyncError(f"the rendezvous store client of {self.endpoint} is closed (store {op} {key})")
        try:
            self._sock.send(msgpack.packb([request_id, op, args]), zmq.NOBLOCK)
        except zmq.Again:  # nothing queued: the server is not reachable
            stage = f"store {op} {key}"
            raise PeerTimeout(f"the rendezvous store at {self.endpoint}", stage, self._timeout_s()) from None

    def _answer(self, request_id: int, stage: str, limit_s: float) -> tuple[bool, object]:
        deadline = time.monotonic() + limit_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
                raise PeerTimeout(f"the rendezvous store at {self.endpoint}", stage, limit_s)
            try:
                answer = msgpack.unpackb(self._sock.recv(), raw=False, use_list=True, strict_map_key=True)
            except Exception as e:  # the server is authenticated: a bad answer is a bug, not an attack
                raise MalformedFrame(
                    f"the rendezvous store at {self.endpoint} answered {stage} badly: {e}"
                ) from None
            if isinstance(answer, list) and len(answer) == 3 and answer[0] == request_id:
                return bool(answer[1]), answer[2]
            # an answer to an earlier request that timed out here: drop it
