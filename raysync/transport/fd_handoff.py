"""The handoff of a ring's memfds from the sender's process to the receiver's (raysync.transport.shm).

# Note [handing over the segments]
# A memfd is reached only through an fd, so the sender passes them with SCM_RIGHTS over a unix socket it
# listens on in a private directory (mode 0700, named as in Note [shm names and crashes]). The socket's path
# and a one-time token of 32 random bytes travel in RingInfo.handles, inside the control channel's signed
# frame: only the receiver that holds the session key learns them. A thread of the sender (FdHandoff) answers
# the first connection whose peer runs as this user (SO_PEERCRED) and sends the token, with the fds, then
# closes the socket and removes the directory: one receiver, once. The receiver (fetch_fds) checks that the
# socket is served by this user and, in the same pid namespace, by the process the directory is named after,
# then checks every fd it got (check_sealed) before mapping it. Every wait on either side is bounded.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time

from raysync.core import leftovers
from raysync.core.control import private_dir_base
from raysync.core.errors import LayoutError, PeerLost, PeerTimeout

logger = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = 60.0  # the handoff follows RingInfo at once; a bound, not an expected time
_CONNECTION_TIMEOUT_S = 10.0  # one connection to the handoff socket: a stranger cannot hold it longer
_TOKEN_BYTES = 32
_SOCKET_NAME = "fds"
_HANDOFF_MAGIC = b"raysync-shm-fds"
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


# --- the handoff of the fds (Note [handing over the segments]) -------------------------------------------------------
class FdHandoff:
    """The sender's half: serves ``fds`` to the first ``readers`` connections of this user that send ``token``
    (one each), from a thread, for at most ``timeout_s``. ``path`` and ``token`` go to the receivers in the
    signed RingInfo."""

    def __init__(self, fds: list[int], timeout_s: float = HANDOFF_TIMEOUT_S, readers: int = 1):
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.served, self.readers = 0, readers
        self.path, self._dir = "", ""
        self._fds: list[int] = []  # our own copies: the ring closing its fds never pulls one from the thread
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._wake, self._woken = socket.socketpair()
        try:
            self._fds += [os.dup(fd) for fd in fds]
            self._dir = tempfile.mkdtemp(prefix=f"{leftovers.owner_tag()}-", dir=private_dir_base())  # 0700
            self.path = os.path.join(self._dir, _SOCKET_NAME)
            self._listener.bind(self.path)
            self._listener.listen(8)
        except BaseException:
            self._wake.close()
            self._release()
            raise
        self._thread = threading.Thread(
            target=self._serve, args=(timeout_s,), name="raysync-shm-handoff", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving (idempotent): wake the thread, which releases what it holds, and remove the directory."""
        try:
            self._wake.send(b"x")
        except OSError:
            pass  # the thread has ended and closed its end
        self._thread.join(timeout=_CONNECTION_TIMEOUT_S)  # at once, or after the connection it is serving
        self._wake.close()
        _remove_dir(self._dir)

    def _serve(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._woken, select.POLLIN)
        try:
            while self.served < self.readers:
                remaining = deadline - time.monotonic()
                ready = {fd for fd, _ in poller.poll(max(0, int(remaining * 1000)))}  # 0: the deadline passed
                if not ready:
                    logger.warning(
                        "no receiver fetched the shm ring within %gs: its handoff socket is closed", timeout_s
                    )
                    return
                if self._woken.fileno() in ready:
                    return
                conn, _ = self._listener.accept()
                with conn:
                    self._serve_one(conn, min(remaining, _CONNECTION_TIMEOUT_S))
        except Exception:  # never let the thread die silently: the receiver's wait is bounded anyway
            logger.exception("the shm ring's fd handoff failed")
        finally:
            self._release()

    def _serve_one(self, conn: socket.socket, timeout_s: float) -> None:
        conn.settimeout(timeout_s)
        pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        try:
            token = _recv_exactly(conn, _TOKEN_BYTES) if uid == os.geteuid() else b""
            if not hmac.compare_digest(token, self.token):
                logger.warning(
                    "refused a connection to the shm ring's handoff socket from pid %d (uid %d): "
                    "not this session's receiver",
                    pid,
                    uid,
                )
                return
            socket.send_fds(conn, [_HANDOFF_MAGIC], self._fds)
        except OSError as e:  # a timeout or a peer that went away: wait for the next connection
            logger.warning("shm ring handoff to pid %d failed: %s", pid, e)
            return
        self.served += 1
        logger.debug("handed %d shm ring segments to pid %d", len(self._fds), pid)

    def _release(self) -> None:
        self._listener.close()
        self._woken.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        _remove_dir(self._dir)


def _remove_dir(path: str) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = conn.recv(nbytes - len(data))
        if not more:
            break
        data += more
    return data


def fetch_fds(
    path: str, token: bytes, count: int, peer: str, timeout_s: float = HANDOFF_TIMEOUT_S
) -> list[int]:
    """The receiver's half: connect to the sender's handoff socket, prove the session with ``token``, and return
    the ``count`` fds it hands over (not yet checked: see check_sealed). Every step is bounded by ``timeout_s``."""
    stage = "handshake: fetch the ring's segments"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            _check_server(sock, path, peer)
            sock.sendall(token)
            data, fds, flags, _ = socket.recv_fds(sock, 64, count + 1, socket.MSG_CMSG_CLOEXEC)
        except TimeoutError:
            raise PeerTimeout(peer, stage, timeout_s) from None
        except OSError as e:
            raise PeerLost(
                peer,
                stage,
                f"its handoff socket {path} is not there ({e.strerror}): it died, gave up waiting "
                f"for this receiver, or served another one; start a new session",
            ) from None
    if not data and not fds:
        raise PeerLost(
            peer,
            stage,
            f"it closed its handoff socket {path} without handing over the ring: it "
            "refused this receiver (another session's token, or another user)",
        )
    if data != _HANDOFF_MAGIC or flags & socket.MSG_CTRUNC or len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise LayoutError(
            f"{peer} handed over {len(fds)} fds (truncated: {bool(flags & socket.MSG_CTRUNC)}) with {data[:32]!r}, "
            f"the ring has {count} buffers: refusing the ring; start a new session with a sender of this version"
        )
    return fds


def _check_server(sock: socket.socket, path: str, peer: str) -> None:
    """The socket is served by this user and, where pids can be compared, by the process its directory names."""
    pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    owner = leftovers.owner_of(os.path.basename(os.path.dirname(path)))
    same_namespace = owner is not None and owner.ns == leftovers.this_process().ns
    if uid != os.geteuid() or (same_namespace and owner is not None and pid != owner.pid):
        raise LayoutError(
            f"refusing the ring's handoff socket {path}: it is served by pid {pid} of uid {uid}, not by {peer} of "
            f"uid {os.geteuid()}; another process took the sender's place: start a new session"
        )
