"""SyncConfig: every knob of a sync session, with units in the names. Environment variables are read here only."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

MiB = 1 << 20

# Defaults, overridable by environment for operators who cannot change the calling code.
_ENV_PREFIX = "RAYSYNC_"
_YES, _NO = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Settings shared by both halves of a session (the sender's values are the ones that count for the layout).

    bucket_bytes    size of one ring buffer; a tensor larger than this is sliced over consecutive buckets. A
                    multiple of align_bytes; a layout may make at most raysync.core.wire.MAX_LAYOUT_BUCKETS buckets
                    (Note [layout bounds] in raysync.core.plan): the error says which size fits
    num_buffers     buffers in the ring: the sender packs bucket k+1 while the receiver loads bucket k (on two
                    GPUs; two processes on one GPU take turns on it, so there few, large buckets win)
    align_bytes     every tensor starts at a multiple of this inside a bucket (views stay aligned for any dtype):
                    a power of two from 16 to 2 MiB
    timeout_s       limit of every blocking wait on a peer
    max_frame_bytes control frames above this are refused before they are parsed
    cast_dtype      cast floating-point tensors to this dtype on the sender ("bfloat16", ...), None to keep
    keep_dtype      names or fnmatch patterns of tensors that are never cast (e.g. "*.norm.weight")
    include         names or fnmatch patterns to send (empty: all)
    exclude         names or fnmatch patterns never to send
    transport       ring transport of a WeightSender: "shm" or "cuda_ipc" (WeightSync plans per pair)
    progress        show a tqdm bar (bytes) for pushes longer than about a second
    staged          receiver: land a push in a copy of the destination tensors and apply it after the last
                    bucket, so a push that fails part-way leaves the weights as they were (one more copy of
                    the weights in memory, one more copy per push). Load functions stage themselves (see
                    raysync.engines.vllm's StagedReload)
    verify          sender: send each tensor's digest of the packed bytes after the last bucket; the receiver
                    compares it with what landed (into= destinations, or the bytes handed to a load
                    function) before the push counts as applied (every transport; see raysync.core.digest)
    direct          cuda_ipc pairs: no ring; the receiver copies straight from the trainer's tensors, whose
                    storages are exported once. They must stay alive between pushes, on the sender's GPU,
                    contiguous and in their wire dtype (one GPU or plain DDP; no cast_dtype); anything else is
                    refused before a byte moves. Other transports ignore it
    cuda_graphs     each side: a list of copies that all stay on one GPU (packing, unpacking, direct mode's
                    copies) is captured into a CUDA graph at its second push and replayed with one launch.
                    Measured on an H200: saves the ~6 us per copy launch (1.5B ring 5.0-5.5 -> 4.0-4.1 ms, 7B
                    2 x 2048 MB 18.3 -> 17.5 ms) but large copies ran ~4% slower from the graph (7B through
                    one 8 GB buffer 16.6 -> 17.3 ms): off for few, large buckets
    """

    bucket_bytes: int = 512 * MiB
    num_buffers: int = 2
    align_bytes: int = 256
    timeout_s: float = 60.0
    max_frame_bytes: int = 16 * MiB
    cast_dtype: str | None = None
    keep_dtype: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    transport: str = "shm"
    progress: bool = True
    staged: bool = False
    verify: bool = False
    direct: bool = False
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
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
        if self.num_buffers < 1:
            raise ValueError(f"num_buffers={self.num_buffers}: need at least 1 (2 to overlap pack and load)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: must be > 0")
        if self.max_frame_bytes < 4096:
            raise ValueError(f"max_frame_bytes={self.max_frame_bytes}: must be >= 4096")
        if self.cast_dtype is not None:
            from raysync.core.wire import check_dtype_name

            check_dtype_name(self.cast_dtype)

    @classmethod
    def from_env(cls, **overrides: object) -> SyncConfig:
        """Defaults, then the numeric and yes/no fields from RAYSYNC_<FIELD> (RAYSYNC_BUCKET_BYTES,
        RAYSYNC_TIMEOUT_S, RAYSYNC_CUDA_GRAPHS=0, ...), then ``overrides``."""
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            name = _ENV_PREFIX + f.name.upper()
            raw = os.environ.get(name)
            if raw is not None and f.type in ("int", "float"):
                values[f.name] = int(raw) if f.type == "int" else float(raw)
            elif raw is not None and f.type == "bool":
                if raw.lower() not in _YES | _NO:
                    raise ValueError(f"{name}={raw!r}: expected one of {sorted(_YES | _NO)}")
                values[f.name] = raw.lower() in _YES
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
