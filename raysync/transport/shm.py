"""POSIX shared-memory ring: same node, no CUDA IPC (CPU, NPU, or IPC refused).

    sender process                              /dev/shm (tmpfs)                          receiver process
    params --pack--> [ buffer 0 ][ buffer 1 ]  raysync-<pid>-<start>-<ns>-<random> x N  --map--> unpack --> model

Segments are created exclusively (O_EXCL | O_NOFOLLOW) with mode 0600 under names nobody can guess that carry
their owner (Note [names that outlive a crash]), and every page is reserved and populated once per session.
Where the process uses CUDA the mapping is registered with cudaHostRegister, so device <-> host copies run at
pinned-memory speed.

# Note [shm names and crashes]
# The receiver unlinks every name the moment it has mapped it (the sender does too when told, and on close),
# so once a session is set up /dev/shm holds nothing of it: the kernel frees the memory when the last mapping
# goes, whichever side is SIGKILLed. A crash inside the handshake itself leaves names behind; they carry the
# dead owner's pid, and the next ring, sender or receiver made on the machine removes them (raysync.leftovers).
# Python's multiprocessing.shared_memory is not used: on Python < 3.13 it registers every segment with the
# resource_tracker, which warns about or unlinks segments it did not create.

# Note [no SIGBUS]
# Touching a page of a mapped file beyond the file's end kills the process with SIGBUS: no exception, no
# cleanup. Two ways to get there, both closed here:
# - a sparse segment whose pages cannot be allocated when first written (/dev/shm full, e.g. Docker's 64 MB
#   beside Ray's object store): every segment is reserved with posix_fallocate when made, so a full /dev/shm
#   is a ShmSpaceError at setup, naming the sizes and the fix;
# - a segment that another process shrank (ftruncate) after it was mapped: each side keeps the segment's fd
#   and checks its size (one fstat, ~1 us) before every pack and every unpack (``before_pack`` /
#   ``before_unpack``, or ``check``), so it is a ShmSegmentResized naming the peer and the stage.
# What the check cannot close: a process that shrinks a segment during the copy itself (after the check).
# Only a process of the same user can, one that could as well kill ours.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from typing import ClassVar

import torch

from raysync import leftovers
from raysync.errors import LayoutError, ShmSegmentResized, ShmSpaceError
from raysync.leftovers import SHM_DIR
from raysync.transport.base import HostRing
from raysync.wire import Attached, RingInfo

logger = logging.getLogger(__name__)

_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# what a ring's segments are called (Note [names that outlive a crash]); the receiver maps nothing else
SEGMENT_NAME = re.compile(r"raysync-[0-9]{1,10}-[0-9]{1,20}-[0-9]{1,20}-[0-9a-f]{32}")
_FIX = (
    "lower SyncConfig.bucket_bytes or num_buffers, give the container a larger /dev/shm (docker run "
    "--shm-size=..., on Kubernetes an emptyDir with medium: Memory), or free /dev/shm (Ray's object store may "
    "live there too)"
)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _shm_space() -> str:
    st = os.statvfs(SHM_DIR)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return (
        f"{free / 2**20:.1f} MiB free of {total / 2**20:.1f} MiB, {st.f_favail} of {st.f_files} inodes free"
    )


class _Segment:
    """One mapped segment: its bytes as a uint8 tensor, optionally registered with CUDA, and its fd, kept for
    the size check (Note [no SIGBUS]). Owns ``fd`` once made.

    # Note [shm buffer lifetime]
    # The tensor exports the mmap's buffer; the mmap cannot close while any view of it lives. close() drops
    # our references, unregisters from CUDA, and closes the map; if the caller still holds a view (against
    # Note [ring buffer views]), the map is left to the garbage collector: the name is unlinked already, so
    # nothing outlives the process.
    """

    def __init__(self, name: str, fd: int, nbytes: int, pin: bool, peer: str):
        self._mmap = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)
        self.name, self.fd, self.nbytes, self.peer = name, fd, nbytes, peer
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._pinned = pin and _cuda_host_register(self.tensor)

    def check(self, stage: str) -> None:
        """Raise ShmSegmentResized if the segment no longer has the size it was mapped with."""
        size = os.fstat(self.fd).st_size
        if size != self.nbytes:
            raise ShmSegmentResized(self.peer, stage, self.name, self.nbytes, size)

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


def _check_free_space(num_buffers: int, buffer_bytes: int) -> None:
    st = os.statvfs(SHM_DIR)
    free, wanted = st.f_bavail * st.f_frsize, num_buffers * buffer_bytes
    if free < wanted:
        raise ShmSpaceError(
            f"the shm ring needs {num_buffers} x {buffer_bytes} bytes = {wanted / 2**20:.1f} MiB, and {SHM_DIR} "
            f"has {_shm_space()}: {_FIX}"
        )


def create_segment(nbytes: int, pin: bool = True) -> _Segment:
    """A new segment of ``nbytes`` with every page reserved (Note [no SIGBUS]); raises ShmSpaceError when
    /dev/shm has no room or no inode left, and then leaves nothing behind."""
    name = f"{leftovers.owner_tag()}-{secrets.token_hex(16)}"
    try:
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise _no_room_for_a_name() from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        _reserve(fd, nbytes)
        return _Segment(name, fd, nbytes, pin, "the receiver")
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise


def _no_room_for_a_name() -> ShmSpaceError:
    if os.statvfs(SHM_DIR).f_favail == 0:  # tmpfs counts inodes apart from bytes: small files use them up
        return ShmSpaceError(
            f"cannot create a shm segment: {SHM_DIR} has no inode left ({_shm_space()}): remove the files that "
            f"fill it (ls {SHM_DIR}), or give it more inodes (mount -o remount,nr_inodes=... {SHM_DIR})"
        )
    return ShmSpaceError(f"cannot create a shm segment: {SHM_DIR} is full ({_shm_space()}): {_FIX}")


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate every page now: writing a page of a sparse segment in a full /dev/shm raises SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise ShmSpaceError(
            f"cannot reserve {nbytes} bytes ({nbytes / 2**20:.1f} MiB) for a shm ring buffer in {SHM_DIR} "
            f"({e.strerror}; {_shm_space()}): {_FIX}"
        ) from None


class ShmRingSender(HostRing):
    """POSIX shared memory: needs a writable /dev/shm."""

    name: ClassVar[str] = "shm"

    @classmethod
    def is_available(cls) -> bool:
        return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)

    def __init__(self, num_buffers: int, buffer_bytes: int, pin: bool = True):
        leftovers.sweep(SHM_DIR)  # what dead processes left takes room: Note [names that outlive a crash]
        _check_free_space(num_buffers, buffer_bytes)
        self.buffer_bytes = buffer_bytes
        self._segments: list[_Segment] = []
        self._linked: list[str] = []  # names still in /dev/shm
        try:
            for _ in range(num_buffers):
                self._segments.append(create_segment(buffer_bytes, pin))
                self._linked.append(self._segments[-1].name)
        except BaseException:
            self.close()
            raise
        self.buffers = [s.tensor for s in self._segments]
        logger.debug("shm ring: %d x %d bytes (%s)", num_buffers, buffer_bytes, ", ".join(self._linked))

    def info(self) -> RingInfo:
        names = tuple(s.name for s in self._segments)
        return RingInfo(self.name, len(names), self.buffer_bytes, names)

    def check(self, stage: str) -> None:
        """Raise ShmSegmentResized if any buffer was resized since it was made (Note [no SIGBUS])."""
        for s in self._segments:
            s.check(stage)

    def before_pack(self, slot: int) -> None:
        self._segments[slot].check(f"pack into buffer {slot}")

    def receiver_attached(self, attached: Attached | None = None) -> None:
        for name in self._linked:
            _unlink(name)
        self._linked = []

    def close(self) -> None:
        self.receiver_attached()  # idempotent: unlink whatever is still named
        for s in self._segments:
            s.close()
        self._segments, self.buffers = [], []


class ShmRingReceiver(HostRing):
    name: ClassVar[str] = "shm"

    def __init__(self, info: RingInfo, pin: bool = True):
        if info.transport != self.name or not 1 <= info.num_buffers == len(info.handles) <= 64:
            raise LayoutError(f"ring description does not fit the shm transport: {info}")
        self._segments: list[_Segment] = []
        try:
            for name in info.handles:
                self._segments.append(self._attach(name, info.buffer_bytes, pin))
        except BaseException:
            self.close()
            raise
        finally:
            for name in info.handles:  # Note [shm names and crashes]
                if SEGMENT_NAME.fullmatch(name):
                    _unlink(name)
        self.buffers = [s.tensor for s in self._segments]

    @staticmethod
    def _attach(name: str, nbytes: int, pin: bool) -> _Segment:
        owner = leftovers.owner_of(name)
        if owner is None or not SEGMENT_NAME.fullmatch(name):
            raise LayoutError(f"refusing shm segment name {name!r}: not one raysync makes")
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise LayoutError(f"refusing shm segment {name!r}: owner {st.st_uid}, mode {oct(st.st_mode)}")
            if st.st_size != nbytes:  # a shorter segment would SIGBUS on access
                raise LayoutError(f"shm segment {name!r} has {st.st_size} bytes, the ring says {nbytes}")
            return _Segment(name, fd, nbytes, pin, f"the sender (pid {owner.pid})")
        except BaseException:
            os.close(fd)
            raise

    def check(self, stage: str) -> None:
        """Raise ShmSegmentResized if any buffer was resized since it was mapped (Note [no SIGBUS])."""
        for s in self._segments:
            s.check(stage)

    def before_unpack(self, slot: int) -> None:
        self._segments[slot].check(f"unpack from buffer {slot}")

    def close(self) -> None:
        for s in self._segments:
            s.close()
        self._segments, self.buffers = [], []
