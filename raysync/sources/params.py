"""What each rank of a sharded trainer holds: every tensor's global shape, dtype and placement, from metadata.

Placements, on a mesh of one dim (FSDP, or a tensor-parallel group) or two (FSDP x TP): ``Shard(d)`` for any dim
d (FSDP2's ``Shard(0)``; a tensor-parallel column or row split) and ``Replicate()`` along each mesh dim, as long as
each rank's block is rows x columns of a matrix view of the tensor (raysync.sources.gather_plan.mesh_shares: e.g.
``(Shard(0), Shard(1))`` of a matrix; FSDP2's ``_StridedShard`` is refused). A plain tensor counts as replicated (every rank holds
it whole and equal), unless ``shards`` declares it a shard along a dim: then it is this rank's part of a tensor
split evenly over the ranks (Megatron-style tensor parallelism), its global shape the local one with that dim
times the world size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from raysync.core.errors import LayoutError
from raysync.sources.gather_plan import Share, block_ranges, mesh_shares


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    tensor: torch.Tensor  # the DTensor (or plain tensor) handed in; its local part is read at each push
    placements: tuple[int | None, ...]  # per mesh dim: the tensor dim it is sharded along, None: replicated

    def shares(self, mesh: tuple[int, ...]) -> list[Share]:
        return mesh_shares(self.shape, mesh, self.placements)


def mesh_of(named: list[tuple[str, torch.Tensor]]) -> object | None:
    """The mesh the DTensors share (None: no DTensor); a LayoutError for a second mesh, or one of more than two
    dims."""
    from torch.distributed.tensor import DTensor

    mesh = None
    for name, t in named:
        if not isinstance(t, DTensor):
            continue
        mesh = t.device_mesh if mesh is None else mesh
        if t.device_mesh != mesh or mesh.ndim > 2:
            raise LayoutError(
                f"tensor {name!r} is on mesh {t.device_mesh}: a DTensorSource takes the tensors of one mesh "
                f"of one dim (FSDP, or tensor-parallel) or two (FSDP x TP), here {mesh}"
            )
    return mesh


def describe(
    named: Iterable[tuple[str, torch.Tensor]],
    mesh: tuple[int, ...],
    rank: int,
    shards: Mapping[str, int],
) -> list[Param]:
    """Each tensor's global shape, dtype and placements, checked against what this rank (``rank``: its index
    in the mesh, row-major) holds. A plain tensor takes the ``shards`` dim on a one-dimensional mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params = []
    for name, t in named:
        if not isinstance(t, DTensor):
            dim = shards.get(name)
            shape = tuple(t.shape)
            if dim is not None:
                if not 0 <= dim < len(shape) or len(mesh) != 1:
                    raise LayoutError(
                        f"tensor {name!r} of shape {shape} declared a shard along dim {dim}: a plain tensor is "
                        f"a shard along one of its dims over a one-dimensional group (mesh {mesh})"
                    )
                shape = (*shape[:dim], shape[dim] * mesh[0], *shape[dim + 1 :])
            params.append(Param(name, shape, t.dtype, t, (dim,) + (None,) * (len(mesh) - 1)))
            continue
        dims = []
        for placement in t.placements:
            if not (
                type(placement) is Shard or isinstance(placement, Replicate)
            ):  # not _StridedShard, Partial
                raise LayoutError(
                    f"tensor {name!r} is placed {tuple(t.placements)}: a DTensorSource gathers Shard(d) and "
                    f"Replicate() placements; {placement} is not built yet (issue 16, item 3)"
                )
            dims.append(placement.dim % t.ndim if isinstance(placement, Shard) else None)
        params.append(Param(name, tuple(t.shape), t.dtype, t, tuple(dims)))
    missing = sorted(set(shards) - {p.name for p in params})
    if missing:
        raise LayoutError(f"shards names tensors {missing} that the source was not given")
    for p in params:
        try:
            p.shares(mesh)
        except ValueError as e:
            raise LayoutError(
                f"tensor {p.name!r} placed {p.placements} on mesh {mesh}: {e}; not built yet"
            ) from e
        expect = tuple(hi - lo for lo, hi in block_ranges(p.shape, mesh, p.placements, rank))
        local = local_part(p)
        if tuple(local.shape) != expect:
            raise LayoutError(
                f"tensor {p.name!r}: this rank holds {tuple(local.shape)} of {p.shape}, not the block "
                f"{expect} that torch.chunk gives rank {rank} of mesh {mesh} for placements {p.placements}"
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
