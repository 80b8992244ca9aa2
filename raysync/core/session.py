"""One push session: the stages of a push, written once, for every data plane (transport.base.DataPlane).

    Source --select--> Layout --plan--> [Bucket] --pack--> data plane --> unpack --> Sink

| stage        | sender half (PushSender, here)                 | receiver half (PushReceiver, session_receiver) |
| ------------ | ---------------------------------------------- | ---------------------------------------------- |
| select       | filter names, fix wire dtypes (source.select)  |                                                |
| session      | first push: Hello, describe the plane, Attached| Hello, attach the plane, Attached              |
| agree_layout | send the Layout when it changed (and what the  | check it, plan it (or refuse it: answered at   |
|              | plane places: a direct plane's storages)       | the next PushStart)                            |
| check_ahead  |                                                | make the sink for the current layout while     |
|              |                                                | waiting for the push                           |
| accept       | pack ahead, PushStart, wait for Accept         | check every destination; Accept or Abort       |
| stream       | bucket k: claim -> pack -> packed -> publish   | bucket k: receive -> unpack -> release         |
| verify       | PushDigest of what was packed                  | compare with what landed                       |
| commit       | wait for PushDone                              | drain, apply (sink.commit), version := pushed  |
| report       | PushReport                                     | PushReport                                     |

A session is one sender and N receivers (control.Fanout: N = 1 for a ring; a collective group's receivers).
A plane that must move every receiver together (``all_or_none``: a broadcast) gets one more message after
accept: the sender's own Accept, the go (skip only if every receiver has the version), or an Abort for all
when any receiver refused.

Every wait is bounded by ``timeout_s``. A push that fails on this side before it starts (the trainer's
source raised, a layout over the bounds, a pack ahead of the push) is announced to the receiver with an Abort,
so it raises at once instead of waiting for a push that never comes. Once it started, a failure here is an
Abort of that push; the receiver's version then follows Note [versions never lie] (raysync.core.version).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from raysync.core import digest
from raysync.core.config import SyncConfig
from raysync.core.control import SenderChannel
from raysync.core.errors import PeerLost, PeerTimeout, RaysyncError, RemoteError
from raysync.core.fanout import Fanout
from raysync.core.plan import Bucket, plan_buckets, total_bytes
from raysync.core.report import PushReport
from raysync.core.source import Packer, SourceTensor, select
from raysync.core.wire import Accept, Attached, Close, Layout, PushDigest, PushDone, PushStart
from raysync.transport import registry
from raysync.transport.base import DataPlane

logger = logging.getLogger(__name__)


class PushSender:
    """The sender's half of a session over ``channel`` (bound; the receiver connects to it), or over a Fanout
    to several receivers. ``plane``: the data plane, when the transport made it before the session (a
    collective group); else the session makes the one ``config`` names once the receiver is there."""

    def __init__(self, channel: SenderChannel | Fanout, config: SyncConfig, plane: DataPlane | None = None):
        self.config = config
        self._channel = channel if isinstance(channel, Fanout) else Fanout([channel])
        self._given_plane = plane
        self._plane: DataPlane | None = None
        self._layout: Layout | None = None
        self._layout_bytes = 0
        self._buckets: list[Bucket] = []
        self._push_id = 0
        self._sources: list[SourceTensor] = []
        self._sources_key: tuple | None = None
        self._named: list[tuple[str, torch.Tensor]] = []  # what the last push was given
        self._placed = 0  # counts the placements: what every push replays, made once per set of tensors
        self._is_placed = False  # for the current tensors (_select clears it when they change)
        self._packer: Packer | None = None  # the copies into the plane's buffers (none: read in place)
        self._digests: dict[int, list[torch.Tensor]] | None = None
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time

    @property
    def ring(self) -> object | None:
        """The transport's own object this session runs on (a ring: its ``buffers``, to inspect them; direct:
        the exported or mapped storages); None before the first push."""
        return self._plane.transport if self._plane is not None else None

    _ring = ring  # the name tests and benchmarks used before ``ring`` was public

    # --- the push ----------------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushReport:
        """Send ``named_tensors`` as ``version``; returns once the receiver has applied all of it."""
        start = time.perf_counter()
        try:
            named = list(named_tensors)  # a generator runs the trainer's code: it may raise
        except Exception as e:
            self.abort(e, "source")
            raise
        self._digests = {} if self.config.verify else None
        # the same tensor objects as last push (a training loop): the device packs the first buckets while the
        # host checks the tensors; what was packed is dropped if they changed after all (new data pointers)
        placed = self._placed if self._is_placed else -1
        ahead = self._pack_ahead() if placed >= 0 and self._same_objects(named) else 0
        sources = self._select_or_abort(named)
        self._ensure_session()
        self._agree_layout_or_abort(sources)
        if self._placed != placed:
            self._digests, ahead = {} if self.config.verify else None, 0
        if not ahead:
            ahead = self._pack_ahead()
        self._push_id += 1
        selected = time.perf_counter()
        accept = self._accept(version)
        accepted = streamed = time.perf_counter()
        if not accept.skip:
            self._stream(version, ahead)
            streamed = time.perf_counter()
            self._channel.expect(PushDone, self._push_id, "finish")
        self.last_stages_s = {
            "select": selected - start,
            "accept": accepted - selected,
            "stream": streamed - accepted,
            "finish": time.perf_counter() - streamed,
        }
        return self._report(version, len(sources), accept.skip, time.perf_counter() - start)

    def abort(self, error: BaseException, stage: str = "source") -> None:
        """This push failed here before it started (e.g. the trainer's source raised): tell the receiver, which
        raises ``error``'s type and message at once instead of waiting for a push that will not come. Best
        effort; before the first push it waits (up to timeout_s) for the receiver's Hello to know where to."""
        if self._plane is None:
            try:
                self._channel.accept("abort: waiting for the receiver's Hello")
            except RaysyncError:
                return  # no receiver came: nobody is waiting
            self._channel.abort(0, stage, error)  # answers the receiver's wait for the plane
            return
        self._push_id += 1  # the receiver raises for an Abort of a push newer than the last it saw start
        self._channel.abort(self._push_id, stage, error)

    def _select_or_abort(self, named: list[tuple[str, torch.Tensor]]) -> list[SourceTensor]:
        try:
            return self._select(named)
        except Exception as e:  # a bad tensor: before the first push nobody waits yet (no handshake needed)
            if self._plane is not None:
                self.abort(e, "select")
            raise

    def _agree_layout_or_abort(self, sources: list[SourceTensor]) -> None:
        try:
            self._agree_layout(sources)
        except Exception as e:  # e.g. a layout over the bounds (BadLayout): the receiver is waiting
            self.abort(e, "layout")
            raise

    def _accept(self, version: int) -> Accept:
        """Every receiver's Accept; the go for a plane that moves all receivers together (skip only if every
        receiver has the version). A refusal by one is an Abort for all: nothing moved anywhere."""
        pid = self._push_id
        self._plane.begin(pid, self._buckets)
        self._channel.send(PushStart(pid, version, self._layout.layout_id, self.config.verify), "accept")
        try:
            answers = self._channel.expect(Accept, pid, "accept")
        except RemoteError as e:
            if len(self._channel.channels) > 1:
                self._channel.abort(pid, "accept", e)
            raise
        go = Accept(pid, all(a.skip for a in answers))
        if getattr(self._plane, "all_or_none", False):
            self._channel.send(go, "accept: the go")
        return go

    def _pack_ahead(self) -> int:
        """Pack the first buckets before PushStart: every buffer is free between pushes (the last push ended
        with every buffer released), and nothing is published until the receiver accepts."""
        ahead = min(self._plane.slots, len(self._buckets))
        for k in range(ahead):
            try:
                self._pack(k)
            except Exception as e:  # e.g. a ring the receiver resized: tell it now, not after timeout_s
                self.abort(e, f"pack bucket {k} ahead of the push")
                raise
        return ahead

    def _pack(self, k: int) -> None:
        """Claim bucket k's buffer and pack it (a plane that reads the source in place has none to fill)."""
        if self._plane.claim(k) is not None:
            self._packer.pack(k)
        if self._digests is not None:  # of the bytes as the receiver reads them, wire dtype and all
            view = self._plane.bucket_view(k)
            for c in self._buckets[k].chunks:
                part = digest.partial(view[c.bucket_offset : c.bucket_offset + c.nbytes], c.src_offset)
                self._digests.setdefault(c.index, []).append(part)
        self._plane.packed(k)

    def _stream(self, version: int, packed_ahead: int) -> None:
        count = len(self._buckets)
        bar = _LazyBar(self._layout_bytes, f"push v{version}", self.config.progress)
        stage = "stream"
        walk = self._buckets
        if getattr(self._plane, "reads_in_place", False) and self._digests is None:
            walk = []  # the receiver reads the source in place: nothing to pack or publish per bucket
            bar.update(self._layout_bytes)
        try:
            for k, bucket in enumerate(walk):
                stage = f"pack bucket {k}/{count}"
                if k >= packed_ahead:
                    self._pack(k)
                self._plane.publish(k)
                bar.update(sum(c.nbytes for c in bucket.chunks))
                logger.debug("bucket %d: %d chunks, %d bytes", k, len(bucket.chunks), bucket.nbytes)
            stage = "verify" if self._digests is not None else "finish"
            self._send_digests()
            self._plane.wait_released()
        except RemoteError:
            self._plane.fail()
            raise
        except Exception as e:  # tell the receivers now, rather than let them wait for timeout_s
            self._plane.fail()  # e.g. a broadcast group: abort it, so no receiver stays in a broadcast
            cause = None
            if isinstance(e, (PeerTimeout, PeerLost, RuntimeError)) and len(self._channel.channels) > 1:
                cause = self._channel.reason(self._push_id, wait_s=1.0)  # a receiver that failed first
            self._channel.abort(self._push_id, stage, e)
            if cause is not None:
                raise cause from e
            raise
        finally:
            bar.close()

    def _send_digests(self) -> None:
        """Verified pushes: each tensor's digest of what was packed (read in place: of the tensor itself)."""
        if self._digests is None:
            return
        count = len(self._layout.tensors)
        sums = tuple(digest.combine([self._digests.get(i, []) for i in range(count)]))
        self._channel.send(PushDigest(self._push_id, sums), "verify")

    def _report(self, version: int, tensors: int, skipped: bool, seconds: float) -> PushReport:
        moved = not skipped
        report = PushReport(
            version,
            self._plane.name,
            self._layout_bytes * moved,
            len(self._buckets) * moved,
            tensors,
            seconds,
            skipped=skipped,
        )
        logger.info("pushed to %s: %s", self._channel.peer, report)
        return report

    # --- set-up, once per session ------------------------------------------------------------------------------
    def _ensure_session(self) -> None:
        if self._plane is not None:
            return
        hellos = self._channel.accept("handshake: waiting for the receiver's Hello")
        cfg = self.config
        try:
            name = registry.ring_name(cfg.transport, cfg.direct)
            plane = self._given_plane or registry.sender_plane(name, cfg, self._channel)
        except Exception as e:  # e.g. not enough memory for the ring: tell the receiver, not let it time out
            self._channel.abort(0, "handshake: ring", e)
            raise
        self._plane = plane
        self._channel.send(plane.describe(), "handshake: ring")
        for attached in self._channel.expect(
            Attached, 0, "handshake: waiting for the receiver to map the ring"
        ):
            plane.attached(attached)
        logger.info(
            "session up with %s (pids %s): %s plane, %d x %d bytes",
            self._channel.peer,
            [h.pid for h in hellos],
            plane.name,
            plane.slots,
            cfg.bucket_bytes,
        )

    def _select(self, named: list[tuple[str, torch.Tensor]]) -> list[SourceTensor]:
        """select(), skipped while the trainer pushes the same tensors (updated in place) as last time."""
        key = tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for n, t in named)
        if key != self._sources_key:
            self._sources, self._sources_key = select(named, self.config), key
            self._is_placed, self._packer = False, None
        self._named = named
        return self._sources

    def _same_objects(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """The same names and tensor objects as last push: likely (not surely) the same tensors."""
        last = self._named
        if len(named) != len(last):
            return False
        return all(a[0] == b[0] and a[1] is b[1] for a, b in zip(named, last, strict=True))

    def _agree_layout(self, sources: list[SourceTensor]) -> None:
        """Send the Layout when the tensors' names, dtypes or shapes change; make what every push replays when
        the tensors themselves change: the Packer's copies, or what the plane places (a direct plane: the
        exported storages and its own plan, checked before anything is sent)."""
        if self._is_placed:  # made for these very tensors (_select clears it when they change)
            return
        cfg = self.config
        specs = tuple(s.spec for s in sources)
        new = self._layout is None or self._layout.tensors != specs
        layout = self._layout
        if new:
            layout_id = self._layout.layout_id + 1 if self._layout else 1
            layout = Layout(layout_id, cfg.bucket_bytes, cfg.align_bytes, specs)
        placed = self._plane.place(layout, sources)
        if new:
            self._layout, self._layout_bytes = layout, total_bytes(specs)
            self._buckets = plan_buckets(specs, cfg.bucket_bytes, cfg.align_bytes)
            self._channel.send(layout, "layout")
        if placed is not None:
            self._buckets, message = placed
            self._channel.send(message, "layout: the trainer's storages")
        buffers = self._plane.buffers
        self._packer = Packer(self._buckets, sources, buffers, cfg.cuda_graphs) if buffers else None
        self._placed, self._is_placed = self._placed + 1, True

    # --- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._packer = None  # its copies hold views of the ring: drop them first
        if self._plane is not None:
            self._channel.try_send(Close())
            self._plane.close()
            self._plane = None
        self._channel.close()


class _LazyBar:
    """A tqdm bar (bytes) that exists only once a push has run for a second. tqdm's first bar in a process
    creates a multiprocessing lock, a named semaphore in /dev/shm that a SIGKILLed process leaves behind:
    pushes shorter than a second never make one."""

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
