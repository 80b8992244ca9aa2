"""Triton kernels for a delta on a CUDA device, the receiver's: GAPS payloads decoded into their destinations
(raysync.core.delta.decode), checked on the device first (Note [fused delta kernels] in
raysync.core.delta_kernels, whose ``available`` says where they run).

    warm(device, itemsizes)                           # at set-up: compiled, not in the first delta push
    apply = GapsApply(payloads); apply.run()          # checked on the device, then written (or nothing)
"""

from __future__ import annotations

import torch

from raysync.core import delta_kernels
from raysync.core.delta_kernels import INTS, WRITE_BLOCK, on, to_device

try:  # Triton ships with torch's CUDA builds; the CPU build and a GPU without it use torch's kernels
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    from raysync.core.delta_kernels import TL_INTS

    @triton.jit(do_not_specialize=["blocks"])
    def _gap_sums(table_ptr, sums_ptr, blocks, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        r, b = p // blocks, p % blocks
        row = table_ptr + r * 5
        k = b * BLOCK + tl.arange(0, BLOCK)
        live = k < tl.load(row)
        gaps = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        step = tl.where(live, tl.load(gaps + k, mask=live, other=0).to(tl.int64) + 32769, 0)
        tl.store(sums_ptr + r * blocks + b, tl.sum(step, axis=0))

    @triton.jit(do_not_specialize=["blocks"])
    def _apply_gaps(table_ptr, ends_ptr, fits_ptr, blocks, WORD: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        r, b = p // blocks, p % blocks
        row = table_ptr + r * 5
        k = b * BLOCK + tl.arange(0, BLOCK)
        count = tl.where(tl.load(fits_ptr) != 0, tl.load(row), 0)  # no row is written unless all of them fit
        live = k < count
        gaps = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        step = tl.where(live, tl.load(gaps + k, mask=live, other=0).to(tl.int64) + 32769, 0)
        before = tl.load(ends_ptr + r * blocks + b - 1, mask=b > 0, other=0)
        at = before + tl.cumsum(step, axis=0) - 1
        values = tl.load(row + 2).to(tl.pointer_type(WORD))
        dest = tl.load(row + 3).to(tl.pointer_type(WORD))
        tl.store(dest + at, tl.load(values + k, mask=live), mask=live)


WARM_PAYLOADS = 3  # ``warm``'s buckets


def warm(device: torch.device, itemsizes) -> None:
    """Compile the decoder's kernels for words of ``itemsizes`` bytes on ``device`` (or load them from Triton's
    cache), once per process: at set-up, not in the first delta push (delta_kernels.warm says why)."""
    key = (device, frozenset(itemsizes))
    if not delta_kernels.available(device) or key in _warm:
        return
    # shaped as a bucket's (several payloads of several blocks, buckets settled together): torch's kernels that
    # a bucket's shapes take (the ends' gather across rows, the check's reduction, the settle's join) load now,
    # not in the first delta push: CUDA loads a kernel at its first launch (Note [the first delta push's one-time
    # work] in raysync.core.delta_workspace). Every gap is 0 (a step of 32769): no payload fits, nothing is written
    entries = 2 * WRITE_BLOCK + 1
    for itemsize in sorted(set(itemsizes)):
        gaps = torch.zeros(entries, dtype=torch.int16, device=device)
        dest, values = torch.zeros(2, entries, dtype=INTS[itemsize], device=device)
        payload = (entries, gaps.data_ptr(), values.data_ptr(), dest)
        applies = [GapsApply([payload] * WARM_PAYLOADS) for _ in range(2)]
        for apply in applies:
            apply.run()
        torch.cat([apply.lasts for apply in applies]).tolist()
    if device.type == "cuda":  # (Triton's interpreter runs them on the CPU)
        torch.cuda.synchronize(device)
    _warm.add(key)


_warm: set = set()


class GapsApply:
    """GAPS payloads decoded on a CUDA device (the receiver's half, raysync.core.delta.decode): per payload
    (entries, address of its gaps, of its values, its destination, all on one device). Made: each block of
    entries' index sum queued, and from them on the device each payload's last index + 1 (``lasts``) and
    whether every one fits its destination (gaps are at least 1: the indices increase strictly, the last is
    the largest). ``run``: every destination's elements written, one launch per word size, and nothing at all
    unless every payload fits; ``ends`` (one host sync) says whether they did."""

    def __init__(self, payloads: list[tuple[int, int, int, torch.Tensor]]):
        by_size: dict[int, list[int]] = {}
        for i, (_, _, _, dest) in enumerate(payloads):
            by_size.setdefault(dest.element_size(), []).append(i)
        self.groups, self.order = [], [i for same in by_size.values() for i in same]
        for itemsize, same in by_size.items():
            rows = [[e, gaps, values, dest.data_ptr(), dest.numel()] for e, gaps, values, dest in payloads]
            rows = [rows[i] for i in same]
            device = payloads[same[0]][3].device
            table = to_device(rows, device)
            blocks = max(1, triton.cdiv(max(r[0] for r in rows), WRITE_BLOCK))
            sums = torch.empty(len(rows), blocks, dtype=torch.int64, device=device)
            with on(device):
                _gap_sums[(blocks * len(rows),)](table, sums, blocks, BLOCK=WRITE_BLOCK)
            self.groups.append((itemsize, table, sums.cumsum_(1), blocks, len(rows)))
        self.lasts = torch.cat([ends[:, -1] for _, _, ends, _, _ in self.groups])  # in ``order``
        numels = torch.cat([table[:, 4] for _, table, _, _, _ in self.groups])
        self.fits = (self.lasts <= numels).all().view(torch.uint8)

    def ends(self, crossed: list[int] | None = None) -> list[int]:
        """Per payload, in the order given: its last index + 1 (0 without entries); ``crossed``: ``lasts``,
        on the host already."""
        crossed = self.lasts.tolist() if crossed is None else crossed
        out = [0] * len(crossed)
        for i, end in zip(self.order, crossed, strict=True):
            out[i] = end
        return out

    def run(self) -> None:
        for itemsize, table, ends, blocks, rows in self.groups:
            with on(table.device):
                grid = (blocks * rows,)
                _apply_gaps[grid](table, ends, self.fits, blocks, WORD=TL_INTS[itemsize], BLOCK=WRITE_BLOCK)
