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

Placements (raysync.sources.params): ``Shard(d)`` for any dim d (FSDP2's ``fully_shard`` makes ``Shard(0)``; a
tensor-parallel group ``Shard(0)`` or ``Shard(1)``) and ``Replicate()``, on a mesh of one dim or two (FSDP x TP:
every rank of the mesh takes part in one all-gather per bucket); a plain tensor counts as replicated (every rank
holds it whole and equal) unless ``shards`` declares it this rank's shard along a dim (Megatron-style, without
DTensors: the ranks are those of ``group``). A one-rank mesh gathers nothing: its local tensors are whole,
packed as the plain source packs them.

``mapping`` (raysync.sources.mapping.NameMap): the engine's names and shapes when they differ from the trainer's
(a fused ``qkv_proj`` on one side, ``q_proj`` / ``k_proj`` / ``v_proj`` on the other); the layout is the mapped
one, and the pieces of each bucket are written into their mapped places by the same copies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from raysync.core.config import SyncConfig
from raysync.core.copies import CopyList
from raysync.core.errors import RemoteError
from raysync.core.plan import Bucket, plan_buckets
from raysync.core.source import Packer, SourceTensor, selected, wire_dtype
from raysync.core.wire import DTYPES, TensorSpec, dtype_name
from raysync.sources.gather_plan import HEADER_BYTES, BucketGather, Piece, plan_gathers
from raysync.sources.mapping import Mapped, NameMap, identity
from raysync.sources.params import describe, local_part, mesh_of, storages
from raysync.sources.walk import GatherWalk, group_timeout


class DTensorSource:
    """The tensors of one trainer rank of a DTensor mesh (FSDP2, or a tensor-parallel group), as a lazy source
    (raysync.core.source.Source). Make one on every rank of the mesh, from the same tensors in the same order and
    the same ``config`` and ``mapping``. ``group``: the process group to gather on (default: a new one over the
    mesh's ranks, or over the default group's when no tensor is a DTensor, with a timeout of its own from
    ``config.timeout_s``); ``store``: where the ranks take their census after a failed gather (default: the
    default group's store); ``shards``: plain tensors that are this rank's shard, name -> dim;
    ``mapping``: the engine's names and shapes (raysync.sources.mapping)."""

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        config: SyncConfig,
        *,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
        shards: Mapping[str, int] | None = None,
        mapping: NameMap | None = None,
    ):
        self.config = config
        named = list(named_tensors)
        mesh = mesh_of(named)
        if mesh is not None:
            ranks = mesh.mesh.flatten().tolist()
            self.mesh, self.rank = tuple(mesh.shape), ranks.index(dist.get_rank())
        elif shards:
            self.mesh, self.rank, ranks = (dist.get_world_size(group),), dist.get_rank(group), None
        else:
            self.mesh, self.rank, ranks = (1,), 0, None
        self.world = math.prod(self.mesh)
        self._params = describe(named, self.mesh, self.rank, shards or {})
        meta = [(p.name, p.shape, p.dtype) for p in self._params]
        self._mapped: list[Mapped] = mapping.apply(meta) if mapping is not None else identity(meta)
        self._mapping = mapping
        self.device = self._params[0].tensor.device if self._params else torch.device("cpu")
        self._walk: GatherWalk | None = None
        self._own_group = False
        if self.world > 1:
            if group is None:
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                group = dist.new_group(ranks, timeout=group_timeout(config.timeout_s), backend=backend)
                self._own_group = True
            store = store if store is not None else dist.distributed_c10d._get_default_store()
            name = f"{getattr(group, 'group_name', 'group')}-{len(self._params)}"
            self._walk = GatherWalk(group, self.rank, self.world, store, config.timeout_s, self.device, name)
        self._group = group
        self._packers: dict[tuple, object] = {}  # what follow() packed with, by layout

    def specs(self, config: SyncConfig) -> list[TensorSpec]:
        """The engine's names, global shapes and wire dtypes (mapped), from the metadata alone."""
        return [
            TensorSpec(m.name, dtype_name(wire_dtype(m.name, m.dtype, config)), m.shape)
            for m in self._mapped
            if selected(m.name, config)
        ]

    def packer(
        self, config: SyncConfig, buckets: Sequence[Bucket], buffers: Sequence[torch.Tensor] | None
    ) -> OneRankPacker | GatheringPacker:
        specs = self.specs(config)
        kept = [m for m in self._mapped if selected(m.name, config)]
        if self._walk is None and self._mapping is None:
            params = [self._params[m.parts[0].source] for m in kept]
            return OneRankPacker(specs, params, buckets, buffers, config.cuda_graphs)
        shares = [p.shares(self.mesh) for p in self._params]
        numels = [math.prod(p.shape) for p in self._params]
        gathers = plan_gathers(specs, shares, buckets, [m.parts for m in kept], numels)
        return GatheringPacker(
            self._walk, self.rank, specs, self._params, gathers, buckets, buffers, config.cuda_graphs
        )

    def follow(self, version: int, config: SyncConfig | None = None) -> str:
        """Take part in the push of ``version`` without sending (a rank other than the sending one): the same
        walk of gathers, bounded by ``timeout_s``. Returns "done" or "skipped" (the sending rank's outcome);
        raises the typed error of a rank that failed or did not join (naming it and the bucket). ``config``:
        the sending rank's session config when it differs from this source's (WeightSync's plan sizes the
        buckets: raysync.ray.trainer_group)."""
        cfg = config or self.config
        specs = self.specs(cfg)
        key = (tuple(specs), cfg.bucket_bytes, cfg.align_bytes)
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
        key = storages(self._params)
        if key != self._key and self._buffers:
            locals_ = [local_part(p) for p in self._params]
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
    all-gather -> (the sending rank) every piece into its place in the ring buffer. Buffer and copies made once.
    Without a walk (one rank, with a mapping) the pieces go from the local tensors straight into the ring."""

    def __init__(
        self,
        walk: GatherWalk | None,
        rank: int,
        specs: list[TensorSpec],
        params: list,
        gathers: list[BucketGather],
        buckets: Sequence[Bucket],
        buffers: Sequence[torch.Tensor] | None,
        graphs: bool,
    ):
        # every bucket gathers segments of one size, the largest any bucket needs (only the last buckets need
        # less): a collective that allocates a temporary of its output (gloo does, per gather) then reuses the
        # same block each time, where temporaries of varying sizes left the allocator holding several (~4x the
        # buffer's RSS measured with gloo on the CPU)
        most = max((g.segment_bytes for g in gathers), default=HEADER_BYTES)
        gathers = [dataclasses.replace(g, segment_bytes=most) for g in gathers]
        self._walk, self.rank, self._specs, self._params, self.gathers = walk, rank, specs, params, gathers
        self._graphs, self._key, self._buffers = graphs, None, buffers
        device = params[0].tensor.device if params else torch.device("cpu")
        world = walk.world if walk is not None else 1
        self._buffer = torch.zeros(world * most if walk else 0, dtype=torch.uint8, device=device)
        self._own: list[CopyList] = []
        self._out = (
            [self._copies_out(k, buffers[k % len(buffers)]) for k in range(len(gathers))]
            if buffers and walk
            else None
        )
        self._host_sync = (
            device if device.type == "cuda" and buffers and buffers[0].device.type == "cpu" else None
        )
        # the pieces too: ranks whose placements or mapping differ plan other pieces, refused at the start
        shape = (
            specs,
            [(b.nbytes, len(b.chunks)) for b in buckets],
            [(g.segment_bytes, g.pieces) for g in gathers],
        )
        digest = hashlib.blake2b(repr(shape).encode(), digest_size=8)
        self._layout_hash = int.from_bytes(digest.digest(), "little", signed=True)

    @property
    def buffer_bytes(self) -> int:
        """The gather buffer's size: this rank's extra memory for a push, besides the ring."""
        return self._buffer.nbytes

    def start(self, version: int) -> None:
        key = storages(self._params)
        if key != self._key:
            locals_ = [local_part(p) for p in self._params]
            self._own, self._key = [self._copies_in(k, g, locals_) for k, g in enumerate(self.gathers)], key
        if self._walk is None:
            return
        self._walk.bind(self._buffer, [g.segment_bytes for g in self.gathers])
        self._walk.start(version, self._layout_hash)
        if self.gathers:
            self._own[0].run()
            self._walk.issue(0)

    def pack(self, k: int) -> bool:
        if self._walk is None:  # one rank: straight into the ring
            self._own[k].run()
            self._sync()
            return True
        if not self._walk.wait():
            if self._out is not None:
                raise RemoteError("a trainer rank", f"bucket {k}", "another rank ended the walk of this push")
            return False
        if self._out is not None:
            self._out[k].run()
            self._sync()
        if k + 1 < len(self.gathers):
            self._own[k + 1].run()
            self._walk.issue(k + 1)
        return True

    def finish(self, outcome: str) -> str:
        return self._walk.end(outcome) if self._walk is not None else outcome

    def _sync(self) -> None:
        if self._host_sync is not None:
            torch.cuda.current_stream(self._host_sync).synchronize()

    def _copies_in(self, k: int, gather: BucketGather, locals_: list[torch.Tensor]) -> CopyList:
        """This rank's pieces: its local tensors -> its segment, cast to the wire dtype on the way (one rank:
        -> their places in the ring buffer)."""
        seg = gather.segment_bytes
        base = self.rank * seg + HEADER_BYTES
        pairs = []
        for p in gather.pieces:
            if p.rank != self.rank:
                continue
            wire = DTYPES[self._specs[p.index].dtype]
            flat = locals_[p.source].reshape(-1)
            src = flat.as_strided(
                (p.rows, p.cols), (p.local_stride, 1), flat.storage_offset() + p.local_start
            )
            if self._walk is None:
                if not self._buffers:  # one rank that does not send: nothing to copy
                    continue
                dst = _ring_view(self._buffers[k % len(self._buffers)], p, wire)
            else:
                dst = self._buffer[base + p.offset : base + p.offset + p.count * wire.itemsize]
                dst = dst.view(wire).view(p.rows, p.cols)
            pairs.append((dst, src))
        return CopyList(pairs, self._graphs)

    def _copies_out(self, k: int, ring_buffer: torch.Tensor) -> CopyList:
        """Every rank's pieces of bucket k: the gather buffer -> their places in the ring buffer (a Shard(d > 0)
        piece re-interleaved into the global layout by this one strided copy)."""
        gather, pairs = self.gathers[k], []
        for p in gather.pieces:
            wire = DTYPES[self._specs[p.index].dtype]
            n = p.count * wire.itemsize
            src = self._buffer[p.rank * gather.segment_bytes + HEADER_BYTES + p.offset :][:n]
            if p.ring_step == 1 and (p.rows == 1 or p.cols == p.ring_stride):  # contiguous in the ring too
                pairs.append((ring_buffer[p.bucket_offset : p.bucket_offset + n], src))
            else:
                pairs.append((_ring_view(ring_buffer, p, wire), src.view(wire).view(p.rows, p.cols)))
        return CopyList(pairs, self._graphs)


def _ring_view(ring_buffer: torch.Tensor, p: Piece, wire: torch.dtype) -> torch.Tensor:
    """Where piece ``p`` goes in the ring buffer: ``rows`` x ``cols`` elements, rows ``ring_stride`` apart and
    columns ``ring_step`` apart (a transposed piece)."""
    span = ((p.rows - 1) * p.ring_stride + (p.cols - 1) * p.ring_step + 1) * wire.itemsize if p.count else 0
    region = ring_buffer[p.bucket_offset : p.bucket_offset + span].view(wire)
    return region.as_strided((p.rows, p.cols), (p.ring_stride, p.ring_step))
