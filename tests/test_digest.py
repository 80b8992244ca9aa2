"""SyncConfig.verify's digest (raysync.core.digest): what it detects (Note [what the digest detects]), that chunks add
up to the whole tensor, that every way of computing it gives the same number, and that a corrupted push is
refused end to end on the shm transport."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import random_tensor, session_pair
from hypothesis import given, settings
from hypothesis import strategies as st

from raysync import PushIncomplete, RemoteError, SyncConfig
from raysync.core import digest
from raysync.core.errors import IntegrityError
from raysync.core.plan import plan_buckets
from raysync.core.version import MIXED
from raysync.core.wire import DTYPES, TensorSpec

MOD = 1 << 63
ROWS = digest.ROW_BYTES


def reference(data: bytes, offset: int = 0) -> int:
    """The digest as the module docstring defines it, one byte at a time in Python integers."""
    total = 0
    for i, byte in enumerate(data):
        k = offset + i
        signed = byte - 256 if byte >= 128 else byte
        total += (2 * (k // 4) + 1) * 256 ** (k % 4) * signed
    return total % MOD


def of(data: torch.Tensor, offset: int = 0) -> int:
    return digest.combine([[digest.partial(data, offset)]])[0]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=["int8 product", "weight table"])
def product(request, monkeypatch) -> str:
    """Both ways the module computes (Note [one pass: ...]): the int8 product where torch has a fast one, and
    the weight table that other devices (and small pieces everywhere) use."""
    if request.param == "int8 product" and not digest._fast_int8_product(torch.device("cpu")):
        pytest.skip("torch has no fast int8 product on this CPU (no AVX512-VNNI or oneDNN)")
    if request.param == "weight table":
        monkeypatch.setattr(digest, "_fast_int8_product", lambda device: False)
    return request.param


# --- the number itself --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 256, ROWS - 1, ROWS, ROWS + 3, 17 * ROWS, 17 * ROWS + 6])
@pytest.mark.parametrize("offset", [0, 256, 4 * (1 << 40) + 256])
def test_partial_equals_the_definition(product, n, offset):
    data = random_bytes(n, seed=n)
    assert of(data, offset) == reference(bytes(data.numpy()), offset)


def test_several_int8_products_and_a_short_last_piece_add_up(product, monkeypatch):
    """A chunk longer than one int8 product (GEMM_ROWS rows, made small here), whose last piece is too short
    for one (under 17 rows: the table takes it) or long enough."""
    monkeypatch.setattr(digest, "GEMM_ROWS", 20)
    for n in (2 * 20 * ROWS + 3 * ROWS + 5, 20 * ROWS + 17 * ROWS):
        data = random_bytes(n, seed=n)
        assert of(data, 4096) == reference(bytes(data.numpy()), 4096)


def test_a_view_at_an_odd_address_gives_the_same_digest():
    data = random_bytes(3 * ROWS + 40, seed=1)
    for start in (1, 2, 3, 4, 8):  # a chunk of a destination tensor can start anywhere in its storage
        view = data[start : start + 2 * ROWS + 17]
        assert of(view, 8) == reference(bytes(view.numpy()), 8)


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiple of 4"):
        digest.partial(random_bytes(16, 0), 2)
    with pytest.raises(ValueError, match="1-d uint8"):
        digest.partial(torch.zeros(4, dtype=torch.int32), 0)


# --- what it detects ----------------------------------------------------------------------------------------------
def _flips(data: torch.Tensor) -> torch.Tensor:
    """Every single-bit flip of ``data``: row i is data with bit i % 8 of byte i // 8 flipped."""
    n = data.numel()
    flipped = data.repeat(8 * n, 1)
    index = torch.arange(8 * n)
    flipped[index, index // 8] ^= (1 << (index % 8)).to(torch.uint8)
    return flipped


@pytest.mark.parametrize("dtype", sorted(DTYPES), ids=str)
def test_every_single_bit_flip_is_detected_through_partial(dtype):
    """Exhaustive, through the code: 8 words of every allowed dtype's random bits plus a partial word, at an
    offset where the index is large (the tail and high-index weights are where a digest goes wrong)."""
    gen = torch.Generator().manual_seed(len(dtype))
    data = random_tensor(DTYPES[dtype], (32 // DTYPES[dtype].itemsize,), gen).view(-1).view(torch.uint8)
    data = torch.cat([data, random_bytes(2, seed=3)])  # 34 bytes: 8 words and a tail of 2 bytes
    offset = 4 * ((1 << 31) - 3)
    clean = of(data, offset)
    got = [of(row, offset) for row in _flips(data)]
    assert clean not in got
    assert got == [reference(bytes(row.numpy()), offset) for row in _flips(data)]


@pytest.fixture(scope="module")
def byte_weights() -> torch.Tensor:
    """What the code adds per unit of each byte of a 4 KiB tensor: the digest of a tensor that is 1 at that
    byte and 0 elsewhere (the digest is a weighted sum of the bytes, Note [what the digest detects])."""
    n = 4096
    return torch.tensor([of(_one_hot(n, k)) for k in range(n)], dtype=torch.int64)


def _one_hot(n: int, k: int) -> torch.Tensor:
    t = torch.zeros(n, dtype=torch.uint8)
    t[k] = 1
    return t


@pytest.mark.parametrize("dtype", sorted(DTYPES), ids=str)
def test_every_single_bit_flip_of_a_few_kib_is_detected(dtype, byte_weights):
    """Exhaustive over 4 KiB (32768 flips) of each dtype's random bits: a flip changes the digest by the
    byte's weight times the byte's change, non-zero mod 2**63 for every one; 64 of them also through partial."""
    gen = torch.Generator().manual_seed(len(dtype))
    n = byte_weights.numel()
    data = random_tensor(DTYPES[dtype], (n // DTYPES[dtype].itemsize,), gen).view(-1).view(torch.uint8)
    bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)
    flipped = (data[:, None] ^ bits).view(torch.int8).to(torch.int64)  # [byte, bit]: the byte's new value
    change = flipped - data.view(torch.int8).to(torch.int64)[:, None]
    delta = (byte_weights[:, None] * change) & (MOD - 1)  # int64 wraps mod 2**64; the digest is mod 2**63
    assert delta.shape == (n, 8) and bool((delta != 0).all())
    clean = of(data)
    for k, bit in random.Random(0).sample([(k, b) for k in range(n) for b in range(8)], 64):
        one = data.clone()
        one[k] ^= 1 << bit
        assert (of(one) - clean) % MOD == delta[k, bit].item()


def _swap(data: torch.Tensor, i: int, j: int, size: int) -> torch.Tensor:
    out = data.clone()
    out[i * size : (i + 1) * size] = data[j * size : (j + 1) * size]
    out[j * size : (j + 1) * size] = data[i * size : (i + 1) * size]
    return out


def test_swapped_words_are_detected_anywhere():
    """Every adjacent pair and 300 random pairs of the 512 words of 2 KiB, at an offset of 32 GiB."""
    data = random_bytes(2048, seed=5)
    offset, words = 1 << 35, 512
    clean = of(data, offset)
    rng = random.Random(1)
    pairs = [(i, i + 1) for i in range(words - 1)] + [tuple(rng.sample(range(words), 2)) for _ in range(300)]
    for i, j in pairs:
        assert of(_swap(data, i, j, 4), offset) != clean, (i, j)


def test_swapped_words_are_detected_in_rows_of_an_int8_product(product):
    """17 rows (the int8 product's smallest size): pairs within a row, across rows, first and last."""
    data = random_bytes(17 * ROWS, seed=6)
    words = data.numel() // 4
    clean = of(data, 256)
    rng = random.Random(2)
    pairs = [(0, 1), (0, words - 1), (words - 2, words - 1), (1023, 1024), (5, 5 + 1024)]
    pairs += [tuple(rng.sample(range(words), 2)) for _ in range(15)]
    for i, j in pairs:
        assert of(_swap(data, i, j, 4), 256) != clean, (i, j)


def test_words_that_differ_only_in_their_top_bit_are_told_apart():
    """What the sum of 64-bit words before missed: two 64-bit words 0 and -2**63 swapped."""
    signs = torch.zeros(8 * 64, dtype=torch.uint8)
    signs[7::8] = (
        torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(2), dtype=torch.uint8) << 7
    )
    top = signs.view(torch.int64)  # each 0 or -2**63
    i, j = (top == 0).nonzero()[0].item(), (top != 0).nonzero()[0].item()
    assert of(_swap(signs, i, j, 8)) != of(signs)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_swap_of_two_elements_of_up_to_4_bytes_is_detected(size):
    """All pairs of 64 bytes' elements (Note [what the digest detects]: aligned 1, 2 and 4-byte elements).
    Swaps of 8-byte elements are only caught when their halves' differences do not cancel (the Note)."""
    data = random_bytes(64, seed=size)
    count = 64 // size
    clean = of(data)
    for i in range(count):
        for j in range(i + 1, count):
            if not torch.equal(data[i * size : (i + 1) * size], data[j * size : (j + 1) * size]):
                assert of(_swap(data, i, j, size)) != clean, (i, j)


# --- chunks add up to the whole -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_bytes", [256, 4096, 3 * ROWS, 20 * ROWS])
def test_the_chunks_of_a_plan_add_up_to_the_whole_tensor(product, bucket_bytes):
    specs = [
        TensorSpec("a", "bfloat16", (7,)),
        TensorSpec("big", "float32", (5 * ROWS + 3,)),
        TensorSpec("c", "uint8", (4099,)),
    ]
    tensors = [random_bytes(s.nbytes, seed=i) for i, s in enumerate(specs)]
    parts: list[list[torch.Tensor]] = [[] for _ in specs]
    for bucket in plan_buckets(specs, bucket_bytes):
        for c in bucket.chunks:
            parts[c.index].append(
                digest.partial(tensors[c.index][c.src_offset : c.src_offset + c.nbytes], c.src_offset)
            )
    assert len(parts[1]) > 1 or bucket_bytes > specs[1].nbytes
    assert digest.combine(parts) == [of(t) for t in tensors] == [reference(bytes(t.numpy())) for t in tensors]


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3 * ROWS),
    cuts=st.lists(st.integers(0, 3 * ROWS // 256), max_size=6),
    first_word=st.integers(0, (1 << 40)),
    flip=st.tuples(st.integers(0, 1 << 30), st.integers(0, 7)),
)
def test_any_cut_at_aligned_offsets_and_any_flip(data, cuts, first_word, flip):
    """Cut anywhere at multiples of 256 (as plan.py does), at any offset: the parts add up to the whole and to
    the definition; and a flipped bit anywhere changes the digest."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    offset = 4 * first_word
    bounds = sorted({0, len(data), *(min(256 * c, len(data)) for c in cuts)})
    parts = [digest.partial(t[a:b], offset + a) for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = of(t, offset)
    assert digest.combine([parts])[0] == whole == reference(data, offset)
    if data:
        k, bit = flip[0] % len(data), flip[1]
        flipped = t.clone()
        flipped[k] ^= 1 << bit
        assert of(flipped, offset) != whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_computes_the_same_digest_as_the_cpu():
    for n, offset in [(5, 0), (ROWS + 1, 256), (17 * ROWS, 4 << 33), (300 * ROWS + 7, 256)]:
        data = random_bytes(n, seed=n)
        assert of(data.cuda(), offset) == of(data, offset) == reference(bytes(data.numpy()), offset)
    big = random_bytes(digest.GEMM_ROWS * ROWS + 5 * ROWS + 3, seed=9).cuda()  # more than one int8 product
    cut = digest.GEMM_ROWS * ROWS // 2
    assert digest.combine([[digest.partial(big[:cut], 0), digest.partial(big[cut:], cut)]]) == [of(big)]
    assert of(big[1:]) == of(big[1:].cpu())  # an unaligned view: copied first


# --- end to end: a corrupted push never becomes the engine's version ----------------------------------------------
def _sign_bit(buffer: torch.Tensor) -> None:
    buffer[7] ^= 0x80  # the top bit of the first 64-bit word: a float32's sign, invisible to the old digest


def _swap_words(buffer: torch.Tensor) -> None:
    """32-bit words 0 and 2 (the low halves of two 64-bit words): the old digest's sum did not change."""
    first, third = buffer[0:4].clone(), buffer[8:12].clone()
    buffer[0:4], buffer[8:12] = third, first


@pytest.mark.parametrize("corrupt", [_sign_bit, _swap_words], ids=["sign bit", "two words swapped"])
@pytest.mark.parametrize("mode", ["into", "into, staged", "load_fn"])
def test_a_corrupted_push_is_refused_and_never_becomes_the_version(
    private_tmp, in_thread, monkeypatch, corrupt, mode
):
    """The sender packs and digests a bucket, then its bytes change in the shm ring before the receiver reads
    them; the receiver's own digest of what landed must differ, so the push fails with IntegrityError and the
    receiver's version is MIXED (non-atomic: bytes reached the destinations) or still the old one (staged)."""
    from raysync.transport.shm import ShmRingSender

    staged = mode == "into, staged"
    config = SyncConfig(bucket_bytes=4096, timeout_s=5, progress=False, verify=True, staged=staged)
    gen = torch.Generator().manual_seed(0)
    src = {
        "embed": torch.randn(3000, generator=gen),
        "w": torch.randn(500, generator=gen),
    }  # embed: 3 buckets
    dest = {k: torch.zeros_like(v) for k, v in src.items()}
    kwargs = {"load_fn": lambda batch: None} if mode == "load_fn" else {"into": dest}
    with session_pair(config) as (sender, receiver):
        got = in_thread(receiver.receive, **kwargs)
        sender.push(src.items(), 1)  # verified and clean, a tensor sliced over buckets included
        assert got.result(timeout=10).version == 1
        packed = []
        original = ShmRingSender.after_pack

        def corrupt_second_bucket(self, slot):  # after the sender packed and digested it
            packed.append(slot)
            if len(packed) == 2:
                corrupt(self.buffers[slot])
            original(self, slot)

        monkeypatch.setattr(ShmRingSender, "after_pack", corrupt_second_bucket)
        got = in_thread(receiver.receive, **kwargs)
        with pytest.raises(RemoteError, match="differ from what the sender packed"):
            sender.push({k: -v for k, v in src.items()}.items(), 2)
        with pytest.raises(PushIncomplete) as e:
            got.result(timeout=10)
        assert isinstance(e.value.__cause__, IntegrityError)
        assert receiver.version == (1 if staged else MIXED)
        if staged:
            assert all(torch.equal(dest[k], src[k]) for k in src)
