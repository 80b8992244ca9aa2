"""An FSDP2 / DTensor trainer as a source: every rank of the mesh takes part, no rank holds the whole model.

    every rank:   DTensorSource(model.named_parameters(), config)       (at the same point: it makes a group)
    sending rank: sender.push(source, version)                          (a WeightSender, or any PushSender)
    other ranks:  source.follow(version)                                (the same walk, without a ring)

The layout comes from the DTensors' metadata (global shapes, dtypes): nothing is gathered to know it. A push
then walks the session's buckets on every rank (Note [every rank walks the same buckets], raysync.sources.walk):
for bucket k each rank copies its pieces of the bucket's tensors into its segment of one flat buffer (casting to
the wire dtype in that copy), one all-gather fills the buffer on every rank, and the sending rank copies the
pieces into the ring buffer of bucket k. The gather of bucket k + 1 is issued before bucket k is published, so
it runs while the receivers read bucket k.

Memory on every rank: one gather buffer, about one bucket (W segments of the largest rank's share of a
bucket), kept with its copies while the layout stays; on the sending rank the ring as well. Both sets of copies
(local shards -> own segment, gathered pieces -> ring buffer) are made once and replayed (raysync.core.copies),
so the local tensors must stay the same storages between pushes (an optimizer updates them in place; a new
set of parameters needs a new source).

Placements: ``Shard(0)`` (what FSDP2's ``fully_shard`` makes) and ``Replicate()`` on a one-dimensional mesh; a
plain tensor in the list counts as replicated (every rank holds it whole and equal). A one-rank mesh gathers
nothing: its local tensors are whole, packed as the plain source packs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raysync.core.config import SyncConfig
from raysync.core.copies import CopyList
from raysync.core.errors import LayoutError, RemoteError
from raysync.core.plan import Bucket, plan_buckets
from raysync.core.source import Packer, SourceTensor, selected, wire_dtype
from raysync.core.wire import DTYPES, TensorSpec, dtype_name
from raysync.sources.gather_plan import (
    HEADER_BYTES,
    BucketGather,
    plan_gathers,
    replica_shares,
    shard0_shares,
)
from raysync.sources.walk import GatherWalk, group_timeout


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    tensor: torch.Tensor  # the DTensor (or plain tensor) handed in; its local part is read at each push
    sharded: bool  # Shard(0); else whole on every rank


class DTensorSource:
    """The tensors of one trainer rank of a DTensor mesh (FSDP2), as a lazy source (raysync.core.source.Source).
    Make one on every rank of the mesh, from the same tensors in the same order and the same ``config``.
    ``group``: the process group to gather on (default: a new one over the mesh's ranks, with a timeout of its
    own from ``config.timeout_s``); ``store``: where the ranks take their census after a failed gather
    (default: the default group's store)."""

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        config: SyncConfig,
        *,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
    ):
        self.config = config
        self._params, mesh = _describe(named_tensors)
        self.world = mesh.size() if mesh is not None else 1
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.device = self._params[0].tensor.device if self._params else torch.device("cpu")
        self._walk: GatherWalk | None = None
        self._own_group = False
        if self.world > 1:
            if group is None:
                ranks = mesh.mesh.flatten().tolist()
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                group = dist.new_group(ranks, timeout=group_timeout(config.timeout_s), backend=backend)
                self._own_group = True
            store = store if store is not None else dist.distributed_c10d._get_default_store()
            name = f"{getattr(group, 'group_name', 'group')}-{len(self._params)}"
            self._walk = GatherWalk(group, self.rank, self.world, store, config.timeout_s, self.device, name)
        self._group = group
        self._packers: dict[tuple, object] = {}  # what follow() packed with, by layout

    def specs(self, config: SyncConfig) -> list[TensorSpec]:
        """Names, global shapes and wire dtypes, from the metadata alone."""
        return [
            TensorSpec(p.name, dtype_name(wire_dtype(p.name, p.dtype, config)), p.shape)
            for p in self._params
            if selected(p.name, config)
        ]

    def packer(
        self, config: SyncConfig, buckets: Sequence[Bucket], buffers: Sequence[torch.Tensor] | None
    ) -> OneRankPacker | GatheringPacker:
        specs = self.specs(config)
        params = [p for p in self._params if selected(p.name, config)]
        if self._walk is None:
            return OneRankPacker(specs, params, buckets, buffers, config.cuda_graphs)
        shares = [
            shard0_shares(p.shape, self.world) if p.sharded else replica_shares(s.numel, self.world)
            for p, s in zip(params, specs, strict=True)
        ]
        gathers = plan_gathers(specs, shares, buckets)
        return GatheringPacker(self._walk, specs, params, gathers, buckets, buffers, config.cuda_graphs)

    def follow(self, version: int) -> str:
        """Take part in the push of ``version`` without sending (a rank other than the sending one): the same
        walk of gathers, bounded by ``timeout_s``. Returns "done" or "skipped" (the sending rank's outcome);
        raises the typed error of a rank that failed or did not join (naming it and the bucket)."""
        cfg = self.config
        specs = self.specs(cfg)
        key = tuple(specs)
        if key not in self._packers:
            self._packers = {
                key: self.packer(cfg, plan_buckets(specs, cfg.bucket_bytes, cfg.align_bytes), None)
            }
        packer = self._packers[key]
        packer.start(version)
        try:
            for k in range(len(packer.gathers)):
                if not packer.pack(k):
                    break
        except BaseException:
            packer.finish("failed")
            raise
        return packer.finish("followed")

    def close(self) -> None:
        """Drop the gather buffers (and the group, when this source made it)."""
        self._packers = {}
        if self._own_group and self._group is not None:
            dist.destroy_process_group(self._group)
        self._group = self._walk = None


class OneRankPacker:
    """A one-rank mesh: the local tensors are whole, packed as the plain source packs them (nothing gathered)."""

    def __init__(self, specs, params, buckets, buffers, graphs: bool):
        self._specs, self._params, self._buckets, self._buffers = specs, params, buckets, buffers
        self._graphs, self._key, self._packer = graphs, None, None
        self.gathers = buckets

    def start(self, version: int) -> None:
        key = _storages(self._params)
        if key != self._key and self._buffers:
            locals_ = [_local(p) for p in self._params]
            sources = [SourceTensor(s, t) for s, t in zip(self._specs, locals_, strict=True)]
            self._packer, self._key = Packer(self._buckets, sources, self._buffers, self._graphs), key

    def pack(self, k: int) -> bool:
        if self._packer is not None:
            self._packer.pack(k)
        return True

    def finish(self, outcome: str) -> str:
        return outcome


class GatheringPacker:
    """Packs a bucket from the ranks' shards: this rank's pieces -> its segment of the gather buffer -> the
    all-gather -> (the sending rank) every piece into the ring buffer. Buffer and copies made once."""

    def __init__(
        self, walk: GatherWalk, specs, params, gathers: list[BucketGather], buckets, buffers, graphs
    ):
        # every bucket gathers segments of one size, the largest any bucket needs (only the last buckets need
        # less): a collective that allocates a temporary of its output (gloo does, per gather) then reuses the
        # same block each time, where temporaries of varying sizes left the allocator holding several (~4x the
        # buffer's RSS measured with gloo on the CPU)
        most = max((g.segment_bytes for g in gathers), default=HEADER_BYTES)
        gathers = [dataclasses.replace(g, segment_bytes=most) for g in gathers]
        self._walk, self._specs, self._params, self.gathers = walk, specs, params, gathers
        self._graphs, self._key = graphs, None
        device = params[0].tensor.device if params else torch.device("cpu")
        self._buffer = torch.zeros(walk.world * most, dtype=torch.uint8, device=device)
        self._own: list[CopyList] = []
        self._out = (
            [self._copies_out(k, buffers[k % len(buffers)]) for k in range(len(gathers))] if buffers else None
        )
        self._host_sync = (
            device if device.type == "cuda" and buffers and buffers[0].device.type == "cpu" else None
        )
        shape = (specs, [(b.nbytes, len(b.chunks)) for b in buckets], [g.segment_bytes for g in gathers])
        digest = hashlib.blake2b(repr(shape).encode(), digest_size=8)
        self._layout_hash = int.from_bytes(digest.digest(), "little", signed=True)

    @property
    def buffer_bytes(self) -> int:
        """The gather buffer's size: this rank's extra memory for a push, besides the ring."""
        return self._buffer.nbytes

    def start(self, version: int) -> None:
        key = _storages(self._params)
        if key != self._key:
            locals_ = [_local(p) for p in self._params]
            self._own, self._key = [self._copies_in(g, locals_) for g in self.gathers], key
        self._walk.bind(self._buffer, [g.segment_bytes for g in self.gathers])
        self._walk.start(version, self._layout_hash)
        if self.gathers:
            self._own[0].run()
            self._walk.issue(0)

    def pack(self, k: int) -> bool:
        if not self._walk.wait():
            if self._out is not None:
                raise RemoteError("a trainer rank", f"bucket {k}", "another rank ended the walk of this push")
            return False
        if self._out is not None:
            self._out[k].run()
            if self._host_sync is not None:
                torch.cuda.current_stream(self._host_sync).synchronize()
        if k + 1 < len(self.gathers):
            self._own[k + 1].run()
            self._walk.issue(k + 1)
        return True

    def finish(self, outcome: str) -> str:
        return self._walk.end(outcome)

    def _copies_in(self, gather: BucketGather, locals_: list[torch.Tensor]) -> CopyList:
        """This rank's pieces: its local tensors -> its segment (cast to the wire dtype on the way)."""
        seg, rank = gather.segment_bytes, self._walk.rank
        base = rank * seg + HEADER_BYTES
        pairs = []
        for p in gather.pieces:
            if p.rank != rank:
                continue
            wire = DTYPES[self._specs[p.index].dtype]
            dst = self._buffer[base + p.offset : base + p.offset + p.count * wire.itemsize].view(wire)
            pairs.append((dst, locals_[p.index].reshape(-1)[p.local_start : p.local_start + p.count]))
        return CopyList(pairs, self._graphs)

    def _copies_out(self, k: int, ring_buffer: torch.Tensor) -> CopyList:
        """Every rank's pieces of bucket k: the gather buffer -> their places in the ring buffer (bytes)."""
        gather, pairs = self.gathers[k], []
        for p in gather.pieces:
            n = p.count * self._specs[p.index].itemsize
            src = p.rank * gather.segment_bytes + HEADER_BYTES + p.offset
            pairs.append((ring_buffer[p.bucket_offset : p.bucket_offset + n], self._buffer[src : src + n]))
        return CopyList(pairs, self._graphs)


def _storages(params: list[_Param]) -> tuple:
    """Where each local part lives, checked at every push: the copies are remade when it changed (FSDP2 may
    swap a parameter's local tensor, e.g. at its lazy init before the first forward). Reads the DTensor's
    ``_local_tensor`` (what ``to_local()`` returns), since ``to_local()`` is an autograd call of tens of
    microseconds per tensor: milliseconds per push for a 7B model."""
    key = []
    for p in params:
        t = getattr(p.tensor, "_local_tensor", None)
        if t is None:
            t = _local(p)
        key.append((t.data_ptr(), t.stride()))
    return tuple(key)


def _local(p: _Param) -> torch.Tensor:
    """The part of ``p`` this rank holds (checked against the shape the plan expects)."""
    t = p.tensor.to_local() if p.sharded or hasattr(p.tensor, "to_local") else p.tensor
    t = t.detach()
    if not t.is_contiguous():
        raise LayoutError(f"tensor {p.name!r}: its local part is not contiguous; raysync reads it in place")
    return t


def _describe(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[_Param], object | None]:
    """Each tensor's global shape, dtype and placement, and the mesh they share (None: no DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params, mesh = [], None
    for name, t in named:
        if not isinstance(t, DTensor):
            params.append(_Param(name, tuple(t.shape), t.dtype, t, False))
            continue
        if mesh is None:
            mesh = t.device_mesh
        if t.device_mesh != mesh or mesh.ndim != 1:
            raise LayoutError(
                f"tensor {name!r} is on mesh {t.device_mesh}: a DTensorSource takes tensors of one "
                f"one-dimensional mesh ({mesh}); tensor-parallel and 2-D meshes are not built yet (issue 16, item 3)"
            )
        (placement,) = t.placements
        if not (placement == Shard(0) or isinstance(placement, Replicate)):
            raise LayoutError(
                f"tensor {name!r} is placed {placement}: a DTensorSource gathers Shard(0) (FSDP2) and "
                f"Replicate() tensors; other placements are not built yet (issue 16, item 3)"
            )
        params.append(_Param(name, tuple(t.shape), t.dtype, t, placement == Shard(0)))
    if mesh is not None:
        for p in params:
            expect = shard0_shares(p.shape, mesh.size())[mesh.get_local_rank()] if p.sharded else None
            local = _local(p)
            if expect is not None and local.numel() != expect.hi - expect.lo:
                raise LayoutError(
                    f"tensor {p.name!r}: this rank holds {tuple(local.shape)} of {p.shape}, not the rows "
                    f"torch.chunk gives rank {mesh.get_local_rank()} of {mesh.size()}"
                )
    return params, mesh
