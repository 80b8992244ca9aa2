"""Lazy sources in one process: the gather plan of a sharded source (pure), and DTensors on a one-rank mesh through
a real session (the ranks of a real FSDP2 mesh: tests/test_fsdp.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import random_tensor, same_bits, session_pair

from raysync import LayoutError, SyncConfig
from raysync.core.plan import plan_buckets
from raysync.core.source import Packer, is_source, select
from raysync.core.wire import DTYPES
from raysync.sources.gather_plan import (
    HEADER_BYTES,
    chunk_range,
    plan_gathers,
    replica_shares,
    shard0_shares,
)

CFG = SyncConfig(bucket_bytes=4096, timeout_s=30, progress=False)


# --- the gather plan (pure) --------------------------------------------------------------------------------------
def test_shard0_shares_are_the_rows_torch_chunk_gives_each_rank():
    for rows, world in [(8, 2), (7, 2), (3, 4), (1, 4), (0, 2), (10, 3), (5, 1)]:
        t = torch.arange(rows * 3).reshape(rows, 3)
        parts = list(torch.chunk(t, world)) if rows else []
        parts += [t[:0]] * (world - len(parts))  # DTensor / FSDP2: ranks past the rows hold none
        for r, share in enumerate(shard0_shares((rows, 3), world)):
            assert t.reshape(-1)[share.lo : share.hi].tolist() == parts[r].reshape(-1).tolist(), (
                rows,
                world,
                r,
            )
            assert share.base == share.lo
    assert [chunk_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]


def _gather_by_hand(specs, full, sharded, world, buckets, gathers):
    """What the ranks' all-gathers and the sending rank's copies make of each bucket, computed without any
    process group: each rank's segment from its own part of each tensor, then every piece into the bucket."""
    out = []
    for bucket, gather in zip(buckets, gathers, strict=True):
        seg = gather.segment_bytes
        gathered = torch.zeros(world * seg, dtype=torch.uint8)
        ring = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for p in gather.pieces:
            wire = DTYPES[specs[p.index].dtype]
            t = full[p.index]
            shares = shard0_shares(t.shape, world) if sharded[p.index] else replica_shares(t.numel(), world)
            local = t.reshape(-1)[shares[p.rank].base :] if sharded[p.index] else t.reshape(-1)  # this rank's
            start = p.rank * seg + HEADER_BYTES + p.offset
            assert p.rows == 1 and HEADER_BYTES + p.offset + p.count * wire.itemsize <= seg  # in its segment
            dst = gathered[start : start + p.count * wire.itemsize].view(wire)
            dst.copy_(local[p.local_start : p.local_start + p.count])  # the cast happens here
        for p in gather.pieces:
            n = p.count * specs[p.index].itemsize
            src = p.rank * seg + HEADER_BYTES + p.offset
            ring[p.bucket_offset : p.bucket_offset + n] = gathered[src : src + n]
        out.append(ring)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_gathered_buckets_hold_the_bytes_the_plain_packer_packs(seed):
    """Every chunk of every bucket is covered by the ranks' pieces exactly once: the bucket assembled from the
    ranks' shares (Shard(0), uneven, empty, replicated; cast or not; tensors sliced over buckets) equals the one
    the plain source packs from the whole tensors, byte for byte."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    world = rnd.choice([1, 2, 3, 4])
    cfg = dataclasses.replace(
        CFG, bucket_bytes=rnd.choice([256, 1024, 4096]), cast_dtype=rnd.choice([None, "bfloat16"])
    )
    named, sharded = [], []
    for i in range(rnd.randint(1, 12)):
        shape = (rnd.randint(0, 40), rnd.randint(1, 9)) if rnd.random() < 0.8 else (rnd.randint(1, 300),)
        named.append(
            (f"t{i}", random_tensor(rnd.choice([torch.float32, torch.bfloat16, torch.int64]), shape, gen))
        )
        sharded.append(rnd.random() < 0.75)
    sources = select(named, cfg)
    specs = [s.spec for s in sources]
    buckets = plan_buckets(specs, cfg.bucket_bytes, cfg.align_bytes)
    shares = [
        shard0_shares(s.shape, world) if sh else replica_shares(s.numel, world)
        for s, sh in zip(specs, sharded, strict=True)
    ]
    gathers = plan_gathers(specs, shares, buckets)
    rings = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in buckets]
    packer = Packer(buckets, sources, rings)
    for k in range(len(buckets)):
        packer.pack(k)
    got = _gather_by_hand(specs, [t for _, t in named], sharded, world, buckets, gathers)
    assert len(got) == len(rings) and all(same_bits(a, b) for a, b in zip(got, rings, strict=True))
    for g in gathers:  # one all-gather per bucket, each rank's segment no larger than its share needs
        assert g.segment_bytes % HEADER_BYTES == 0
        for r in range(world):
            mine = sorted(
                (p.offset, p.offset + p.count * specs[p.index].itemsize) for p in g.pieces if p.rank == r
            )
            assert all(
                a[1] <= b[0] for a, b in zip(mine[:-1], mine[1:], strict=True)
            )  # no two pieces overlap


def test_shares_that_miss_elements_are_refused():
    from raysync.core.wire import TensorSpec
    from raysync.sources.gather_plan import Share

    spec = TensorSpec("w", "float32", (4, 2))
    buckets = plan_buckets([spec], 4096)
    with pytest.raises(ValueError, match="do not cover"):
        plan_gathers([spec], [[Share(0, 4, 0, 8), Share(5, 8, 5, 8)]], buckets)  # element 4 is nobody's
    with pytest.raises(ValueError, match="do not cover"):
        plan_gathers([spec], [[Share(0, 8, 0, 8), Share(0, 8, 0, 8)]], buckets)  # twice


# --- DTensors on a one-rank mesh, in this process -----------------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    path = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _fsdp_model(seed: int, mesh):
    """FSDP2 on the given CPU mesh (without one, fully_shard would put the parameters on a GPU where there is one)."""
    pytest.importorskip("transformers")
    from torch.distributed.fsdp import fully_shard

    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_a_dtensor_handed_to_the_plain_source_is_refused_naming_it_and_the_dtensor_source(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    named = [
        ("plain.weight", torch.ones(4)),
        ("sharded.weight", distribute_tensor(torch.ones(4, 4), one_rank_mesh, [Shard(0)])),
    ]
    with pytest.raises(LayoutError, match=r"'sharded.weight' is a DTensor .*DTensorSource"):
        select(named, CFG)
    with session_pair(CFG) as (sender, _):  # the session refuses it before anything is sent
        with pytest.raises(LayoutError, match="DTensorSource"):
            sender.push(named, version=1)


def test_a_one_rank_fsdp2_model_pushes_bit_exact_through_a_session_and_the_plain_path_still_works(
    one_rank_mesh, in_thread
):
    """A DTensorSource on a one-rank mesh is a Source, its layout from metadata equals the plain source's, and
    three pushes (one cast to bf16, a plain push between them) land bit-exact."""
    from raysync.sources import DTensorSource

    model = _fsdp_model(seed=0, mesh=one_rank_mesh)
    base = dataclasses.replace(CFG, bucket_bytes=64 << 10)
    for cfg in (base, dataclasses.replace(base, cast_dtype="bfloat16", keep_dtype=("*norm*",))):
        source = DTensorSource(model.named_parameters(), cfg)
        whole = [(n, p.to_local().detach()) for n, p in model.named_parameters()]
        assert is_source(source) and not is_source(whole) and not is_source(dict(whole).items())
        assert source.specs(cfg) == [s.spec for s in select(whole, cfg)]
        dest = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in source.specs(cfg)}
        with session_pair(cfg) as (sender, receiver):
            for version in (1, 2, 3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.to_local().mul_(1.5).add_(version)
                what = whole if version == 2 else source  # a plain push between two lazy ones
                got = in_thread(receiver.receive, into=dest)
                report = sender.push(what, version=version)
                assert got.result(timeout=60).version == version and report.version == version
                for (name, t), s in zip(whole, source.specs(cfg), strict=True):
                    assert same_bits(dest[name], t.to(DTYPES[s.dtype])), (version, name)
        source.close()


def test_a_lazy_source_is_refused_by_a_plane_that_reads_tensors_in_place(one_rank_mesh):
    from raysync.core.agreement import SenderLayout
    from raysync.sources import DTensorSource

    source = DTensorSource([("w", torch.ones(4))], CFG)

    class InPlace:
        name, reads_in_place = "cuda_ipc_direct", True

    with pytest.raises(LayoutError, match="reads whole tensors in place"):
        SenderLayout(CFG).agree_source(source, InPlace(), channel=None)


# --- a lazy source: tensors made when their bucket is packed ------------------------------------------------------
def test_a_lazy_source_makes_each_tensor_once_when_its_bucket_is_packed_and_holds_one_bucket_of_them(
    in_thread,
):
    """The layout comes from a model on the meta device (no memory); each push makes every tensor once, in
    bucket order, holds at most one bucket's tensors (plus one a slice spans), and lands bit-exact, cast too."""
    import weakref

    from raysync.sources.lazy import LazySource

    gen = torch.Generator().manual_seed(3)
    shapes = {f"w{i}": (64, 12) for i in range(12)} | {"big": (700, 16), "b": (5,)}  # big spans 11 buckets
    tensors = {n: random_tensor(torch.float32, s, gen) for n, s in shapes.items()}
    with torch.device("meta"):
        meta = torch.nn.ParameterDict({n: torch.nn.Parameter(torch.empty(s)) for n, s in shapes.items()})
    alive, most, loads = [0], [0], []

    def load(name: str) -> torch.Tensor:
        loads.append(name)
        t = tensors[name].clone()
        alive[0] += 1
        most[0] = max(most[0], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        return t

    source = LazySource.from_module(meta, load)
    cfg = dataclasses.replace(CFG, cast_dtype="bfloat16", keep_dtype=("b",))
    buckets = plan_buckets(source.specs(cfg), cfg.bucket_bytes, cfg.align_bytes)
    dest = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in source.specs(cfg)}
    with session_pair(cfg) as (sender, receiver):
        for version in (1, 2):
            loads.clear()
            got = in_thread(receiver.receive, into=dest)
            sender.push(source, version=version)
            assert got.result(timeout=60).version == version
            assert loads == [n for n, _ in meta.named_parameters()]  # each made once, in push order
            assert alive[0] == 0 and most[0] <= max(len(b.chunks) for b in buckets) + 1
            for n, t in tensors.items():
                assert same_bits(dest[n], t if n == "b" else t.to(torch.bfloat16)), n
    wrong = LazySource([("w0", (3, 3), torch.float32)], lambda name: torch.zeros(2))
    packer = wrong.packer(CFG, plan_buckets(wrong.specs(CFG), 4096), [torch.zeros(4096, dtype=torch.uint8)])
    packer.start(1)
    with pytest.raises(LayoutError, match=r"load\('w0'\) made"):
        packer.pack(0)
