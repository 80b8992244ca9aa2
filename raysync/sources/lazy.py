"""Tensors made on demand, bucket by bucket: a source whose layout is a manifest (names, shapes, dtypes; e.g. a
model built on the meta device, or a checkpoint's index) and whose tensors are made only when their bucket is
packed (e.g. read from a checkpoint file, or computed), then dropped.

    source = LazySource.from_module(meta_model, load=lambda name: read_from_checkpoint(name))
    sender.push(source, version=step)

Peak memory: the ring plus the tensors of one bucket; a tensor larger than a bucket is held from its first slice
to its last. Its copies are made at each push (its tensors are new each time), unlike the plain source's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from raysync.core.config import SyncConfig
from raysync.core.errors import LayoutError
from raysync.core.plan import Bucket
from raysync.core.source import SourceTensor, selected, wire_dtype, write_chunk
from raysync.core.wire import TensorSpec, dtype_name


class LazySource:
    """``manifest``: (name, shape, dtype) of every tensor, in push order; ``load(name)``: the tensor, made when
    its first chunk is packed (it must have the manifest's shape and dtype, on any device)."""

    def __init__(
        self, manifest: Iterable[tuple[str, Sequence[int], torch.dtype]], load: Callable[[str], torch.Tensor]
    ):
        self._manifest = [(name, tuple(shape), dtype) for name, shape, dtype in manifest]
        self._load = load

    @classmethod
    def from_module(cls, module: torch.nn.Module, load: Callable[[str], torch.Tensor]) -> LazySource:
        """The manifest of ``module``'s parameters (a model on the meta device costs no memory)."""
        return cls(((n, p.shape, p.dtype) for n, p in module.named_parameters()), load)

    def specs(self, config: SyncConfig) -> list[TensorSpec]:
        return [
            TensorSpec(name, dtype_name(wire_dtype(name, dtype, config)), shape)
            for name, shape, dtype in self._manifest
            if selected(name, config)
        ]

    def packer(
        self, config: SyncConfig, buckets: Sequence[Bucket], buffers: Sequence[torch.Tensor] | None
    ) -> LoadingPacker:
        kept = [(n, s, d) for n, s, d in self._manifest if selected(n, config)]
        return LoadingPacker(self.specs(config), kept, self._load, buckets, buffers)


class LoadingPacker:
    """Packs bucket k from the tensors ``load`` makes for it; holds only those not fully packed yet."""

    def __init__(self, specs, manifest, load, buckets, buffers):
        self._specs, self._manifest, self._load = specs, manifest, load
        self._buckets, self._buffers = buckets, buffers
        self._held: dict[int, torch.Tensor] = {}
        self.most_held = 0  # the most tensors held at once during the last push

    def start(self, version: int) -> None:
        self._held, self.most_held = {}, 0

    def pack(self, k: int) -> bool:
        buffer = self._buffers[k % len(self._buffers)]
        devices = set()
        for c in self._buckets[k].chunks:
            tensor = self._held.get(c.index)
            if tensor is None:
                tensor = self._made(c.index)
                self._held[c.index] = tensor
                self.most_held = max(self.most_held, len(self._held))
            write_chunk(SourceTensor(self._specs[c.index], tensor), c, buffer[c.bucket_offset :][: c.nbytes])
            if tensor.is_cuda and buffer.device.type == "cpu":
                devices.add(tensor.device)
            if c.last:
                del self._held[c.index]
        for device in devices:  # the non-blocking copies into host memory are done before the bucket goes
            torch.cuda.current_stream(device).synchronize()
        return True

    def finish(self, outcome: str) -> str:
        self._held = {}
        return outcome

    def _made(self, index: int) -> torch.Tensor:
        name, shape, dtype = self._manifest[index]
        tensor = self._load(name)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise LayoutError(f"load({name!r}) made {got}; the manifest says {(shape, dtype)}")
        return tensor.detach()
