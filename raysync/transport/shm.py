"""Shared-memory ring: same node, no CUDA IPC (CPU, NPU, or IPC refused).

    sender process                                                                receiver process
    params --pack--> [ memfd 0 ][ memfd 1 ]   sealed: cannot shrink or grow   --map--> unpack --> model
                            |  fds, once per session, over a unix socket in the sender's 0700 directory
                            +---------------------------------------------------------> (SCM_RIGHTS)

Every buffer is a memfd (an anonymous file: no name in /dev/shm or anywhere), its pages reserved and then
sealed so that no process can change its size (Note [no SIGBUS]). The receiver gets the fds over a unix socket
(Note [handing over the segments] in raysync.transport.fd_handoff). Where the process uses CUDA the mapping
is registered with cudaHostRegister, so device <-> host copies run at pinned-memory speed.

# Note [shm names and crashes]
# A memfd has no name: it lives exactly as long as an fd or a mapping of it, so a SIGKILL of either side at
# any point frees whatever only that side held, and nothing of a ring is ever in /dev/shm. The one named
# entry is the handoff socket's private directory, ``raysync-<pid>-<start>-<pidns>-<random>`` in the temp dir:
# removed once the receiver has its fds (and on every path the sender survives); after a SIGKILL of the sender
# before that, the next sender, receiver or ring made on the machine removes it (raysync.core.leftovers).
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
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import mmap
import os
import socket
import stat
from typing import ClassVar

import torch

from raysync.core import host_memory, leftovers
from raysync.core.control import private_dir_base
from raysync.core.errors import LayoutError, ShmSpaceError
from raysync.core.wire import Attached, RingInfo
from raysync.transport.base import HostRing
from raysync.transport.fd_handoff import _SOCKET_NAME, _TOKEN_BYTES, HANDOFF_TIMEOUT_S, FdHandoff, fetch_fds

logger = logging.getLogger(__name__)

_MAX_BUFFERS = 64
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# a seal against writing would make the receiver's writable mapping fail (F_SEAL_FUTURE_WRITE: Linux >= 5.1)
_WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
_MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x8)  # Linux >= 6.3; refused (EINVAL) by older kernels
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
        self._pinned = pin and host_memory.register(self.tensor)

    def close(self) -> None:
        if self._pinned:
            host_memory.unregister(self.tensor)
            self._pinned = False
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("a view of a ring buffer is still alive; its mapping closes when that view dies")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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


# --- the two halves -------------------------------------------------------------------------------------------------
class ShmRingSender(HostRing):
    """Memfds sealed against resizing: needs Linux >= 3.17."""

    name: ClassVar[str] = "shm"

    @classmethod
    def is_available(cls) -> bool:
        return memfd_sealing_works()

    def __init__(
        self,
        num_buffers: int,
        buffer_bytes: int,
        pin: bool = True,
        timeout_s: float = HANDOFF_TIMEOUT_S,
        readers: int = 1,
    ):
        leftovers.sweep_shared_dirs(private_dir_base())  # Note [names that outlive a crash]
        _check_memory(num_buffers, buffer_bytes)
        self.buffer_bytes = buffer_bytes
        self._segments: list[_Segment] = []
        self._handoff: FdHandoff | None = None
        try:
            for _ in range(num_buffers):
                self._segments.append(create_segment(buffer_bytes, pin))
            self._handoff = FdHandoff([s.fd for s in self._segments], timeout_s, readers)
        except BaseException:
            self.close()
            raise
        self.buffers = [s.tensor for s in self._segments]
        self.readers = readers
        logger.debug(
            "shm ring: %d x %d bytes, handed over at %s", num_buffers, buffer_bytes, self._handoff.path
        )

    def info(self) -> RingInfo:
        assert self._handoff is not None, "info() of a closed ring"
        handles = (self._handoff.path, self._handoff.token.hex())
        return RingInfo(self.name, len(self._segments), self.buffer_bytes, handles, readers=self.readers)

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
