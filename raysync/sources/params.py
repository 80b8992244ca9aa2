"""What each rank of a sharded trainer holds: every tensor's global shape, dtype and placement, from metadata.

Placements, on a one-dimensional mesh (or group): ``Shard(d)`` for any dim d (FSDP2's ``Shard(0)``; a
tensor-parallel column or row split) and ``Replicate()``. A plain tensor counts as replicated (every rank holds
it whole and equal), unless ``shards`` declares it a shard along a dim: then it is this rank's part of a tensor
split evenly over the ranks (Megatron-style tensor parallelism), its global shape the local one with that dim
times the world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from raysync.core.errors import LayoutError
from raysync.sources.gather_plan import Share, replica_shares, shard_shares


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    tensor: torch.Tensor  # the DTensor (or plain tensor) handed in; its local part is read at each push
    dim: int | None  # sharded along this dim; None: whole on every rank

    def shares(self, world: int) -> list[Share]:
        if self.dim is None:
            numel = 1
            for d in self.shape:
                numel *= d
            return replica_shares(numel, world)
        return shard_shares(self.shape, world, self.dim)


def mesh_of(named: list[tuple[str, torch.Tensor]]) -> object | None:
    """The mesh the DTensors share (None: no DTensor); a LayoutError for a second mesh or a 2-D one."""
    from torch.distributed.tensor import DTensor

    mesh = None
    for name, t in named:
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh if mesh is None else mesh
        if t.device_mesh != mesh or mesh.ndim != 1:
            raise LayoutError(
                f"tensor {name!r} is on mesh {t.device_mesh}: a DTensorSource takes tensors of one "
                f"one-dimensional mesh ({mesh}), FSDP or tensor-parallel; 2-D meshes (FSDP x TP) are not "
                f"built yet (issue 16, item 3)"
            )
    return mesh


def describe(
    named: Iterable[tuple[str, torch.Tensor]], world: int, rank: int, shards: Mapping[str, int]
) -> list[Param]:
    """Each tensor's global shape, dtype and placement, checked against what this rank holds."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params = []
    for name, t in named:
        if not isinstance(t, DTensor):
            dim = shards.get(name)
            shape = tuple(t.shape)
            if dim is not None:
                if not 0 <= dim < len(shape):
                    raise LayoutError(
                        f"tensor {name!r} of shape {shape} has no dim {dim} to be sharded along"
                    )
                shape = (*shape[:dim], shape[dim] * world, *shape[dim + 1 :])
            params.append(Param(name, shape, t.dtype, t, dim))
            continue
        (placement,) = t.placements
        if not (type(placement) is Shard or isinstance(placement, Replicate)):  # not _StridedShard
            raise LayoutError(
                f"tensor {name!r} is placed {placement}: a DTensorSource gathers Shard(d) and Replicate() "
                f"tensors; other placements are not built yet (issue 16, item 3)"
            )
        dim = placement.dim if isinstance(placement, Shard) else None
        if dim is not None and dim < 0:
            dim += len(t.shape)
        params.append(Param(name, tuple(t.shape), t.dtype, t, dim))
    missing = sorted(set(shards) - {p.name for p in params})
    if missing:
        raise LayoutError(f"shards names tensors {missing} that the source was not given")
    for p in params:
        if p.dim is None:
            continue
        expect = p.shares(world)[rank]
        local = local_part(p)
        if local.numel() != expect.numel:
            raise LayoutError(
                f"tensor {p.name!r}: this rank holds {tuple(local.shape)} of {p.shape}, not the part of dim "
                f"{p.dim} that torch.chunk gives rank {rank} of {world}"
            )
    return params


def storages(params: list[Param]) -> tuple:
    """Where each local part lives, checked at every push: the copies are remade when it changed (FSDP2 may
    swap a parameter's local tensor, e.g. at its lazy init before the first forward). Reads the DTensor's
    ``_local_tensor`` (what ``to_local()`` returns), since ``to_local()`` is an autograd call of tens of
    microseconds per tensor: milliseconds per push for a 7B model."""
    key = []
    for p in params:
        t = getattr(p.tensor, "_local_tensor", None)
        if t is None:
            t = local_part(p)
        key.append((t.data_ptr(), t.stride()))
    return tuple(key)


def local_part(p: Param) -> torch.Tensor:
    """The part of ``p`` this rank holds (contiguous: it is read in place)."""
    t = p.tensor.to_local() if hasattr(p.tensor, "to_local") else p.tensor
    t = t.detach()
    if not t.is_contiguous():
        raise LayoutError(f"tensor {p.name!r}: its local part is not contiguous; raysync reads it in place")
    return t
