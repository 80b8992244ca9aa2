"""Delta pushes in the push session (SyncConfig.delta, issue 24): the sender's reference of what its receivers
hold and which pushes go as a delta (what a push sent: raysync.core.delta_stats). The encoding itself is
raysync.core.delta (Note [delta pushes]); the receiver's half is a mode of its sink
(raysync.core.sink.IntoTensors) and one answer at accept.

    on_plane(plane)                   whether this session can send deltas at all (``off`` says why not)
    start(version, full) -> base      None: this push is full (the time rule may say so, and whether it ``keeps``
                                      the reference: Note [no reference while full wins] in delta_rule)
    per bucket k: encode(k, buffer)   a delta: the tensors read in place or packed into the scratch, encoded
                  keep(k, buffer)     a full push the Packer packed: copied into the reference (if it keeps it)
                  pack_full(k, buffer)   ``packs_full``: packed into the scratch, copied into ring and reference
    finish(version)                   every receiver applied it: the reference is that version (if kept), and
                                      the time rule learns what the push cost (raysync.core.delta_rule)

# Note [the delta reference]
# The reference is one uint8 tensor on the trainer's device (the device of the first tensor pushed: the GPU
# for a GPU trainer; a lazy source's: the ring's device), laid out as the buckets are: bucket k at
# ``offsets[k]``, each chunk at its ``bucket_offset``, in the wire dtype. It costs one more copy of the model
# in the wire dtype there, plus one bucket of scratch (a bucket that needs a cast -- fp32 master -> bf16 -- is
# packed there first, so it is compared in the bits receivers hold; one that needs none is read in place: Note
# [a delta read in place] in raysync.core.delta_reference). Its version is None from ``start`` until
# ``finish``: a push that fails, is skipped or is demoted part-way leaves None, and the next push is full for
# every receiver. A full push in delta mode rewrites all of it (packed through the scratch when the ring
# lives on another device, so the bytes cross to the ring once and never back), unless the time rule keeps none
# (Note [no reference while full wins] in raysync.core.delta_rule); a delta push advances it by each bucket's
# encoding on its device (the FULL payloads, the GAPS values at their indices), which is what every receiver
# holds after decoding (Note [the reference advances by the encoding]). A new layout makes a new reference
# (version None), with encode's workspace (a mask of the largest bucket's elements; a staging buffer of its
# encoding when the ring lives on another device).
# Where deltas go (``on_plane``; ``off`` names the reason, logged once, when they cannot):
# * a ring the session makes (shm, cuda_ipc): its buffers are made larger by the header, table and padding of
#   the largest bucket of the first layout (``ring_config`` in raysync.core.delta_buffers); a later layout
#   whose buckets do not fit pushes full (``off`` says so).
# * the collective (a broadcast group, ``transport.collective``): its buffers grow to the layout's
#   ``buffer_bytes`` when the layout is placed, and it broadcasts only a bucket's encoded bytes (the plane's
#   ``encoded(k, nbytes)``: its table first, then the rest, whose size the table says). A broadcast moves the
#   group together, so one receiver not at the base makes that round full for the whole group: a full
#   broadcast serves the others as well as the one, and costs what the one's full push would have.
# * a cuda_ipc ring read on the trainer's own GPU, under the time rule, never (delta_rule.ONE_GPU_OFF): its full push is
#   two device copies, which the delta's compare costs alone (H200, 7B: the measuring delta 235.5 ms, full
#   pushes 30-34 ms). Readers on a peer GPU pull a full push over NVLink, where a delta may win: the rule decides.
# * direct mode (cuda_ipc_direct: the receiver copies the trainer's tensors in place) never: the compare reads
#   the reference and the new bytes once each, more than direct mode's one copy (H200: encode + decode 29-37x
#   that copy, docs/benchmarks.md 12, with the encoder of e0d7e7a).
# * a lazy source (sources/: a manifest, FSDP2 / tensor-parallel): its packer is made a second time over the
#   scratch bucket (``source.packer(config, buckets, [scratch])``) and every push in delta mode packs through
#   it: a delta is encoded from the scratch, a full push is copied from the scratch into the ring and the
#   reference. A delta push of a lazy source packs nothing ahead of PushStart: if a receiver then needs a full
#   push, the packer walks its buckets once, in order (Note [every rank walks the same buckets] in sources.walk).
# * N readers of one shm ring (fan-out) that do not all take the delta are served in turns, in the same push:
#   the delta to those that take it (the others wait for their go), then a full push to the rest. The sender
#   packs twice; the report counts the bytes of both turns, as a push from no single base. A lazy source's push
#   goes full for all instead (its packer walks once a push). WeightSync makes one session per pair.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from raysync.core.config import SyncConfig
from raysync.core.delta_changes import SPARSE_DENSITY
from raysync.core.delta_encode import Changes, encode, find_changes
from raysync.core.delta_reference import ReferenceBytes
from raysync.core.delta_rule import DIRECT_OFF, NOT_KEPT, ONE_GPU_OFF, StageClock, TimeRule, decide
from raysync.core.delta_stats import DeltaStats
from raysync.core.delta_workspace import CopyOut
from raysync.core.source import Packer, Source, SourcePacker

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout

logger = logging.getLogger(__name__)


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
        self._started = self._streaming = 0.0  # this push's start; its buckets' clock (``accepted``)
        self._measured, self._figure = False, True  # the rule learns from it; its time is its kind's figure
        self._usable = False  # this push could be a delta (a reference of this layout and its packer)
        self._refused = False  # this push was chosen a delta and a receiver could not take it (``demote``)
        self._refusals = 0  # delta pushes refused since the last one every receiver took
        self._full_from: int | None = None  # this delta push's buckets from this one on go full
        self.keeps, self._unkept = True, False  # rewrites the reference; the last push did not, by choice
        self._ref: ReferenceBytes | None = None
        self._source: Source | None = None
        self._packer: Packer | SourcePacker | None = None
        self._in_place: list[list | None] = []  # per bucket: chunks encoded from the trainer's tensors
        # the changes of the next two buckets, found while a bucket's bytes cross (Notes [the next bucket's
        # compare overlaps this one's copy] and [two buckets in flight] in raysync.core.delta_encode), by bucket
        self._ahead: dict[int, Changes] = {}
        self._staged: dict[int, tuple[int, torch.cuda.Event]] = {}  # by bucket, ``stage``'s bytes and end
        self.found_ahead = 0  # buckets of this push whose changes were found so

    def on_plane(self, plane: object, made_here: bool) -> None:
        """The session's plane is known: a ring it made, or a given plane that moves encoded buckets (the
        collective: ``encoded``), carries deltas; direct mode does not (Note [the delta reference])."""
        if not self.config.delta:
            return
        if plane.reads_in_place:
            self.off = DIRECT_OFF
        elif self.config.delta_by_time and getattr(plane.transport, "one_gpu", False):
            # its measuring delta push would take ~7x a full one (docs/benchmarks.md, section 12)
            self.off = ONE_GPU_OFF
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
        self._started = self._streaming = time.perf_counter()
        usable = self.active and self._ref is not None and self._ref.fits and self._packer is not None
        self._measured = self._usable = usable
        self._refused, self._full_from = False, None
        self._ahead, self._staged, self.found_ahead = {}, {}, 0
        based = usable and self.version is not None  # Note [no reference while full wins] in delta_rule
        c = decide(self.config, self.rule, usable, based, full, self._since_full, self.lazy, self._unkept)
        as_delta, why, self.keeps, self._figure = c.delta, c.why, c.keeps, c.figure
        self.base, self.version = (self.version if as_delta else None), None
        self.stats = DeltaStats(self.base, changed=None if self.base is None else 0, why=why)
        self.clock.start(self._ref.device if self._ref is not None else None)
        return self.base

    def accepted(self) -> None:
        """The receivers accepted this push: its buckets' clock starts (Note [a delta push that falls behind])."""
        self._streaming = time.perf_counter()

    def demote(self, why: str = "a receiver needs a full push", refused: bool = True) -> None:
        """This push goes full after all (a receiver cannot take the delta, or the tensors changed after the
        first buckets were encoded): whatever was applied to the reference is rewritten by the full push.
        ``refused``: a receiver's answer demoted it (the stream's go_full), not new tensors or a new layout."""
        self._refused = refused and (self._refused or self.base is not None)
        self.base, self._measured = None, False
        self.stats = DeltaStats(why=why if self.keeps else f"{why}; {NOT_KEPT}")
        self._ahead = {}
        self.drain()  # no encoding still crossing into a buffer the full push packs

    def prepare(self, agreed: SenderLayout, buffers: Sequence[torch.Tensor]) -> None:
        """After the layout agreement made new copies (new tensors, or a new layout): a new reference for a
        new layout, a new scratch packer for new tensors. This push is full (the copies packed ahead, if any,
        read other tensors)."""
        if not self.active:
            return
        self.demote("new tensors or a new layout: full", refused=False)
        sources = agreed.sources
        self._new_layout(agreed, buffers, sources[0].tensor.device if sources else torch.device("cpu"))
        self._packer = Packer(agreed.buckets, sources, [self._ref.scratch], self.config.cuda_graphs)
        self._in_place = self._ref.in_place(agreed.buckets, sources)  # Note [a delta read in place]
        self._source = None

    def prepare_source(self, agreed: SenderLayout, source: Source, buffers: Sequence[torch.Tensor]) -> None:
        """A lazy source's push in delta mode: its scratch packer, made again for a new layout or a new
        source (then this push is full)."""
        ref = self._ref
        if not self.active or (source is self._source and ref and agreed.layout.layout_id == ref.layout_id):
            return
        self.demote("a new source or layout: full", refused=False)
        self._new_layout(agreed, buffers, buffers[0].device)
        self._packer = source.packer(self.config, agreed.buckets, [self._ref.scratch])
        self._in_place = [None] * len(agreed.buckets)
        self._source = source

    def _new_layout(
        self, agreed: SenderLayout, buffers: Sequence[torch.Tensor], device: torch.device
    ) -> None:
        ref = self._ref
        if ref is not None and ref.layout_id == agreed.layout.layout_id and ref.device == device:
            return  # new tensors of the same layout: the same reference, scratch and workspace
        self._ref = ReferenceBytes(agreed, buffers, device)
        self.version, self.off = None, self._ref.off
        if self.off:
            logger.warning("delta pushes off: %s", self.off)

    def merge(self, first: DeltaStats) -> None:
        """A push served in turns: what the delta turn (``first``) sent, with the full turn's bytes."""
        self.stats = first.in_turns(self.stats.sent_as_full)

    def bucket(self, k: int) -> torch.Tensor:
        """Bucket k's bytes in the reference, laid out as in a ring buffer (what verify digests)."""
        return self._ref.bucket(k)

    @property
    def packs_full(self) -> bool:
        """A full push in delta mode packs through the scratch (then one copy into the ring, one into the
        reference) instead of copying the ring into the reference: a lazy source, or a ring on another device
        than the reference (a host ring of a GPU trainer: that copy would cross PCIe a second time); not a push
        that keeps no reference (the Packer packs the ring, as without delta mode)."""
        other = self._ref is not None and self._ref.ring_device != self._ref.device
        return self.keeps and (self.lazy or other)

    @property
    def stages(self) -> bool:
        """Each bucket is encoded into a staging buffer on the trainer's GPU ahead of its claim (``stage``), then
        copied across (``send``, ``copied``): Note [a bucket is encoded while ...] in delta_workspace."""
        return self.active and self.base is not None and self._ref is not None and self._looks_ahead

    def stage(self, k: int, ahead: bool = True) -> None:
        """Encode bucket k of a delta push into staging buffer k % 2 (``stages``); ``ahead=False``: the caller
        calls ``find_ahead`` (Note [publish, then look ahead] in sender_stream)."""
        if k not in self._staged:
            target = self._ref.staging(k % 2)
            nbytes, written = self.encode(k, target), torch.cuda.Event()  # the copy across waits for it
            written.record(torch.cuda.current_stream(target.device))
            self._staged[k] = (nbytes, written)
            if ahead:  # queued after this bucket's payloads (Note [two buckets in flight])
                self.find_ahead(k)

    def send(self, k: int, buffer: torch.Tensor) -> int:
        """Bucket k, staged (``stage``), on its way into ``buffer`` on the copy stream; ``copied(k)`` waits for
        it. Returns the bytes of ``buffer`` the encoding uses."""
        self.stage(k)
        nbytes, written = self._staged.pop(k)
        self.clock.restart()
        staged = self._ref.space.buffers[k % 2][:nbytes]
        CopyOut(buffer, staged, 0, self._ref.space, k % 2, written).finish(nbytes, wait=False)
        self.clock.mark("copy queued")
        return nbytes

    def copied(self, k: int) -> None:
        """Wait until bucket k's encoding is in its ring buffer (``send``)."""
        self.clock.restart()
        self._ref.space.wait_copied(k % 2)
        self.clock.mark("copy out")

    def drain(self) -> None:
        """No encoding crosses into a ring buffer once this returns (a failed, skipped or demoted push, a
        close). A failure to wait (a CUDA error, which leaves nothing running) is logged, not raised: this runs
        on the way out of another error."""
        self._staged = {}
        if self._ref is not None:
            try:
                self._ref.space.wait_copied()
            except Exception:
                logger.warning("delta: waiting for the copies into the ring failed", exc_info=True)

    def encode(self, k: int, buffer: torch.Tensor) -> int:
        """A delta push's bucket k: pack it into the scratch bucket (unless it is read in place: Note [a delta
        read in place] in raysync.core.delta_reference), encode it into ``buffer`` against the reference (on
        the reference's device, crossing to ``buffer``'s once: Note [where a delta is encoded] in
        raysync.core.delta_encode), and the reference advances by the encoding (Note [the reference advances
        by the encoding]). Returns the bytes of ``buffer`` the encoding uses."""
        ref, mark = self._ref, self.clock.mark
        self.clock.restart()
        changes = self._ahead.pop(k, None)
        slot = k % 2 if self._looks_ahead else 0  # Note [two buckets in flight] in raysync.core.delta_encode
        in_place = self._read_in_place(k)
        sparse = False
        if changes is None:
            if in_place is None:
                self._packer.pack(k)
                mark("pack")
            sparse, ref.sparse[k] = ref.sparse[k], False  # a failed encode leaves no hint behind
            based = self._on_time(k)
        else:
            based = changes.based
            self.found_ahead += 1
        code = encode(
            ref.pairs[k] if in_place is None else in_place,
            buffer,
            base_version=self.base if based else None,
            max_density=self.config.delta_max_density,
            space=ref.space,
            mark=mark,
            sparse=sparse,
            advance=True,  # Note [the reference advances by the encoding] in raysync.core.delta_encode
            changes=changes,
            slot=slot,
        )
        # Note [listing instead of counting]: torch's path lists a sparse bucket at the next push
        density = code.density
        ref.sparse[k] = density is not None and density <= SPARSE_DENSITY
        self.stats = self.stats.add(code)
        return code.nbytes

    @property
    def _looks_ahead(self) -> bool:
        """A reference on a GPU and a ring elsewhere (host memory, another GPU): each bucket's bytes cross on a
        copy stream, and buckets are staged (``stages``) and their changes found ahead (``find_ahead``)."""
        return self._ref.device.type == "cuda" and self._ref.ring_device != self._ref.device

    def find_ahead(self, k: int) -> None:
        """Once bucket k is staged, start finding the changes of the two buckets after it (Notes [the next
        bucket's compare overlaps this one's copy] and [two buckets in flight] in raysync.core.delta_encode):
        only buckets read in place, which need no packing (packing one into the scratch would overwrite what
        verify digests of the bucket before). A failure here fails the push: a compare may have advanced the
        reference already (Note [the reference advances at the compare] in raysync.core.delta_kernels), and
        comparing that bucket again would find none of those changes; a failed push leaves the reference at no
        version, so the next push is full."""
        for j in (k + 1, k + 2):
            pairs = self._read_in_place(j) if j < len(self._ref.offsets) - 1 else None
            if pairs is None or j in self._ahead:
                continue
            sparse, self._ref.sparse[j] = self._ref.sparse[j], False
            self._ahead[j] = find_changes(
                pairs,
                based=self._on_time(j),
                space=self._ref.space,
                sparse=sparse,
                slot=j % 2,
                wait=False,
                advance=True,  # Note [the reference advances at the compare] in delta_kernels
            )

    def _read_in_place(self, k: int) -> list | None:
        """Bucket k's (reference, trainer's tensor) chunk pairs when it is read in place, else None."""
        return None if self.lazy or not self._in_place else self._in_place[k]

    def meant(self, k: int) -> list[torch.Tensor]:
        """A delta push's bucket k as the trainer meant it, a uint8 view per chunk: its tensors read in place, or
        the scratch it was packed into (what verify digests: Note [the reference advances by the encoding])."""
        pairs = self._read_in_place(k) or self._ref.pairs[k]
        return [new.view(torch.uint8) for _, new in pairs]

    def _on_time(self, k: int) -> bool:
        """Whether bucket k of this delta push goes as a delta: False from the bucket at which the push fell
        behind a full push (Note [a delta push that falls behind] in raysync.core.delta_rule)."""
        if self._full_from is not None:
            return k < self._full_from
        by_time = k > 0 and self.config.delta_by_time
        elapsed = time.perf_counter() - self._streaming
        why = self.rule.behind(elapsed, self._ref.offsets[k]) if by_time else None
        if why is None:
            return True
        self._full_from = k
        n = len(self._ref.offsets) - 1
        self.stats = dataclasses.replace(
            self.stats, why=f"{self.stats.why}; buckets {k}..{n - 1} of {n} full: {why}".lstrip("; ")
        )
        return False

    def keep(self, k: int, buffer: torch.Tensor, nbytes: int, payload: int) -> None:
        """A full push's bucket k, packed into ``buffer`` (``nbytes`` bytes, ``payload`` of them tensors'):
        the reference takes it, unless this push does not keep it (the stage clock times this copy only)."""
        if self.keeps:
            self.clock.restart()
            self.bucket(k)[:nbytes].copy_(buffer[:nbytes])
            self.clock.mark("reference")
        self.stats = self.stats.add_full(payload)

    def pack_full(self, k: int, buffer: torch.Tensor, nbytes: int, payload: int) -> None:
        """A full push's bucket k packed through the scratch (``packs_full``): copied into ``buffer`` and
        kept."""
        self.clock.restart()
        self._packer.pack(k)
        self.clock.mark("pack")
        buffer[:nbytes].copy_(self._ref.scratch[:nbytes])
        self.clock.mark("copy out")
        self.keep(k, self._ref.scratch, nbytes, payload)

    def finish(self, version: int, skipped: bool) -> None:
        """Every receiver applied the push (or had the version: then the reference may hold part of this
        push's bytes over the last one's, and stays None). The time rule learns what it cost."""
        if not self.active or skipped:
            return
        if self._refused:
            self._refusals += 1
        elif self.base is not None:  # every receiver took the delta
            self._refusals = 0
        refused_again = self._refused and self._usable and self._refusals >= 2
        if (self._measured or refused_again) and self.config.delta_by_time:
            delta = self.base is not None or refused_again  # refused again: what choosing a delta costs here
            seconds = time.perf_counter() - self._started
            self.rule.observe(delta, seconds, self._ref.offsets[-1], figure=self._figure)
        self.version, self._unkept = (version, False) if self.keeps else (None, True)
        self._since_full = self._since_full + 1 if self.base is not None else 0
