"""Delta encoding (raysync.core.delta, Note [delta pushes]): decode(encode(old, new)) applied to old gives new,
bit for bit, for every change pattern; the encoded size stays within its bound; the density rule picks FULL
where a delta would not be smaller; a delta applies only on top of the version it was computed from; and a
hostile bucket is refused before any byte of it is written."""

from __future__ import annotations

import pytest
import torch
from conftest import random_tensor, same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from raysync.core import delta
from raysync.core.delta import GAP_SPAN, Mode
from raysync.core.delta_changes import SPARSE_DENSITY, list_changes
from raysync.core.delta_encode import Workspace, encode, find_changes
from raysync.core.errors import BadDelta, BaseMismatch, LayoutError
from raysync.core.version import MIXED

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [BF16, F16, F32, torch.float8_e4m3fn, torch.float64]  # words of 2, 4, 1 and 8 bytes


def changed_copy(old: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``old`` with the bits of the elements at ``where`` (a bool mask or indices) changed (a random xor, never 0)."""
    bits = old.clone().reshape(-1).view(delta._BITS[old.element_size()])
    index = where.nonzero().view(-1) if where.dtype == torch.bool else where
    flips = torch.randint(1, 1 << min(8 * old.element_size() - 1, 62), (index.numel(),), dtype=torch.int64)
    bits[index] ^= flips.to(bits.dtype)
    return bits.view(old.dtype).reshape(old.shape)


def random_mask(numel: int, density: float, seed: int) -> torch.Tensor:
    return torch.rand(numel, generator=torch.Generator().manual_seed(seed)) < density


def push(
    pairs: list[tuple[torch.Tensor | None, torch.Tensor]], base: int | None = 7, **kw: float
) -> tuple[delta.BucketCode, torch.Tensor]:
    """Encode ``pairs`` into a buffer of exactly ``capacity`` bytes; the code and the buffer."""
    out = torch.full(
        (delta.capacity([(n.numel(), n.element_size()) for _, n in pairs]),), 0xAB, dtype=torch.uint8
    )
    return encode(pairs, out, base_version=base, **kw), out


def round_trip(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], base: int | None = 7, **kw: float
) -> delta.BucketCode:
    """Encode, decode into copies of the references, check every copy is bit-exactly the new values; the
    encoder's own copies of the references, advanced by the encoding (``advance``), are too."""
    refs = [old.clone() for old, _ in pairs]
    code, out = push(
        [(ref, new) for ref, (_, new) in zip(refs, pairs, strict=True)], base, advance=True, **kw
    )
    dests = [old.clone() for old, _ in pairs]
    received = delta.decode(out, dests, held_version=base)
    for dest, ref, (_, new) in zip(dests, refs, pairs, strict=True):
        assert same_bits(dest, new) and same_bits(ref, new)
    assert [c.mode for c in received.chunks] == [c.mode for c in code.chunks]
    assert received.nbytes == code.nbytes
    return code


# --- bit-exact round trips, table ---------------------------------------------------------------------------------
PATTERNS = ["none", "all", "first", "last", "middle", "0.5%", "3.6%", "9%", "30%"]


def pattern_mask(pattern: str, numel: int) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool)
    if pattern == "all":
        mask[:] = True
    elif pattern in ("first", "last", "middle") and numel:
        mask[{"first": 0, "last": numel - 1, "middle": numel // 2}[pattern]] = True
    elif pattern.endswith("%"):
        mask = random_mask(numel, float(pattern[:-1]) / 100, seed=numel)
    return mask


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, GAP_SPAN - 1, GAP_SPAN, GAP_SPAN + 1, 3 * GAP_SPAN + 5])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_round_trip_is_bit_exact_for_every_change_pattern(dtype, numel, pattern):
    old = random_tensor(dtype, (numel,), torch.Generator().manual_seed(numel))
    mask = pattern_mask(pattern, numel)
    new = changed_copy(old, mask)
    (chunk,) = round_trip([(old, new)]).chunks
    assert chunk.changed == int(mask.sum())
    assert chunk.payload_bytes <= chunk.full_bytes
    if chunk.changed == 0:
        assert chunk.mode == Mode.SAME and chunk.payload_bytes == 0


def test_bits_are_compared_not_values():
    """-0.0 against 0.0, NaNs with other payloads, a flipped sign: changes, and they arrive bit-exactly."""
    specials = [0.0, float("nan"), 1.0, float("inf"), 2.5, -0.0]
    for dtype, bits in [(BF16, torch.int16), (F16, torch.int16), (F32, torch.int32)]:
        old = torch.tensor(specials * 20000, dtype=dtype)
        new = old.clone()
        new[0] = -0.0  # 0.0 -> -0.0: equal as values
        new.view(bits)[1] ^= 1  # another NaN payload: unequal to everything, itself included
        new[2] = -1.0
        new.view(bits)[5 + 6 * 9000] ^= 1 << (8 * old.element_size() - 1)  # -0.0 -> 0.0
        (chunk,) = round_trip([(old, new)]).chunks
        assert chunk.mode == Mode.GAPS and chunk.changed == 4
        (same,) = round_trip([(old, old.clone())]).chunks  # NaN != NaN as values; the same bits: unchanged
        assert same.mode == Mode.SAME and same.changed == 0


def test_no_gap_is_longer_than_the_16_bit_field():
    """One change at each end of 3 * 65536 + 5 elements: the entries are the two changes and one unchanged
    element every 65536 (Note [delta pushes]), and both changes land."""
    old = random_tensor(torch.bfloat16, (3 * GAP_SPAN + 5,), torch.Generator().manual_seed(1))
    new = changed_copy(old, torch.tensor([0, old.numel() - 1]))
    (chunk,) = round_trip([(old, new)]).chunks
    assert (chunk.mode, chunk.changed, chunk.entries) == (Mode.GAPS, 2, 2 + 3)


def test_several_chunks_of_mixed_dtypes_in_one_bucket():
    gen = torch.Generator().manual_seed(2)
    olds = [random_tensor(d, (n,), gen) for d, n in [(BF16, 5000), (F32, 33), (F16, 0)]]
    news = [
        changed_copy(olds[0], random_mask(5000, 0.02, 3)),
        changed_copy(olds[1], torch.ones(33, dtype=torch.bool)),
        olds[2].clone(),
    ]
    code = round_trip(list(zip(olds, news, strict=True)))
    assert [c.mode for c in code.chunks] == [Mode.GAPS, Mode.FULL, Mode.SAME]
    assert code.sent_as_full == 33 * 4 and code.sent_as_delta == code.nbytes - 33 * 4
    assert code.changed == int(random_mask(5000, 0.02, 3).sum()) + 33 + 0
    assert code.density == code.changed / (5000 + 33) and code.full_bytes == 5000 * 2 + 33 * 4


def test_changes_found_ahead_encode_as_those_found_by_encode_and_another_base_is_refused():
    """``find_changes`` made ahead of ``encode`` (Note [the next bucket's compare overlaps this one's copy])
    gives the same bytes as encode's own compare, and the reference advances alike; changes found for a full
    bucket do not encode as a delta."""
    gen = torch.Generator().manual_seed(4)
    olds = [random_tensor(d, (n,), gen) for d, n in [(BF16, 70000), (F32, 33), (BF16, 900)]]
    news = [
        changed_copy(o, random_mask(o.numel(), p, 5)) for o, p in zip(olds, (0.03, 1.0, 0.0), strict=True)
    ]
    sizes = [[(n.numel(), n.element_size()) for n in news]]
    codes, outs, refs = [], [], []
    for ahead in (False, True):
        ref = [o.clone() for o in olds]
        space = Workspace.for_buckets(sizes, torch.device("cpu"))
        pairs = list(zip(ref, news, strict=True))
        changes = find_changes(pairs, based=True, space=space) if ahead else None
        code, out = push(pairs, 7, space=space, advance=True, changes=changes)
        codes.append(code)
        outs.append(out[: code.nbytes])
        refs.append(ref)
    assert [c.mode for c in codes[1].chunks] == [Mode.GAPS, Mode.FULL, Mode.SAME]
    assert codes[0] == codes[1] and torch.equal(outs[0], outs[1])
    assert all(same_bits(a, b) for a, b in zip(*refs, strict=True))
    full = find_changes(list(zip(olds, news, strict=True)), based=False)
    with pytest.raises(LayoutError, match="another base"):
        push(list(zip(olds, news, strict=True)), 7, changes=full)


@pytest.mark.parametrize("density", [0.0, 0.03, 0.2, 0.6])
def test_a_bucket_listed_at_once_gives_each_chunk_what_listing_it_alone_gives(density):
    """list_changes (Note [a listing's work by the bucket]) against each chunk listed on its own: the counts,
    the indices within the chunk and their int16 gaps, with the forced entries (index 65535 mod 65536) set;
    a span denser than the listing's cap is counted instead (no listings)."""
    sizes = [5, 0, 70000, 65536, 200000, 131071, 1]
    span = random_mask(sum(sizes), density, 6)
    expected, start = [], 0
    for n in sizes:
        mask = span[start : start + n].clone()
        changed = int(mask.sum())
        strided = mask[GAP_SPAN - 1 :: GAP_SPAN]
        forced = int((~strided).sum())
        strided.fill_(True)
        index = mask.nonzero().view(-1)
        gaps = (torch.diff(index, prepend=index.new_full((1,), -1)) - 1 - 32768).to(torch.int16)
        expected.append(((changed, forced), index, gaps))
        start += n
    masks, start = [], 0
    for n in sizes:
        masks.append(span[start : start + n])
        start += n
    cache = {}
    counts, listed, gaps = list_changes([None, *masks], span, cache)
    assert counts[0] is None and listed[0] is None and list(cache) == [tuple(sizes)]
    assert counts[1:] == [c for c, _, _ in expected]
    if density > 2 * SPARSE_DENSITY:
        assert listed == [None] * (len(sizes) + 1) and gaps == listed
        return
    for (_, index, gap), got_index, got_gaps in zip(expected, listed[1:], gaps[1:], strict=True):
        assert torch.equal(got_index, index) and torch.equal(got_gaps, gap)


def test_a_bucket_listed_at_once_round_trips_bit_exactly():
    """A bucket encoded from list_changes' listing (the GPU's way for a bucket sparse at its last push, made
    here on the CPU) decodes bit-exactly, and the reference advances to the new values."""
    from raysync.core.delta import _bits
    from raysync.core.delta_changes import compare
    from raysync.core.delta_encode import Changes

    gen = torch.Generator().manual_seed(8)
    olds = [random_tensor(d, (n,), gen) for d, n in [(BF16, 140000), (F32, 70000), (BF16, 3), (F16, 65536)]]
    news = [
        changed_copy(o, random_mask(o.numel(), p, 9))
        for o, p in zip(olds, (0.02, 0.05, 0.0, 0.9), strict=True)
    ]
    refs = [o.clone() for o in olds]
    cpu = torch.device("cpu")
    space = Workspace.for_buckets([[(n.numel(), n.element_size()) for n in news]], cpu)
    views = [(_bits(r, "reference"), _bits(n, "new")) for r, n in zip(refs, news, strict=True)]
    masks, span = compare(views, True, space, cpu)
    counts, listed, gaps = list_changes(masks, span, space.spans)
    assert all(index is not None for index in listed)
    changes = Changes(views, cpu, True, masks, counts, listed, gaps)
    code, out = push(list(zip(refs, news, strict=True)), 7, space=space, advance=True, changes=changes)
    assert [c.mode for c in code.chunks] == [Mode.GAPS, Mode.GAPS, Mode.SAME, Mode.FULL]
    dests = [o.clone() for o in olds]
    delta.decode(out, dests, held_version=7)
    assert all(same_bits(d, n) and same_bits(r, n) for d, r, n in zip(dests, refs, news, strict=True))


def test_decode_writes_in_place_into_slices_of_a_larger_tensor():
    gen = torch.Generator().manual_seed(4)
    whole_old = random_tensor(torch.bfloat16, (10, 4099), gen)
    whole_new = changed_copy(whole_old, random_mask(whole_old.numel(), 0.04, 5)).reshape(10, 4099)
    flat_old, flat_new = whole_old.view(-1), whole_new.view(-1)
    cuts = [(7, 12000), (12000, 12001), (20001, 40990)]  # element ranges, at odd offsets too
    code, out = push([(flat_old[a:b], flat_new[a:b]) for a, b in cuts])
    engine = whole_old.clone()
    delta.decode(out, [engine.view(-1)[a:b] for a, b in cuts], held_version=7)
    expected = whole_old.clone().view(-1)
    for a, b in cuts:
        expected[a:b] = flat_new[a:b]
    assert same_bits(engine.view(-1), expected)  # the slices changed, nothing around them


# --- bit-exact round trips, properties ----------------------------------------------------------------------------
def masks() -> st.SearchStrategy:
    return st.one_of(
        st.just(("none", 0.0)),
        st.just(("all", 1.0)),
        st.just(("single", 0.0)),
        st.tuples(st.just("density"), st.floats(0.0, 1.0)),
    )


@settings(max_examples=150, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.integers(0, 3 * GAP_SPAN), st.integers(0, 64), masks()),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**31),
    max_density=st.sampled_from([1.0, 0.05]),
)
def test_any_bucket_round_trips_bit_exactly_within_its_size_bound(chunks, seed, max_density):
    gen = torch.Generator().manual_seed(seed)
    pairs, counts = [], []
    for dtype, numel, lead, (kind, density) in chunks:
        storage = random_tensor(dtype, (lead + numel + 3,), gen)  # a slice of a larger tensor, odd sizes
        old = storage[lead : lead + numel]
        mask = (
            torch.zeros(numel, dtype=torch.bool) if kind != "density" else random_mask(numel, density, seed)
        )
        if kind == "all":
            mask[:] = True
        elif kind == "single" and numel:
            mask[seed % numel] = True
        pairs.append((old, changed_copy(old, mask)))
        counts.append(int(mask.sum()))
    code = round_trip(pairs, max_density=max_density)
    assert code.nbytes <= delta.capacity([(n.numel(), n.element_size()) for _, n in pairs])
    for c, changed in zip(code.chunks, counts, strict=True):
        assert c.changed == changed
        assert c.payload_bytes <= c.full_bytes
        if c.mode == Mode.GAPS:  # the size bound: the changes and one entry per 65536 elements
            assert changed <= c.entries <= changed + c.numel // GAP_SPAN
            assert changed <= max_density * c.numel
            assert c.payload_bytes == delta.gaps_bytes(c.entries, c.itemsize) < c.full_bytes


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), steps=st.integers(1, 4), density=st.floats(0.0, 0.2))
def test_the_sender_reference_and_the_receiver_stay_equal_over_consecutive_pushes(seed, steps, density):
    """A full push (no base), then deltas: the sender applies each code to its reference as the receiver
    does to its weights, and both hold each version's bits; re-encoding an applied version sends nothing."""
    gen = torch.Generator().manual_seed(seed)
    trainer = random_tensor(torch.bfloat16, (70001,), gen)
    reference, engine = torch.empty_like(trainer), torch.empty_like(trainer)
    code, out = push([(None, trainer)], base=None)
    assert code.chunks[0].mode == Mode.FULL
    for dest in (reference, engine):  # version 0, from nothing
        delta.decode(out, [dest], held_version=None)
    for version in range(1, steps + 1):
        trainer = changed_copy(trainer, random_mask(trainer.numel(), density, seed + version))
        code, out = push([(reference, trainer)], base=version - 1)
        for dest in (reference, engine):
            delta.decode(out, [dest], held_version=version - 1)
        assert same_bits(reference, trainer) and same_bits(engine, trainer)
        (again,) = push([(reference, trainer)], base=version)[0].chunks
        assert again.mode == Mode.SAME


def test_a_reference_advanced_by_the_encoding_holds_what_the_receiver_holds_when_the_tensor_changes_midway():
    """Note [the reference advances by the encoding]: the new tensor changes between the compare and the
    compaction (as a trainer's tensor read in place may). An element that changed after the compare is neither
    sent nor taken; one in the mask is sent and taken with its later value; the reference is bit for bit what
    the receiver decodes, and the next push sends what the receiver missed."""
    gen = torch.Generator().manual_seed(21)
    old = random_tensor(torch.bfloat16, (200_000,), gen)
    new = old.clone()
    new.view(torch.int16)[::100] ^= 1  # 1% of the elements change a bit

    def change_after_the_compare(stage: str) -> None:
        if stage == "compare":  # 5: not in the mask; 100: in it
            new.view(torch.int16)[[5, 100]] ^= 2

    ref, engine = old.clone(), old.clone()
    _, out = push([(ref, new)], base=1, advance=True, mark=change_after_the_compare)
    delta.decode(out, [engine], held_version=1)
    assert same_bits(ref, engine)  # the sender's reference is what the receiver holds
    assert not same_bits(ref[5:6], new[5:6]) and same_bits(ref[5:6], old[5:6])  # 5: neither sent nor taken
    assert same_bits(ref[100:101], new[100:101])  # sent and taken with its later value
    _, out = push([(ref, new)], base=2, advance=True)  # the next push
    delta.decode(out, [engine], held_version=2)
    assert same_bits(engine, new) and same_bits(ref, new)


# --- the density rule ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, density, max_density, mode",
    [
        (torch.bfloat16, 0.03, 1.0, Mode.GAPS),
        (torch.bfloat16, 0.45, 1.0, Mode.GAPS),  # 4 bytes per change: 90% of the full bytes
        (torch.bfloat16, 0.55, 1.0, Mode.FULL),  # 110%: the full bytes are smaller
        (torch.float32, 0.60, 1.0, Mode.GAPS),  # 6 bytes per change of 4: 90%
        (torch.float32, 0.70, 1.0, Mode.FULL),
        (torch.bfloat16, 0.03, 0.05, Mode.GAPS),
        (
            torch.bfloat16,
            0.08,
            0.05,
            Mode.FULL,
        ),  # smaller as a delta, but denser than the caller's break-even
    ],
)
def test_the_density_rule_sends_full_where_a_delta_does_not_pay(dtype, density, max_density, mode):
    numel = 100_000
    old = random_tensor(dtype, (numel,), torch.Generator().manual_seed(6))
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[torch.randperm(numel, generator=torch.Generator().manual_seed(7))[: int(density * numel)]] = True
    (chunk,) = round_trip([(old, changed_copy(old, mask))], max_density=max_density).chunks
    assert chunk.mode == mode and chunk.changed == int(density * numel)
    gaps = delta.gaps_bytes(chunk.entries, chunk.itemsize)
    assert chunk.payload_bytes == (chunk.full_bytes if mode == Mode.FULL else gaps)


# --- versions: a delta applies on top of exactly its base ---------------------------------------------------------
@pytest.mark.parametrize(
    "held, base, applies",
    [
        (3, 3, True),
        (4, 3, False),
        (None, 3, False),
        (MIXED, 3, False),
        (3, None, False),
        (MIXED, MIXED, False),
        (None, None, False),
        (True, 1, False),
        (0, 0, True),
    ],
)
def test_a_delta_applies_only_on_top_of_the_version_it_was_computed_from(held, base, applies):
    assert delta.delta_applies(held, base) is applies
    if applies:
        delta.check_base(held, base)
    else:
        with pytest.raises(BaseMismatch, match="needs a full push"):
            delta.check_base(held, base)


@pytest.mark.parametrize("held", [6, None, MIXED])
def test_decode_refuses_a_delta_from_another_version_and_writes_nothing(held):
    old = random_tensor(torch.float32, (1000,), torch.Generator().manual_seed(8))
    new = changed_copy(old, random_mask(1000, 0.01, 9))
    _, out = push([(old, new)], base=7)
    engine = old.clone()
    with pytest.raises(BaseMismatch):
        delta.decode(out, [engine], held_version=held)
    assert same_bits(engine, old)


def test_a_full_bucket_applies_whatever_version_the_receiver_holds():
    old = random_tensor(torch.bfloat16, (999,), torch.Generator().manual_seed(10))
    new = changed_copy(old, random_mask(999, 0.5, 11))
    code, out = push([(old, new)], base=None)
    assert code.chunks[0].mode == Mode.FULL and code.base_version is None
    for held in [None, MIXED, 3]:
        engine = torch.zeros_like(old)
        delta.decode(out, [engine], held_version=held)
        assert same_bits(engine, new)


# --- hostile buckets: refused before anything is written ----------------------------------------------------------
def hostile_bucket() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A valid bucket of two chunks (FULL, then GAPS), the engine's tensors, and the buffer to corrupt."""
    gen = torch.Generator().manual_seed(12)
    olds = [random_tensor(torch.float32, (64,), gen), random_tensor(torch.bfloat16, (3 * GAP_SPAN,), gen)]
    news = [
        changed_copy(olds[0], torch.ones(64, dtype=torch.bool)),
        changed_copy(olds[1], random_mask(3 * GAP_SPAN, 0.01, 13)),
    ]
    code, out = push(list(zip(olds, news, strict=True)))
    assert [c.mode for c in code.chunks] == [Mode.FULL, Mode.GAPS]
    return olds, [o.clone() for o in olds], out


def word(out: torch.Tensor, index: int) -> torch.Tensor:
    """The 64-bit word ``index`` of the header (0-3) and table (4 per chunk), as a writable view."""
    return out[: 8 * (index + 1)].view(torch.int64)[index:]


def gaps_of_chunk_1(out: torch.Tensor) -> torch.Tensor:
    start = delta._align(delta.HEADER_BYTES + 2 * delta.ROW_BYTES) + delta._align(64 * 4)
    return out[start : start + 2 * int(word(out, 11))].view(torch.int16)


HOSTILE = {
    "an index past the end": lambda out: gaps_of_chunk_1(out).fill_(32767),  # every gap 65536
    "one more entry than the bytes used hold": lambda out: word(out, 11).add_(1),
    "one entry fewer than the bytes used hold": lambda out: word(out, 11).sub_(1),
    "more entries than elements": lambda out: word(out, 11).fill_(3 * GAP_SPAN + 1),
    "a GAPS chunk with no entries": lambda out: word(out, 11).fill_(0),
    "entries for a FULL chunk": lambda out: word(out, 7).fill_(1),
    "a count of elements not the destination's": lambda out: word(out, 9).sub_(1),
    "an itemsize not the destination's": lambda out: word(out, 10).fill_(4),
    "an unknown mode": lambda out: word(out, 8).fill_(7),
    "another chunk count": lambda out: word(out, 2).fill_(3),
    "more bytes used than the buffer has": lambda out: word(out, 3).add_(out.numel()),
    "a negative size": lambda out: word(out, 3).fill_(-16),
    "not a delta bucket": lambda out: word(out, 0).fill_(0),
    "a delta without a base version": lambda out: word(out, 1).fill_(-1),
}


@pytest.mark.parametrize("corruption", HOSTILE, ids=list(HOSTILE))
def test_a_hostile_bucket_is_refused_before_anything_is_written(corruption):
    olds, engine, out = hostile_bucket()
    HOSTILE[corruption](out)
    with pytest.raises(BadDelta):
        delta.decode(out, engine, held_version=7)
    for dest, old in zip(engine, olds, strict=True):  # not even the valid FULL chunk ahead of the bad one
        assert same_bits(dest, old)


def test_a_buffer_shorter_than_its_table_is_refused():
    _, engine, out = hostile_bucket()
    with pytest.raises(BadDelta, match="cannot hold the table"):
        delta.decode(out[:48], engine, held_version=7)


def test_any_gap_bytes_write_distinct_elements_or_are_refused():
    """Duplicates cannot be written down: whatever the gap bytes say, the indices increase strictly, so a
    delta writes each of its entries into an element of its own, or is refused whole."""
    for seed in range(12):
        _, engine, out = hostile_bucket()
        gaps, entries = gaps_of_chunk_1(out), int(word(out, 11))
        used = int(word(out, 3))  # the last chunk's values end the bytes used
        values = set(out[used - 2 * entries : used].view(torch.int16).tolist())
        marker = next(m for m in range(1 << 15) if m not in values)  # bits that no entry writes
        top = 1 << 15 if seed % 2 else 16 - (1 << 15)  # odd: any gaps (too long); even: gaps of 1 to 16
        gen = torch.Generator().manual_seed(seed)
        gaps.copy_(torch.randint(-(1 << 15), top, gaps.shape, dtype=torch.int16, generator=gen))
        engine[1].view(torch.int16).fill_(marker)
        try:
            delta.decode(out, engine, held_version=7)
        except BadDelta:
            assert seed % 2 and (engine[1].view(torch.int16) == marker).all()
            continue
        assert not seed % 2
        assert int((engine[1].view(torch.int16) != marker).sum()) == entries  # distinct elements, all written
