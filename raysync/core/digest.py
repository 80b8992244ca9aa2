"""End-to-end digests of tensor bytes (SyncConfig.verify): computed by the sender from the bytes it packed,
by the receiver from the bytes that landed, compared before a push counts as applied.

A tensor's bytes b_0, b_1, ... (each read as a signed byte, -128..127) make 32-bit words
v_g = b_4g + 2**8 b_4g+1 + 2**16 b_4g+2 + 2**24 b_4g+3 (a last, shorter word zero-padded), and its digest is

    D = sum_g (2g + 1) * v_g   mod 2**63          g: the word's index in the whole tensor

computed where the bytes are (on their GPU) and, per chunk of a sliced tensor, from the chunk's own bytes and
its offset in the tensor: the digests of the chunks add up to the digest of the whole (``partial`` per chunk,
``finish`` per tensor). It guards against corruption and bugs, not against a peer that holds the session key
(the frames' HMAC does that).

# Note [what the digest detects]
# Arithmetic is modulo M = 2**63 (a wire integer is < 2**63). v_g is a word written in base 256 with digits
# -128..127: a one-to-one map of the 2**32 byte patterns onto integers, so two different words differ by d
# with 0 < |d| < 2**32. A change of the bytes changes D by delta = sum_g (2g + 1) (v'_g - v_g) mod M.
# * Any change within one word (every single-bit flip, any float's sign bit included): delta = (2g + 1) d.
#   An odd number times d is divisible by 2**63 only if d is, and no 0 < |d| < 2**32 is. Always detected.
# * Two words swapped (i < j, v_i != v_j): delta = (2i+1)(v_j - v_i) + (2j+1)(v_i - v_j) = 2 (j - i) d.
#   Zero mod 2**63 needs 2**62 | (j - i) d with |d| < 2**32, so 2**31 | (j - i): never within a tensor of fewer
#   than 2**31 words (8 GiB; the largest tensor of a 70B model is about 2 GiB). Always detected below that.
#   The same holds for two swapped elements of 1 or 2 bytes: in the same lane of their words, delta is 2 (j - i)
#   times a difference below 2**16 times 256**lane; in different lanes, an odd number times 256**lane times
#   the difference. Two swapped 8-byte elements are two words swapped twice: delta = 4 (j - i) (d_low + d_high),
#   missed when the halves' differences cancel (d_low = -d_high).
# * Anything else (several words changed, a longer permutation, a slice written at the wrong offset) is
#   caught unless the changes cancel exactly mod 2**63 (a 3-cycle a, b, c -> c, a, b with a + b = 2c does).
#   It is a checksum, not a hash.
# Why 32-bit words and weights 2g+1, and not a sum of 64-bit words (the digest before this one): with 64-bit
# words mod 2**64 a flipped bit 63 is 2**63, which any even weight sends to 0, and no weighting makes every
# difference of three weights odd. 32-bit words leave 31 bits of the accumulator for the index.
#
# Note [one pass: the digest as an int8 matrix product]
# The weight of byte k = 4g + t (t = k % 4) is 256**t (2g + 1). With no per-byte weight ever materialized:
#     bytes of a chunk as an int8 matrix [R, K] (K = ROW_BYTES): row r, column c = 4q + t is the byte of
#     word first_word + r K/4 + q, lane t
#     P = matrix @ LANES        LANES [K, 16] int8: for each lane t, columns 1, q % 64, q // 64 on the
#                                bytes of lane t (weights <= 63: no int16 saturation on any int8 path)
#     D = sum_t 256**t sum_r ( (2 (first_word + r K/4) + 1) P[r,t] + 2 P[r,4+t] + 128 P[r,8+t] )
# P is exact in int32 (|entries| < 2**24) and 64x smaller than the data.
# The product is torch._int_mm (LANES stored column-major: cuBLAS then picks a kernel 5x faster on an H200),
# on tensor cores; on CPUs, oneDNN where the CPU has AVX512-VNNI. Its output meets a cached coefficient table
# [GEMM_ROWS, 16] in one multiply and one sum. Elsewhere, and for what is left after the full rows (and any
# piece under 17 rows), each byte is multiplied by its weight from a cached table of TABLE_BYTES weights.
# Wrap-around: int64 products and sums wrap modulo 2**64 on every device torch runs on (as the sum of the
# digest before this one did); every step is linear, so the result is exact mod 2**64, then mod 2**63.
"""

from __future__ import annotations

import torch

MOD = 1 << 63
ROW_BYTES = 4096  # K: bytes per row of the matrix view
GEMM_ROWS = 1 << 16  # rows per int8 product (256 MiB): element counts stay within cuBLAS's int32
MIN_GEMM_ROWS = 17  # torch._int_mm needs more than 16 rows
TABLE_BYTES = 1 << 18  # bytes per step of the direct path (its two int64 tables: 2 MiB each per device)
_LANES = 4
_COLUMNS = 16  # 3 per lane, padded to a multiple of 8 (torch._int_mm)


def partial(data: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """The digest of the bytes of ``data`` (a 1-d uint8 tensor) that start at byte ``offset_bytes`` of their
    tensor (a chunk's ``src_offset``; 0 for a whole tensor), as a 0-d int64 tensor on its device (no host
    sync). Chunks' partial digests add up, in ``combine``, to the digest of the whole tensor."""
    _check(data, offset_bytes)
    signed = data.view(torch.int8)
    first_word = offset_bytes // _LANES
    parts, done = [], 0
    if signed.numel() >= MIN_GEMM_ROWS * ROW_BYTES and _fast_int8_product(data.device):
        parts, done = _product_digests(signed, first_word)
    parts += _table_digests(signed[done:], first_word + done // _LANES)
    return _sum(parts, data.device)


def combine(parts_per_tensor: list[list[torch.Tensor]]) -> list[int]:
    """Each tensor's digest in [0, 2**63) from its partial digests: summed where they are, then read back
    with one host sync per device (never one per tensor)."""
    sums = [_sum(p, None) if p else None for p in parts_per_tensor]
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        if s is not None:
            by_device.setdefault(s.device, []).append(i)
    out = [0] * len(sums)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([sums[i] for i in indices]).tolist(), strict=True):
            out[i] = value % MOD
    return out


def _check(data: torch.Tensor, offset_bytes: int) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(
            f"digest.partial takes a 1-d uint8 view of the bytes, got {data.dtype} {tuple(data.shape)}"
        )
    if offset_bytes < 0 or offset_bytes % _LANES:
        raise ValueError(
            f"digest.partial: offset_bytes={offset_bytes} must be a non-negative multiple of {_LANES} "
            "(chunks are cut at multiples of align_bytes, see raysync.core.plan)"
        )


def _product_digests(signed: torch.Tensor, first_word: int) -> tuple[list[torch.Tensor], int]:
    """The digests of the leading full rows of ``signed`` by int8 products of GEMM_ROWS rows, and how many
    bytes they cover (a last piece under MIN_GEMM_ROWS rows is left to the table)."""
    rows = signed.numel() // ROW_BYTES
    rows -= rows % GEMM_ROWS if rows % GEMM_ROWS < MIN_GEMM_ROWS else 0
    matrix = signed[: rows * ROW_BYTES]
    if matrix.data_ptr() % 16:  # the int8 product wants aligned rows: an aligned copy (odd views only)
        matrix = matrix.clone()
    parts = []
    for r0 in range(0, rows, GEMM_ROWS):
        piece = matrix[r0 * ROW_BYTES : (r0 + GEMM_ROWS) * ROW_BYTES].view(-1, ROW_BYTES)
        parts.append(_product_digest(piece, first_word + r0 * ROW_BYTES // _LANES))
    return parts, rows * ROW_BYTES


def _product_digest(rows: torch.Tensor, first_word: int) -> torch.Tensor:
    """The digest mod 2**64 of ``rows`` (int8 [R, ROW_BYTES], R > 16), row r starting at word
    first_word + r * ROW_BYTES / 4 (Note [one pass: the digest as an int8 matrix product])."""
    table, per_first_word = _coefficient_table(rows.device)
    products = torch._int_mm(rows, _lane_matrix(rows.device))  # [R, 16] int32
    coefficients = _shifted(table[: rows.shape[0]], per_first_word, first_word)
    return (products * coefficients).sum()


def _table_digests(flat: torch.Tensor, first_word: int) -> list[torch.Tensor]:
    """The digest mod 2**64 of ``flat`` (int8, starting at word ``first_word``) as the definition reads, each
    byte times its weight, TABLE_BYTES at a time: a step's weights are a cached table plus 2 * its first word
    * 256**t; one 0-d tensor per step."""
    table, lane_scale = _weight_table(flat.device)
    parts = []
    for b0 in range(0, flat.numel(), TABLE_BYTES):
        step = flat[b0 : b0 + TABLE_BYTES]
        n = step.numel()
        weights = _shifted(table[:n], lane_scale[:n], first_word + b0 // _LANES)
        parts.append((step * weights).sum())
    return parts


def _shifted(weights: torch.Tensor, per_word: torch.Tensor, first_word: int) -> torch.Tensor:
    """``weights`` of a piece at word 0 moved to ``first_word``: + 2 first_word per_word (no kernel for a
    piece at word 0, the case of every whole tensor: a kernel launch costs more than most small tensors)."""
    if first_word == 0:
        return weights
    return torch.add(weights, per_word, alpha=_as_int64(2 * first_word))


def _sum(parts: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


# --- constants, made once per device ------------------------------------------------------------------------------
_CACHE: dict[tuple[str, torch.device], object] = {}


def _lane_matrix(device: torch.device) -> torch.Tensor:
    """LANES [ROW_BYTES, 16] int8, column-major: column t is 1 on lane t's bytes, column 4+t is q % 64 there,
    8+t is q // 64 (q: the byte's word within the row); columns 12..15 are 0."""
    key = ("lanes", device)
    if key not in _CACHE:
        c = torch.arange(ROW_BYTES)
        q, lane = c // _LANES, c % _LANES
        m = torch.zeros(ROW_BYTES, _COLUMNS, dtype=torch.int8)
        m[c, lane] = 1
        m[c, _LANES + lane] = (q % 64).to(torch.int8)
        m[c, 2 * _LANES + lane] = (q // 64).to(torch.int8)
        _CACHE[key] = m.to(device).t().contiguous().t()
    return _CACHE[key]  # type: ignore[return-value]


def _coefficient_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """What multiplies P[r, j] (the Note's formula): table[r, j] + 2 first_word * per_first_word[j], where
    table [GEMM_ROWS, 16] int64 is 256**t (1 + r ROW_BYTES/2) | 2 * 256**t | 128 * 256**t | 0 by column group
    and per_first_word is 256**t on the 4 lane columns, 0 elsewhere."""
    key = ("coefficients", device)
    if key not in _CACHE:
        scale = torch.tensor([256**t for t in range(_LANES)], dtype=torch.int64)
        r = torch.arange(GEMM_ROWS, dtype=torch.int64)[:, None]
        table = torch.zeros(GEMM_ROWS, _COLUMNS, dtype=torch.int64)
        table[:, :_LANES] = scale * (1 + r * (ROW_BYTES // 2))
        table[:, _LANES : 2 * _LANES] = 2 * scale
        table[:, 2 * _LANES : 3 * _LANES] = 128 * scale
        per_first_word = torch.zeros(_COLUMNS, dtype=torch.int64)
        per_first_word[:_LANES] = scale
        _CACHE[key] = (table.to(device), per_first_word.to(device))
    return _CACHE[key]  # type: ignore[return-value]


def _weight_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[TABLE_BYTES] int64 each: byte k's weight 256**(k % 4) (2 (k // 4) + 1) in a piece that starts at word
    0, and 256**(k % 4), half of what one more word of offset adds."""
    key = ("table", device)
    if key not in _CACHE:
        k = torch.arange(TABLE_BYTES, dtype=torch.int64)
        lane_scale = torch.ones_like(k) << (8 * (k % _LANES))
        _CACHE[key] = ((lane_scale * (2 * (k // _LANES) + 1)).to(device), lane_scale.to(device))
    return _CACHE[key]  # type: ignore[return-value]


def _fast_int8_product(device: torch.device) -> bool:
    """Whether torch._int_mm is fast here: cuBLAS on CUDA, oneDNN on CPUs with AVX512-VNNI (elsewhere torch
    runs it as a scalar loop, ~20 MB/s)."""
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    return bool(capabilities and capabilities().get("avx512_vnni", False))


def _as_int64(value: int) -> int:
    """``value`` mod 2**64 as a signed 64-bit int (what int64 arithmetic wraps to)."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value
