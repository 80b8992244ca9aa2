"""The rendezvous store's server, run by rank 0 of a collective group (Note [who may talk to the rendezvous
store] in raysync.transport.rendezvous, which holds the keys, the limits and the client)."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass

import msgpack
import zmq
from zmq.utils import z85

from raysync.core.control import bound_to_every_interface
from raysync.core.errors import EndpointError, MalformedFrame, WireError
from raysync.core.wire import SessionSecret
from raysync.transport.rendezvous import (
    _ENVELOPE_BYTES,
    _HANDSHAKE_MS,
    _NO_REPLY,
    _ZAP_ENDPOINT,
    MAX_KEY_CHARS,
    MAX_KEYS,
    MAX_WAITERS,
    CurveKeys,
    _endpoint,
    interface_address,
)

logger = logging.getLogger(__name__)


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
            raise EndpointError(
                f"the rendezvous store bound {bound}, every interface, for host {host!r}; give this node's IP"
            )
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


def _parse_request(frame: bytes) -> tuple[int, str, list]:
    try:
        request = msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise MalformedFrame(f"not msgpack: {e}") from None
    if not (
        isinstance(request, list)
        and len(request) == 3
        and isinstance(request[1], str)
        and isinstance(request[2], list)
    ):
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
