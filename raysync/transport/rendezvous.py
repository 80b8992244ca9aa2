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

from raysync.control import binds_every_interface, bound_to_every_interface
from raysync.errors import EndpointError, MalformedFrame, PeerTimeout, RaysyncError, WireError
from raysync.wire import SessionSecret

logger = logging.getLogger(__name__)

MAX_KEYS = 4096  # a push writes a handful of keys and deletes the previous push's (CollectiveSender)
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
    "all interfaces" is refused, decided by what it resolves to (raysync.control's guard, and any resolved
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


# --- the server ------------------------------------------------------------------------------------------------------
@dataclass
class _Waiter:
    peer: bytes
    request_id: int
    op: str  # "get", "multi_get" or "wait"
    keys: tuple[str, ...]
    deadline: float


class StoreServer:
    """The rendezvous store's server, in rank 0's process: one thread answers every request."""

    def __init__(self, secret: SessionSecret, host: str, max_value_bytes: int):
        self.max_value_bytes = max_value_bytes
        address = interface_address(host)
        keys = CurveKeys.of(secret)
        self._ctx = zmq.Context()
        self._zap = self._ctx.socket(zmq.REP)  # bound before the server socket: no handshake skips it
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(_ZAP_ENDPOINT)
        self._client_public = z85.decode(keys.client_public)
        self._sock = self._ctx.socket(zmq.ROUTER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.MAXMSGSIZE, max_value_bytes + _ENVELOPE_BYTES),
            (zmq.CURVE_SERVER, 1),
            (zmq.CURVE_SECRETKEY, keys.server_secret),
            (zmq.ZAP_DOMAIN, b"raysync-rendezvous"),
            (zmq.ZAP_ENFORCE_DOMAIN, 1),
            (zmq.HANDSHAKE_IVL, _HANDSHAKE_MS),
        ):
            self._sock.setsockopt(option, value)
        self._sock.ipv6 = ":" in address
        try:
            self._sock.bind(_endpoint(address, "*"))
        except zmq.ZMQError as e:
            self._close_sockets()
            raise EndpointError(f"cannot bind the rendezvous store on {address}: {e}") from None
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if bound_to_every_interface(bound):  # a spelling nothing above foresaw
            self._close_sockets()
            raise EndpointError(f"the rendezvous store bound {bound}, every interface, for host {host!r}; "
                                f"give this node's IP")  # fmt: skip
        self.port = int(bound.rsplit(":", 1)[1])
        self.refused = 0  # connections refused at the handshake
        self._data: dict[str, bytes] = {}
        self._waiters: list[_Waiter] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="raysync-rendezvous", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else the thread still uses them; the daemon dies with the process
            self._close_sockets()

    def _close_sockets(self) -> None:
        if not self._ctx.closed:
            self._sock.close(linger=0)
            self._zap.close(linger=0)
            self._ctx.term()

    # the loop ------------------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        while not self._stop.is_set():
            # wake at least every 50 ms to see close(), and at the next waiter's deadline
            wake_s = min([0.05] + [w.deadline - time.monotonic() for w in self._waiters])
            events = dict(poller.poll(max(0, int(wake_s * 1000))))
            if self._zap in events:
                self._answer_zap()
            if self._sock in events:
                self._answer_request()
            self._expire_waiters()

    def _answer_zap(self) -> None:
        """RFC 27: admit only the session's client key (Note [who may talk to the rendezvous store])."""
        frames = self._zap.recv_multipart()
        version, request_id = frames[0], frames[1] if len(frames) > 1 else b""
        mechanism = frames[5] if len(frames) > 5 else b""
        key = frames[6] if len(frames) > 6 else b""
        admitted = (
            version == b"1.0" and mechanism == b"CURVE" and hmac.compare_digest(key, self._client_public)
        )
        if not admitted:
            self.refused += 1
            log = logger.warning if self.refused == 1 else logger.debug  # a flood must not flood the log
            log("rendezvous store: refused a connection without the session's key (%d so far)", self.refused)
        status = (b"200", b"OK") if admitted else (b"400", b"not this session's key")
        self._zap.send_multipart([b"1.0", request_id, *status, b"", b""])

    def _answer_request(self) -> None:
        parts = self._sock.recv_multipart()
        if len(parts) != 2:
            return  # only our clients talk here, and they send one frame per request
        peer, frame = parts
        try:
            request_id, op, args = _parse_request(frame)
        except WireError as e:
            logger.warning("rendezvous store: dropped a malformed request: %s", e)
            return
        try:
            result = self._apply(peer, request_id, op, args)
        except (WireError, KeyError, ValueError, TypeError) as e:
            self._reply(peer, request_id, False, f"{type(e).__name__}: {e}")
            return
        if result is not _PENDING:
            self._reply(peer, request_id, True, result)
        self._wake_waiters()

    def _reply(self, peer: bytes, request_id: int, ok: bool, result: object) -> None:
        if request_id == _NO_REPLY:
            return
        try:
            self._sock.send_multipart([peer, msgpack.packb([request_id, ok, result])], zmq.NOBLOCK)
        except zmq.ZMQError:  # the client went away: it raises its own timeout
            logger.debug("rendezvous store: could not answer request %d", request_id)

    # the operations ------------------------------------------------------------------------------------------------
    def _apply(self, peer: bytes, request_id: int, op: str, args: list) -> object:
        data = self._data
        if op == "set":
            self._put(_key(args[0]), _value(args[1], self.max_value_bytes))
            return None
        if op == "multi_set":
            keys, values = _keys(args[0]), [_value(v, self.max_value_bytes) for v in args[1]]
            if len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys for {len(values)} values")
            for k, v in zip(keys, values, strict=True):
                self._put(k, v)
            return None
        if op == "append":
            key = _key(args[0])
            self._put(
                key, _value(data.get(key, b"") + _value(args[1], self.max_value_bytes), self.max_value_bytes)
            )
            return None
        if op == "add":
            key, amount = _key(args[0]), _int(args[1])
            value = int(data.get(key, b"0")) + amount
            self._put(key, str(value).encode())
            return value
        if op == "compare_set":
            key, expected, desired = (
                _key(args[0]),
                _value(args[1], self.max_value_bytes),
                _value(args[2], self.max_value_bytes),
            )
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._put(key, desired)
                return desired
            return expected if current is None else current
        if op == "check":
            return all(k in data for k in _keys(args[0]))
        if op == "delete_key":
            return data.pop(_key(args[0]), None) is not None
        if op == "delete_keys":
            return sum(data.pop(k, None) is not None for k in _keys(args[0]))
        if op == "num_keys":
            return len(data)
        if op in ("get", "multi_get", "wait"):
            keys = _keys(args[0]) if op != "get" else (_key(args[0]),)
            waiter = _Waiter(peer, request_id, op, keys, time.monotonic() + _int(args[1]) / 1000)
            if all(k in data for k in keys):
                return self._result(waiter)
            if len(self._waiters) >= MAX_WAITERS:
                raise ValueError(f"{MAX_WAITERS} requests are waiting already")
            self._waiters.append(waiter)
            return _PENDING
        raise ValueError(f"unknown store operation {op!r}")

    def _put(self, key: str, value: bytes) -> None:
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise ValueError(f"the store holds {MAX_KEYS} keys already; refusing {key!r}")
        self._data[key] = value

    def _result(self, waiter: _Waiter) -> object:
        if waiter.op == "get":
            return self._data[waiter.keys[0]]
        if waiter.op == "multi_get":
            return [self._data[k] for k in waiter.keys]
        return None

    def _wake_waiters(self) -> None:
        ready = [w for w in self._waiters if all(k in self._data for k in w.keys)]
        for w in ready:
            self._waiters.remove(w)
            self._reply(w.peer, w.request_id, True, self._result(w))

    def _expire_waiters(self) -> None:
        now = time.monotonic()
        late = [w for w in self._waiters if w.deadline <= now]
        for w in late:
            self._waiters.remove(w)
            self._reply(w.peer, w.request_id, False, f"timeout: keys {list(w.keys)} not set")


_PENDING = object()  # the answer comes when the keys are set (or the request's deadline passes)
_NO_REPLY = 0  # the request id of a request whose sender does not wait for an answer


def _parse_request(frame: bytes) -> tuple[int, str, list]:
    try:
        request = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise MalformedFrame(f"not msgpack: {e}") from None
    if not (isinstance(request, list) and len(request) == 3 and isinstance(request[1], str)
            and isinstance(request[2], list)):  # fmt: skip
        raise MalformedFrame("expected [request_id, op, args]")
    return _int(request[0]), request[1], request[2]


def _int(value: object) -> int:
    if type(value) is not int or not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"expected a 64-bit integer, got {type(value).__name__}")
    return value


def _key(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_KEY_CHARS:
        raise ValueError(f"a key is a string of 1..{MAX_KEY_CHARS} characters, got {type(value).__name__}")
    return value


def _keys(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_KEYS:
        raise ValueError(f"expected a list of 1..{MAX_KEYS} keys")
    return tuple(_key(k) for k in value)


def _value(value: object, max_bytes: int) -> bytes:
    if not isinstance(value, bytes):
        raise ValueError(f"a value is bytes, got {type(value).__name__}")
    if len(value) > max_bytes:
        raise ValueError(f"a value of {len(value)} bytes exceeds max_frame_bytes={max_bytes}")
    return value


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
        self._call("multi_set", [list(keys), [self._bytes(k, v) for k, v in zip(keys, values, strict=True)]],
                   ",".join(keys))  # fmt: skip

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
            raise WireError(f"store value for key {key!r}: {len(data)} bytes exceed max_frame_bytes="
                            f"{self.max_value_bytes}; raise SyncConfig.max_frame_bytes")  # fmt: skip
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
