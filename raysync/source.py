"""The sender's side of the data: pick the trainer's tensors, decide their wire dtype, pack them into buckets.

Casting and contiguity are applied while packing, in the one copy into the ring: a contiguous tensor that
keeps its dtype is read in place (no clone, no ``.contiguous()``), and a cast (fp32 master weights -> bf16)
happens inside that same copy, so no second copy of the model ever exists.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from raysync.config import SyncConfig
from raysync.errors import LayoutError
from raysync.plan import Bucket, Chunk
from raysync.wire import DTYPES, TensorSpec, dtype_name


@dataclass(frozen=True)
class SourceTensor:
    spec: TensorSpec  # what travels (wire dtype, shape)
    tensor: torch.Tensor  # the trainer's tensor, untouched


def matches(name: str, patterns: Sequence[str]) -> bool:
    """True if ``name`` equals one of ``patterns`` or matches it as an fnmatch pattern."""
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def select(named_tensors: Iterable[tuple[str, torch.Tensor]], config: SyncConfig) -> list[SourceTensor]:
    """Filter by ``include`` / ``exclude`` and fix each tensor's wire dtype (``cast_dtype`` unless ``keep_dtype``)."""
    cast = DTYPES[config.cast_dtype] if config.cast_dtype else None
    out: list[SourceTensor] = []
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if config.include and not matches(name, config.include) or matches(name, config.exclude):
            continue
        tensor = tensor.detach()
        if tensor.layout != torch.strided:
            raise LayoutError(
                f"tensor {name!r} has layout {tensor.layout}; only dense (strided) tensors travel"
            )
        dtype = tensor.dtype
        if (
            cast is not None
            and dtype.is_floating_point
            and dtype != cast
            and not matches(name, config.keep_dtype)
        ):
            dtype = cast
        out.append(SourceTensor(TensorSpec(name, dtype_name(dtype), tuple(tensor.shape)), tensor))
    return out


def pack_bucket(bucket: Bucket, sources: Sequence[SourceTensor], buffer: torch.Tensor) -> None:
    """Write every chunk of ``bucket`` into ``buffer`` (a uint8 tensor). Device copies into host memory are
    issued non-blocking; the current stream of every device involved is synchronized once, at the end."""
    devices: set[torch.device] = set()
    for chunk in bucket.chunks:
        src = sources[chunk.index]
        region = buffer[chunk.bucket_offset : chunk.bucket_offset + chunk.nbytes]
        write_chunk(src, chunk, region)
        if src.tensor.device.type == "cuda" and buffer.device.type == "cpu":
            devices.add(src.tensor.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()  # this stream only, never the whole device


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


def direct_bytes(src: SourceTensor, chunk: Chunk, device_type: str) -> torch.Tensor | None:
    """The chunk's bytes, read in place from the trainer's tensor (no copy), when the tensor is contiguous,
    keeps its dtype and lives on ``device_type``; None when it has to be packed."""
    t = src.tensor
    if t.dtype != DTYPES[src.spec.dtype] or not t.is_contiguous() or t.device.type != device_type:
        return None
    return t.reshape(-1).view(torch.uint8)[chunk.src_offset : chunk.src_offset + chunk.nbytes]
