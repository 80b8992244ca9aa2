"""Tensor-parallel sources and the name/shape mapping: the gather plan of Shard(d) tensors against a reference
that assembles each bucket element run by element run (pure, property test), the mapping's rules and its
errors, and two TP ranks (spawned processes on gloo: DTensor Shard(0) / Shard(1) / Replicate and plain tensors
declared as shards) pushing to an engine through a real session with a qkv split, a gate/up fuse and a transpose."""

from __future__ import annotations

import dataclasses
import itertools
import math
import queue
import time

import pytest
import torch
from conftest import random_tensor, same_bits, session_pair
from hypothesis import given, settings
from hypothesis import strategies as st

from raysync import LayoutError, SyncConfig
from raysync.core.plan import plan_buckets
from raysync.core.source import Packer, SourceTensor
from raysync.core.wire import DTYPES, TensorSpec
from raysync.sources import DTensorSource, Fuse, NameMap, Rename, Split, Transpose
from raysync.sources.gather_plan import (
    HEADER_BYTES,
    check_cover,
    mesh_shares,
    plan_gathers,
    replica_shares,
    shard_shares,
)

CFG = SyncConfig(bucket_bytes=256, timeout_s=20, progress=False)


# --- the gather plan of Shard(d) tensors, with a mapping (pure) ---------------------------------------------------
def _local(full: torch.Tensor, world: int, rank: int, dim: int | None) -> torch.Tensor:
    """Rank ``rank``'s part as DTensor / FSDP2 cut it (torch.chunk; ranks past the end hold an empty part)."""
    if dim is None:
        return full
    parts = list(torch.chunk(full, world, dim)) if full.shape[dim] else []
    empty = list(full.shape)
    empty[dim] = 0
    parts += [full.new_empty(empty)] * (world - len(parts))
    return parts[rank].contiguous()


def _assemble(specs, locals_, world, buckets, gathers) -> list[torch.Tensor]:
    """Each bucket as the ranks' segments and the sending rank's copies make it, one row of one piece at a
    time (no strided views): rank r's rows -> its segment, packed; then each row to its place in the bucket."""
    out = []
    for bucket, gather in zip(buckets, gathers, strict=True):
        seg = gather.segment_bytes
        gathered = torch.zeros(world * seg, dtype=torch.uint8)
        ring = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for p in gather.pieces:
            wire = DTYPES[specs[p.index].dtype]
            size = wire.itemsize
            assert HEADER_BYTES + p.offset + p.count * size <= seg  # inside its rank's segment
            flat = locals_[p.rank][p.source].reshape(-1)
            for i in range(p.rows):
                at = p.rank * seg + HEADER_BYTES + p.offset + i * p.cols * size
                row = flat[p.local_start + i * p.local_stride :][: p.cols]
                assert row.numel() == p.cols  # the piece stays inside the rank's local tensor
                gathered[at : at + p.cols * size].view(wire).copy_(row)  # the cast happens here
        for p in gather.pieces:
            size = specs[p.index].itemsize
            for i in range(p.rows):
                for j in range(p.cols):  # element by element: a transposed piece's columns are apart
                    src = p.rank * seg + HEADER_BYTES + p.offset + (i * p.cols + j) * size
                    dst = p.bucket_offset + (i * p.ring_stride + j * p.ring_step) * size
                    ring[dst : dst + size] = gathered[src : src + size]
        out.append(ring)
    return out


@st.composite
def _layouts(draw):
    world = draw(st.integers(1, 4))
    tensors = []
    for i in range(draw(st.integers(1, 6))):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.integers(0 if d else 1, 7)) for d in range(ndim))
        dim = draw(st.sampled_from([None, *range(ndim)]))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int32]))
        tensors.append((f"t{i}", shape, dim, dtype))
    split = draw(st.booleans()) and tensors[0][1][0] >= 2
    matrices = [name for name, shape, _, _ in tensors[1:] if len(shape) == 2]
    transpose = draw(st.sampled_from([None, *matrices]))
    return world, tensors, split, transpose, draw(st.sampled_from([64, 256, 1024])), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(_layouts(), st.integers(0, 2**31))
def test_gathered_buckets_of_sharded_and_mapped_tensors_equal_the_plain_packers(layout, seed):
    """Shard(d) for every d (uneven, empty ranks), Replicate, cast or not, tensors sliced over buckets mid-row,
    the first tensor split in two along dim 0, a matrix transposed: the bucket assembled from the ranks' local parts through the
    plan's pieces equals, byte for byte, the one the plain Packer packs from the whole, mapped tensors."""
    world, tensors, split, transpose, bucket_bytes, cast = layout
    gen = torch.Generator().manual_seed(seed)
    full = [random_tensor(dtype, shape, gen) for _, shape, _, dtype in tensors]
    meta = [(name, shape, dtype) for name, shape, _, dtype in tensors]
    rows0 = tensors[0][1][0]
    rules = [Split("t0", ("a", "b"), (1, rows0 - 1))] if split else []
    mapping = NameMap(*rules, *([Transpose(transpose, "tr")] if transpose else []))
    mapped = mapping.apply(meta)
    wire = {
        torch.float32: "bfloat16" if cast else "float32",
        torch.bfloat16: "bfloat16",
        torch.int32: "int32",
    }
    specs = [TensorSpec(m.name, wire[m.dtype], m.shape) for m in mapped]
    buckets = plan_buckets(specs, bucket_bytes, 16)
    shares = [
        replica_shares(math.prod(shape), world) if dim is None else shard_shares(shape, world, dim)
        for _, shape, dim, _ in tensors
    ]
    numels = [math.prod(shape) for _, shape, _, _ in tensors]
    gathers = plan_gathers(specs, shares, buckets, [m.parts for m in mapped], numels)
    whole = [  # the engine's tensors, made from the whole trainer tensors
        torch.cat(
            [
                full[p.source].reshape(p.rows, -1).T.reshape(-1)
                if p.rows
                else full[p.source].reshape(-1)[p.start : p.start + p.count]
                for p in m.parts
            ]
        ).reshape(m.shape)
        for m in mapped
    ]
    rings = [torch.zeros(b.nbytes, dtype=torch.uint8) for b in buckets]
    packer = Packer(buckets, [SourceTensor(s, t) for s, t in zip(specs, whole, strict=True)], rings)
    for k in range(len(buckets)):
        packer.pack(k)
    locals_ = [
        [_local(t, world, r, dim) for t, (_, _, dim, _) in zip(full, tensors, strict=True)]
        for r in range(world)
    ]
    got = _assemble(specs, locals_, world, buckets, gathers)
    assert all(same_bits(a, b) for a, b in zip(got, rings, strict=True))
    for g in gathers:  # no two pieces of a rank overlap in its segment
        for r in range(world):
            mine = sorted(
                (p.offset, p.offset + p.count * specs[p.index].itemsize) for p in g.pieces if p.rank == r
            )
            assert all(a[1] <= b[0] for a, b in zip(mine[:-1], mine[1:], strict=True))


def test_shard1_shares_are_the_columns_torch_chunk_gives_each_rank():
    t = torch.arange(5 * 7 * 2).reshape(5, 7, 2)
    for dim in (0, 1, 2):
        for world in (1, 2, 3, 4):
            for r, share in enumerate(shard_shares(t.shape, world, dim)):
                block = t.reshape(share.row_hi - share.row_lo, share.width)[:, share.lo : share.hi]
                assert block.reshape(-1).tolist() == _local(t, world, r, dim).reshape(-1).tolist()


@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 2), (2, 3), (3, 2)])
def test_mesh_shares_are_the_blocks_dtensor_gives_each_rank_and_cover_the_tensor_once(mesh):
    """For every placement of a matrix and of a 3-D tensor on 1-D and 2-D meshes (Shard(d) / Replicate per mesh
    dim): each rank's share, read through its local index formula, is the block nested torch.chunk gives it;
    the shares cover every element once (replicas split a block); on a 1-D mesh they are shard_shares /
    replica_shares; a block that is not rows x columns of a matrix view is refused."""
    for shape in [(6, 5), (7, 3, 2), (4,), (3, 8)]:
        full = torch.arange(math.prod(shape)).reshape(shape)
        for placements in itertools.product([None, *range(len(shape))], repeat=len(mesh)):
            if len(shape) == 3 and sorted(d for d in placements if d is not None) == [1, 2]:
                with pytest.raises(ValueError, match="not rows x columns"):
                    mesh_shares(shape, mesh, placements)
                continue
            shares = mesh_shares(shape, mesh, placements)
            check_cover("t", full.numel(), shares)
            for rank, share in enumerate(shares):
                local = _block(full, mesh, placements, rank).reshape(-1)
                view = full.reshape(-1, share.width)
                for i in range(share.row_lo, share.row_hi):
                    cols = torch.arange(share.lo, share.hi)
                    got = local[(i - share.row_lo) * share.stride + cols - share.base]
                    assert torch.equal(got, view[i, share.lo : share.hi]), (shape, mesh, placements, rank)
            if len(mesh) == 1:
                (d,) = placements
                one_dim = (
                    replica_shares(full.numel(), mesh[0]) if d is None else shard_shares(shape, mesh[0], d)
                )
                assert shares == one_dim


# --- the mapping's rules and errors -----------------------------------------------------------------------------
def test_the_mapping_splits_fuses_and_renames_in_the_trainers_order():
    meta = [
        ("dec.0.qkv.weight", (8, 4), torch.float32),
        ("dec.0.gate.weight", (3, 4), torch.float32),
        ("dec.0.norm", (4,), torch.float32),
        ("dec.0.up.weight", (5, 4), torch.float32),
    ]
    mapping = NameMap(
        Split(r"dec\.(\d+)\.qkv\.weight", (r"l.\1.q.weight", r"l.\1.k.weight", r"l.\1.v.weight"), (4, 2, 2)),
        Fuse((r"dec\.(\d+)\.gate\.weight", r"dec\.(\d+)\.up\.weight"), r"l.\1.gate_up.weight"),
        Rename(r"dec\.(\d+)\.(.*)", r"l.\1.\2"),
    )
    got = [(m.name, m.shape, [(p.source, p.start, p.count) for p in m.parts]) for m in mapping.apply(meta)]
    assert got == [
        ("l.0.q.weight", (4, 4), [(0, 0, 16)]),
        ("l.0.k.weight", (2, 4), [(0, 16, 8)]),
        ("l.0.v.weight", (2, 4), [(0, 24, 8)]),
        ("l.0.gate_up.weight", (8, 4), [(1, 0, 12), (3, 0, 20)]),
        ("l.0.norm", (4,), [(2, 0, 4)]),
    ]


def test_a_mapping_whose_shapes_do_not_add_up_is_refused_naming_the_tensor():
    ones = [("a.qkv.weight", torch.ones(8, 4)), ("a.gate", torch.ones(3, 4)), ("a.up", torch.ones(3, 5))]
    split = NameMap(Split(r"(.*)\.qkv\.weight", (r"\1.q", r"\1.k", r"\1.v"), (4, 2, 1)))
    with pytest.raises(LayoutError, match=r"'a.qkv.weight' of shape \(8, 4\) cannot be split into rows"):
        DTensorSource(ones, CFG, mapping=split)
    fuse = NameMap(Fuse((r"(.*)\.gate", r"(.*)\.up"), r"\1.gate_up"))
    with pytest.raises(LayoutError, match=r"'a.up' \(\(3, 5\), torch.float32\) cannot be joined"):
        DTensorSource(ones, CFG, mapping=fuse)
    half = NameMap(Fuse((r"(.*)\.gate", r"(.*)\.down"), r"\1.gate_down"))
    with pytest.raises(LayoutError, match=r"\['a.gate'\] match the Fuse rule"):
        DTensorSource(ones, CFG, mapping=half)
    flat = NameMap(Transpose("a.gate", "a.gate_t"))
    with pytest.raises(LayoutError, match=r"'a.gate' of shape \(3,\) cannot be transposed"):
        DTensorSource([("a.gate", torch.ones(3))], CFG, mapping=flat)
    twice = NameMap(Rename(r"a\.(gate|up)", "a.same"))
    with pytest.raises(LayoutError, match=r"\['a.same'\] more than once"):
        DTensorSource(ones, CFG, mapping=twice)


def test_a_mapped_source_on_one_rank_pushes_the_mapped_tensors_bit_exact(in_thread):
    """No group: the pieces go from the trainer's tensors straight into their mapped places in the ring."""
    gen = torch.Generator().manual_seed(1)
    qkv, gate, up = (torch.randn(s, generator=gen) for s in ((24, 5), (6, 5), (6, 5)))
    mapping = NameMap(
        Split("qkv", ("q", "k", "v"), (16, 4, 4)), Fuse(("gate", "up"), "gate_up"), Rename("norm", "ln")
    )
    norm = torch.randn(5, generator=gen)
    source = DTensorSource([("qkv", qkv), ("gate", gate), ("norm", norm), ("up", up)], CFG, mapping=mapping)
    cfg = dataclasses.replace(CFG, cast_dtype="bfloat16", exclude=("k",))

    def expect() -> dict[str, torch.Tensor]:
        return {"q": qkv[:16], "v": qkv[20:], "gate_up": torch.cat([gate, up]), "ln": norm}

    assert [(s.name, s.shape) for s in source.specs(cfg)] == [
        (n, tuple(t.shape)) for n, t in expect().items()
    ]
    dest = {s.name: torch.zeros(s.shape, dtype=DTYPES[s.dtype]) for s in source.specs(cfg)}
    with session_pair(cfg) as (sender, receiver):
        for version in (1, 2):
            for t in (qkv, gate, up, norm):
                t.mul_(2).add_(version)  # in place: the copies made at the first push are replayed
            got = in_thread(receiver.receive, into=dest)
            sender.push(source, version=version)
            assert got.result(timeout=60).version == version
            for name, t in expect().items():
                assert same_bits(dest[name], t.to(torch.bfloat16)), (version, name)


# --- tensor-parallel ranks (and FSDP x TP), spawned, on gloo -----------------------------------------------------
H = 12
# name, global shape, and per layout its placement per mesh dim: a tensor dim d is Shard(d), None Replicate(),
# ("plain", d) a plain tensor declared a shard along d (a one-dimensional group only)
TENSORS = [  # tp2: one TP group of 2; fsdp2xtp2: a (2, 2) mesh, FSDP on the first dim, TP on the second
    ("attn.qkv_proj.weight", (16 + 8 + 8, H), {"tp2": (0,), "fsdp2xtp2": (0, 0)}),  # fused on the trainer
    ("attn.o_proj.weight", (H, 16), {"tp2": (1,), "fsdp2xtp2": (0, 1)}),  # row-parallel
    ("mlp.gate_proj.weight", (20, H), {"tp2": (0,), "fsdp2xtp2": (0, 0)}),
    ("mlp.up_proj.weight", (20, H), {"tp2": (("plain", 0),), "fsdp2xtp2": (None, 0)}),
    ("mlp.down_proj.weight", (H, 20), {"tp2": (("plain", 1),), "fsdp2xtp2": (None, 1)}),
    ("odd.weight", (5, 7), {"tp2": (1,), "fsdp2xtp2": (0, 1)}),  # uneven: 4 and 3 columns (3 and 2 rows)
    ("norm.weight", (H,), {"tp2": (None,), "fsdp2xtp2": (0, None)}),
    ("conv.weight", (6, H), {"tp2": (1,), "fsdp2xtp2": (1, 0)}),  # [in, out] on the trainer: transposed
]
MESHES = {"tp2": (2,), "fsdp2xtp2": (2, 2)}
MAPPING = NameMap(
    Split(
        r"(.*)\.qkv_proj\.weight", (r"\1.q_proj.weight", r"\1.k_proj.weight", r"\1.v_proj.weight"), (16, 8, 8)
    ),
    Fuse((r"(.*)\.gate_proj\.weight", r"(.*)\.up_proj\.weight"), r"\1.gate_up_proj.weight"),
    Transpose(r"conv\.weight", "linear.weight"),
)
TP_CFG = dataclasses.replace(CFG, bucket_bytes=512, cast_dtype="bfloat16", keep_dtype=("norm.*",))


def _full(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {name: random_tensor(torch.float32, shape, gen) for name, shape, _ in TENSORS}


def _block(full: torch.Tensor, mesh: tuple[int, ...], placements, rank: int) -> torch.Tensor:
    """Rank ``rank``'s block as DTensor cuts it: torch.chunk along each mesh dim in turn."""
    coord = [rank // math.prod(mesh[i + 1 :]) % mesh[i] for i in range(len(mesh))]
    for d, c, size in zip(placements, coord, mesh, strict=True):
        d = d[1] if isinstance(d, tuple) else d
        if d is not None:
            full = _local(full, size, c, d)
    return full.contiguous()


def tp_rank(rank, layout, store, secret, versions, endpoints, out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from raysync import RaysyncError, WeightSender

    mesh_shape = MESHES[layout]
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=math.prod(mesh_shape)
    )
    mesh = init_device_mesh("cpu", mesh_shape)
    named, shards = [], {}
    for name, shape, how in TENSORS:
        placements, local = how[layout], _block(torch.zeros(shape), mesh_shape, how[layout], rank)
        if isinstance(placements[0], tuple):
            named.append((name, local))
            shards[name] = placements[0][1]
        else:
            dt = [Replicate() if d is None else Shard(d) for d in placements]
            named.append(
                (name, DTensor.from_local(local, mesh, dt, shape=shape, stride=torch.zeros(shape).stride()))
            )
    source = DTensorSource(named, TP_CFG, shards=shards, mapping=MAPPING)
    sender = WeightSender(secret, TP_CFG) if rank == 0 else None
    if sender is not None:
        endpoints.put(sender.endpoint)
    try:
        for version in versions:
            with torch.no_grad():  # the new weights, written into each rank's part in place
                for (name, t), (_, _, how) in zip(named, TENSORS, strict=True):
                    local = t.to_local() if hasattr(t, "to_local") else t
                    local.copy_(_block(_full(version)[name], mesh_shape, how[layout], rank))
            if sender is not None:
                out.put(("pushed", version, sender.push(source, version=version).version))
            else:
                out.put(("followed", version, source.follow(version)))
    except RaysyncError as e:
        out.put(("error", rank, repr(e)))
    if sender is not None:
        sender.close()
    source.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tp2", "fsdp2xtp2"])
def test_tp_ranks_push_the_unsharded_mapped_weights_bit_exact(layout, spawn, tmp_path, in_thread):
    """Two TP ranks (Shard(0), Shard(1), uneven Shard(1), Replicate, plain tensors declared as shards), or a
    (2, 2) FSDP x TP mesh ((Shard(0), Shard(0)), (Shard(0), Shard(1)), (Replicate, Shard(d)), (Shard(0),
    Replicate)), with the qkv split and the gate/up fuse: after each of two pushes the engine's weights equal
    the unsharded trainer weights, mapped and cast, bit-exactly, and every other rank followed both pushes."""
    from raysync import SessionSecret, WeightReceiver

    ctx = spawn.ctx
    secret, endpoints, out = SessionSecret.generate(), ctx.Queue(), ctx.Queue()
    versions, world = [1, 2], math.prod(MESHES[layout])
    for rank in range(world):
        spawn(tp_rank, rank, layout, str(tmp_path / "store"), secret, versions, endpoints, out)
    with WeightReceiver(endpoints.get(timeout=120), secret, TP_CFG) as receiver:
        dest = None
        for version in versions:
            full = _full(version)
            qkv = full["attn.qkv_proj.weight"]
            expect = {
                "attn.q_proj.weight": qkv[:16],
                "attn.k_proj.weight": qkv[16:24],
                "attn.v_proj.weight": qkv[24:],
                "attn.o_proj.weight": full["attn.o_proj.weight"],
                "mlp.gate_up_proj.weight": torch.cat(
                    [full["mlp.gate_proj.weight"], full["mlp.up_proj.weight"]]
                ),
                "mlp.down_proj.weight": full["mlp.down_proj.weight"],
                "odd.weight": full["odd.weight"],
                "norm.weight": full["norm.weight"],
                "linear.weight": full["conv.weight"].T,
            }
            expect = {
                n: t.to(torch.float32 if n == "norm.weight" else torch.bfloat16) for n, t in expect.items()
            }
            dest = dest or {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in expect.items()}
            got = in_thread(receiver.receive, into=dest)
            assert got.result(timeout=120).version == version
            for name, t in expect.items():
                assert same_bits(dest[name], t), (version, name)
    events = []
    deadline = time.monotonic() + 60
    while len(events) < world * len(versions):
        try:
            events.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
        except queue.Empty:
            pytest.fail(f"the ranks did not report; so far {events}")
    expected = [("pushed", v, v) for v in versions] + [("followed", v, "done") for v in versions] * (
        world - 1
    )
    assert sorted(events) == sorted(expected), events


def odd_rank(rank, store, out) -> None:
    """Rank 0 holds its half of "w" (declared a Shard(0)); rank 1 holds the whole "w" (a replica): the same
    names and global shapes on both, other pieces."""
    import torch.distributed as dist

    from raysync import RaysyncError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    w, shards = (torch.zeros(2, 4), {"w": 0, "x": 0}) if rank == 0 else (torch.zeros(4, 4), {"x": 0})
    source = DTensorSource([("w", w), ("x", torch.zeros(2, 4))], CFG, shards=shards)
    try:
        out.put(("followed", rank, [(s.name, s.shape) for s in source.specs(CFG)], source.follow(1)))
    except RaysyncError as e:
        out.put(("error", rank, [(s.name, s.shape) for s in source.specs(CFG)], type(e).__name__, str(e)))
    source.close()
    dist.destroy_process_group()


def test_ranks_whose_placements_differ_under_the_same_layout_are_refused_before_any_data_moves(
    spawn, tmp_path
):
    """The walk's start compares the plan's pieces too: two ranks that agree on names and global shapes but
    not on how "w" is placed each raise a LayoutError at the start of the push, instead of gathering bytes
    that do not fit together."""
    out = spawn.ctx.Queue()
    for rank in range(2):
        spawn(odd_rank, rank, str(tmp_path / "store"), out)
    events = sorted(out.get(timeout=120) for _ in range(2))
    assert [e[:2] for e in events] == [("error", 0), ("error", 1)], events
    for _, _, specs, kind, text in events:
        assert specs == [("w", (4, 4)), ("x", (4, 4))] and kind == "LayoutError", events
        assert "do not walk the same push" in text, events
