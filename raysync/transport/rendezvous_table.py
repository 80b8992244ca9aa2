"""The rendezvous store's table: what a request means, the keys and values it holds within their limits, and the
requests that wait for keys (Note [who may talk to the rendezvous store] in raysync.transport.rendezvous).

Pure: no socket, no thread, no clock of its own. raysync.transport.rendezvous_server reads a frame, hands it to
``parse_request`` and then to ``StoreTable.apply``, and sends what comes back; it asks the table which waiting
requests can be answered now (``take_ready``) and which have run out of time (``take_late``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from raysync.core.errors import MalformedFrame
from raysync.transport.rendezvous import MAX_KEY_CHARS, MAX_KEYS, MAX_WAITERS

PENDING = object()  # the answer comes when the keys are set (or the request's deadline passes)


@dataclass
class Waiter:
    """A get / multi_get / wait whose keys are not all set yet, held until they are or until ``deadline``."""

    peer: bytes
    request_id: int
    op: str  # "get", "multi_get" or "wait"
    keys: tuple[str, ...]
    deadline: float  # time.monotonic()


class StoreTable:
    """At most MAX_KEYS keys of at most MAX_KEY_CHARS characters, values of at most ``max_value_bytes``, and at
    most MAX_WAITERS waiting requests. Every operation checks its arguments (count, types, sizes) first; a bad
    one raises ValueError (or TypeError) and the server answers it as refused: no request ends its thread."""

    def __init__(self, max_value_bytes: int):
        self.max_value_bytes = max_value_bytes
        self._data: dict[str, bytes] = {}
        self._waiters: list[Waiter] = []

    def apply(self, peer: bytes, request_id: int, op: str, args: list, now: float) -> object:
        """The answer to one request, or PENDING when it waits for keys (``now`` is time.monotonic())."""
        if op not in _ARITY:
            raise ValueError(f"unknown store operation {op!r}")
        if len(args) != _ARITY[op]:  # else args[i] raises IndexError, which would end the server's thread
            raise ValueError(f"store {op} takes {_ARITY[op]} arguments, got {len(args)}")
        if op in ("get", "multi_get", "wait"):
            keys = _keys(args[0]) if op != "get" else (_key(args[0]),)
            return self._get_or_wait(Waiter(peer, request_id, op, keys, now + _int(args[1]) / 1000))
        return _ANSWERS[op](self, args)

    # waiting requests ----------------------------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """The earliest deadline of a waiting request (time.monotonic()), infinity when none waits."""
        return min((w.deadline for w in self._waiters), default=math.inf)

    def take_ready(self) -> list[tuple[Waiter, object]]:
        """The waiting requests whose keys are all set now, with their answers; they wait no more."""
        ready = [w for w in self._waiters if self._has(w.keys)]
        for w in ready:
            self._waiters.remove(w)
        return [(w, self._result(w)) for w in ready]

    def take_late(self, now: float) -> list[Waiter]:
        """The waiting requests whose deadline has passed by ``now``; they wait no more."""
        late = [w for w in self._waiters if w.deadline <= now]
        for w in late:
            self._waiters.remove(w)
        return late

    def _get_or_wait(self, waiter: Waiter) -> object:
        if self._has(waiter.keys):
            return self._result(waiter)
        if len(self._waiters) >= MAX_WAITERS:
            raise ValueError(f"{MAX_WAITERS} requests are waiting already")
        self._waiters.append(waiter)
        return PENDING

    def _result(self, waiter: Waiter) -> object:
        if waiter.op == "get":
            return self._data[waiter.keys[0]]
        if waiter.op == "multi_get":
            return [self._data[k] for k in waiter.keys]
        return None

    def _has(self, keys: tuple[str, ...]) -> bool:
        return all(k in self._data for k in keys)

    # the operations that answer at once ----------------------------------------------------------------------------
    def _put(self, key: str, value: bytes) -> None:
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise ValueError(f"the store holds {MAX_KEYS} keys already; refusing {key!r}")
        self._data[key] = value

    def _set(self, args: list) -> None:
        self._put(_key(args[0]), _value(args[1], self.max_value_bytes))

    def _multi_set(self, args: list) -> None:
        keys, values = _keys(args[0]), [_value(v, self.max_value_bytes) for v in args[1]]
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self._put(k, v)

    def _append(self, args: list) -> None:
        key = _key(args[0])
        appended = self._data.get(key, b"") + _value(args[1], self.max_value_bytes)
        self._put(key, _value(appended, self.max_value_bytes))

    def _add(self, args: list) -> int:
        key, amount = _key(args[0]), _int(args[1])
        value = int(self._data.get(key, b"0")) + amount
        if not -(1 << 63) <= value < 1 << 63:  # TCPStore's counters are int64, and msgpack packs no larger
            raise ValueError(f"store add {key!r}: {value} is outside the 64-bit range")
        self._put(key, str(value).encode())
        return value

    def _compare_set(self, args: list) -> bytes:
        key = _key(args[0])
        expected, desired = _value(args[1], self.max_value_bytes), _value(args[2], self.max_value_bytes)
        current = self._data.get(key)
        if (current is None and expected == b"") or current == expected:
            self._put(key, desired)
            return desired
        return expected if current is None else current

    def _check(self, args: list) -> bool:
        return self._has(_keys(args[0]))

    def _delete_key(self, args: list) -> bool:
        return self._data.pop(_key(args[0]), None) is not None

    def _delete_keys(self, args: list) -> int:
        return sum(self._data.pop(k, None) is not None for k in _keys(args[0]))

    def _num_keys(self, args: list) -> int:
        return len(self._data)


_ANSWERS: dict[str, Callable[[StoreTable, list], object]] = {
    "set": StoreTable._set,
    "multi_set": StoreTable._multi_set,
    "append": StoreTable._append,
    "add": StoreTable._add,
    "compare_set": StoreTable._compare_set,
    "check": StoreTable._check,
    "delete_key": StoreTable._delete_key,
    "delete_keys": StoreTable._delete_keys,
    "num_keys": StoreTable._num_keys,
}
_ARITY = {  # how many arguments each operation takes: what StoreClient sends
    "set": 2,
    "multi_set": 2,
    "append": 2,
    "add": 2,
    "compare_set": 3,
    "check": 1,
    "delete_key": 1,
    "delete_keys": 1,
    "num_keys": 0,
    "get": 2,
    "multi_get": 2,
    "wait": 2,
}


# --- what a request is -----------------------------------------------------------------------------------------------
def parse_request(frame: bytes) -> tuple[int, str, list]:
    """``[request_id, op, args]`` from one msgpack frame (bounded by the socket's MAXMSGSIZE before it gets
    here); anything else raises MalformedFrame."""
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
