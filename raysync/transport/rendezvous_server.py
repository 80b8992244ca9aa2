"""The rendezvous store's server, run by rank 0 of a collective group (Note [who may talk to the rendezvous
store] in raysync.transport.rendezvous, which holds the keys, the limits and the client).

Two parts, each its own piece:

    StoreServer  the listening socket (ROUTER, CURVE server, MAXMSGSIZE, handshake timeout), bound to one
                 interface, and the one thread that polls it, reads each request and sends each answer
      _ZapGate   the ZAP handler (RFC 27) on the same zmq context: admits only the session's client key and
                 counts the connections it refuses; bound before the listening socket, so no handshake skips it
    StoreTable   (raysync.transport.rendezvous_table) what a request means, the keys and values within their
                 limits and the requests that wait for keys; no socket, no thread
"""

from __future__ import annotations

import hmac
import logging
import threading
import time

import msgpack
import zmq
from zmq.utils import z85

from raysync.core.control import bound_to_every_interface
from raysync.core.errors import EndpointError, WireError
from raysync.core.wire import SessionSecret
from raysync.transport.rendezvous import (
    _ENVELOPE_BYTES,
    _HANDSHAKE_MS,
    _NO_REPLY,
    _ZAP_ENDPOINT,
    CurveKeys,
    _endpoint,
    interface_address,
)
from raysync.transport.rendezvous_table import PENDING, StoreTable, parse_request

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # the server thread wakes at least this often to see close()


# --- who may connect ---------------------------------------------------------------------------------------------------
class _ZapGate:
    """The ZAP handler of one zmq context: admits a CURVE handshake only with the session's client key."""

    def __init__(self, ctx: zmq.Context, client_public_z85: bytes):
        self._client_public = z85.decode(client_public_z85)
        self.refused = 0  # connections refused at the handshake
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(_ZAP_ENDPOINT)

    def answer(self) -> None:
        """RFC 27: admit only the session's client key (Note [who may talk to the rendezvous store])."""
        frames = self.sock.recv_multipart()
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
        self.sock.send_multipart([b"1.0", request_id, *status, b"", b""])


# --- the server ------------------------------------------------------------------------------------------------------
class StoreServer:
    """The rendezvous store's server, in rank 0's process: one thread answers every request."""

    def __init__(self, secret: SessionSecret, host: str, max_value_bytes: int):
        self.max_value_bytes = max_value_bytes
        address = interface_address(host)
        keys = CurveKeys.of(secret)
        self._ctx = zmq.Context()
        self._zap = _ZapGate(self._ctx, keys.client_public)  # before the server socket: no handshake skips it
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
        self.port = self._bind(address, host)
        self._table = StoreTable(max_value_bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="raysync-rendezvous", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections refused at the handshake so far."""
        return self._zap.refused

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else the thread still uses them; the daemon dies with the process
            self._close_sockets()

    def _bind(self, address: str, host: str) -> int:
        """Bind the server socket to the one interface ``address`` and return its port."""
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
        return int(bound.rsplit(":", 1)[1])

    def _close_sockets(self) -> None:
        if not self._ctx.closed:
            self._sock.close(linger=0)
            self._zap.sock.close(linger=0)
            self._ctx.term()

    # the loop ------------------------------------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap.sock, zmq.POLLIN)
        while not self._stop.is_set():
            # wake at least every _POLL_S to see close(), and at the next waiter's deadline
            wake_s = min(_POLL_S, self._table.next_deadline() - time.monotonic())
            events = dict(poller.poll(max(0, int(wake_s * 1000))))
            if self._zap.sock in events:
                self._zap.answer()
            if self._sock in events:
                self._answer_request()
            for late in self._table.take_late(time.monotonic()):
                self._reply(late.peer, late.request_id, False, f"timeout: keys {list(late.keys)} not set")

    def _answer_request(self) -> None:
        parts = self._sock.recv_multipart()
        if len(parts) != 2:
            return  # only our clients talk here, and they send one frame per request
        peer, frame = parts
        try:
            request_id, op, args = parse_request(frame)
        except WireError as e:
            logger.warning("rendezvous store: dropped a malformed request: %s", e)
            return
        try:
            result = self._table.apply(peer, request_id, op, args, time.monotonic())
        except (WireError, KeyError, ValueError, TypeError) as e:
            self._reply(peer, request_id, False, f"{type(e).__name__}: {e}")
            return
        if result is not PENDING:
            self._reply(peer, request_id, True, result)
        for waiter, answer in self._table.take_ready():
            self._reply(waiter.peer, waiter.request_id, True, answer)

    def _reply(self, peer: bytes, request_id: int, ok: bool, result: object) -> None:
        if request_id == _NO_REPLY:
            return
        try:
            self._sock.send_multipart([peer, msgpack.packb([request_id, ok, result])], zmq.NOBLOCK)
        except zmq.ZMQError:  # the client went away: it raises its own timeout
            logger.debug("rendezvous store: could not answer request %d", request_id)
