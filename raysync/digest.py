"""End-to-end digests of tensor bytes (SyncConfig.verify): computed by the sender from the bytes it packed,
by the receiver from the bytes that landed, compared before a push counts as applied.

A digest is the sum, modulo 2**63, of a tensor's bytes read as little-endian 64-bit words (a shorter tail as
single bytes). It runs where the bytes are, as one reduction (cheap on a GPU), and is additive over the
chunks of a sliced tensor, whose cuts fall on multiples of align_bytes (Note in plan.py). Any single corrupted
byte changes it. It guards against corruption and bugs, not against a peer that holds the session key (the
frames' HMAC does that).
"""

from __future__ import annotations

import torch

MOD = 1 << 63


def partial(data: torch.Tensor, offset_bytes: int = 0) -> torch.Tensor:
    """The digest of the bytes of ``data`` (a uint8 tensor), as a 0-d int64 tensor on its device (no sync)."""
    if data.storage_offset() % 8:  # words count from the tensor's first byte: read them from an aligned copy
        data = data.clone()
    words = data.numel() // 8 * 8
    total = (
        data[:words].view(torch.int64).sum()
        if words
        else torch.zeros((), dtype=torch.int64, device=data.device)
    )
    if words < data.numel():
        total = total + data[words:].to(torch.int64).sum()
    return total


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
