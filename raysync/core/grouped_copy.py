"""One Triton launch that copies many tensors on one CUDA device: a table of (source address, destination
address, length) rows, one per program, made once on the device from (destination, source) pairs and launched
at every run. raysync.core.copies (CopyList) sends its eligible pairs here; used where Triton imports (torch's
CUDA builds bring it) and compiles, and not with RAYSYNC_GROUPED_COPY=0; otherwise the copies stay torch's.

    if available(device) and warm(device):     # compiled once per device, or refused: torch's copies
        grouped = GroupedCopy([(d, s) for d, s in pairs if eligible(d, s)])
        grouped.run()                          # every push: one launch, on the current stream

# Note [grouped copy]
# Measured on one H200 (torch 2.11.0+cu130, Triton 3.6.0; ``python benchmarks/bench_grouped_copy.py``, median
# of 20), the copies of every tensor of a model into another model's, bf16 filled with random bits:
#   7B layout (339 tensors, 15.23 GB): one memcpy of the same bytes 7.19 ms; one torch copy_ per tensor 8.18;
#     CopyList 8.08 (launched one by one: its large copies average 32 MB or more), CopyList forced into a
#     CUDA graph 8.18; this kernel 7.45 at 16 KB a program, 7.83 at 64 KB, 7.95-8.01 at 256 KB.
#   1.5B layout (338 tensors, 3.09 GB): memcpy 1.65 ms; copy_ per tensor 3.49; CopyList (a graph) 1.76; this
#     kernel 1.59 at 16 KB a program, 1.63 at 64 KB.
# One launch runs within 4% of a memcpy of the same bytes on the large model and under it on the small one (the
# memcpy row is one copy_ of one buffer, launched from Python too), ahead of every way of torch's.
# A later run, CopyList routing its pairs here (the same script, ``--configs 16:16:8,64:16:8,256:16:8:masked,
# 256:16:8:stream``): 7B 7.43 ms (929741 programs, one launch) against 7.98 for CopyList without the kernel,
# this kernel alone 7.33 and the memcpy 7.19; 1.5B 1.51 against 1.74, the memcpy 1.64. The kernel copies bits
# (int32 words), so NaN payloads and signs stay what they were: the first run found CopyList's fused copies
# wrong (torch._foreach_copy_ on CUDA goes through float for bf16 and writes every NaN as one NaN; Note
# [bit-exact copies] in raysync.core.copies).
# The design:
# * One table row per program, (source address, destination address, 16-byte words) of its chunk, a slice of
#   one tensor: a program reaches its bytes through one dependent load (a row per tensor reached through a
#   row per program would be two). Programs run in table order, tensor after tensor, so neighbouring programs
#   stream neighbouring memory. 16 KB a program (CHUNK_BYTES: one block, BLOCK_BYTES) and 8 warps were the
#   fastest of the configs tried (4 and 8 warps at 64 KB to 1 MB a program, 16 or 32 KB blocks). The table
#   costs 24 bytes per 16 KB (0.15% of the bytes: 22 MB for the 7B layout), made on the device from a row per
#   tensor.
# * Copied as int32, four to a 16-byte vector (ld/st.global.v4.b32). A pointer loaded from memory loses what
#   Triton knows of the integer's divisibility: ``tl.multiple_of(ptr, 16)`` on the pointer itself, after the
#   int-to-pointer cast, is what gives v4 loads and stores (compiled offline for sm_90 with Triton 3.9: without a
#   hint, with the hint on the int64 before the cast, or with address / 16 in the table, they are scalar
#   ld.global.b32; the H200 run's PTX, Triton 3.6, has ld.global.v4.b32 and st.global.v4.b32). It is
#   a promise the host keeps (``eligible``: both addresses 16-byte aligned, the length a multiple of 16 bytes;
#   any other pair the caller copies with torch). Triton's interpreter ignores it.
# * A program's full blocks load unmasked, its last partial block (only a tensor's last chunk has one) masked;
#   the length is loaded as words and multiplied by 4 in the kernel, so Triton knows it divides 4 elements and
#   the masked block still moves v4 vectors. (With a length of unknown divisibility a masked block loads
#   scalars: raysync's compare kernel took 1.05 ms instead of 0.37, Note [fused delta kernels].)
# * The experiment's other variants are kept as flags, off here (the script times this kernel): every block
#   masked (7B: 7.88 ms against 8.01 unmasked, both 256 KB a program and 8 warps; not tried at 16 KB, where a
#   program is one block), and loads evict_first with .cs stores (8.31 ms at 256 KB).
# * The table holds addresses, fixed when it is made: the views stay alive with it (``GroupedCopy.pairs``),
#   and a storage that moves under them (``resize_`` to 0 and back) is not followed, as a captured CUDA graph
#   does not follow it either. ``warm`` compiles the kernel once per device and process, when the first list
#   that uses it there is made (not at its first run); where compiling fails (no compiler for Triton's
#   launcher, say) the copies are torch's, and a warning says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

import torch

try:  # Triton ships with torch's CUDA builds; without it (a CPU build) the copies are torch's
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

logger = logging.getLogger(__name__)

WORD = 16  # bytes of one vector: both addresses and the length must be multiples of it (``eligible``)
CHUNK_BYTES = 16 << 10  # bytes a program copies (a tensor's last chunk: what is left)
BLOCK_BYTES = 16 << 10  # bytes a program's loop step copies: one step per 16 KB chunk
WARPS = 8
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (destination, source), as CopyList takes them


def available(device: torch.device) -> bool:
    """Whether copies on ``device`` may go through the kernel (``warm`` says whether it compiles there)."""
    return triton is not None and device.type == "cuda" and os.environ.get("RAYSYNC_GROUPED_COPY", "1") != "0"


def eligible(d: torch.Tensor, s: torch.Tensor) -> bool:
    """Whether the kernel copies ``s`` into ``d`` as ``d.copy_(s)`` would: the same device, dtype and shape,
    each one contiguous span of bytes (no conjugate or negative bit to resolve) at a 16-byte aligned address,
    a multiple of 16 bytes long (Note [grouped copy])."""
    return (
        d.device == s.device
        and d.dtype == s.dtype
        and d.shape == s.shape
        and d.is_contiguous()
        and s.is_contiguous()
        and not (d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg())
        and d.data_ptr() % WORD == 0
        and s.data_ptr() % WORD == 0
        and d.nbytes % WORD == 0
    )


if triton is not None:

    @triton.jit
    def _grouped_copy(table_ptr, BLOCK: tl.constexpr, ALL_MASKED: tl.constexpr, STREAM: tl.constexpr):
        """Program p copies its table row's chunk: row p is (source address, destination address, words)."""
        row = table_ptr + tl.program_id(0).to(tl.int64) * 3
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)  # Note [grouped copy]
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        n = (tl.load(row + 2) * 4).to(tl.int32)  # int32 elements, known to Triton as a multiple of 4
        k = tl.arange(0, BLOCK)
        full = n // BLOCK
        if ALL_MASKED:
            full = 0
        else:
            for b in range(0, full):  # whole blocks: unmasked
                o = b * BLOCK + k
                if STREAM:
                    tl.store(dst + o, tl.load(src + o, eviction_policy="evict_first"), cache_modifier=".cs")
                else:
                    tl.store(dst + o, tl.load(src + o))
        for b in range(full, tl.cdiv(n, BLOCK)):  # the chunk's partial last block, if any (ALL_MASKED: all)
            o = b * BLOCK + k
            m = o < n
            if STREAM:
                value = tl.load(src + o, mask=m, eviction_policy="evict_first")
                tl.store(dst + o, value, mask=m, cache_modifier=".cs")
            else:
                tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


def table(pairs: Pairs, chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor | None:
    """The kernel's table for ``pairs`` (all ``eligible``, on one device): int64 [programs, 3] on that device,
    a row per chunk of ``chunk_bytes`` (source address, destination address, 16-byte words), tensor after
    tensor; None where there are no bytes to copy. A row per tensor crosses to the device, the chunks' rows are
    made there (queued on the current stream, no host sync)."""
    assert chunk_bytes % WORD == 0 and chunk_bytes < 1 << 31, "whole words per chunk, int32 offsets"
    each = [[s.data_ptr(), d.data_ptr(), d.nbytes // WORD] for d, s in pairs if d.nbytes]
    if not each:
        return None
    device, per_chunk = pairs[0][0].device, chunk_bytes // WORD
    programs = sum(-(-words // per_chunk) for _, _, words in each)
    rows = torch.tensor(each, dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory, which torch keeps until the copy has run
        rows = rows.pin_memory().to(device, non_blocking=True)
    chunks = (rows[:, 2] + per_chunk - 1) // per_chunk
    tensor_of = torch.repeat_interleave(torch.arange(len(each), device=device), chunks, output_size=programs)
    firsts = chunks.cumsum(0) - chunks  # each tensor's first program
    start = (torch.arange(programs, device=device) - firsts[tensor_of]) * per_chunk  # words into its tensor
    picked = rows[tensor_of]
    words = (picked[:, 2] - start).clamp_(max=per_chunk)
    return torch.stack([picked[:, 0] + start * WORD, picked[:, 1] + start * WORD, words], 1)


def launch(
    rows: torch.Tensor,
    block_bytes: int = BLOCK_BYTES,
    warps: int = WARPS,
    all_masked: bool = False,
    stream: bool = False,
):
    """One launch of the kernel over ``rows`` (``table``'s) on the current stream of their device; what
    Triton returns (a compiled kernel on a GPU, its ``asm`` the PTX; nothing from the interpreter)."""
    assert block_bytes & (block_bytes - 1) == 0 and block_bytes >= WORD, "a power of two of words (tl.arange)"
    with _on(rows.device):
        return _grouped_copy[(rows.shape[0],)](
            rows, BLOCK=block_bytes // 4, ALL_MASKED=all_masked, STREAM=stream, num_warps=warps
        )


class GroupedCopy:
    """``pairs`` ((destination, source), every one ``eligible``, all on one device) copied by one launch: the
    table made here, once; ``run`` launches it on the current stream (ordered after the table's making where
    that was another stream)."""

    def __init__(self, pairs: Pairs):
        self.pairs = list(pairs)  # the views: their memory stays while the table holds its addresses
        wrong = [i for i, (d, s) in enumerate(self.pairs) if not eligible(d, s)]
        if wrong:
            raise ValueError(f"pairs {wrong} cannot be copied by the grouped kernel (eligible)")
        devices = {d.device for d, _ in self.pairs}
        if len(devices) > 1:
            raise ValueError(f"a grouped copy runs on one device, not {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        with _on(self.device):
            self.table = table(self.pairs)
            cuda = self.device.type == "cuda" and self.table is not None
            self._made = torch.cuda.current_stream() if cuda else None
            self._ready = torch.cuda.Event() if cuda else None
            if self._ready is not None:
                self._ready.record(self._made)
        self.programs = 0 if self.table is None else self.table.shape[0]

    def run(self) -> None:
        if self.table is None:
            return
        if self._made is not None:
            now = torch.cuda.current_stream(self.device)
            if now != self._made:  # the table was made on another stream: wait for it, keep its memory
                now.wait_event(self._ready)
                self.table.record_stream(now)
        launch(self.table)


def warm(device: torch.device) -> bool:
    """Compile the kernel for ``device`` (or load it from Triton's cache) by copying 16 bytes there, once per
    process: at set-up, not in a push. False where it does not compile (a warning says why, once): the caller
    copies with torch."""
    if device not in _warm:
        try:
            scratch = torch.zeros(2 * WORD, dtype=torch.uint8, device=device)
            GroupedCopy([(scratch[WORD:], scratch[:WORD])]).run()
            _warm[device] = True
        except Exception as e:  # Triton's compile or launcher build: whatever fails, torch copies instead
            logger.warning("grouped copy kernel unusable on %s, copies launched by torch: %r", device, e)
            _warm[device] = False
    return _warm[device]


_warm: dict[torch.device, bool] = {}


def _on(device: torch.device):
    """Triton launches on the current CUDA device: that of the tensors (Triton's interpreter: the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
