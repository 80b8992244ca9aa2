"""Transport name -> "module:Class" for each half, imported only when asked for (a GPU transport's module may
need CUDA; importing raysync must not)."""

from __future__ import annotations

import importlib

from raysync.errors import TransportUnavailable

_HALVES: dict[str, tuple[str, str]] = {
    "shm": ("raysync.transport.shm:ShmRingSender", "raysync.transport.shm:ShmRingReceiver"),
    "collective": (
        "raysync.transport.collective:CollectiveSender",
        "raysync.transport.collective:CollectiveReceiver",
    ),
}


def _load(path: str) -> type:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def names() -> list[str]:
    return list(_HALVES)


def _halves(name: str) -> tuple[str, str]:
    try:
        return _HALVES[name]
    except KeyError:
        raise TransportUnavailable(f"unknown transport {name!r}; built so far: {names()}") from None


def sender_class(name: str) -> type:
    cls = _load(_halves(name)[0])
    if not cls.is_available():
        raise TransportUnavailable(
            f"transport {name!r} cannot run on this machine ({cls.__doc__.splitlines()[0]})"
        )
    return cls


def receiver_class(name: str) -> type:
    return _load(_halves(name)[1])


def available() -> list[str]:
    """The transports that can run here, in order of preference."""
    return [n for n in _HALVES if _load(_HALVES[n][0]).is_available()]
