"""POSIX shared-memory ring: same node, no CUDA IPC (CPU, NPU, or IPC refused).

    sender process                              /dev/shm (tmpfs)                  receiver process
    params --pack--> [ buffer 0 ][ buffer 1 ]  raysync-<128 random bits> x N  --map--> unpack --> model

Segments are created exclusively (O_EXCL | O_NOFOLLOW) with mode 0600 under names nobody can guess, space is
reserved up front (posix_fallocate: a full /dev/shm is a clear error now, not a SIGBUS later), and every page
is populated once per session. Where the process uses CUDA the mapping is registered with cudaHostRegister,
so device <-> host copies run at pinned-memory speed.

# Note [shm names and crashes]
# The receiver unlinks every name the moment it has mapped it (the sender does too when told, and on close),
# so once a session is set up /dev/shm holds nothing of it: the kernel frees the memory when the last mapping
# goes, whichever side is SIGKILLed. Only a crash inside the handshake itself can leave a name behind.
# Python's multiprocessing.shared_memory is not used: on Python < 3.13 it registers every segment with the
# resource_tracker, which warns about or unlinks segments it did not create.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import stat
from typing import ClassVar

import torch

from raysync.errors import LayoutError, ShmSpaceError
from raysync.transport.base import HostRing
from raysync.wire import SHM_NAME, Attached, RingInfo

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


class _Mapping:
    """One mapped segment as a uint8 tensor, optionally registered with CUDA.

    # Note [shm buffer lifetime]
    # The tensor exports the mmap's buffer; the mmap cannot close while any view of it lives. close() drops
    # our references, unregisters from CUDA, and closes the map; if the caller still holds a view (against
    # Note [ring buffer views]), the map is left to the garbage collector: the name is unlinked already, so
    # nothing outlives the process.
    """

    def __init__(self, fd: int, nbytes: int, pin: bool):
        self._mmap = mmap.mmap(fd, nbytes, flags=_MAP_FLAGS)
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


def _check_free_space(nbytes: int) -> None:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ShmSpaceError(
            f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the ring needs {nbytes / 2**20:.0f} MiB: lower "
            f"bucket_bytes or num_buffers, free {SHM_DIR} (Ray's object store lives there too), or enlarge it "
            f"(docker run --shm-size=...)"
        )


class ShmRingSender(HostRing):
    """POSIX shared memory: needs a writable /dev/shm."""

    name: ClassVar[str] = "shm"

    @classmethod
    def is_available(cls) -> bool:
        return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)

    def __init__(self, num_buffers: int, buffer_bytes: int, pin: bool = True):
        _check_free_space(num_buffers * buffer_bytes)
        self.buffer_bytes = buffer_bytes
        self._names: list[str] = []
        self._maps: list[_Mapping] = []
        try:
            for _ in range(num_buffers):
                self._maps.append(self._create(buffer_bytes, pin))
        except BaseException:
            self.close()
            raise
        self.buffers = [m.tensor for m in self._maps]
        logger.debug("shm ring: %d x %d bytes (%s)", num_buffers, buffer_bytes, ", ".join(self._names))

    def _create(self, nbytes: int, pin: bool) -> _Mapping:
        name = f"raysync-{secrets.token_hex(16)}"
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._names.append(name)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise ShmSpaceError(
                    f"cannot reserve {nbytes} bytes in {SHM_DIR}: {e}; lower bucket_bytes"
                ) from e
            return _Mapping(fd, nbytes, pin)
        finally:
            os.close(fd)

    def info(self) -> RingInfo:
        return RingInfo(self.name, len(self._names), self.buffer_bytes, tuple(self._names))

    def receiver_attached(self, attached: Attached | None = None) -> None:
        for name in self._names:
            _unlink(name)

    def close(self) -> None:
        self.receiver_attached()  # idempotent: unlink whatever is still named
        for m in self._maps:
            m.close()
        self._maps, self.buffers = [], []


class ShmRingReceiver(HostRing):
    name: ClassVar[str] = "shm"

    def __init__(self, info: RingInfo, pin: bool = True):
        if info.transport != self.name or not 1 <= info.num_buffers == len(info.handles) <= 64:
            raise LayoutError(f"ring description does not fit the shm transport: {info}")
        self._maps: list[_Mapping] = []
        try:
            for name in info.handles:
                self._maps.append(self._attach(name, info.buffer_bytes, pin))
        except BaseException:
            self.close()
            raise
        finally:
            for name in info.handles:  # Note [shm names and crashes]
                if SHM_NAME.fullmatch(name):
                    _unlink(name)
        self.buffers = [m.tensor for m in self._maps]

    @staticmethod
    def _attach(name: str, nbytes: int, pin: bool) -> _Mapping:
        if not SHM_NAME.fullmatch(name):
            raise LayoutError(f"refusing shm segment name {name!r}: not one raysync makes")
        fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise LayoutError(f"refusing shm segment {name!r}: owner {st.st_uid}, mode {oct(st.st_mode)}")
            if st.st_size != nbytes:  # a shorter segment would SIGBUS on access
                raise LayoutError(f"shm segment {name!r} has {st.st_size} bytes, the ring says {nbytes}")
            return _Mapping(fd, nbytes, pin)
        finally:
            os.close(fd)

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps, self.buffers = [], []
