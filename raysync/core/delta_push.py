"""Delta pushes in the push session (SyncConfig.delta, issue 24): the sender's reference of what its receivers
hold, which pushes go as a delta, and what a push sent. The encoding itself is raysync.core.delta (Note [delta
pushes]); the receiver's half is a mode of its sink (raysync.core.sink.IntoTensors) and one answer at accept.

    sender   on_plane(plane)          whether this session can send deltas at all (``off`` says why not)
             start(version, full)  ->  base version (None: this push is full; the time rule may say so)
             per bucket k: encode(k, ring buffer)  (a delta push: pack into the scratch bucket, encode into
                           the ring, the reference takes the scratch's bytes)
                        or keep(k, ring buffer)    (a full push: the Packer packed the ring; copy it into the
                           reference) / pack_full(k, ring buffer) (``packs_full``: packed into the scratch,
                           copied into the ring and the reference)
             finish(version) once every receiver applied the push: the reference is that version, and the
                           time rule learns what the push cost (raysync.core.delta_rule)

# Note [the delta reference]
# The reference is one uint8 tensor on the trainer's device (the device of the first tensor pushed: the GPU
# for a GPU trainer; a lazy source's: the ring's device), laid out as the buckets are: bucket k at
# ``offsets[k]``, each chunk at its ``bucket_offset``, in the wire dtype. It costs one more copy of the model
# in the wire dtype there, plus one bucket of scratch (a delta is packed there first, so a cast -- fp32
# master -> bf16 -- is compared in the bits receivers hold). Its version is None from ``start`` until
# ``finish``: a push that fails, is skipped or is demoted part-way leaves None, and the next push is full for
# every receiver. A full push in delta mode rewrites all of it (packed through the scratch when the ring
# lives on another device, so the bytes cross to the ring once and never back); a delta push copies each
# bucket's new bytes into it on its device, which is what every receiver holds after decoding (Note [delta
# pushes]). A new layout makes a new reference (version None), with encode's workspace (a mask of the
# largest bucket's elements; a staging buffer of its encoding when the ring lives on another device).
# Where deltas go (``on_plane``; ``off`` names the reason, logged once, when they cannot):
# * a ring the session makes (shm, cuda_ipc): its buffers are made larger by the header, table and padding of
#   the largest bucket of the first layout (``ring_config``); a later layout whose buckets do not fit pushes
#   full (``off`` says so).
# * the collective (a broadcast group, ``transport.collective``): its buffers grow to the layout's
#   ``buffer_bytes`` when the layout is placed, and it broadcasts only a bucket's encoded bytes (the plane's
#   ``encoded(k, nbytes)``: its table first, then the rest, whose size the table says). A broadcast moves the
#   group together, so one receiver not at the base makes that round full for the whole group: a full
#   broadcast serves the others as well as the one, and costs what the one's full push would have.
# * direct mode (cuda_ipc_direct: the receiver copies the trainer's tensors in place) never: encoding a
#   bucket reads its reference and its new bytes at least once each (the compare), already more than the
#   one copy of its full bytes that direct mode makes, so a delta can never beat it (docs/benchmarks.md,
#   section 12, measured encode + decode at 29-37x that copy on an H200, with the encoder of e0d7e7a).
# * a lazy source (sources/: a manifest, FSDP2 / tensor-parallel): its packer is made a second time over the
#   scratch bucket (``source.packer(config, buckets, [scratch])``) and every push in delta mode packs through
#   it: a delta is encoded from the scratch, a full push is copied from the scratch into the ring and the
#   reference (one more copy of each bucket, on full pushes only). A delta push of a lazy source packs nothing
#   ahead of PushStart: if a receiver then needs a full push, the packer walks its buckets once, in order
#   (Note [every rank walks the same buckets] in raysync.sources.walk).
# * N readers of one shm ring (fan-out) that do not all take the delta are served in turns, in the same push:
#   the delta to those that take it (the others wait for their go), then a full push to the rest (those that
#   took the delta are not in it). The sender packs twice; the report counts the bytes of both turns, as a
#   push from no single base. A lazy source's push goes full for all instead (its packer walks once a push). WeightSync makes one session per pair, so there each pair goes its own way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from raysync.core import delta
from raysync.core.config import SyncConfig
from raysync.core.delta_encode import Workspace, encode
from raysync.core.delta_rule import StageClock, TimeRule
from raysync.core.plan import Bucket, align_up, plan_buckets
from raysync.core.source import Packer, Source, SourcePacker
from raysync.core.wire import TensorSpec

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout

logger = logging.getLogger(__name__)

DIRECT_OFF = (
    "direct mode reads the trainer's tensors in place with one copy each; encoding a delta reads the "
    "reference and the new bytes at least once each, more than that copy, so its pushes go full"
)


@dataclass(frozen=True)
class DeltaStats:
    """What one push sent, summed over its buckets (raysync.core.delta.BucketCode's fields), and why."""

    base_version: int | None = None  # the version the deltas were computed from (None: a full push)
    sent_as_delta: int = 0  # SAME and GAPS payloads, headers, tables, padding
    sent_as_full: int = 0  # FULL payloads (a full push: every tensor byte)
    changed: int | None = None  # elements whose bits changed (known for delta pushes only)
    numel: int = 0
    why: str = ""  # why the push went full, or why the time rule let it be a delta (Note [the density ...])
    full_by_size: int = 0  # FULL payloads of a delta push whose gaps would not have been smaller
    full_by_density: int = 0  # FULL payloads of a delta push denser than SyncConfig.delta_max_density

    @property
    def density(self) -> float | None:
        return None if self.changed is None else self.changed / max(self.numel, 1)

    @property
    def explain(self) -> str:
        """Which rule sent what full, and why: the report's words."""
        parts = [self.why] if self.why else []
        for rule, nbytes in (("size", self.full_by_size), ("density", self.full_by_density)):
            if nbytes:
                parts.append(f"{nbytes / 1e6:.2f} MB full by {rule}")
        return "; ".join(parts)

    def add(self, code: delta.BucketCode) -> DeltaStats:
        changed = code.changed
        return dataclasses.replace(
            self,
            sent_as_delta=self.sent_as_delta + code.sent_as_delta,
            sent_as_full=self.sent_as_full + code.sent_as_full,
            changed=None if self.changed is None or changed is None else self.changed + changed,
            numel=self.numel + code.numel,
            full_by_size=self.full_by_size + code.full_by("size"),
            full_by_density=self.full_by_density + code.full_by("density"),
        )


def chunk_sizes(bucket: Bucket, specs: Sequence[TensorSpec]) -> list[tuple[int, int]]:
    """(elements, bytes each) of every chunk as delta compares it: words of the dtype's width, 8 at most."""
    out = []
    for c in bucket.chunks:
        width = min(specs[c.index].itemsize, 8)
        out.append((c.nbytes // width, width))
    return out


def table_bytes(bucket: Bucket) -> int:
    """Where bucket k's first payload starts in its encoding: the header and table, padded (what a plane that
    moves only the bytes used sends first: the header says how many follow)."""
    return align_up(delta.HEADER_BYTES + delta.ROW_BYTES * len(bucket.chunks), delta.PAYLOAD_ALIGN)


def buffer_bytes(specs: Sequence[TensorSpec], bucket_bytes: int, align_bytes: int) -> int:
    """The buffer size that holds the encoding of every bucket of this layout (at least ``bucket_bytes``)."""
    if not specs:
        return bucket_bytes
    buckets = plan_buckets(specs, bucket_bytes, align_bytes)
    need = max(delta.capacity(chunk_sizes(b, specs)) for b in buckets)
    return max(bucket_bytes, align_up(need, align_bytes))


def ring_config(config: SyncConfig, specs: Sequence[TensorSpec]) -> SyncConfig:
    """The config a delta session's ring is made with: buffers that hold the largest bucket's encoding."""
    if not config.delta or not specs:
        return config
    need = buffer_bytes(specs, config.bucket_bytes, config.align_bytes)
    return dataclasses.replace(config, bucket_bytes=need)


class Reference:
    """The sender's half of delta mode (Note [the delta reference])."""

    def __init__(self, config: SyncConfig):
        self.config = config
        self.enabled = config.delta  # this session's plane can carry deltas (on_plane)
        self.off: str | None = None  # why not, when delta was asked for and this session cannot send one
        self.active = False  # this push runs in delta mode (full or delta)
        self.lazy = False  # this push's source is lazy: it packs through the reference's scratch packer
        self.version: int | None = None  # what the reference holds; None while a push writes it
        self.base: int | None = None  # this push's base version: None for a full push
        self.stats = DeltaStats()
        self.rule = TimeRule()  # Note [the density rule by time] (raysync.core.delta_rule)
        self.clock = StageClock()  # per-stage seconds of a push, when enabled (benchmarks)
        self._since_full = 0  # delta pushes since the last full one (SyncConfig.delta_full_every)
        self._layout_id, self._fits, self._source = 0, False, None
        self._started, self._measured = 0.0, False  # this push's start, and whether the rule learns from it
        self._bytes: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None
        self._space: Workspace | None = None  # encode's work tensors, reused by every push
        self._ring_device: torch.device | None = None
        self._offsets: list[int] = []
        self._sizes: list[int] = []  # per bucket: its bytes, padding between chunks included
        self._pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per bucket: (reference, scratch)
        self._packer: Packer | SourcePacker | None = None

    def on_plane(self, plane: object, made_here: bool) -> None:
        """The session's plane is known: a ring it made, or a given plane that moves encoded buckets (the
        collective: ``encoded``), carries deltas; direct mode does not (Note [the delta reference])."""
        if not self.config.delta:
            return
        if plane.reads_in_place:
            self.off = DIRECT_OFF
        elif not made_here and not hasattr(plane, "encoded"):
            self.off = f"the {plane.name} plane moves whole buffers only, so its pushes go full"
        self.enabled = self.off is None
        self.active = self.active and self.enabled  # the push under way (the first: it opened the plane) too
        if self.off:
            logger.warning("delta pushes off: %s", self.off)

    @property
    def source_packer(self) -> SourcePacker | None:
        """A lazy source's packer over the scratch bucket, which packs every push in delta mode."""
        return self._packer if self.active and self.lazy else None

    def start(self, full: bool, lazy: bool = False) -> int | None:
        """Choose this push's encoding before anything is packed: a delta from the reference's version, unless
        ``full``, a full anchor is due, there is no valid reference, or the time rule measured full pushes
        faster (Note [the density rule by time]). The reference's version is None from here until ``finish``."""
        self.active, self.lazy = self.enabled, lazy
        self._started = time.perf_counter()
        every = self.config.delta_full_every
        usable = self.active and self._fits and self._packer is not None
        self._measured = usable
        as_delta, why = False, ""
        if not usable or self.version is None:
            why = "no reference of the receivers' version: full"
        elif full:
            why = "full=True"
        elif every > 0 and self._since_full + 1 >= every:
            why = f"an anchor (delta_full_every={every})"
        elif self.config.delta_by_time:
            as_delta, why = self.rule.choose()
        else:
            as_delta = True
        self.base = self.version if as_delta else None
        self.version = None
        self.stats = DeltaStats(self.base, changed=None if self.base is None else 0, why=why)
        self.clock.start(self._bytes.device if self._bytes is not None else None)
        return self.base

    def demote(self, why: str = "a receiver needs a full push") -> None:
        """This push goes full after all (a receiver cannot take the delta, or the tensors changed after the
        first buckets were encoded): whatever was applied to the reference is rewritten by the full push."""
        self.base, self.stats, self._measured = None, DeltaStats(why=why), False

    def prepare(self, agreed: SenderLayout, buffers: Sequence[torch.Tensor]) -> None:
        """After the layout agreement made new copies (new tensors, or a new layout): a new reference for a
        new layout, a new scratch packer for new tensors. This push is full (the copies packed ahead, if any,
        read other tensors)."""
        if not self.active:
            return
        self.demote("new tensors or a new layout: full")
        sources = agreed.sources
        device = sources[0].tensor.device if sources else torch.device("cpu")
        self._new_layout(agreed, buffers, device)
        self._packer = Packer(agreed.buckets, sources, [self._scratch], self.config.cuda_graphs)
        self._source = None

    def prepare_source(self, agreed: SenderLayout, source: Source, buffers: Sequence[torch.Tensor]) -> None:
        """A lazy source's push in delta mode: its scratch packer, made again for a new layout or a new
        source (then this push is full)."""
        if not self.active or (source is self._source and agreed.layout.layout_id == self._layout_id):
            return
        self.demote("a new source or layout: full")
        self._new_layout(agreed, buffers, buffers[0].device)
        self._packer = source.packer(self.config, agreed.buckets, [self._scratch])
        self._source = source

    def _new_layout(
        self, agreed: SenderLayout, buffers: Sequence[torch.Tensor], device: torch.device
    ) -> None:
        specs, buckets, layout_id = agreed.layout.tensors, agreed.buckets, agreed.layout.layout_id
        if layout_id != self._layout_id or self._bytes is None or self._bytes.device != device:
            self._offsets = [0]
            for b in buckets:
                self._offsets.append(self._offsets[-1] + align_up(b.nbytes, delta.PAYLOAD_ALIGN))
            self._bytes = torch.empty(self._offsets[-1], dtype=torch.uint8, device=device)
            self._layout_id, self.version = layout_id, None
            room = buffers[0].numel() if buffers else 0
            self._fits = all(delta.capacity(chunk_sizes(b, specs)) <= room for b in buckets)
            self.off = None
            if not self._fits:
                self.off = (
                    f"layout {layout_id}: its buckets' encoding does not fit the plane's buffers of {room} "
                    f"bytes (made for the first layout), so its pushes go full"
                )
                logger.warning("delta pushes off: %s", self.off)
        self._sizes = [b.nbytes for b in buckets]
        size = max(self._sizes, default=0)
        self._scratch = torch.empty(size, dtype=torch.uint8, device=device)
        sizes = [chunk_sizes(b, specs) for b in buckets]
        self._space = Workspace.for_buckets(sizes, device)
        self._ring_device = buffers[0].device if buffers else device
        if self._ring_device != device:  # encoded here first, then copied (Note [where a delta is encoded])
            self._space.staging(max((delta.capacity(c) for c in sizes), default=0), device)
        self._scratch.zero_()  # these pages are faulted in now, not in the first delta push (the time rule's)
        self._space.touch()
        self._pairs = [
            [(_words(self.bucket(k), c, specs), _words(self._scratch, c, specs)) for c in b.chunks]
            for k, b in enumerate(buckets)
        ]  # the same offsets in both

    def merge(self, first: DeltaStats) -> None:
        """A push served in turns: what the delta turn (``first``) sent, with the full turn's bytes."""
        full = self.stats.sent_as_full
        why = f"in turns: the delta turn: {first.explain}" if first.explain else "in turns"
        self.stats = dataclasses.replace(
            first, base_version=None, sent_as_full=first.sent_as_full + full, changed=None, why=why
        )

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket k's bytes in the reference, laid out as in a ring buffer (what verify digests)."""
        return self._bytes[self._offsets[k] : self._offsets[k + 1]]

    @property
    def packs_full(self) -> bool:
        """A full push in delta mode packs through the scratch (then one copy into the ring, one into the
        reference) instead of copying the ring into the reference: a lazy source, or a ring on another device
        than the reference (a host ring of a GPU trainer: that copy would cross PCIe a second time)."""
        return self.lazy or (self._bytes is not None and self._ring_device != self._bytes.device)

    def encode(self, k: int, buffer: torch.Tensor) -> int:
        """A delta push's bucket k: pack it into the scratch bucket, encode it into ``buffer`` against the
        reference (on the reference's device, crossing to ``buffer``'s once: Note [where a delta is encoded]
        in raysync.core.delta_encode), and the reference takes the new bytes (Note [delta pushes]). Returns
        the bytes of ``buffer`` the encoding uses."""
        self.clock.restart()
        self._packer.pack(k)
        self.clock.mark("pack")
        pairs, cap = self._pairs[k], self.config.delta_max_density
        code = encode(
            pairs, buffer, base_version=self.base, max_density=cap, space=self._space, mark=self.clock.mark
        )
        size = self._sizes[k]
        self.bucket(k)[:size].copy_(self._scratch[:size])
        self.clock.mark("reference")
        self.stats = self.stats.add(code)
        return code.nbytes

    def keep(self, k: int, buffer: torch.Tensor, nbytes: int, payload: int) -> None:
        """A full push's bucket k, packed into ``buffer`` (``nbytes`` bytes, ``payload`` of them tensors'):
        the reference takes it (the stage clock times this copy only: the Packer's is the push's rest)."""
        self.clock.restart()
        self.bucket(k)[:nbytes].copy_(buffer[:nbytes])
        self.clock.mark("reference")
        s = self.stats
        self.stats = dataclasses.replace(
            s, base_version=None, sent_as_full=s.sent_as_full + payload, changed=None
        )

    def pack_full(self, k: int, buffer: torch.Tensor, nbytes: int, payload: int) -> None:
        """A full push's bucket k packed through the scratch (``packs_full``): copied into ``buffer`` and
        kept."""
        self.clock.restart()
        self._packer.pack(k)
        self.clock.mark("pack")
        buffer[:nbytes].copy_(self._scratch[:nbytes])
        self.clock.mark("copy out")
        self.keep(k, self._scratch, nbytes, payload)

    def finish(self, version: int, skipped: bool) -> None:
        """Every receiver applied the push (or had the version: then the reference may hold part of this
        push's bytes over the last one's, and stays None). The time rule learns what it cost."""
        if not self.active or skipped:
            return
        if self._measured and self.config.delta_by_time:
            self.rule.observe(self.base is not None, time.perf_counter() - self._started, self._offsets[-1])
        self.version = version
        self._since_full = self._since_full + 1 if self.base is not None else 0


def _words(buffer: torch.Tensor, chunk: object, specs: Sequence[TensorSpec]) -> torch.Tensor:
    width = min(specs[chunk.index].itemsize, 8)
    return buffer[chunk.bucket_offset : chunk.bucket_offset + chunk.nbytes].view(delta.WORDS[width])
