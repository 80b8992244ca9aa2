"""Delta pushes in the push session (SyncConfig.delta, issue 24): the sender's reference of what its receivers
hold, which pushes go as a delta, and what a push sent. The encoding itself is raysync.core.delta (Note [delta
pushes]); the receiver's half is a mode of its sink (raysync.core.sink.IntoTensors) and one answer at accept.

    sender   start(version, full)  ->  base version (None: this push is full)
             per bucket k: encode(k, ring buffer)  (a delta push: pack into the scratch bucket, encode into
                           the ring, apply the same bytes to the reference as the receivers will)
                        or keep(k, ring buffer)    (a full push: the Packer packed the ring; copy it into the
                           reference)
             finish(version) once every receiver applied the push: the reference is that version

# Note [the delta reference]
# The reference is one uint8 tensor on the trainer's device (the device of the first tensor pushed: the GPU
# for a GPU trainer), laid out as the buckets are: bucket k at ``offsets[k]``, each chunk at its
# ``bucket_offset``, in the wire dtype. It costs one more copy of the model in the wire dtype there, plus one
# bucket of scratch (a delta is packed there first, so a cast -- fp32 master -> bf16 -- is compared in the
# bits receivers hold). Its version is None from ``start`` until ``finish``: a push that fails, is skipped or
# is demoted part-way leaves None, and the next push is full for every receiver. A full push in delta mode
# rewrites all of it; a delta push applies each bucket's code to it with the receivers' own ``decode``, so it
# equals what every receiver holds, by construction. A new layout makes a new reference (version None).
# Deltas need a ring the sender makes (shm, cuda_ipc): a collective group's plane (given to the session, which
# moves whole buckets) and direct mode (no ring) push full; so does a lazy source (no scratch packer for it
# yet). The ring's buffers are made larger by the header, table and padding of the largest bucket of the
# first layout (delta.capacity); a later layout whose buckets do not fit pushes full.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from raysync.core import delta
from raysync.core.config import SyncConfig
from raysync.core.plan import Bucket, align_up, plan_buckets
from raysync.core.source import Packer
from raysync.core.wire import TensorSpec

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeltaStats:
    """What one push sent, summed over its buckets (raysync.core.delta.BucketCode's fields)."""

    base_version: int | None = None  # the version the deltas were computed from (None: a full push)
    sent_as_delta: int = 0  # SAME and GAPS payloads, headers, tables, padding
    sent_as_full: int = 0  # FULL payloads (a full push: every tensor byte)
    changed: int | None = None  # elements whose bits changed (known for delta pushes only)
    numel: int = 0

    @property
    def density(self) -> float | None:
        return None if self.changed is None else self.changed / max(self.numel, 1)

    def add(self, code: delta.BucketCode) -> DeltaStats:
        changed = code.changed
        return DeltaStats(
            self.base_version,
            self.sent_as_delta + code.sent_as_delta,
            self.sent_as_full + code.sent_as_full,
            None if self.changed is None or changed is None else self.changed + changed,
            self.numel + code.numel,
        )


def chunk_sizes(bucket: Bucket, specs: Sequence[TensorSpec]) -> list[tuple[int, int]]:
    """(elements, bytes each) of every chunk as delta compares it: words of the dtype's width, 8 at most."""
    out = []
    for c in bucket.chunks:
        width = min(specs[c.index].itemsize, 8)
        out.append((c.nbytes // width, width))
    return out


def ring_config(config: SyncConfig, specs: Sequence[TensorSpec]) -> SyncConfig:
    """The config a delta session's ring is made with: buffers that hold the largest bucket's encoding."""
    if not config.delta or not specs:
        return config
    buckets = plan_buckets(specs, config.bucket_bytes, config.align_bytes)
    need = max(delta.capacity(chunk_sizes(b, specs)) for b in buckets)
    return dataclasses.replace(
        config, bucket_bytes=max(config.bucket_bytes, align_up(need, config.align_bytes))
    )


class Reference:
    """The sender's half of delta mode (Note [the delta reference])."""

    def __init__(self, config: SyncConfig, ring: bool):
        self.config = config
        self.enabled = config.delta and ring  # a ring this session made (not a group's, not direct)
        self.active = (
            False  # this push runs in delta mode (a plain source: full or delta; a lazy one: neither)
        )
        self.version: int | None = None  # what the reference holds; None while a push writes it
        self.base: int | None = None  # this push's base version: None for a full push
        self.stats = DeltaStats()
        self._since_full = 0  # delta pushes since the last full one (SyncConfig.delta_full_every)
        self._layout_id, self._placed, self._fits = 0, -1, False
        self._bytes: torch.Tensor | None = None
        self._offsets: list[int] = []
        self._pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per bucket: (reference, scratch)
        self._packer: Packer | None = None

    def start(self, full: bool, lazy: bool = False) -> int | None:
        """Choose this push's encoding before anything is packed: a delta from the reference's version, unless
        ``full``, a full anchor is due, or there is no valid reference. The reference's version is None from
        here until ``finish``. A lazy source's push leaves the reference alone (and invalid)."""
        self.active = self.enabled and not lazy
        every = self.config.delta_full_every
        anchor = every > 0 and self._since_full + 1 >= every
        usable = self.active and self._fits and self._packer is not None
        self.base = self.version if usable and not full and not anchor else None
        self.version = None
        self.stats = DeltaStats(self.base, changed=None if self.base is None else 0)
        return self.base

    def demote(self) -> None:
        """This push goes full after all (a receiver cannot take the delta, or the tensors changed after the
        first buckets were encoded): whatever was applied to the reference is rewritten by the full push."""
        self.base, self.stats = None, DeltaStats()

    def prepare(self, agreed: SenderLayout, buffers: Sequence[torch.Tensor]) -> None:
        """After the layout agreement made new copies (new tensors, or a new layout): a new reference for a
        new layout, a new scratch packer for new tensors. This push is full (the copies packed ahead, if any,
        read other tensors)."""
        if not self.active:
            return
        self.demote()
        sources, specs, buckets = agreed.sources, agreed.layout.tensors, agreed.buckets
        layout_id = agreed.layout.layout_id
        device = sources[0].tensor.device if sources else torch.device("cpu")
        if layout_id != self._layout_id or self._bytes is None or self._bytes.device != device:
            self._offsets = [0]
            for b in buckets:
                self._offsets.append(self._offsets[-1] + align_up(b.nbytes, delta.PAYLOAD_ALIGN))
            self._bytes = torch.empty(self._offsets[-1], dtype=torch.uint8, device=device)
            self._layout_id, self.version = layout_id, None
            room = buffers[0].numel() if buffers else 0
            self._fits = all(delta.capacity(chunk_sizes(b, specs)) <= room for b in buckets)
            if not self._fits:
                logger.warning("delta pushes off for layout %d: its buckets' encoding does not fit the ring's "
                               "buffers of %d bytes (made for the first layout); pushes go full", layout_id, room)  # fmt: skip
        scratch = torch.empty(max((b.nbytes for b in buckets), default=0), dtype=torch.uint8, device=device)
        self._packer = Packer(buckets, sources, [scratch], self.config.cuda_graphs)
        self._pairs = []
        for k, b in enumerate(buckets):
            ref = self.bucket(k)
            self._pairs.append(
                [
                    (_words(ref, c, specs), _words(scratch, c, specs))
                    for c in b.chunks  # the same offsets in both
                ]
            )

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket k's bytes in the reference, laid out as in a ring buffer (what verify digests)."""
        return self._bytes[self._offsets[k] : self._offsets[k + 1]]

    def encode(self, k: int, buffer: torch.Tensor) -> None:
        """A delta push's bucket k: pack it into the scratch bucket, encode it into ``buffer`` against the
        reference, and apply that very encoding to the reference, as every receiver does."""
        self._packer.pack(k)
        pairs = self._pairs[k]
        code = delta.encode(pairs, buffer, base_version=self.base, max_density=self.config.delta_max_density)
        delta.decode(buffer, [ref for ref, _ in pairs], held_version=self.base)
        self.stats = self.stats.add(code)

    def keep(self, k: int, buffer: torch.Tensor, nbytes: int, payload: int) -> None:
        """A full push's bucket k, packed into ``buffer`` (``nbytes`` bytes, ``payload`` of them tensors'):
        the reference takes it."""
        self.bucket(k)[:nbytes].copy_(buffer[:nbytes])
        s = self.stats
        self.stats = DeltaStats(None, s.sent_as_delta, s.sent_as_full + payload, None, s.numel)

    def finish(self, version: int, skipped: bool) -> None:
        """Every receiver applied the push (or had the version: then the reference may hold part of this
        push's bytes over the last one's, and stays None)."""
        if not self.active or skipped:
            return
        self.version = version
        self._since_full = self._since_full + 1 if self.base is not None else 0


def _words(buffer: torch.Tensor, chunk: object, specs: Sequence[TensorSpec]) -> torch.Tensor:
    width = min(specs[chunk.index].itemsize, 8)
    return buffer[chunk.bucket_offset : chunk.bucket_offset + chunk.nbytes].view(delta.WORDS[width])
