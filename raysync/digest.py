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
# P is exact in int32 (|entries| < 2**24) and 64x smaller than the data; the sums over r are int64, which
# wraps modulo 2**64 on every device torch runs on, so D is exact mod 2**63 after the last reduction.
# The product is torch._int_mm: one read of the bytes on tensor cores (cuBLAS), or oneDNN on CPUs with
# AVX512-VNNI. Elsewhere, and for pieces of TABLE_ROWS rows or fewer (small tensors, the short last row),
# the bytes are multiplied by their weights directly, TABLE_ROWS rows at a time, from a cached table.
"""

from __future__ import annotations

import torch

MOD = 1 << 63
ROW_BYTES = 4096  # K: bytes per row of the matrix view
GEMM_ROWS = 1 << 16  # rows per int8 product (256 MiB): element counts stay within cuBLAS's int32
TABLE_ROWS = 16  # rows per step of the direct path (torch._int_mm needs more than 16 rows)
_LANES = 4
_COLUMNS = 16  # 3 per lane, padded to a multiple of 8 (torch._int_mm)


def partial(data: torch.Tensor, offset_bytes: int) -> torch.Tensor:
    """The digest of the bytes of ``data`` (a 1-d uint8 tensor) that start at byte ``offset_bytes`` of their
    tensor (a chunk's ``src_offset``; 0 for a whole tensor), as a 0-d int64 tensor on its device (no host
    sync). Chunks' partial digests add up, in ``finish``, to the digest of the whole tensor."""
    _check(data, offset_bytes)
    if data.data_ptr() % 16:  # int8 products want aligned rows: read an aligned copy (rare: odd views)
        data = data.clone()
    signed = data.view(torch.int8)
    full_rows = signed.numel() // ROW_BYTES
    first_word = offset_bytes // _LANES
    parts = []
    for r0 in range(0, full_rows, GEMM_ROWS):
        rows = signed[r0 * ROW_BYTES : min(r0 + GEMM_ROWS, full_rows) * ROW_BYTES].view(-1, ROW_BYTES)
        parts.append(_rows_digest(rows, first_word + r0 * ROW_BYTES // _LANES))
    if full_rows * ROW_BYTES < signed.numel():  # the last row, shorter
        last = signed[full_rows * ROW_BYTES :].view(1, -1)
        parts.append(_table_digest(last, first_word + full_rows * ROW_BYTES // _LANES))
    return _sum(parts, data.device)


def finish(parts_per_tensor: list[list[torch.Tensor]]) -> list[int]:
    """Each tensor's digest in [0, 2**63) from its partial digests: summed where they are, then read back
    with one host sync per device (never one per tensor)."""
    sums: list[torch.Tensor | None] = [torch.stack(p).sum() if p else None for p in parts_per_tensor]
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
            "(chunks are cut at multiples of align_bytes, see raysync.plan)"
        )


def _rows_digest(rows: torch.Tensor, first_word: int) -> torch.Tensor:
    """The digest mod 2**64 of the bytes of ``rows`` (int8 [R, ROW_BYTES]), row r starting at word
    first_word + r * ROW_BYTES / 4."""
    if rows.shape[0] > TABLE_ROWS and _fast_int8_product(rows.device):
        return _product_digest(rows, first_word)
    return _table_digest(rows, first_word)


def _product_digest(rows: torch.Tensor, first_word: int) -> torch.Tensor:
    """Note [one pass: the digest as an int8 matrix product]."""
    products = torch._int_mm(rows, _lane_matrix(rows.device)).to(torch.int64)  # [R, 16]
    ramp = _ramp(rows.device)[: rows.shape[0], None]
    sums = torch.cat([products.sum(dim=0), (products[:, :_LANES] * ramp).sum(dim=0)])  # [20]
    base, per_first_word = _coefficients(rows.device)
    return (sums * torch.add(base, per_first_word, alpha=_as_int64(2 * first_word))).sum()


def _table_digest(rows: torch.Tensor, first_word: int) -> torch.Tensor:
    """The digest as the definition reads, each byte times its weight, TABLE_ROWS rows of ``rows`` (int8
    [R, L], L <= ROW_BYTES) at a time: a block's weights are the cached table plus 2 * first_word * 256**t."""
    table, lane_scale = _weight_table(rows.device)
    width = rows.shape[1]
    parts = []
    for r0 in range(0, rows.shape[0], TABLE_ROWS):
        block = rows[r0 : r0 + TABLE_ROWS]
        start = _as_int64(2 * (first_word + r0 * ROW_BYTES // _LANES))
        weights = torch.add(table[: block.shape[0], :width], lane_scale[:width], alpha=start)
        parts.append((block.to(torch.int64) * weights).sum())
    return _sum(parts, rows.device)


def _sum(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not parts:
        return torch.zeros((), dtype=torch.int64, device=device)
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


# --- constants, made once per device ------------------------------------------------------------------------------
_CACHE: dict[tuple[str, torch.device], object] = {}


def _lane_matrix(device: torch.device) -> torch.Tensor:
    """LANES [ROW_BYTES, 16] int8: column t is 1 on lane t's bytes, column 4+t is q % 64 there, 8+t is q // 64
    (q: the byte's word within the row); columns 12..15 are 0."""
    key = ("lanes", device)
    if key not in _CACHE:
        c = torch.arange(ROW_BYTES)
        q, lane = c // _LANES, c % _LANES
        m = torch.zeros(ROW_BYTES, _COLUMNS, dtype=torch.int8)
        m[c, lane] = 1
        m[c, _LANES + lane] = (q % 64).to(torch.int8)
        m[c, 2 * _LANES + lane] = (q // 64).to(torch.int8)
        _CACHE[key] = m.to(device)
    return _CACHE[key]  # type: ignore[return-value]


def _coefficients(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """D = sum(sums * (base + 2 first_word * per_first_word)), sums = [the 16 column sums of P, then
    sum_r r P[r, t] for the 4 lanes]: the Note's formula, one coefficient per sum."""
    key = ("coefficients", device)
    if key not in _CACHE:
        scale = [256**t for t in range(_LANES)]
        base = scale + [2 * s for s in scale] + [128 * s for s in scale] + [0] * _LANES
        base += [ROW_BYTES // 2 * s for s in scale]  # row r starts r * ROW_BYTES / 4 words later
        per_first_word = scale + [0] * (len(base) - _LANES)
        _CACHE[key] = (
            torch.tensor(base, dtype=torch.int64, device=device),
            torch.tensor(per_first_word, dtype=torch.int64, device=device),
        )
    return _CACHE[key]  # type: ignore[return-value]


def _weight_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[TABLE_ROWS, ROW_BYTES] int64, the weight 256**t (2 (r ROW_BYTES/4 + q) + 1) of byte c = 4q + t of row r
    of a block at word 0; and [ROW_BYTES] int64, 256**t: half of what one more word of offset adds."""
    key = ("table", device)
    if key not in _CACHE:
        c = torch.arange(ROW_BYTES, dtype=torch.int64)
        r = torch.arange(TABLE_ROWS, dtype=torch.int64)[:, None]
        lane_scale = 1 << (8 * (c % _LANES))
        table = lane_scale * (2 * (r * ROW_BYTES // _LANES + c // _LANES) + 1)
        _CACHE[key] = (table.to(device), lane_scale.to(device))
    return _CACHE[key]  # type: ignore[return-value]


def _ramp(device: torch.device) -> torch.Tensor:
    """0, 1, ..., GEMM_ROWS - 1 (int64): each row's index within one int8 product."""
    key = ("ramp", device)
    if key not in _CACHE:
        _CACHE[key] = torch.arange(GEMM_ROWS, dtype=torch.int64, device=device)
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
