"""Transport name -> "module:Class" for each half, imported only when asked for (a GPU transport's module may
need CUDA; importing raysync must not). A ring transport is one module with its two ring halves and one line
in ``_HALVES``: the push session drives it through the ring data plane (transport.ring). A transport that is a
data plane of its own (cuda_ipc_direct) says so in ``_PLANES`` too."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from raysync.core.errors import TransportUnavailable

if TYPE_CHECKING:
    from raysync.core.config import SyncConfig
    from raysync.core.control import Channel
    from raysync.core.wire import RingInfo
    from raysync.transport.base import DataPlane, PlaneReader

_HALVES: dict[str, tuple[str, str]] = {
    "cuda_ipc": (
        "raysync.transport.cuda_ipc:CudaIpcRingSender",
        "raysync.transport.cuda_ipc:CudaIpcRingReceiver",
    ),
    "cuda_ipc_direct": (
        "raysync.transport.cuda_ipc_direct:CudaIpcDirectSender",
        "raysync.transport.cuda_ipc_direct:CudaIpcDirectReceiver",
    ),
    "shm": ("raysync.transport.shm:ShmRingSender", "raysync.transport.shm:ShmRingReceiver"),
    "collective": (
        "raysync.transport.collective:CollectiveSender",
        "raysync.transport.collective:CollectiveReceiver",
    ),
}


# the data plane each half runs as (transport.base.DataPlane / PlaneReader): a ring's flow control by default
_RING_PLANE = ("raysync.transport.ring:RingPlane", "raysync.transport.ring:RingReader")
_PLANES: dict[str, tuple[str, str]] = {"cuda_ipc_direct": _HALVES["cuda_ipc_direct"]}  # reads in place


def _load(path: str) -> type:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


_MODES = {"cuda_ipc_direct"}  # a mode of a transport (SyncConfig.direct), never planned for a pair by itself


def names() -> list[str]:
    """The transports a pair can be planned on."""
    return [n for n in _HALVES if n not in _MODES]


def ring_name(transport: str, direct: bool) -> str:
    """The ring a WeightSender runs for ``transport``: cuda_ipc in direct mode has none (cuda_ipc_direct)."""
    return "cuda_ipc_direct" if direct and transport == "cuda_ipc" else transport


def _halves(name: str) -> tuple[str, str]:
    try:
        return _HALVES[name]
    except KeyError:
        raise TransportUnavailable(f"unknown transport {name!r}; built so far: {names()}") from None


_GROUPS = {"collective"}  # broadcast groups (one sender, N ranks): WeightSync makes them, never a pair


def _ring(name: str) -> tuple[str, str]:
    halves = _halves(name)
    if name in _GROUPS:
        raise TransportUnavailable(
            f"transport {name!r} is a broadcast group, not a ring for one sender and one receiver: use "
            f"WeightSync (or CollectiveSender / CollectiveReceiver); rings: {sorted(set(_HALVES) - _GROUPS)}"
        )
    return halves


def sender_class(name: str) -> type:
    """The sending half of ring transport ``name``."""
    cls = _load(_ring(name)[0])
    if not cls.is_available():
        raise TransportUnavailable(
            f"transport {name!r} cannot run on this machine ({cls.__doc__.splitlines()[0]})"
        )
    return cls


def receiver_class(name: str) -> type:
    """The receiving half of ring transport ``name`` (the name arrives off the wire: rings only)."""
    return _load(_ring(name)[1])


def available() -> list[str]:
    """The transports that can run here, in order of preference."""
    return [n for n in names() if _load(_HALVES[n][0]).is_available()]


def sender_plane(name: str, config: SyncConfig, channel: Channel) -> DataPlane:
    """The sending half of ``name`` as a data plane: the ring made (or the storages' exporter), ready to
    describe to the receiver."""
    transport = sender_class(name)
    return _load(_PLANES.get(name, _RING_PLANE)[0]).open(transport, config, channel)


def reader_plane(info: RingInfo, channel: Channel) -> PlaneReader:
    """The receiving half of the data plane ``info`` describes (the name arrives off the wire: rings only)."""
    transport = receiver_class(info.transport)
    return _load(_PLANES.get(info.transport, _RING_PLANE)[1]).open(transport, info, channel)
