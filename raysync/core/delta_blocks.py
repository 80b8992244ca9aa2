"""A bucket's chunks laid out in blocks, as the fused delta kernels (raysync.core.delta_kernels, Note [fused
delta kernels]) read and count them: ``Blocks`` (where each chunk's elements lie in the bucket's mask),
``Counted`` (what a compare found: its bitmask and the running sums of its entries by block) and
``mask_words`` (the bitmask's words in a mask's buffer).

    blocks = Blocks.of(chunk_sizes, device)                # once per bucket shape
    counted = delta_kernels.count_blocks(pairs, mask_words(slab, blocks), blocks)
    counted.crossed(host_sums); counted.entries(j)          # the counts, once on the host
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BLOCK = 4096  # elements a compare or listing block takes; each chunk's mask is padded to whole blocks
assert 65536 % BLOCK == 0, "a forced entry (index 65535 mod 65536) must end a block"


@dataclass(frozen=True)
class Blocks:
    """A bucket's chunks (those with a reference) laid out in whole blocks of BLOCK elements, one after the
    other in its mask: chunk j's element i at ``firsts[j] * BLOCK + i``, every block in one chunk. Made once
    per bucket shape (``Workspace.spans`` keeps them)."""

    firsts: tuple[int, ...]  # each chunk's first block, then the blocks of all
    bounds: torch.Tensor  # the same, int64 on the device
    chunk_of: torch.Tensor  # int32 [blocks]: each block's chunk

    @classmethod
    def of(cls, sizes: Sequence[int], device: torch.device) -> Blocks:
        firsts = [0]
        for n in sizes:
            firsts.append(firsts[-1] + -(-n // BLOCK))
        spans = torch.tensor(firsts, dtype=torch.int64)
        chunk_of = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), spans.diff())
        return cls(tuple(firsts), spans.to(device), chunk_of.to(device))

    @property
    def elements(self) -> int:
        """The mask's elements: every block's."""
        return self.firsts[-1] * BLOCK


@dataclass
class Counted:
    """A bucket's compare on the device (delta_kernels.count_blocks): its bitmask (entries: changed elements and
    the forced ones) and per block the entries before it (``sums[0]``) and the unchanged forced ones
    (``sums[1]``, plus every entry: only its differences are read); ``cut``, where each chunk's entries begin
    (and their end), and ``forced`` per chunk, once on the host."""

    mask: torch.Tensor  # int32 words, one bit an element of the blocks (``mask_words``)
    blocks: Blocks
    sums: torch.Tensor  # int64 [2, blocks + 1]
    cut: list[int] | None = None
    forced: list[int] | None = None
    advanced: bool = False  # the references took the changed words (Note [the reference ... compare])

    def picked(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The entries and unchanged forced ones before each chunk's first block, and before the end: [2,
        chunks + 1], on the device (``crossed`` takes them on the host), into ``out`` when given."""
        if out is None:
            return self.sums[:, self.blocks.bounds]
        return torch.index_select(self.sums, 1, self.blocks.bounds, out=out)

    def crossed(self, host: list[int]) -> Counted:
        chunks = len(self.blocks.firsts)
        self.cut = host[:chunks]
        self.forced = [b - a for a, b in zip(host[chunks:-1], host[chunks + 1 :], strict=True)]
        return self

    def entries(self, j: int) -> int:
        """Chunk j's entries (changed and forced), from the device: a host sync (delta_kernels.warm's)."""
        if self.cut is None:
            self.crossed(self.picked().reshape(-1).tolist())
        return self.cut[j + 1] - self.cut[j]


def mask_words(slab: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The bitmask of ``blocks`` in a mask's buffer (bool or uint8, at least ``blocks.elements / 8`` bytes; torch's
    path holds a byte an element there): its first ``blocks.elements / 8`` bytes, as int32 words. Element i of
    the blocks is bit i % 32 of word i // 32."""
    words = slab.view(torch.uint8)[: blocks.elements // 8]
    if words.numel() < blocks.elements // 8:  # the kernels would write past it
        raise ValueError(f"a mask of {slab.numel()} bytes for a bitmask of {blocks.elements // 8}")
    return words.view(torch.int32)
