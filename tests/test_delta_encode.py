"""The sender's half of the delta encoding (raysync.core.delta_encode, Note [where a delta is encoded]): what
encode refuses before writing; an encoding staged on the chunks' device and copied out writes the bytes an
in-place one writes; on a GPU, round trips through a GPU buffer and through host memory (shm's case), the
latter in several copy runs on the side stream."""

from __future__ import annotations

import pytest
import torch
from conftest import random_tensor, same_bits
from test_delta import BF16, F16, F32, changed_copy, random_mask

from raysync.core import delta
from raysync.core.delta import GAP_SPAN, Mode
from raysync.core.delta_encode import encode
from raysync.core.delta_workspace import COPY_RUN_BYTES, Workspace
from raysync.core.errors import LayoutError


# --- what encode refuses --------------------------------------------------------------------------------------------
def test_encode_refuses_a_buffer_too_small_and_writes_nothing():
    old = random_tensor(torch.bfloat16, (1000,), torch.Generator().manual_seed(14))
    out = torch.zeros(delta.capacity([(1000, 2)]) - 16, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="capacity"):
        encode([(None, old)], out, base_version=None)
    assert not out.any()


@pytest.mark.parametrize(
    "pair, out_offset, match",
    [
        ((torch.zeros(8, dtype=BF16), torch.zeros(8, dtype=F16)), 0, "dtype, size and device"),
        ((torch.zeros(8), torch.zeros(9)), 0, "dtype, size and device"),
        ((torch.zeros(8, 2)[:, 0], torch.zeros(8)), 0, "not a contiguous tensor"),
        ((torch.zeros(8), torch.zeros(8)), 8, "multiple of 16"),
    ],
)
def test_encode_refuses_what_it_cannot_encode(pair, out_offset, match):
    out = torch.zeros(4096, dtype=torch.uint8)[out_offset:]
    with pytest.raises(LayoutError, match=match):
        encode([pair], out, base_version=1)


@pytest.mark.parametrize("base", [-1, -7, 1 << 63, True])
def test_encode_refuses_a_base_version_its_header_cannot_hold(base):
    """The header stores the base version in an int64 and -1 as "none": a base of -1 would decode as a bucket
    without a base (refused by every receiver), one of 2**63 does not fit."""
    out = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="base_version"):
        encode([(torch.zeros(8), torch.ones(8))], out, base_version=base)
    assert not out.any()


# --- encoded on the chunks' device, then copied (Note [where a delta is encoded]) -------------------------------------
def defined_bytes(code: delta.BucketCode) -> list[tuple[int, int]]:
    """The [start, end) ranges of an encoding that encode writes: header and table, gaps, values, FULL bytes."""
    ranges = [(0, delta.HEADER_BYTES + delta.ROW_BYTES * len(code.chunks))]
    offset = delta._align(ranges[0][1])
    for c in code.chunks:
        if c.mode == Mode.GAPS:
            ranges.append((offset, offset + 2 * c.entries))
            values = offset + delta._align(2 * c.entries)
            ranges.append((values, values + c.entries * c.itemsize))
        elif c.mode == Mode.FULL:
            ranges.append((offset, offset + c.full_bytes))
        offset = delta._align(offset + c.payload_bytes)
    return ranges


@pytest.mark.parametrize("density", [0.0, 0.036, 0.6])
def test_a_staged_encoding_writes_the_same_bytes_and_reuses_its_workspace(density):
    """What a GPU trainer over a host ring does (encode into the workspace, copy the bytes used), run on the
    CPU: the same bytes as encoding in place, every mode, and the workspace's tensors kept for the next call."""
    gen = torch.Generator().manual_seed(17)
    olds = [random_tensor(d, (n,), gen) for d, n in [(BF16, 3 * GAP_SPAN + 5), (F32, 999), (BF16, 64)]]
    news = [changed_copy(o, random_mask(o.numel(), density, 18 + i)) for i, o in enumerate(olds)]
    news[2] = olds[2].clone()  # a SAME chunk
    pairs = list(zip(olds, news, strict=True))
    size = delta.capacity([(n.numel(), n.element_size()) for n in news])
    space = Workspace.for_buckets([[(n.numel(), n.element_size()) for n in news]], torch.device("cpu"))
    direct, staged = torch.zeros(size, dtype=torch.uint8), torch.full((size,), 0xCD, dtype=torch.uint8)
    code = encode(pairs, direct, base_version=3, space=space)
    mask, again = space.mask, encode(pairs, staged, base_version=3, space=space, staged=True)
    assert again == code and space.mask is mask and space.buffers[0] is not None
    for start, end in defined_bytes(code):  # padding is left as it was, in either buffer
        assert torch.equal(staged[start:end], direct[start:end]), (start, end)
    assert bool((staged[code.nbytes :] == 0xCD).all())  # nothing past the bytes used
    engine = [o.clone() for o in olds]
    delta.decode(staged, engine, held_version=3)
    assert all(same_bits(e, n) for e, n in zip(engine, news, strict=True))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize("density", [0.0, 0.0004, 0.036, 0.6])
def test_listing_without_counting_writes_what_counting_writes(device, density):
    """A bucket expected sparse (``sparse=True``, Note [listing instead of counting]) is listed without a count
    first: the same table and the same bytes as counting, every mode (GAPS, FULL by size, SAME, a chunk without
    a reference), the forced entries of long runs included, and the receiver ends bit-exact."""
    gen = torch.Generator().manual_seed(21)
    olds = [
        random_tensor(d, (n,), gen) for d, n in [(BF16, 4 * GAP_SPAN + 9), (F32, 999), (BF16, 64), (F16, 300)]
    ]
    news = [changed_copy(o, random_mask(o.numel(), density, 22 + i)) for i, o in enumerate(olds)]
    news[2] = olds[2].clone()  # a SAME chunk
    olds, news = [o.to(device) for o in olds], [n.to(device) for n in news]
    pairs = [(o, n) for o, n in zip(olds, news, strict=True)]
    pairs[1] = (None, news[1])  # no reference: FULL "base", between chunks that have one
    chunks = [(n.numel(), n.element_size()) for n in news]
    space = Workspace.for_buckets([chunks], torch.device(device))
    counted = torch.zeros(delta.capacity(chunks), dtype=torch.uint8, device=device)
    listed = torch.full_like(counted, 0xCD)
    code = encode(pairs, counted, base_version=5, space=space)
    again = encode(pairs, listed, base_version=5, space=space, sparse=True)
    assert again == code
    assert code.chunks[0].mode == (Mode.SAME if density == 0 else Mode.GAPS if density < 0.5 else Mode.FULL)
    for start, end in defined_bytes(code):
        assert torch.equal(listed[start:end], counted[start:end]), (start, end)
    engine = [o.clone() for o in olds]
    delta.decode(listed, engine, held_version=5)
    assert all(same_bits(e, n) for e, n in zip(engine, news, strict=True))


# --- on a GPU -------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("buffer_device", ["cuda", "cpu"])  # a GPU ring, or a host ring (shm) for GPU tensors
def test_a_gpu_round_trip_is_bit_exact(buffer_device):
    gen = torch.Generator().manual_seed(15)
    olds = [random_tensor(d, (n,), gen).cuda() for d, n in [(BF16, 3 * GAP_SPAN + 1), (F32, 4097)]]
    news = [changed_copy(o.cpu(), random_mask(o.numel(), 0.036, 16)).cuda() for o in olds]
    out = torch.zeros(
        delta.capacity([(n.numel(), n.element_size()) for n in news]), dtype=torch.uint8, device=buffer_device
    )
    code = encode(list(zip(olds, news, strict=True)), out, base_version=2)
    assert [c.mode for c in code.chunks] == [Mode.GAPS, Mode.GAPS]
    engine = [o.clone() for o in olds]
    delta.decode(out, engine, held_version=2)
    assert all(same_bits(e, n) for e, n in zip(engine, news, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_encoding_into_host_memory_crosses_in_runs_and_is_bit_exact():
    """GPU chunks, a pinned host buffer (a GPU trainer over shm): payloads of several copy runs (a FULL chunk
    of 12 MiB, GAPS and FULL chunks around it) cross on the side stream while the others are compacted."""
    gen = torch.Generator().manual_seed(19)
    sizes = [(BF16, 2 * GAP_SPAN + 3, 0.05), (BF16, 6 << 20, 0.6), (F32, 3 << 20, 0.02), (BF16, 777, 0.7)]
    olds = [random_tensor(d, (n,), gen).cuda() for d, n, _ in sizes]
    news = [
        changed_copy(o.cpu(), random_mask(o.numel(), p, 20 + i)).cuda()
        for i, (o, (_, _, p)) in enumerate(zip(olds, sizes, strict=True))
    ]
    chunks = [(n.numel(), n.element_size()) for n in news]
    out = torch.zeros(delta.capacity(chunks), dtype=torch.uint8, pin_memory=True)
    space = Workspace.for_buckets([chunks], torch.device("cuda"))
    code = encode(list(zip(olds, news, strict=True)), out, base_version=4, space=space)
    assert [c.mode for c in code.chunks] == [Mode.GAPS, Mode.FULL, Mode.GAPS, Mode.FULL]
    assert code.nbytes > 2 * COPY_RUN_BYTES and space.stream is not None
    engine = [o.clone() for o in olds]
    delta.decode(out, engine, held_version=4)
    assert all(same_bits(e, n) for e, n in zip(engine, news, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_encoding_that_fails_part_way_leaves_no_copy_in_flight(monkeypatch):
    """Unverified here (no GPU was lent): a staged encoding into host memory that raises after its first
    copy run was queued on the side stream waits for that run before it raises, so nothing writes into the
    ring buffer, or reads the workspace the next bucket reuses, after encode returned."""
    from raysync.core import delta_encode

    gen = torch.Generator().manual_seed(23)
    olds = [random_tensor(BF16, (6 << 20,), gen).cuda(), random_tensor(BF16, (4096,), gen).cuda()]
    news = [changed_copy(o.cpu(), random_mask(o.numel(), 0.6, 24 + i)).cuda() for i, o in enumerate(olds)]
    chunks = [(n.numel(), n.element_size()) for n in news]
    out = torch.zeros(delta.capacity(chunks), dtype=torch.uint8, pin_memory=True)
    space = Workspace.for_buckets([chunks], torch.device("cuda"))
    write, calls = delta_encode._write_payload, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:  # the first chunk (12 MiB, FULL) is written and its copy run queued
            raise RuntimeError("injected")
        torch.cuda._sleep(1 << 28)  # the run waits for the current stream: it is still queued at the raise
        write(*args)

    monkeypatch.setattr(delta_encode, "_write_payload", failing)
    with pytest.raises(RuntimeError, match="injected"):
        encode(list(zip(olds, news, strict=True)), out, base_version=5, space=space)
    assert space.stream is not None and space.stream.query()  # the run finished before encode raised


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_buckets_encoded_one_after_another_through_one_workspace_keep_their_bytes():
    """Unverified here (no GPU was lent): two buckets staged through the same workspace into two pinned host
    buffers (a GPU trainer over a ring of two shm slots): the second bucket's compaction reuses the staging
    buffer on the current stream, so the first one's copy runs must be done when its encode returns; both
    decode bit-exact afterwards."""
    gen = torch.Generator().manual_seed(27)
    buckets = []
    for b in range(2):
        olds = [random_tensor(BF16, (5 << 20,), gen).cuda(), random_tensor(F32, (2 * GAP_SPAN,), gen).cuda()]
        masks = [
            random_mask(o.numel(), p, 28 + 2 * b + i)
            for i, (o, p) in enumerate(zip(olds, [0.6, 0.05], strict=True))
        ]
        buckets.append((olds, [changed_copy(o.cpu(), m).cuda() for o, m in zip(olds, masks, strict=True)]))
    chunks = [(n.numel(), n.element_size()) for n in buckets[0][1]]
    space = Workspace.for_buckets([chunks], torch.device("cuda"))
    outs = [torch.zeros(delta.capacity(chunks), dtype=torch.uint8, pin_memory=True) for _ in buckets]
    for (olds, news), out in zip(buckets, outs, strict=True):
        encode(list(zip(olds, news, strict=True)), out, base_version=7, space=space)
    for (olds, news), out in zip(buckets, outs, strict=True):
        engine = [o.cpu() for o in olds]
        delta.decode(out, engine, held_version=7)
        assert all(same_bits(e, n.cpu()) for e, n in zip(engine, news, strict=True))
