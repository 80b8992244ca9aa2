"""Bucket planning, packing and reassembly as pure functions (no processes, no sockets)."""

from __future__ import annotations

import tracemalloc

import hypothesis.strategies as st
import pytest
import torch
from conftest import random_tensor, same_bits
from hypothesis import event, given, settings

from raysync.core.config import SyncConfig
from raysync.core.errors import BadLayout
from raysync.core.plan import (
    LayoutBounds,
    check_layout,
    check_tensor_count,
    direct_buckets,
    fitting_bucket_bytes,
    layout_size,
    plan_buckets,
)
from raysync.core.sink import IntoLoadFn, IntoTensors
from raysync.core.source import pack_bucket, select
from raysync.core.wire import DTYPES, MAX_LAYOUT_BUCKETS, MAX_LAYOUT_TENSORS, TensorSpec

ALIGN = 256
TESTED_DTYPES = [n for n in DTYPES if n != "float4_e2m1fn_x2"]  # float4 packs two values per byte: no arange


def spec(name: str, nbytes: int, dtype: str = "uint8") -> TensorSpec:
    return TensorSpec(name, dtype, (nbytes // DTYPES[dtype].itemsize,))


def layout(buckets) -> list[list[tuple[int, int, int, int]]]:
    return [[(c.index, c.src_offset, c.bucket_offset, c.nbytes) for c in b.chunks] for b in buckets]


@pytest.mark.parametrize(
    "sizes, bucket, expected",
    [
        ([100, 100], 512, [[(0, 0, 0, 100), (1, 0, 256, 100)]]),
        ([512], 512, [[(0, 0, 0, 512)]]),  # ends exactly at the bucket boundary
        ([512, 8], 512, [[(0, 0, 0, 512)], [(1, 0, 0, 8)]]),
        ([300, 300], 512, [[(0, 0, 0, 300)], [(1, 0, 0, 300)]]),  # does not fit after padding: next bucket
        ([100, 1200], 512, [[(0, 0, 0, 100), (1, 0, 256, 256)], [(1, 256, 0, 512)], [(1, 768, 0, 432)]]),
        ([1024], 512, [[(0, 0, 0, 512)], [(0, 512, 0, 512)]]),  # exactly two buckets
        ([0, 0], 512, [[(0, 0, 0, 0), (1, 0, 0, 0)]]),  # zero-size tensors still travel (as names)
        ([], 512, []),
    ],
)
def test_plan_table(sizes, bucket, expected):
    specs = [spec(f"t{i}", n) for i, n in enumerate(sizes)]
    assert layout(plan_buckets(specs, bucket, ALIGN)) == expected


def test_plan_rejects_unaligned_bucket():
    with pytest.raises(BadLayout, match="multiple of align_bytes"):
        plan_buckets([spec("a", 8)], 1000, ALIGN)


# --- layout bounds (Note [layout bounds]) ------------------------------------------------------------------------
def plan_counts(buckets) -> tuple[int, int]:
    return len(buckets), sum(len(b.chunks) for b in buckets)


SMALL_SIZES = (0, 1, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100)


def test_layout_size_counts_every_small_layout_exactly():
    """Every sequence of up to three tensors of these sizes, in buckets of 1-4 alignment units: the arithmetic
    count is what the planner makes (so a bound checked on the count is a bound on the plan)."""
    layouts = [()] + [(a,) for a in SMALL_SIZES] + [(a, b) for a in SMALL_SIZES for b in SMALL_SIZES]
    layouts += [(a, b, c) for a in SMALL_SIZES[::2] for b in SMALL_SIZES for c in SMALL_SIZES[1::2]]
    for sizes in layouts:
        specs = [spec(f"t{i}", n) for i, n in enumerate(sizes)]
        for bucket in (16, 32, 48, 64):
            size = layout_size(specs, bucket, 16)
            assert (size.buckets, size.chunks) == plan_counts(plan_buckets(specs, bucket, 16)), (
                sizes,
                bucket,
            )
            assert size.nbytes == sum(sizes)


sizes_mixed = st.one_of(
    st.integers(0, 3000), st.integers(3000, 40_000), st.sampled_from([0, 16, 255, 256, 257])
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["uint8", "bfloat16", "float32", "complex128"]), sizes_mixed), max_size=10
    ),
    st.sampled_from([16, 32, 256, 1024]),
    st.integers(1, 64),
)
def test_layout_size_is_what_plan_buckets_makes(items, align, units):
    specs = [TensorSpec(f"t{i}", d, (n // DTYPES[d].itemsize,)) for i, (d, n) in enumerate(items)]
    size = layout_size(specs, units * align, align)
    buckets, chunks = plan_counts(plan_buckets(specs, units * align, align))
    assert (size.buckets, size.chunks) == (buckets, chunks)
    assert chunks <= len(specs) + buckets - 1 or not specs  # why MAX_LAYOUT_CHUNKS bounds every plan


@settings(max_examples=400, deadline=None)
@given(
    st.lists(sizes_mixed, max_size=12),
    st.sampled_from([16, 32, 256]),
    st.integers(1, 16),
    st.integers(1, 12),
    st.integers(1, 24),
    st.integers(0, 12),
)
def test_refused_layouts_name_a_bucket_size_that_fits(sizes, align, units, max_tensors, max_buckets, extra):
    """With small bounds, so that both outcomes are common: a layout within them plans within them; a refused
    one raises BadLayout before planning, and the bucket size it names (and any larger) fits."""
    bounds = LayoutBounds(max_tensors, max_buckets, max_tensors + extra)
    specs = [spec(f"t{i}", n) for i, n in enumerate(sizes)]
    try:
        size = check_layout(specs, units * align, align, bounds)
        event("accepted")
    except BadLayout as e:
        event("refused")
        if len(specs) > max_tensors:
            assert "fewer tensors" in str(e)
            return
        size = layout_size(specs, units * align, align)
        assert size.buckets > bounds.buckets or size.chunks > bounds.chunks
        fit = fitting_bucket_bytes(size, align, bounds)
        if fit is None:
            assert len(specs) > bounds.chunks and "fewer tensors" in str(e)
            return
        assert f"raise bucket_bytes to {fit} or more" in str(e)
        for bucket in (fit, fit + align, 2 * fit, 7 * fit):
            check_layout(specs, bucket, align, bounds)  # does not raise
        return
    buckets, chunks = plan_counts(plan_buckets(specs, units * align, align))
    assert (buckets, chunks) == (size.buckets, size.chunks)
    assert buckets <= bounds.buckets and chunks <= bounds.chunks and len(specs) <= bounds.tensors


def refusal_peak_bytes(call) -> int:
    """Peak bytes Python allocated while ``call`` raised BadLayout."""
    tracemalloc.start()
    try:
        with pytest.raises(BadLayout):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "nbytes, bucket, align",
    [
        (1 << 30, 16, 16),  # 67M slices of 16 bytes
        (1 << 47, 256, 256),  # 2**39 slices
        ((MAX_LAYOUT_BUCKETS + 1) * 256, 256, 256),  # one bucket above the bound: 32 MB of plan if entered
    ],
)
def test_hostile_layouts_are_refused_before_a_bucket_is_made(nbytes, bucket, align):
    specs = [spec("w", nbytes)]
    peak = refusal_peak_bytes(lambda: plan_buckets(specs, bucket, align))
    assert peak < 64 << 10  # the refusal made no plan: a plan of this size holds over 100k Chunk objects
    with pytest.raises(BadLayout, match=r"raise bucket_bytes to \d+ or more") as e:
        check_layout(specs, bucket, align)
    assert f"makes {-(-nbytes // bucket)} buckets" in str(e.value)


def test_many_tiny_tensors_are_refused_on_their_count():
    with pytest.raises(BadLayout, match=f"above the limit of {MAX_LAYOUT_TENSORS}.*fewer tensors"):
        check_tensor_count(MAX_LAYOUT_TENSORS + 1)
    check_tensor_count(MAX_LAYOUT_TENSORS)  # the bound itself is allowed


def test_direct_plan_refuses_more_storages_than_tensors_before_planning():
    specs = (TensorSpec("a", "float32", (4,)),)
    with pytest.raises(BadLayout, match="2 storages exported for 1 tensors"):
        direct_buckets(specs, (0,), (0,), (16, 16))
    hostile = [16] * (1 << 16)
    peak = refusal_peak_bytes(lambda: direct_buckets(specs, (0,), (0,), hostile))
    assert peak < 64 << 10  # no list per storage was made
    assert len(direct_buckets(specs, (0,), (0,), (16,))) == 1


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
tensor_specs = st.lists(st.tuples(st.sampled_from(TESTED_DTYPES), shapes), max_size=12)


@settings(max_examples=300, deadline=None)
@given(tensor_specs, st.integers(1, 8))
def test_plan_invariants(items, bucket_units):
    bucket_bytes = bucket_units * ALIGN
    specs = [TensorSpec(f"t{i}", d, s) for i, (d, s) in enumerate(items)]
    buckets = plan_buckets(specs, bucket_bytes, ALIGN)
    covered = {i: [] for i in range(len(specs))}
    for b in buckets:
        assert b.chunks, "no empty bucket"
        end = 0
        for c in b.chunks:
            assert c.bucket_offset % ALIGN == 0 and c.bucket_offset >= end  # aligned, no overlap
            end = c.bucket_offset + c.nbytes
            assert end <= b.nbytes <= bucket_bytes
            covered[c.index].append(c)
    for i, s in enumerate(specs):
        chunks = covered[i]
        assert [c.src_offset for c in chunks] == [
            sum(c.nbytes for c in chunks[:k]) for k in range(len(chunks))
        ]
        assert sum(c.nbytes for c in chunks) == s.nbytes
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert all(c.nbytes % ALIGN == 0 for c in chunks[:-1])  # cuts fall on whole elements of any dtype


def _roundtrip(named: dict[str, torch.Tensor], bucket_bytes: int, cast: str | None = None, keep=()):
    cfg = SyncConfig(bucket_bytes=bucket_bytes, cast_dtype=cast, keep_dtype=keep)
    sources = select(named.items(), cfg)
    specs = [s.spec for s in sources]
    buckets = plan_buckets(specs, bucket_bytes, ALIGN)
    dest = {
        s.name: torch.full((s.nbytes,), 7, dtype=torch.uint8).view(DTYPES[s.dtype]).reshape(s.shape)
        for s in specs
    }
    loaded: dict[str, torch.Tensor] = {}
    into, by_fn = (
        IntoTensors(specs, dest),
        IntoLoadFn(specs, lambda batch: loaded.update((n, t.clone()) for n, t in batch)),
    )
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)
    for b in buckets:
        buffer.fill_(0xAB)  # stale bytes must never leak into a tensor
        pack_bucket(b, sources, buffer)
        into.write(b, buffer)
        by_fn.write(b, buffer)
    assert into.undelivered() == [] and by_fn.undelivered() == []
    return dest, loaded


@settings(max_examples=150, deadline=None)
@given(tensor_specs, st.integers(1, 6), st.integers(0, 2**31))
def test_pack_unpack_bit_exact(items, bucket_units, seed):
    gen = torch.Generator().manual_seed(seed)
    named = {f"t{i}": random_tensor(DTYPES[d], s, gen) for i, (d, s) in enumerate(items)}
    dest, loaded = _roundtrip(named, bucket_units * ALIGN)
    for name, t in named.items():
        assert same_bits(dest[name], t), name
        assert same_bits(loaded[name], t), name


def test_every_dtype_scalars_empty_and_huge():
    gen = torch.Generator().manual_seed(0)
    named = {}
    for d in DTYPES:
        dtype = DTYPES[d]
        if d == "float4_e2m1fn_x2":
            named[d] = random_tensor(torch.uint8, (33,), gen).view(dtype)
            continue
        named[f"{d}.scalar"] = random_tensor(dtype, (), gen)
        named[f"{d}.empty"] = random_tensor(dtype, (0, 3), gen)
        named[f"{d}.big"] = random_tensor(dtype, (97, 41), gen)  # many times the bucket for wide dtypes
    dest, loaded = _roundtrip(named, 512)
    for name, t in named.items():
        assert same_bits(dest[name], t) and same_bits(loaded[name], t), name


def test_non_contiguous_and_cast_with_keep():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, 48, generator=gen)
    named = {
        "w.t": base.t(),  # non-contiguous, sliced over buckets
        "w.step": base[:, ::3],  # non-contiguous, strided
        "norm.weight": torch.randn(48, generator=gen),
        "ids": torch.arange(10),
    }
    dest, loaded = _roundtrip(named, 1024, cast="bfloat16", keep=("norm.*",))
    assert same_bits(dest["w.t"], base.t().to(torch.bfloat16))
    assert same_bits(dest["w.step"], base[:, ::3].to(torch.bfloat16))
    assert same_bits(loaded["norm.weight"], named["norm.weight"])  # kept fp32
    assert same_bits(dest["ids"], named["ids"])  # integers are never cast


def test_select_filters_and_passes_through():
    params = {"a.weight": torch.ones(4), "a.bias": torch.ones(2), "b.weight": torch.ones(3)}
    cfg = SyncConfig(include=("a.*", "b.weight"), exclude=("*.bias",))
    sources = select(params.items(), cfg)
    assert [s.spec.name for s in sources] == ["a.weight", "b.weight"]
    assert all(s.tensor.data_ptr() == params[s.spec.name].data_ptr() for s in sources)  # no copy made


def test_select_rejects_what_cannot_travel():
    from raysync.core.errors import LayoutError

    with pytest.raises(LayoutError, match="not a torch.Tensor"):
        select([("x", [1, 2])], SyncConfig())
    with pytest.raises(LayoutError, match="layout"):
        select([("s", torch.eye(3).to_sparse())], SyncConfig())


def test_direct_plan_one_bucket_per_storage_and_hostile_offsets_refused():
    from raysync.core.errors import LayoutError
    from raysync.core.plan import direct_buckets

    specs = (
        TensorSpec("a", "bfloat16", (4, 8)),
        TensorSpec("b", "float32", (3,)),
        TensorSpec("e", "int8", (0,)),
        TensorSpec("c", "bfloat16", (2,)),
    )
    buckets = direct_buckets(specs, (0, 1, 1, 0), (0, 4, 999, 64), (128, 16))
    assert [[(c.index, c.bucket_offset, c.nbytes) for c in b.chunks] for b in buckets] == [
        [(0, 0, 64), (2, 0, 0), (3, 64, 4)],  # the empty tensor rides in bucket 0, wherever it claims to be
        [(1, 4, 12)],
    ]
    assert all(c.whole for b in buckets for c in b.chunks)
    for storage, offsets, sizes, why in [
        ((0, 2, 0, 0), (0, 0, 0, 64), (128, 16), "do not fit"),  # no storage 2
        ((0, 1, 0, 0), (0, 8, 0, 64), (128, 16), "do not fit"),  # runs past the end of storage 1
        ((0, 1, 0, 0), (0, 2, 0, 64), (128, 16), "itemsize"),  # half a float32
        ((0, 1, 0), (0, 4, 0), (128, 16), "for 4 tensors"),
    ]:
        with pytest.raises(LayoutError, match=why):
            direct_buckets(specs, storage, offsets, sizes)
    assert direct_buckets(specs[2:3], (0,), (0,), ()) == [direct_buckets(specs[2:3], (0,), (0,), (0,))[0]]


def test_direct_mode_is_a_mode_of_cuda_ipc_only():
    from raysync.transport import registry

    assert registry.ring_name("cuda_ipc", True) == "cuda_ipc_direct"
    assert registry.ring_name("shm", True) == "shm" and registry.ring_name("cuda_ipc", False) == "cuda_ipc"
    assert "cuda_ipc_direct" not in registry.names()  # never planned for a pair by itself


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["uint8", "bfloat16", "float32", "float64"]), st.integers(0, 40)),
        max_size=8,
    ),
    st.lists(st.integers(0, 400), max_size=4),
    st.data(),
)
def test_direct_plan_from_hostile_values_is_in_bounds_or_refused(items, storage_bytes, data):
    """DirectSources come off the wire: whatever they say, a plan either fits the storages or is refused."""
    from raysync.core.errors import LayoutError
    from raysync.core.plan import direct_buckets

    specs = tuple(TensorSpec(f"t{i}", dtype, (n,)) for i, (dtype, n) in enumerate(items))
    storage = data.draw(st.lists(st.integers(0, 5), min_size=len(specs), max_size=len(specs)))
    offsets = data.draw(st.lists(st.integers(0, 500), min_size=len(specs), max_size=len(specs)))
    try:
        buckets = direct_buckets(specs, storage, offsets, storage_bytes)
    except LayoutError:
        return
    assert len(buckets) == max(1, len(storage_bytes))
    seen = sorted(c.index for b in buckets for c in b.chunks)
    assert seen == list(range(len(specs)))  # every tensor once
    for b in buckets:
        for c in b.chunks:
            assert c.nbytes == specs[c.index].nbytes and c.bucket_offset % specs[c.index].itemsize == 0
            assert c.nbytes == 0 or c.bucket_offset + c.nbytes <= storage_bytes[b.index]
