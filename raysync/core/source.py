"""The sender's side of the data: pick the trainer's tensors, decide their wire dtype, pack them into buckets.

Casting and contiguity are applied while packing, in the one copy into the ring: a contiguous tensor that
keeps its dtype is read in place (no clone, no ``.contiguous()``), and a cast (fp32 master weights -> bf16)
happens inside that same copy, so no second copy of the model ever exists.

Two kinds of source reach a push (PushSender.push):

- the plain one, an iterable of ``(name, tensor)`` pairs holding whole tensors: ``select`` picks them and fixes
  their wire dtypes, ``Packer`` copies them into the ring (copies made once, replayed each push);
- a ``Source`` object, lazy: its layout comes from metadata (``specs``: names, global shapes, wire dtypes, no
  tensor materialized), and its bytes bucket by bucket from its own ``SourcePacker``. A sharded trainer's
  tensors (FSDP2 / DTensor: raysync.sources.DTensorSource) are such a source: the ranks gather each bucket as
  it is packed, so no rank ever holds the whole model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from raysync.core.config import SyncConfig
from raysync.core.copies import CopyList
from raysync.core.errors import LayoutError
from raysync.core.plan import Bucket, Chunk
from raysync.core.wire import DTYPES, TensorSpec, dtype_name


@dataclass(frozen=True)
class SourceTensor:
    spec: TensorSpec  # what travels (wire dtype, shape)
    tensor: torch.Tensor  # the trainer's tensor, untouched


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` equals one of ``patterns`` or matches it as an fnmatch pattern."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def select(named_tensors: Iterable[tuple[str, torch.Tensor]], config: SyncConfig) -> list[SourceTensor]:
    """Filter by ``include`` / ``exclude`` and fix each tensor's wire dtype (``cast_dtype`` unless ``keep_dtype``)."""
    out: list[SourceTensor] = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if not selected(name, config):
            continue
        if type(tensor) not in _WHOLE and _is_dtensor(tensor):
            raise LayoutError(
                f"tensor {name!r} is a DTensor (placements {tuple(tensor.placements)} on "
                f"{tensor.device_mesh}): a plain source sends whole tensors. Hand every rank of the mesh a "
                f"raysync.sources.DTensorSource(model.named_parameters(), config) instead: it gathers the shards "
                f"bucket by bucket, with every rank taking part"
            )
        tensor = tensor.detach()
        if tensor.layout != torch.strided:
            raise LayoutError(
                f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors travel"
            )
        spec = TensorSpec(name, dtype_name(wire_dtype(name, tensor.dtype, config)), tuple(tensor.shape))
        out.append(SourceTensor(spec, tensor))
    return out


def selected(name: str, config: SyncConfig) -> bool:
    """Whether ``include`` / ``exclude`` let ``name`` travel."""
    return not (config.include and not matches(name, config.include) or matches(name, config.exclude))


def wire_dtype(name: str, dtype: torch.dtype, config: SyncConfig) -> torch.dtype:
    """The dtype ``name`` travels in: ``cast_dtype`` for floating-point tensors, unless ``keep_dtype``."""
    cast = DTYPES[config.cast_dtype] if config.cast_dtype else None
    if (
        cast is not None
        and dtype.is_floating_point
        and dtype != cast
        and not matches(name, config.keep_dtype)
    ):
        return cast
    return dtype


_WHOLE = (torch.Tensor, torch.nn.Parameter)  # plain tensors: never a DTensor, no check needed


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


# --- lazy sources ----------------------------------------------------------------------------------------------
class SourcePacker(Protocol):
    """What a lazy source packs with, for one layout and one set of ring buffers (made once, used every push).
    The session calls ``start(version)``, then ``pack(k)`` for k = 0, 1, ... into ``buffers[k % len(buffers)]``
    (claimed for bucket k), then ``finish(outcome)`` once, whatever happened: ``"done"``, ``"skipped"`` (the
    receivers had the version) or ``"failed"``. ``pack`` returns False when the walk was ended elsewhere (a
    sharded source's other ranks); a sending rank raises instead."""

    def start(self, version: int) -> None: ...

    def pack(self, k: int) -> bool: ...

    def finish(self, outcome: str) -> str: ...


class Source(Protocol):
    """A lazy source: the layout from metadata (``specs``: names, global shapes, wire dtypes after ``include`` /
    ``exclude`` / ``cast_dtype``; nothing materialized), the bytes bucket by bucket (``packer``). ``buffers`` is
    None on a rank that takes part without sending (a sharded source's other ranks)."""

    def specs(self, config: SyncConfig) -> list[TensorSpec]: ...

    def packer(
        self, config: SyncConfig, buckets: Sequence[Bucket], buffers: Sequence[torch.Tensor] | None
    ) -> SourcePacker: ...


def pack_bucket(bucket: Bucket, sources: Sequence[SourceTensor], buffer: torch.Tensor) -> None:
    """Write every chunk of ``bucket`` into ``buffer`` (a uint8 tensor), once (Packer replays it)."""
    Packer([bucket], sources, [buffer]).pack(0)


class Packer:
    """Packs the buckets of one layout from one set of source tensors into one ring, its copies made once
    (raysync.core.copies) and replayed each push. Device copies into host memory are issued non-blocking; the
    current stream of every device involved is synchronized once per bucket, at its end."""

    def __init__(
        self,
        buckets: Sequence[Bucket],
        sources: Sequence[SourceTensor],
        buffers: Sequence[torch.Tensor],
        graphs: bool = True,
    ):
        self._plans: list[tuple[CopyList, list[tuple[SourceTensor, Chunk, torch.Tensor]], set]] = []
        for k, bucket in enumerate(buckets):
            buffer = buffers[k % len(buffers)]
            pairs, packed_each_time = [], []
            for c in bucket.chunks:
                src, region = sources[c.index], buffer[c.bucket_offset : c.bucket_offset + c.nbytes]
                view = _source_view(src, c)
                if view is None:  # not contiguous: made contiguous at each push
                    packed_each_time.append((src, c, region))
                elif c.nbytes:
                    pairs.append(
                        (region if view.dtype == torch.uint8 else region.view(DTYPES[src.spec.dtype]), view)
                    )
            host_sync = {
                sources[c.index].tensor.device
                for c in bucket.chunks
                if sources[c.index].tensor.is_cuda and buffer.device.type == "cpu"
            }
            self._plans.append((CopyList(pairs, graphs), packed_each_time, host_sync))

    def pack(self, k: int) -> None:
        copies, packed_each_time, host_sync = self._plans[k]
        copies.run()
        for src, chunk, region in packed_each_time:
            write_chunk(src, chunk, region)
        for device in host_sync:
            torch.cuda.current_stream(device).synchronize()  # this stream only, never the whole device


def _source_view(src: SourceTensor, chunk: Chunk) -> torch.Tensor | None:
    """The chunk in the source tensor: its bytes when it keeps its dtype, else its elements (the cast happens
    in the copy, into the region viewed as the wire dtype). None when the tensor is not contiguous."""
    t, wire = src.tensor, DTYPES[src.spec.dtype]
    if not t.is_contiguous():
        return None
    if t.dtype == wire:
        return t.reshape(-1).view(torch.uint8)[chunk.src_offset : chunk.src_offset + chunk.nbytes]
    first = chunk.src_offset // wire.itemsize
    return t.reshape(-1)[first : first + chunk.nbytes // wire.itemsize]


def write_chunk(src: SourceTensor, chunk: Chunk, region: torch.Tensor) -> None:
    """Pack one chunk into ``region`` (cast and made contiguous on the way)."""
    if chunk.nbytes == 0:
        return
    tensor, wire = src.tensor, DTYPES[src.spec.dtype]
    non_blocking = tensor.device != region.device
    if tensor.dtype == wire:  # pass-through: a byte copy straight from the tensor's storage
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        flat = tensor.reshape(-1).view(torch.uint8)
        region.copy_(flat[chunk.src_offset : chunk.src_offset + chunk.nbytes], non_blocking=non_blocking)
    else:  # cast inside the copy; chunk bounds are whole elements (plan.py: cuts fall on align_bytes)
        first = chunk.src_offset // wire.itemsize
        region.view(wire).copy_(
            tensor.reshape(-1)[first : first + chunk.nbytes // wire.itemsize], non_blocking=non_blocking
        )


def is_source(obj: object) -> bool:
    """Whether ``obj`` is a lazy Source rather than an iterable of (name, tensor) pairs. Two attribute looks
    (under a microsecond), where isinstance against a runtime-checkable Protocol took ~100 us per push."""
    return hasattr(obj, "packer") and hasattr(obj, "specs")
