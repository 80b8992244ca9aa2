"""SyncConfig: every knob of a sync session, with units in the names. Environment variables are read here only."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

MiB = 1 << 20
AUTO = "auto"

# Note [left to the plan]
# ~~~~~~~~~~~~~~~~~~~~~~~
# SyncConfig() leaves the data path to WeightSync's plan (raysync.ray.placement): the transport, direct mode and
# the ring's shape (bucket_bytes, num_buffers) are chosen per pair from where the endpoints run, their tensors
# and the memory free on both sides. A field the user sets is forced for every pair (a forced mode that cannot
# serve a pair is a PlanError before any byte moves). A session without a plan (WeightSender and
# WeightReceiver by hand) runs what is left to the plan with the standalone defaults below, so every reader of
# ``config.bucket_bytes`` keeps getting a number:
#
#     field          SyncConfig() holds          read as (no plan)   forced by
#     transport      Auto("shm")                 "shm"               transport="shm" | "cuda_ipc" | ...
#     bucket_bytes   Auto(512 MiB)               536870912           bucket_bytes=<int>
#     num_buffers    Auto(2)                     2                   num_buffers=<int>
#     direct         None                        False               direct=True | False
#
# An Auto value is an int (or str) that remembers it was not chosen: ``dataclasses.replace(config, verify=True)``
# keeps it left to the plan, ``dataclasses.replace(config, bucket_bytes=1 << 30)`` forces it. It never reaches
# the wire: a copy (dataclasses.asdict, which every frame's encoding makes) is a plain int or str.
_STANDALONE = {"transport": "shm", "bucket_bytes": 512 * MiB, "num_buffers": 2}


class AutoInt(int):
    """An int left to the plan (Note [left to the plan])."""

    def __repr__(self) -> str:
        return f"auto({int(self)})"

    def __deepcopy__(self, memo: dict) -> int:
        return int(self)


class AutoStr(str):
    """A str left to the plan (Note [left to the plan])."""

    def __repr__(self) -> str:
        return f"auto({str(self)!r})"

    def __deepcopy__(self, memo: dict) -> str:
        return str(self)


def _auto(name: str) -> AutoInt | AutoStr:
    value = _STANDALONE[name]
    return AutoStr(value) if isinstance(value, str) else AutoInt(value)


# Defaults, overridable by environment for operators who cannot change the calling code.
_ENV_PREFIX = "RAYSYNC_"
_YES, _NO = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Settings shared by both halves of a session (the sender's values are the ones that count for the layout).

    Fields marked (plan) are WeightSync's to choose per pair unless set: Note [left to the plan].

    bucket_bytes    (plan) size of one ring buffer; a tensor larger than this is sliced over consecutive buckets. A
                    multiple of align_bytes; a layout may make at most raysync.core.wire.MAX_LAYOUT_BUCKETS buckets
                    (Note [layout bounds] in raysync.core.plan): the error says which size fits
    num_buffers     (plan) buffers in the ring: the sender packs bucket k+1 while the receiver loads bucket k (on two
                    GPUs; two processes on one GPU take turns on it, so there few, large buckets win)
    align_bytes     every tensor starts at a multiple of this inside a bucket (views stay aligned for any dtype):
                    a power of two from 16 to 2 MiB
    timeout_s       limit of every blocking wait on a peer
    max_frame_bytes control frames above this are refused before they are parsed
    cast_dtype      cast floating-point tensors to this dtype on the sender ("bfloat16", ...), None to keep
    keep_dtype      names or fnmatch patterns of tensors that are never cast (e.g. "*.norm.weight")
    include         names or fnmatch patterns to send (empty: all)
    exclude         names or fnmatch patterns never to send
    transport       (plan) "auto", or forced: "shm", "cuda_ipc" or "collective" (WeightSync only: a broadcast
                    group); a WeightSender runs "auto" as "shm"
    progress        show a tqdm bar (bytes) for pushes longer than about a second
    staged          receiver: land a push in a copy of the destination tensors and apply it after the last
                    bucket, so a push that fails part-way leaves the weights as they were (one more copy of
                    the weights in memory, one more copy per push). Load functions stage themselves (see
                    raysync.engines.vllm's StagedReload)
    verify          sender: send each tensor's digest of the packed bytes after the last bucket; the receiver
                    compares it with what landed (into= destinations, or the bytes handed to a load
                    function) before the push counts as applied (every transport; see raysync.core.digest)
    direct          (plan) cuda_ipc with no ring: the receiver copies straight from the trainer's tensors, whose
                    storages are exported once per set of tensors. They must be on the sender's GPU,
                    contiguous and in their wire dtype (one GPU or plain DDP; no cast_dtype). None: WeightSync
                    reads in place wherever that holds (raysync.ray.placement); True: every pair must (a pair
                    that cannot is a PlanError); False: never. A WeightSender runs None as False
    cuda_graphs     each side: a list of copies that all stay on one GPU (packing, unpacking, direct mode's
                    copies) is captured into a CUDA graph at its second push and replayed with one launch.
                    Measured on an H200: saves the ~6 us per copy launch (1.5B ring 5.0-5.5 -> 4.0-4.1 ms, 7B
                    2 x 2048 MB 18.3 -> 17.5 ms) but large copies ran ~4% slower from the graph (7B through
                    one 8 GB buffer 16.6 -> 17.3 ms): off for few, large buckets
    delta           sender: push only the elements whose bits changed since the version the receivers hold
                    (raysync.core.delta, Note [the delta reference] in raysync.core.delta_push): the sender
                    keeps one more copy of the model in the wire dtype on its device; a receiver at another
                    version, or one that cannot take a delta (a load function, a staged sink), gets a full push
                    in the same round. Rings the session makes only (shm, cuda_ipc); others push full
    delta_full_every  delta: every N-th push is full (an anchor); 0: only when a receiver needs one
    delta_max_density delta: a chunk whose fraction of changed elements is above this goes full (it goes full
                    anyway where the delta would not be smaller than its bytes)
    delta_by_time   delta: a push goes as a delta only when the sender measured delta pushes faster than full
                    ones on its plane (a full push measures first, then a delta; a delta push that falls
                    behind a full one sends its other buckets full; Notes [the density rule by time] and [a
                    delta push that falls behind] in raysync.core.delta_rule); False: every push that can be
                    a delta is one
    """

    bucket_bytes: int | None = None
    num_buffers: int | None = None
    align_bytes: int = 256
    timeout_s: float = 60.0
    max_frame_bytes: int = 16 * MiB
    cast_dtype: str | None = None
    keep_dtype: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    transport: str = AUTO
    progress: bool = True
    staged: bool = False
    verify: bool = False
    direct: bool | None = None
    cuda_graphs: bool = True
    delta: bool = False
    delta_full_every: int = 0
    delta_max_density: float = 1.0
    delta_by_time: bool = True

    def __post_init__(self) -> None:
        self._fill_auto()
        for name in ("keep_dtype", "include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise TypeError(
                    f"SyncConfig.{name} takes a tuple of names or patterns, got the string {value!r}"
                )
            object.__setattr__(self, name, tuple(value))
        from raysync.core.plan import check_geometry  # imported here, like check_dtype_name below

        check_geometry(
            self.bucket_bytes, self.align_bytes
        )  # the very check, and BadLayout, of a received Layout
        if type(self.num_buffers) is bool or not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ValueError(f"num_buffers={self.num_buffers}: need at least 1 (2 to overlap pack and load)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.max_frame_bytes < 4096:
            raise ValueError(f"max_frame_bytes={self.max_frame_bytes}: must be >= 4096")
        if self.cast_dtype is not None:
            from raysync.core.wire import check_dtype_name

            check_dtype_name(self.cast_dtype)
        if type(self.delta_full_every) is not int or self.delta_full_every < 0:
            raise ValueError(f"delta_full_every={self.delta_full_every!r}: an int >= 0 (0: no anchors)")
        if self.delta_by_time not in (True, False):
            raise TypeError(f"delta_by_time={self.delta_by_time!r}: True or False")
        if not 0.0 <= self.delta_max_density <= 1.0:
            raise ValueError(f"delta_max_density={self.delta_max_density!r}: a fraction of elements, 0 to 1")
        if self.direct not in (None, True, False):
            raise TypeError(f"direct={self.direct!r}: None (the plan chooses), True or False")

    def _fill_auto(self) -> None:
        """None / "auto" become Auto values; a transport must be one that exists (or "auto")."""
        for name in ("bucket_bytes", "num_buffers"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, _auto(name))
        if self.transport == AUTO and not isinstance(self.transport, AutoStr):
            object.__setattr__(self, "transport", _auto("transport"))
        elif not isinstance(self.transport, AutoStr):
            from raysync.transport import registry  # imports no transport module

            if self.transport not in registry.names():
                raise ValueError(
                    f'transport={self.transport!r}: one of {[AUTO, *registry.names()]} ("auto": WeightSync '
                    f"plans each pair)"
                )

    def is_auto(self, name: str) -> bool:
        """Whether field ``name`` is left to the plan (Note [left to the plan])."""
        value = getattr(self, name)
        return value is None if name == "direct" else isinstance(value, (AutoInt, AutoStr))

    def resolved(self, **chosen: object) -> SyncConfig:
        """This config with ``chosen`` values and every other field left to the plan at its standalone value,
        as plain values: what one pair's endpoints run."""
        values: dict[str, object] = {n: type(_STANDALONE[n])(getattr(self, n)) for n in _STANDALONE}
        values["direct"] = bool(self.direct)
        values.update(chosen)
        return dataclasses.replace(self, **values)

    @classmethod
    def from_env(cls, **overrides: object) -> SyncConfig:
        """Defaults, then the numeric and yes/no fields from RAYSYNC_<FIELD> (RAYSYNC_BUCKET_BYTES,
        RAYSYNC_TIMEOUT_S, RAYSYNC_CUDA_GRAPHS=0, ...), then ``overrides``."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            name = _ENV_PREFIX + f.name.upper()
            raw = os.environ.get(name)
            kind = f.type.removesuffix(" | None")
            if raw is not None and kind in ("int", "float"):
                values[f.name] = int(raw) if kind == "int" else float(raw)
            elif raw is not None and f.type == "bool | None" and raw.lower() == AUTO:
                values[f.name] = None
            elif raw is not None and kind == "bool":
                if raw.lower() not in _YES | _NO:
                    raise ValueError(f"{name}={raw!r}: expected one of {sorted(_YES | _NO)}")
                values[f.name] = raw.lower() in _YES
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
