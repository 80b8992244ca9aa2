"""The stream stage of a push, sender half (raysync.core.session runs the other stages): bucket k = 0, 1, ...
claimed, packed (the first ones ahead of the push), published; the digests of what was packed (verify); then
every buffer released.

    claim(k) -> pack (the Packer's copies; in delta mode: raysync.core.delta_push) -> packed(k) -> publish(k)

A delta push whose encoding crosses to the ring on a copy stream (``Reference.stages``) encodes bucket k + 1
into a staging buffer once bucket k's copy is queued, before it publishes bucket k and claims bucket k + 1's
buffer (Note [a bucket is encoded while the one before crosses] in raysync.core.delta_workspace).

# Note [publish, then look ahead]
# Bucket k's copy across (~0.95 ms for a 7B bucket at 5% on an H200) was published only after the sender's thread
# had encoded bucket k + 1 and then started the compares of the buckets after it (``find_ahead``), ~1.3 ms of host
# work under the profiler: in a timeline of stop 40 (docs/results/delta_trace_h200_s40_*) the engine's copy in of
# a bucket began ~1.6 ms after its copy out ended, and with two ring buffers the next claim waits for that copy
# in. So bucket k is published once bucket k + 1's encoding is queued, and the compares ahead are queued after:
# they are needed two buckets later. In a profiled push the copy in then began 0.23 ms after the copy out ended
# (median); unprofiled the push took 51.6 ms at 5% against 51.2 ms for the code before, in the same call
# (docs/benchmarks.md 12, Latest): the period is set elsewhere as well.

In a delta push a bucket's encoding may use fewer bytes than the bucket: a plane that moves only the bytes
used (the collective's ``encoded(k, nbytes)``) hears how many right before ``publish(k)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from raysync.core import digest
from raysync.core.agreement import SenderLayout
from raysync.core.config import SyncConfig
from raysync.core.delta_push import Reference
from raysync.core.errors import PeerLost, PeerTimeout, RemoteError
from raysync.core.fanout import Fanout
from raysync.core.wire import Accept, PushDigest, PushDone
from raysync.transport.base import DataPlane

logger = logging.getLogger(__name__)


class SenderStream:
    """The stream stage, sender half: bucket k = 0, 1, ... claimed, packed (the first ones ahead of the push),
    published; the digests of what was packed (verify); then every buffer released. Made with the plane."""

    def __init__(
        self,
        plane: DataPlane,
        channel: Fanout,
        agreed: SenderLayout,
        config: SyncConfig,
        reference: Reference,
    ):
        self._plane, self._channel, self._agreed, self._config = plane, channel, agreed, config
        self._ref = reference  # SyncConfig.delta: the bytes of the last version pushed (delta_push)
        self.reset()

    def reset(self) -> None:
        """A new push (or new tensors): nothing packed counts yet."""
        self._digests: dict[int, list[torch.Tensor]] | None = {} if self._config.verify else None
        self._encoded: dict[int, int] = {}  # delta buckets packed for this push: the bytes each uses
        self.packs = 0  # buckets packed for this push: one each, whatever the number of receivers

    def go_full(self) -> int:
        """This push goes full after all: what was packed ahead is packed again as it streams."""
        self._ref.demote()
        self.reset()
        return 0  # buckets packed ahead

    def pack_ahead(self, abort: Callable[[BaseException, str], None]) -> int:
        """Pack the first buckets before PushStart: every buffer is free between pushes (the last push ended
        with every buffer released), and nothing is published until the receiver accepts."""
        ahead = min(self._plane.slots, len(self._agreed.buckets))
        if self._ref.active and self._ref.lazy and self._ref.base is not None:
            ahead = 0  # Note [the delta reference]: a lazy source walks its buckets once, in order
        for k in range(ahead):
            try:
                self._pack(k)
            except BaseException as e:  # e.g. a ring the receiver resized: tell it now, not after timeout_s
                self._ref.drain()
                if isinstance(e, Exception):
                    abort(e, f"pack bucket {k} ahead of the push")
                raise
        return ahead

    def _pack(self, k: int) -> None:
        """Claim bucket k's buffer and pack it (a plane that reads the source in place has none to fill)."""
        buffer, ref = self._plane.claim(k), self._ref if self._ref.active else None
        if buffer is not None:
            bucket = self._agreed.buckets[k]
            payload = sum(c.nbytes for c in bucket.chunks)
            if ref is not None and ref.stages:  # a delta push, encoded into a staging buffer: copied across
                self._encoded[k] = ref.send(k, buffer)
            elif ref is not None and ref.base is not None:  # a delta push: encoded against the reference
                self._encoded[k] = ref.encode(k, buffer)
            elif ref is not None and ref.packs_full:  # through the reference's scratch (a lazy source, ...)
                ref.pack_full(k, buffer, bucket.nbytes, payload)
            else:
                self._agreed.packer.pack(k)
                if ref is not None:  # a full push in delta mode: the reference takes its bytes
                    ref.keep(k, buffer, bucket.nbytes, payload)
            self.packs += 1
        if self._digests is not None:  # of the bytes the receiver must have, wire dtype and all
            chunks = self._agreed.buckets[k].chunks
            if ref is not None and ref.base is not None:  # a delta push: the tensors, not the reference
                parts = ref.meant(k)
            else:
                view = ref.bucket(k) if ref is not None and ref.keeps else self._plane.bucket_view(k)
                parts = [view[c.bucket_offset : c.bucket_offset + c.nbytes] for c in chunks]
            for c, part in zip(chunks, parts, strict=True):
                self._digests.setdefault(c.index, []).append(digest.partial(part, c.src_offset))
        if not (ref is not None and ref.stages):
            self._plane.packed(k)  # else once its copy is in (``_publish``)

    def _publish(self, k: int, bar: _LazyBar) -> None:
        """The receivers may read bucket k, packed (staged: once its copy across is in)."""
        if self._ref.stages:
            self._ref.copied(k)
            self._plane.packed(k)
        if k in self._encoded and hasattr(self._plane, "encoded"):
            self._plane.encoded(k, self._encoded[k])  # it moves only the bytes used
        self._plane.publish(k)
        bar.update(sum(c.nbytes for c in self._agreed.buckets[k].chunks))

    def run(self, push_id: int, version: int, packed_ahead: int) -> None:
        """Publish every bucket (packing those not packed ahead), send the digests, wait for the releases."""
        buckets, nbytes = self._agreed.buckets, self._agreed.nbytes
        count = len(buckets)
        bar = _LazyBar(nbytes, f"push v{version}", self._config.progress)
        stage = "stream"
        walk = buckets
        if self._plane.reads_in_place and self._digests is None:
            walk = []  # the receiver reads the source in place: nothing to pack or publish per bucket
            bar.update(nbytes)
        try:
            for k, bucket in enumerate(walk):
                stage = f"pack bucket {k}/{count}"
                if k >= packed_ahead:
                    self._pack(k)
                # Note [a bucket is encoded while ...] in delta_workspace; Note [publish, then look ahead]
                staging = self._ref.stages and packed_ahead <= k + 1 < count
                if staging:
                    stage = f"encode bucket {k + 1}/{count}"
                    self._ref.stage(k + 1, ahead=False)
                    stage = f"pack bucket {k}/{count}"
                self._publish(k, bar)
                if staging:
                    stage = f"compare the buckets after {k + 1}/{count}"
                    self._ref.find_ahead(k + 1)
                logger.debug("bucket %d: %d chunks, %d bytes", k, len(bucket.chunks), bucket.nbytes)
            stage = "verify" if self._digests is not None else "finish"
            self._send_digests(push_id)
            self._plane.wait_released()
        except RemoteError:
            self._ref.drain()
            self._plane.fail()
            raise
        except Exception as e:  # tell the receivers now, rather than let them wait for timeout_s
            self._ref.drain()  # first: nothing crosses into the ring once the others hear of it
            self._plane.fail()  # e.g. a broadcast group: abort it, so no receiver stays in a broadcast
            cause = None
            if isinstance(e, (PeerTimeout, PeerLost, RuntimeError)) and len(self._channel.channels) > 1:
                cause = self._channel.reason(push_id, wait_s=1.0)  # a receiver that failed first
            self._channel.abort(push_id, stage, e)
            if cause is not None:
                raise cause from e
            raise
        finally:
            self._ref.drain()  # no encoding crosses into the ring once the push ended here
            bar.close()

    def run_in_turns(self, push_id: int, version: int, ahead: int, stale: list[int]) -> None:
        """One push to the readers of a fan-out ring in two turns (Note [the delta reference]): the delta to
        those that take it, then a full push to the ``stale`` ones, which wait for their go meanwhile; a
        failure of the first turn is told to them too."""
        channel = self._channel
        fresh = [i for i in range(len(channel.channels)) if i not in stale]
        try:
            with channel.only(fresh):
                channel.send(Accept(push_id, False, False), "accept: the go")
                self.run(push_id, version, ahead)
                channel.expect(PushDone, push_id, "finish")
        except BaseException as e:
            with channel.only(stale):
                channel.abort(push_id, "the other readers' delta", e)
            raise
        sent = self._ref.stats
        with channel.only(stale):
            self.go_full()
            channel.send(Accept(push_id, False, True), "accept: the go")
            self._plane.begin(push_id, self._agreed.buckets)
            self.run(push_id, version, 0)
            channel.expect(PushDone, push_id, "finish")
        self._ref.merge(sent)

    def _send_digests(self, push_id: int) -> None:
        """Verified pushes: each tensor's digest of what was packed (read in place: of the tensor itself)."""
        if self._digests is None:
            return
        count = len(self._agreed.layout.tensors)
        sums = tuple(digest.combine([self._digests.get(i, []) for i in range(count)]))
        self._channel.send(PushDigest(push_id, sums), "verify")


class _LazyBar:
    """A tqdm bar (bytes) made only once a push ran for a second: tqdm's first bar in a process makes a named
    semaphore in /dev/shm that a SIGKILLed process leaves behind, so pushes under a second never make one."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self._total, self._desc, self._enabled = total, desc, enabled
        self._started, self._done, self._bar = time.perf_counter(), 0, None

    def update(self, n: int) -> None:
        self._done += n
        if self._bar is None and self._enabled and time.perf_counter() - self._started > 1.0:
            self._bar = tqdm(
                total=self._total,
                initial=self._done - n,
                unit="B",
                unit_scale=True,
                desc=self._desc,
                leave=False,
            )
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
