"""Delta pushes (issue 24): one bucket's tensors encoded as the elements whose bits changed since the version
the receiver holds, and decoded by a scatter into the receiver's tensors, in place. Pure functions of tensors;
the session plugs them into its pack and unpack stages (Note [delta pushes]). This module is the format and
the receiver's half (decode and its checks); the sender's half is raysync.core.delta_encode.

    delta_encode.encode(pairs, out, base_version=v)  ->  BucketCode   (pairs: (reference as of v, new) per chunk)
    decode(buffer, destinations, held_version=v)  ->  BucketCode   (the destinations hold version v)

# Note [delta pushes]
# The encoding. A bucket buffer holds a header, a table of one row per chunk and the chunks' payloads:
#
#     0        32            32 + 32 k     (each payload at a multiple of 16)
#     +--------+-------------+-------------+----------------------+----------+---
#     | header | table       | payload 0   | payload 1            | (none)   | ...
#     +--------+-------------+-------------+----------------------+----------+---
#     header: int64 [MAGIC, base_version (-1: none), k chunks, bytes used (to the last payload's end)]
#     row:    int64 [mode, numel, itemsize, entries]
#     FULL payload: the new bytes, as a full push sends them
#     SAME payload: nothing (no element changed)
#     GAPS payload: int16 [entries] (gap - 1 - 32768), padded to 16 bytes, then the entries' new values
#
# An entry is an element index i_j and its new bits; gaps are i_j - i_{j-1} (i_{-1} = -1), each stored in 16
# bits. A gap can never be longer than 65536 because every element at index 65535 mod 65536 is an entry,
# changed or not (an unchanged one rewrites its own bits): 4 bytes per 65536 elements, no escape code, and the
# decoder has one case. Indices are a running sum of gaps >= 1, so they increase strictly: duplicates cannot
# be written down, and an index past the destination is refused (with every other check, for the whole
# bucket) before anything is written. Comparisons are on the bits (int16 / int32 views), never on values:
# NaN payloads, -0.0 and sign flips travel like any other change. Why gaps and not a bitmask with the values:
# gaps cost 2 bytes per change, a bitmask 1 bit per element, so gaps are smaller below 6.25% changed
# (where issue 24 expects RL steps to be) and larger above; the gaps decoder has one case and unpacks no
# bits, and decoded faster than the bitmask's at every density benchmarks/bench_delta.py measured on a CPU
# (it times both side by side; their encodes were close). The density rule, per chunk:
# FULL when the GAPS payload would not be smaller than the full bytes ("size"), or the changed fraction is
# above ``max_density`` ("density": a user's cap). Whether a push is encoded at all is decided by time, from
# what the sender measured on its plane (raysync.core.delta_rule, Note [the density rule by time]).
#
# How it plugs into the push (raysync.core.delta_push, Note [the delta reference], says what was built of it):
# * The reference: the sender keeps the wire-dtype bytes of the last version it pushed, one tensor per
#   layout, laid out as the buckets are (chunk views of it pair with the source's chunks). On the trainer's GPU
#   when there is room for it (one more copy of the model in the wire dtype: 2 bytes per parameter in bf16),
#   else in registered (pinned) host memory; the plan says which. A host reference is read once per push over
#   PCIe, as a full push over shm reads the model once, so the gain over shm needs the GPU one; over other
#   nodes (the collective) both gain. A cast (fp32 master -> bf16) goes into a scratch bucket on the trainer's
#   device first: encode compares the wire dtype's bits, which is what receivers hold.
# * pack (sender, per bucket k): claim the buffer as today, then encode(pairs, buffer, base_version=the
#   reference's version) instead of the Packer's copies; the buffer must hold ``capacity`` bytes (the bucket
#   plus 32 + 32 per chunk and padding: ring buffers in delta mode are made that much larger). The reference
#   advances by the encoding as it is written (encode's ``advance``: the FULL payloads' bytes, the GAPS values
#   at their indices, on its device; Note [the reference advances by the encoding]), so it is what every delta
#   receiver holds; and verify compares the receivers' result with the new tensors, what the trainer meant,
#   so a fault in the codec shows there rather than being hidden by a reference that took it too. The
#   reference's version is None from the first bucket of a push until the last one is applied to it; a push
#   that fails between leaves None, and the next push is full for every receiver (a FULL chunk rewrites the
#   reference too).
# * plane: the bytes of a bucket are ``BucketCode.nbytes``, not the bucket's: the collective broadcasts only
#   those (their count travels ahead, e.g. in BucketReady), the rings need nothing new.
# * unpack (receiver): decode(buffer, destination chunk views, held_version=its version), before any write;
#   the PushStart carries the base version and the receiver refuses a delta at accept (check_base) when it
#   holds another version: None, MIXED, a failed push, sleep level 2, a restart. The sender then sends that
#   receiver a full push in the same round: per pair on a ring; on a broadcast group, a full push for the
#   whole group when any member needs one. Only into= sinks (destination tensors written in place) take
#   deltas; a load function (vLLM's load_weights, which may fuse names) receives whole tensors, so a delta for
#   it needs a receiver-side copy to decode into, or a name map to the engine's own parameters: not done.
# * verify: digests of the result, not of the delta: the sender's from its reference after the apply, the
#   receiver's from its destinations, as for a full push.
# * report: per push, bytes sent as delta (SAME and GAPS payloads, headers, tables), bytes sent as full
#   (FULL payloads), the bytes a full push would have sent, changed elements / elements (the density), and
#   where the reference lives (the plan's); the rest are BucketCode's fields, summed over buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from raysync.core import delta_decode_kernels, delta_kernels
from raysync.core.delta_workspace import copy_in_stream
from raysync.core.errors import BadDelta, BaseMismatch, LayoutError
from raysync.core.version import Version, is_version

MAGIC = int.from_bytes(b"rsdelta1", "little")
HEADER_BYTES = 32
ROW_BYTES = 32
PAYLOAD_ALIGN = 16
GAP_SPAN = 1 << 16  # the longest gap a 16-bit field holds (stored as gap - 1)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare bits, never values
WORDS = _BITS  # itemsize -> the integer dtype a chunk is compared (and decoded) as


class Mode(IntEnum):
    FULL = 0
    SAME = 1
    GAPS = 2


_MODES = {int(m) for m in Mode}


@dataclass(frozen=True)
class ChunkCode:
    """How one chunk (a tensor or a slice of one) travels."""

    mode: Mode
    numel: int
    itemsize: int
    entries: int  # GAPS: indices with their values (changed, plus one per 65536 elements); else 0
    changed: int | None  # elements whose bits changed (None on the receiver: the delta does not say)
    why: str = ""  # FULL on the sender: "base" (no reference), "size" or "density" (the density rule)

    @property
    def full_bytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def payload_bytes(self) -> int:
        if self.mode == Mode.FULL:
            return self.full_bytes
        if self.mode == Mode.SAME:
            return 0
        return gaps_bytes(self.entries, self.itemsize)


@dataclass(frozen=True)
class BucketCode:
    """What encode wrote into a bucket buffer, or what decode found there: the report's fields."""

    base_version: int | None
    chunks: tuple[ChunkCode, ...]
    nbytes: int  # bytes of the buffer used: header, table, payloads (what the plane moves)

    @property
    def full_bytes(self) -> int:  # what a full push moves for the same chunks
        return sum(c.full_bytes for c in self.chunks)

    @property
    def sent_as_full(self) -> int:
        return sum(c.payload_bytes for c in self.chunks if c.mode == Mode.FULL)

    @property
    def sent_as_delta(self) -> int:  # everything else: SAME and GAPS payloads, header, table, padding
        return self.nbytes - self.sent_as_full

    def full_by(self, why: str) -> int:  # FULL payload bytes the sender chose for that reason
        return sum(c.payload_bytes for c in self.chunks if c.mode == Mode.FULL and c.why == why)

    @property
    def numel(self) -> int:
        return sum(c.numel for c in self.chunks)

    @property
    def changed(self) -> int | None:
        counts = [c.changed for c in self.chunks if c.changed is not None]
        return sum(counts) if len(counts) == len(self.chunks) else None

    @property
    def density(self) -> float | None:  # changed elements / elements
        changed = self.changed
        return None if changed is None else changed / max(self.numel, 1)


def gaps_bytes(entries: int, itemsize: int) -> int:
    return _align(2 * entries) + entries * itemsize


def capacity(chunks: Sequence[tuple[int, int]]) -> int:
    """The most bytes encode can use for chunks of (numel, itemsize): a bucket buffer of this size never
    overflows (every payload is at most its full bytes, by the density rule)."""
    return _align(HEADER_BYTES + ROW_BYTES * len(chunks)) + sum(_align(n * s) for n, s in chunks)


def used_bytes(buffer: torch.Tensor) -> int:
    """The bytes of ``buffer`` an encoded bucket uses, as its header says: what a plane that moves only those
    reads first (unchecked here: ``decode`` checks it against the table)."""
    return int(buffer[:HEADER_BYTES].view(torch.int64)[3])


# --- the receiver's rule --------------------------------------------------------------------------------------
def delta_applies(held: Version, base: Version) -> bool:
    """True when a delta computed from ``base`` may be applied to destinations holding ``held``: both name
    exactly one version (Note [versions never lie]: never None, never MIXED) and it is the same one."""
    return is_version(held) and is_version(base) and held == base


def check_base(held: Version, base: Version, sender: str = "the sender") -> None:
    """Raise BaseMismatch unless ``delta_applies(held, base)``."""
    if not delta_applies(held, base):
        raise BaseMismatch(
            f"{sender} sent a delta from version {base!r} to a receiver that holds version {held!r}: a delta "
            f"applies only on top of exactly the version it was computed from; this receiver needs a full push"
        )


# --- decode -----------------------------------------------------------------------------------------------------
def copy_in(buffer: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event] | None:
    """Start moving a host bucket's bytes used (its header says how many, within ``buffer``) into ``device``, for
    ``decode(moved=)``: the copy runs while the caller makes the destinations' views and decode reads the table
    (in an H200 timeline under torch's profiler the receiver spent ~0.6 ms a bucket between one copy's end and the
    next one's start, ~0.3 ms of it making views). Nothing is checked but the count: decode checks everything
    before its first write. None: no copy to start."""
    if buffer.device.type != "cpu" or device.type != "cuda" or buffer.numel() < HEADER_BYTES:
        return None
    magic, _, _, used = buffer[:HEADER_BYTES].view(torch.int64).tolist()
    if magic != MAGIC or not HEADER_BYTES <= used <= buffer.numel():
        return None  # decode says what is wrong
    return copy_in_stream(buffer[:used], device)


def decode(
    buffer: torch.Tensor,
    destinations: Sequence[torch.Tensor],
    *,
    held_version: Version,
    mark: Callable[[str], None] | None = None,
    unsettled: list | None = None,
    tag: object = None,
    moved: tuple[torch.Tensor, torch.cuda.Event] | None = None,
) -> BucketCode:
    """Apply the bucket in ``buffer`` to ``destinations`` (contiguous tensors, one per chunk, in the bucket's
    order), in place. Everything is checked before the first write: the header, each row against its
    destination, every payload within the bytes used, every index within its destination, and the base
    version against ``held_version`` (BadDelta, BaseMismatch). Destinations on another device than
    ``buffer`` (a GPU engine reading a host ring) get the bytes used in one copy, then everything runs
    there. Two host syncs per bucket (the table, the indices' check), one more for that copy. ``unsettled``:
    a bucket of GAPS payloads that the fused kernels write (Note [fused delta kernels]) is checked on the
    device instead, where none of its payloads is written unless all fit, and the check is appended here for
    ``settle``, which raises the BadDelta with ``tag`` on it: the bucket waits only for its copy in.
    ``mark(stage)`` ends each stage when given (raysync.core.delta_rule.StageClock). ``moved``: ``copy_in``'s
    copy of ``buffer``, started before the destinations were made."""
    _check_buffer(buffer, "buffer")
    dests = [_bits(d, f"destination {i}") for i, d in enumerate(destinations)]
    code = _read_table(buffer, dests)
    if any(c.mode != Mode.FULL for c in code.chunks):
        if code.base_version is None:
            raise BadDelta("a delta bucket without a base version: only FULL chunks can come without one")
        check_base(held_version, code.base_version)
    mark = mark or _no_mark
    devices = {d.device for d in dests}
    copied = None
    if len(devices) == 1 and buffer.device not in devices:  # cross once, with the bytes used only
        device = devices.pop()
        # a copy into a GPU is left in flight and waited for before returning (the caller reuses the host
        # buffer then); any other way it is waited for here
        if moved is not None and moved[0].numel() == code.nbytes and moved[0].device == device:
            buffer, copied = moved
        elif buffer.device.type == "cpu" and device.type == "cuda":
            buffer, copied = copy_in_stream(buffer[: code.nbytes], device)
        else:
            buffer = buffer[: code.nbytes].to(device)
    mark("copy in")
    offset, work, gapped = _align(HEADER_BYTES + ROW_BYTES * len(dests)), [], []
    fused = delta_kernels.available(buffer.device)  # Note [fused delta kernels]
    for i, (c, dest) in enumerate(zip(code.chunks, dests, strict=True)):
        region = buffer[offset : offset + c.payload_bytes]
        offset = _align(offset + c.payload_bytes)
        if c.mode == Mode.GAPS and fused and dest.device == buffer.device:
            at = region.data_ptr()
            gapped.append((i, dest.numel(), (c.entries, at, at + _align(2 * c.entries), dest)))
        elif c.mode == Mode.GAPS:
            gaps = region[: 2 * c.entries].view(torch.int16).to(dest.device)
            index = gaps.to(torch.int64).add_(1 + 32768).cumsum_(0).sub_(1)  # gaps >= 1: strictly increasing
            values = region[_align(2 * c.entries) :].view(dest.dtype).to(dest.device)
            work.append((i, dest, index, values))
            gapped.append((i, dest.numel(), index[-1]))
        elif c.mode == Mode.FULL:
            work.append((i, dest, None, region))
    payloads = [last for _, _, last in gapped if isinstance(last, tuple)]
    kernels = delta_decode_kernels.GapsApply(payloads) if payloads else None
    mark("index")
    deferred = unsettled is not None and kernels is not None and not work  # only the kernels write
    if not deferred:
        ends = iter(kernels.ends() if kernels is not None else [])  # the last index + 1 of each
        lasts = _to_host([None if isinstance(last, tuple) else last for _, _, last in gapped])
        for (i, numel, _), last in zip(gapped, lasts, strict=True):
            _check_last(i, next(ends) - 1 if last is None else last, numel)
    mark("check")
    for _, dest, index, values in work:  # nothing was written before this loop
        if index is None:
            dest.view(torch.uint8).copy_(values)
        else:
            dest.index_copy_(0, index, values)
    if kernels is not None:
        kernels.run()
    if deferred:
        unsettled.append((kernels, [(i, numel) for i, numel, _ in gapped], tag))
    if copied is not None:
        copied.synchronize()
    mark("apply")
    return code


def settle(unsettled: list) -> None:
    """The checks that ``decode(..., unsettled=)`` left on the device, one host sync per device: BadDelta for
    the first bucket whose indices ran past a destination (the kernels wrote none of its payloads), its
    ``tag`` the one decode was given."""
    checks, crossed = list(unsettled), {}
    unsettled.clear()  # checked once, raising or not
    for device in {kernels.lasts.device for kernels, _, _ in checks}:
        mine = [kernels.lasts for kernels, _, _ in checks if kernels.lasts.device == device]
        crossed[device] = iter(torch.cat(mine).tolist())
    for kernels, chunks, tag in checks:
        lasts = [next(crossed[kernels.lasts.device]) for _ in chunks]
        for (i, numel), end in zip(chunks, kernels.ends(lasts), strict=True):
            try:
                _check_last(i, end - 1, numel, " (none of its bucket's payloads was written)")
            except BadDelta as e:
                e.tag = tag
                raise


def _check_last(i: int, last: int, numel: int, more: str = "") -> None:
    if last >= numel:
        raise BadDelta(f"chunk {i}: a delta writes element {last} of a destination of {numel} elements{more}")


def _no_mark(stage: str) -> None:
    pass


def _read_table(buffer: torch.Tensor, dests: list[torch.Tensor]) -> BucketCode:
    k, end = len(dests), HEADER_BYTES + ROW_BYTES * len(dests)
    if buffer.numel() < end:
        raise BadDelta(
            f"a buffer of {buffer.numel()} bytes cannot hold the table of {k} chunks ({end} bytes)"
        )
    words = buffer[:end].view(torch.int64).tolist()
    magic, base, count, used = words[:4]
    if magic != MAGIC or count != k:
        raise BadDelta(f"not a delta bucket of {k} chunks (magic {magic:#x}, {count} chunks)")
    if not 0 <= used <= buffer.numel():
        raise BadDelta(f"a delta bucket of {used} bytes in a buffer of {buffer.numel()}")
    chunks = []
    for i, dest in enumerate(dests):
        mode, numel, itemsize, entries = words[4 + 4 * i : 8 + 4 * i]
        if mode not in _MODES or (numel, itemsize) != (dest.numel(), dest.element_size()):
            raise BadDelta(
                f"chunk {i}: mode {mode}, {numel} elements of {itemsize} bytes; the destination has "
                f"{dest.numel()} of {dest.element_size()}"
            )
        if mode == Mode.GAPS and not 1 <= entries <= numel or mode != Mode.GAPS and entries != 0:
            raise BadDelta(f"chunk {i}: {entries} entries for a {Mode(mode).name} chunk of {numel} elements")
        chunks.append(ChunkCode(Mode(mode), numel, itemsize, entries, None))
    code = BucketCode(None if base == -1 else base, tuple(chunks), used)
    if _layout_end(code.chunks) != used:
        raise BadDelta(f"the table says {_layout_end(code.chunks)} bytes, the header {used}")
    return code


# --- shared ---------------------------------------------------------------------------------------------------
def _align(n: int) -> int:
    return (n + PAYLOAD_ALIGN - 1) // PAYLOAD_ALIGN * PAYLOAD_ALIGN


def _layout_end(chunks: Sequence[ChunkCode]) -> int:
    """The exact end of the last payload (each payload starts at a multiple of 16; nothing pads the last), so a
    count of entries off by any amount in the last chunk changes it."""
    start = end = _align(HEADER_BYTES + ROW_BYTES * len(chunks))
    for c in chunks:
        start = _align(end)
        end = start + c.payload_bytes
    return end


def _bits(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t``'s elements as integers of the same width, flat, sharing its storage."""
    if t.dim() == 1 and t.dtype == _BITS.get(t.element_size()) and t.is_contiguous():
        return t  # the words already (a bucket's chunk pairs are made so once): no view to make each push
    if not t.is_contiguous() or t.element_size() not in _BITS or t.is_complex():
        raise LayoutError(
            f"{what}: {t.dtype} {tuple(t.shape)} is not a contiguous tensor of 1, 2, 4 or 8-byte elements"
        )
    return t.reshape(-1).view(_BITS[t.element_size()])


def _check_buffer(buffer: torch.Tensor, what: str) -> None:
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise LayoutError(f"{what}: a 1-d contiguous uint8 tensor, not {buffer.dtype} {tuple(buffer.shape)}")
    if buffer.storage_offset() % PAYLOAD_ALIGN:
        raise LayoutError(
            f"{what} starts at byte {buffer.storage_offset()} of its storage, not at a multiple of 16"
        )


def _to_host(tensors: Sequence[torch.Tensor | None]) -> list:
    """Tensors of one shape as Python values (``tolist``), one host sync per device; None stays None."""
    found: dict[int, object] = {}
    for device in {t.device for t in tensors if t is not None}:
        indices = [i for i, t in enumerate(tensors) if t is not None and t.device == device]
        found.update(zip(indices, torch.stack([tensors[i] for i in indices]).tolist(), strict=True))
    return [found.get(i) for i in range(len(tensors))]
