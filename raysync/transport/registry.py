"""Transport name -> "module:Class" for each half, imported only when asked for (a GPU transport's module may
need CUDA; importing raysync must not)."""

from __future__ import annotations

import importlib

from raysync.errors import TransportUnavailable

_HALVES: dict[str, tuple[str, str]] = {
    "cuda_ipc": (
        "raysync.transport.cuda_ipc:CudaIpcRingSender",
        "raysync.transport.cuda_ipc:CudaIpcRingReceiver",
    ),
    "cuda_ipc_direct": (
        "raysync.transport.cuda_ipc:CudaIpcDirectSender",
        "raysync.transport.cuda_ipc:CudaIpcDirectReceiver",
    ),
    "shm": ("raysync.transport.shm:ShmRingSender", "raysync.transport.shm:ShmRingReceiver"),
    "collective": (
        "raysync.transport.collective:CollectiveSender",
        "raysync.transport.collective:CollectiveReceiver",
    ),
}


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


_RINGS = {
    "cuda_ipc",
    "cuda_ipc_direct",
    "shm",
}  # the transports a WeightSender / WeightReceiver pair can use (collective: a group, not a pair)


def _ring(name: str) -> tuple[str, str]:
    halves = _halves(name)
    if name not in _RINGS:
        raise TransportUnavailable(
            f"transport {name!r} is a broadcast group, not a ring for one sender and one receiver: use "
            f"WeightSync (or CollectiveSender / CollectiveReceiver); rings: {sorted(_RINGS)}"
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
