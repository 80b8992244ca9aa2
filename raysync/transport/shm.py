"""Shared-memory ring: same node, no CUDA IPC (CPU, NPU, or IPC refused).

    sender process                                                                receiver process
    params --pack--> [ memfd 0 ][ memfd 1 ]   sealed: cannot shrink or grow   --map--> unpack --> model
                            |  fds, once per session, over a unix socket in the sender's 0700 directory
                            +---------------------------------------------------------> (SCM_RIGHTS)

Every buffer is a memfd (an anonymous file: no name in /dev/shm or anywhere), its pages reserved and then
sealed so that no process can change its size (Note [no SIGBUS]). The receiver gets the fds over a unix socket
(Note [handing over the segments]). Where the process uses CUDA the mapping is registered with
cudaHostRegister, so device <-> host copies run at pinned-memory speed.

# Note [shm names and crashes]
# A memfd has no name: it lives exactly as long as an fd or a mapping of it, so a SIGKILL of either side at
# any point frees whatever only that side held, and nothing of a ring is ever in /dev/shm. The one named
# entry is the handoff socket's private directory, ``raysync-<pid>-<start>-<pidns>-<random>`` in the temp dir:
# removed once the receiver has its fds (and on every path the sender survives); after a SIGKILL of the sender
# before that, the next sender, receiver or ring made on the machine removes it (raysync.leftovers).
# Python's multiprocessing.shared_memory is not used: on Python < 3.13 it registers every segment with the
# resource_tracker, which warns about or unlinks segments it did not create.

# Note [no SIGBUS]
# Touching a page of a mapped file beyond the file's end kills the process with SIGBUS: no exception, no
# cleanup. So is touching a page that cannot be allocated on a tmpfs that is full. Both are closed here:
# - a segment cannot shrink: it is sealed with F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL before any other
#   process can reach it, and the kernel then refuses every size change (ftruncate, fallocate past the end:
#   EPERM) to every holder, through any fd (also /proc/<pid>/fd/N), for the segment's lifetime; F_SEAL_SEAL
#   means nobody can lift the seals. The receiver maps only fds whose seals include all three and whose size
#   is the ring's (``check_sealed``). Nothing is checked before each use, because there is nothing to check:
#   no window between a check and a copy exists in which the size could change.
# - a memfd's pages come from the kernel's internal shm mount, which has no size limit: /dev/shm's size (64 MB
#   in Docker) does not apply. The ring's memory is charged as shared memory is (RAM, the memory cgroup of a
#   container): checked before anything is made, and every page reserved with posix_fallocate before sealing,
#   so no memory is a ShmSpaceError at set-up, naming the sizes and the fix.
# What a holder of a segment can still do: write into it (SyncConfig.verify detects that) or punch a hole in
# it (fallocate PUNCH_HOLE: the pages read back as zeros and are allocated again when touched; where that
# allocation fails it is the OOM killer's, as for any memory, or under strict overcommit
# (vm.overcommit_memory=2) at its limit, a SIGBUS). Only a process of the same user holds one, and such a
# process could as well kill ours.

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

import errno
import fcntl
import functools
import hmac
import logging
import mmap
import os
import secrets
import select
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from typing import ClassVar

import torch

from raysync import leftovers
from raysync.control import private_dir_base
from raysync.errors import LayoutError, PeerLost, PeerTimeout, ShmSpaceError
from raysync.transport.base import HostRing
from raysync.wire import Attached, RingInfo

logger = logging.getLogger(__name__)

HANDOFF_TIMEOUT_S = 60.0  # the handoff follows RingInfo at once; a bound, not an expected time
_CONNECTION_TIMEOUT_S = 10.0  # one connection to the handoff socket: a stranger cannot hold it longer
_TOKEN_BYTES = 32
_MAX_BUFFERS = 64
_SOCKET_NAME = "fds"
_HANDOFF_MAGIC = b"raysync-shm-fds"
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# a seal against writing would make the receiver's writable mapping fail (F_SEAL_FUTURE_WRITE: Linux >= 5.1)
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x8)  # Linux >= 6.3; refused (EINVAL) by older kernels
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_FIX = (
    "lower SyncConfig.bucket_bytes or num_buffers, or give the process more memory (a container's memory "
    "limit: docker run --memory, the pod's memory limit on Kubernetes); the ring lives in memfds, so the size "
    "of /dev/shm does not matter"
)


# --- how much memory a ring may take --------------------------------------------------------------------------------
def ring_memory_bytes() -> int:
    """Memory a new ring may take here: MemAvailable, or less where this process's memory cgroup has less room
    (its limit minus what it uses that cannot be reclaimed). A very large number where neither can be read."""
    rooms = [r for r in (_mem_available(), _cgroup_room()) if r is not None]
    return min(rooms, default=1 << 62)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """The least room left under any memory cgroup limit of this process (cgroup v2 or v1), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: memory.max, memory.current
            bases, files = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), ("max", "current", "inactive_file")
        elif "memory" in controllers.split(","):
            bases, files = (
                ("/sys/fs/cgroup/memory",),
                ("limit_in_bytes", "usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        for base in bases:
            room = _room_in(os.path.join(base, path.lstrip("/")), *files)
            if room is not None:
                rooms.append(room)
                break
    return min(rooms, default=None)


def _room_in(cgroup: str, limit_name: str, usage_name: str, reclaimable_stat: str) -> int | None:
    try:
        with open(os.path.join(cgroup, f"memory.{limit_name}")) as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, f"memory.{usage_name}")) as f:
            usage = int(f.read())
        with open(os.path.join(cgroup, "memory.stat")) as f:  # page cache the kernel would evict for us
            stats = dict(line.split() for line in f if line.count(" ") == 1)
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 62:  # no limit
        return None
    return max(0, int(limit) - usage + int(stats.get(reclaimable_stat, 0)))


def _check_memory(num_buffers: int, buffer_bytes: int) -> None:
    room, wanted = ring_memory_bytes(), num_buffers * buffer_bytes
    if wanted > room:
        raise ShmSpaceError(
            f"the shm ring needs {num_buffers} x {buffer_bytes} bytes = {wanted / 2**20:.1f} MiB of memory, and "
            f"this process has {room / 2**20:.1f} MiB available (MemAvailable, memory cgroup limit): {_FIX}"
        )


# --- segments -------------------------------------------------------------------------------------------------------
class _Segment:
    """One mapped segment: its bytes as a uint8 tensor, optionally registered with CUDA, and its memfd. Owns
    ``fd`` once made.

    # Note [shm buffer lifetime]
    # The tensor exports the mmap's buffer; the mmap cannot close while any view of it lives. close() drops
    # our references, unregisters from CUDA, and closes the map and the fd; if the caller still holds a view
    # (against Note [ring buffer views]), the map is left to the garbage collector: a memfd has no name, so
    # nothing outlives the process.
    """

    def __init__(self, fd: int, nbytes: int, pin: bool):
        self._mmap = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)
        self.fd, self.nbytes = fd, nbytes
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._pinned = pin and _cuda_host_register(self.tensor)

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("a view of a ring buffer is still alive; its mapping closes when that view dies")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _cuda_host_register(tensor: torch.Tensor) -> bool:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 1)  # 1: portable
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister of %d bytes failed (%s): copies run at pageable speed", tensor.numel(), err
        )
        return False
    return True


def create_segment(nbytes: int, pin: bool = True) -> _Segment:
    """A new memfd of ``nbytes``, every page reserved, sealed against any size change (Note [no SIGBUS]); raises
    ShmSpaceError when there is no memory or no fd left for it, and then leaves nothing behind."""
    fd = _memfd(f"{leftovers.owner_tag()}-ring")
    try:
        os.fchmod(fd, 0o600)  # reachable only through fds anyway; /proc/<pid>/fd reopens honour the mode
        os.ftruncate(fd, nbytes)
        _reserve(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS)
        return _Segment(fd, nbytes, pin)
    except BaseException:
        os.close(fd)
        raise


def _memfd(name: str) -> int:
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        try:  # not executable, and quiet on kernels that warn about memfds that do not say
            return os.memfd_create(name, flags | _MFD_NOEXEC_SEAL)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return os.memfd_create(name, flags)  # a kernel before 6.3
    except OSError as e:
        raise ShmSpaceError(
            f"cannot create a memfd for a shm ring buffer ({e.strerror}): raise the open-file limit (ulimit -n) "
            f"if it is EMFILE, or {_FIX}"
        ) from None


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate every page now, so that a page nobody can allocate is an error here, not a SIGBUS later."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise ShmSpaceError(
            f"cannot reserve {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for a shm ring buffer ({e.strerror}; "
            f"{ring_memory_bytes() / 2**20:.1f} MiB available): {_FIX}"
        ) from None


@functools.cache
def memfd_sealing_works() -> bool:
    """Whether this kernel makes sealed memfds (Linux >= 3.17) and Python can pass fds (socket.send_fds)."""
    if not (hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and hasattr(fcntl, "F_ADD_SEALS")):
        return False
    try:
        create_segment(4096, pin=False).close()
    except OSError:
        return False
    return True


def check_sealed(fd: int, nbytes: int, what: str) -> None:
    """Refuse (LayoutError) an fd that a peer handed over unless it is a memfd of exactly ``nbytes`` that can
    never shrink or grow and that we may map for writing: only then does mapping it rule out SIGBUS."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refused(what, f"it is not a file (mode {oct(st.st_mode)})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise _refused(what, "it is not a memfd (no seals)") from None
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise _refused(what, f"its seals are {seals:#x}, without F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL")
    if seals & _WRITE_SEALS:
        raise _refused(what, f"it is sealed against writing (seals {seals:#x})")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise _refused(what, "it is not open for reading and writing")
    if st.st_size != nbytes:
        raise _refused(what, f"it has {st.st_size} bytes, the ring says {nbytes}")


def _refused(what: str, why: str) -> LayoutError:
    return LayoutError(
        f"refusing {what}: {why}. A segment that is not sealed could be shrunk while it is mapped and kill "
        f"this process (SIGBUS); the sender must run this raysync version (memfds sealed with F_SEAL_SHRINK | "
        f"F_SEAL_GROW | F_SEAL_SEAL)"
    )


# --- the handoff of the fds (Note [handing over the segments]) -------------------------------------------------------
class FdHandoff:
    """The sender's half: serves ``fds`` once, to the first connection of this user that sends ``token``, from
    a thread, for at most ``timeout_s``. ``path`` and ``token`` go to the receiver in the signed RingInfo."""

    def __init__(self, fds: list[int], timeout_s: float = HANDOFF_TIMEOUT_S):
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.served = False
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
        self._thread = threading.Thread(target=self._serve, args=(timeout_s,), name="raysync-shm-handoff",
                                        daemon=True)  # fmt: skip
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
            while not self.served:
                remaining = deadline - time.monotonic()
                ready = {fd for fd, _ in poller.poll(max(0, int(remaining * 1000)))}  # 0: the deadline passed
                if not ready:
                    logger.warning("no receiver fetched the shm ring within %gs: its handoff socket is closed",
                                   timeout_s)  # fmt: skip
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
                logger.warning("refused a connection to the shm ring's handoff socket from pid %d (uid %d): "
                               "not this session's receiver", pid, uid)  # fmt: skip
                return
            socket.send_fds(conn, [_HANDOFF_MAGIC], self._fds)
        except OSError as e:  # a timeout or a peer that went away: wait for the next connection
            logger.warning("shm ring handoff to pid %d failed: %s", pid, e)
            return
        self.served = True
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
                peer, stage, f"its handoff socket {path} is not there ({e.strerror}): it died, gave up waiting "
                f"for this receiver, or served another one; start a new session"
            ) from None  # fmt: skip
    if not data and not fds:
        raise PeerLost(peer, stage, f"it closed its handoff socket {path} without handing over the ring: it "
                       "refused this receiver (another session's token, or another user)")  # fmt: skip
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


# --- the two halves -------------------------------------------------------------------------------------------------
class ShmRingSender(HostRing):
    """Memfds sealed against resizing: needs Linux >= 3.17."""

    name: ClassVar[str] = "shm"

    @classmethod
    def is_available(cls) -> bool:
        return memfd_sealing_works()

    def __init__(self, num_buffers: int, buffer_bytes: int, pin: bool = True,
                 timeout_s: float = HANDOFF_TIMEOUT_S):  # fmt: skip
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]
        _check_memory(num_buffers, buffer_bytes)
        self.buffer_bytes = buffer_bytes
        self._segments: list[_Segment] = []
        self._handoff: FdHandoff | None = None
        try:
            for _ in range(num_buffers):
                self._segments.append(create_segment(buffer_bytes, pin))
            self._handoff = FdHandoff([s.fd for s in self._segments], timeout_s)
        except BaseException:
            self.close()
            raise
        self.buffers = [s.tensor for s in self._segments]
        logger.debug(
            "shm ring: %d x %d bytes, handed over at %s", num_buffers, buffer_bytes, self._handoff.path
        )

    def info(self) -> RingInfo:
        assert self._handoff is not None, "info() of a closed ring"
        return RingInfo(self.name, len(self._segments), self.buffer_bytes,
                        (self._handoff.path, self._handoff.token.hex()))  # fmt: skip

    def receiver_attached(self, attached: Attached | None = None) -> None:
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None

    def close(self) -> None:
        self.receiver_attached()  # idempotent: stop serving the fds
        for s in self._segments:
            s.close()
        self._segments, self.buffers = [], []


class ShmRingReceiver(HostRing):
    name: ClassVar[str] = "shm"

    def __init__(self, info: RingInfo, pin: bool = True, timeout_s: float = HANDOFF_TIMEOUT_S):
        path, token, owner = _handoff_of(info)
        peer = f"the sender (pid {owner.pid})"
        fds = fetch_fds(path, token, info.num_buffers, peer, timeout_s)
        self._segments: list[_Segment] = []
        try:
            for k, fd in enumerate(fds):
                check_sealed(fd, info.buffer_bytes, f"buffer {k} of the shm ring from {peer}")
                self._segments.append(_map(fd, info.buffer_bytes, pin, peer))
        except BaseException:
            for fd in fds[len(self._segments) :]:
                os.close(fd)
            self.close()
            raise
        self.buffers = [s.tensor for s in self._segments]

    def close(self) -> None:
        for s in self._segments:
            s.close()
        self._segments, self.buffers = [], []


def _handoff_of(info: RingInfo) -> tuple[str, bytes, leftovers.Owner]:
    """The handoff socket's path, the token and the sender, from a RingInfo; LayoutError for anything else."""
    if (
        info.transport != ShmRingSender.name
        or not 1 <= info.num_buffers <= _MAX_BUFFERS
        or len(info.handles) != 2
    ):
        raise LayoutError(f"ring description does not fit the shm transport: {info}")
    path, token = info.handles
    directory, name = os.path.split(path)
    owner = leftovers.owner_of(os.path.basename(directory))
    if not os.path.isabs(path) or name != _SOCKET_NAME or owner is None or os.path.normpath(path) != path:
        raise LayoutError(f"refusing shm handoff socket {path!r}: not one raysync makes")
    try:
        secret = bytes.fromhex(token)
    except ValueError:
        secret = b""
    if len(secret) != _TOKEN_BYTES:
        raise LayoutError(
            f"refusing the shm ring's token: {len(token)} characters, not {2 * _TOKEN_BYTES} hex digits"
        )
    return path, secret, owner


def _map(fd: int, nbytes: int, pin: bool, peer: str) -> _Segment:
    try:
        return _Segment(fd, nbytes, pin)
    except OSError as e:  # e.g. a hugetlb memfd without huge pages to back it
        raise LayoutError(f"cannot map a shm ring buffer of {nbytes} bytes from {peer}: {e}") from None
