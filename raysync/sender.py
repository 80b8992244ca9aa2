"""WeightSender: the trainer's half of a session. Set up once, push many times.

A push, as a sequence of stages (each wait bounded by ``timeout_s``):

    select    filter names, fix wire dtypes                        (source.select)
    session   first push only: wait for the receiver's Hello, create the ring, wait until it is mapped
    layout    only when the tensors changed: send names/dtypes/shapes; both sides plan the buckets from it
              (direct mode: also whenever the tensors moved, their storages exported and where each lies)
    pack      the first N buckets into the free ring (for the same tensors as last push: before select)
    accept    PushStart -> the receiver checks its destinations and answers Accept (or Abort)
    stream    for bucket k: wait until buffer k % N is free, pack (k >= N), signal BucketReady
              (direct mode: nothing; the receiver copies out of the trainer's tensors in place)
    finish    wait for the last frees and PushDone: only then is the version applied on the receiver

A push that fails here before it starts (the trainer's source raised) is announced to the receiver with an
Abort (``abort``), so the receiver raises at once instead of waiting ``timeout_s`` for a push that never comes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from raysync import digest
from raysync.config import SyncConfig
from raysync.control import SenderChannel
from raysync.errors import RaysyncError, RemoteError
from raysync.plan import direct_buckets, plan_buckets, total_bytes
from raysync.report import PushReport
from raysync.source import Packer, SourceTensor, select
from raysync.transport import registry
from raysync.transport.base import RingSender
from raysync.wire import (
    Accept,
    Attached,
    BucketFreed,
    BucketReady,
    Close,
    DirectSources,
    Layout,
    PushDigest,
    PushDone,
    PushStart,
    SessionSecret,
)

logger = logging.getLogger(__name__)


class WeightSender:
    """Binds the control endpoint at construction; give ``endpoint`` and the secret to the receiver."""

    def __init__(self, secret: SessionSecret, config: SyncConfig | None = None, *, endpoint: str | None = None,
                 allow_any_interface: bool = False):  # fmt: skip
        self.config = config or SyncConfig()
        self._channel = SenderChannel(
            secret, endpoint=endpoint, allow_any_interface=allow_any_interface,
            timeout_s=self.config.timeout_s, max_frame_bytes=self.config.max_frame_bytes,
        )  # fmt: skip
        self.endpoint = self._channel.endpoint
        self._ring = None
        self._layout: Layout | None = None
        self._layout_bytes = 0
        self._buckets: list = []
        self._push_id = 0
        self._sources: list[SourceTensor] = []
        self._sources_key: tuple | None = None
        self._named: list[tuple[str, torch.Tensor]] = []  # what the last push was given
        self._packer: Packer | DirectSources | None = None  # what every push replays, made once per tensors
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time

    @property
    def ring(self) -> RingSender | None:
        """The ring this session runs on (its ``buffers``, to inspect them); None before the first push."""
        return self._ring

    # --- the push ----------------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushReport:
        """Send ``named_tensors`` as ``version``; returns once the receiver has applied all of it."""
        start = time.perf_counter()
        try:
            named = list(named_tensors)  # a generator runs the trainer's code: it may raise
        except Exception as e:
            self.abort(e, "source")
            raise
        self._digests: dict[int, list[torch.Tensor]] | None = {} if self.config.verify else None
        # the same tensor objects as last push (a training loop): the GPU packs the first buckets while the
        # host checks the tensors; what was packed is dropped if they changed after all (new data pointers)
        packer = self._packer  # set only once a session is up
        early = packer is not None and not self._ring.direct and self._same_objects(named)
        ahead = self._pack_ahead() if early else 0
        try:
            sources = self._select(named)
        except Exception as e:  # a bad tensor: before the first push nobody waits yet (no handshake needed)
            if self._ring is not None:
                self.abort(e, "select")
            raise
        self._ensure_session()
        try:
            self._ensure_layout(sources)
        except Exception as e:  # e.g. a layout over the bounds (BadLayout): the receiver is waiting
            self.abort(e, "layout")
            raise
        direct = self._ring.direct
        if self._packer is not packer:
            self._digests, ahead = {} if self.config.verify else None, 0
        if not direct and not ahead:
            ahead = self._pack_ahead()
        self._push_id += 1
        selected = time.perf_counter()
        if direct:
            self._ring.mark_ready()  # before PushStart: the receiver's stream waits for this record
        self._channel.send(PushStart(self._push_id, version, self._layout.layout_id, True, self.config.verify),
                           "accept")  # fmt: skip
        accept = self._channel.expect(Accept, self._push_id, "accept")
        accepted = streamed = time.perf_counter()
        if not accept.skip:
            self._send_digests() if direct else self._stream(version, ahead)
            streamed = time.perf_counter()
            self._channel.expect(PushDone, self._push_id, "finish")
        self.last_stages_s = {"select": selected - start, "accept": accepted - selected,
                              "stream": streamed - accepted, "finish": time.perf_counter() - streamed}  # fmt: skip
        moved = not accept.skip
        report = PushReport(
            version, self._ring.name, self._layout_bytes * moved, len(self._buckets) * moved,
            len(sources), time.perf_counter() - start, skipped=accept.skip,
        )  # fmt: skip
        logger.info("pushed to %s: %s", self._channel.peer, report)
        return report

    def abort(self, error: BaseException, stage: str = "source") -> None:
        """This push failed here before it started (e.g. the trainer's source raised): tell the receiver, which
        raises ``error``'s type and message at once instead of waiting for a push that will not come. Best
        effort; before the first push it waits (up to timeout_s) for the receiver's Hello to know where to."""
        if self._ring is None:
            try:
                self._channel.accept("abort: waiting for the receiver's Hello")
            except RaysyncError:
                return  # no receiver came: nobody is waiting
            self._channel.abort(0, stage, error)  # answers the receiver's wait for the ring
            return
        self._push_id += 1  # the receiver raises for an Abort of a push newer than the last it saw start
        self._channel.abort(self._push_id, stage, error)

    def _pack_ahead(self) -> int:
        """Pack the first buckets before PushStart: every buffer is free between pushes (the last push ended
        with every BucketFreed), and nothing is signalled until the receiver accepts."""
        ahead = min(len(self._ring.buffers), len(self._buckets))
        for k in range(ahead):
            try:
                self._pack(k)
            except Exception as e:  # e.g. a ring the receiver resized: tell it now, not after timeout_s
                self.abort(e, f"pack bucket {k} ahead of the push")
                raise
        return ahead

    def _pack(self, k: int) -> None:
        slot = k % len(self._ring.buffers)
        self._ring.before_pack(slot)
        self._packer.pack(k)
        if self._digests is not None:  # of the bytes as packed, wire dtype and all (raysync.digest)
            buffer = self._ring.buffers[slot]
            for c in self._buckets[k].chunks:
                part = digest.partial(buffer[c.bucket_offset : c.bucket_offset + c.nbytes], c.src_offset)
                self._digests.setdefault(c.index, []).append(part)
        self._ring.after_pack(slot)

    def _stream(self, version: int, packed_ahead: int) -> None:
        n = len(self._ring.buffers)
        pid = self._push_id
        bar = _LazyBar(self._layout_bytes, f"push v{version}", self.config.progress)
        stage = "stream"
        try:
            for k, bucket in enumerate(self._buckets):
                if k >= n:
                    stage = f"wait for buffer {k % n} (bucket {k}/{len(self._buckets)})"
                    self._channel.expect(BucketFreed, pid, stage)
                stage = f"pack bucket {k}/{len(self._buckets)}"
                if k >= packed_ahead:
                    self._pack(k)
                self._channel.send(BucketReady(pid, k, k % n), stage)
                bar.update(sum(c.nbytes for c in bucket.chunks))
                logger.debug("bucket %d: %d chunks, %d bytes", k, len(bucket.chunks), bucket.nbytes)
            stage = "verify" if self._digests is not None else "finish"
            self._send_digests()
            for _ in range(min(n, len(self._buckets))):
                self._channel.expect(BucketFreed, pid, "finish")
        except RemoteError:
            raise
        except Exception as e:  # tell the receiver now, rather than let it wait for timeout_s
            self._channel.abort(pid, stage, e)
            raise
        finally:
            bar.close()

    def _send_digests(self) -> None:
        """Verified pushes: each tensor's digest of what was packed (direct mode: of the tensor itself)."""
        if self._digests is None:
            return
        specs = self._layout.tensors
        if self._ring.direct:
            for bucket, storage in zip(self._buckets, self._ring.shared, strict=False):
                for c in bucket.chunks:
                    part = storage[c.bucket_offset : c.bucket_offset + c.nbytes]
                    self._digests[c.index] = [digest.partial(part, c.src_offset)]
        sums = tuple(digest.finish([self._digests.get(i, []) for i in range(len(specs))]))
        self._channel.send(PushDigest(self._push_id, sums), "verify")

    # --- set-up, once per session ------------------------------------------------------------------------------
    def _ensure_session(self) -> None:
        if self._ring is not None:
            return
        hello = self._channel.accept("handshake: waiting for the receiver's Hello")
        cfg = self.config
        try:
            ring = registry.ring_name(cfg.transport, cfg.direct)
            self._ring = registry.sender_class(ring)(cfg.num_buffers, cfg.bucket_bytes)
        except Exception as e:  # e.g. /dev/shm too small: tell the receiver instead of letting it time out
            self._channel.abort(0, "handshake: ring", e)
            raise
        self._channel.send(self._ring.info(), "handshake: ring")
        attached = self._channel.expect(Attached, 0, "handshake: waiting for the receiver to map the ring")
        self._ring.receiver_attached(attached)
        logger.info("session up with %s (pid %d): %s ring, %d x %d bytes", self._channel.peer, hello.pid,
                    self._ring.name, cfg.num_buffers, cfg.bucket_bytes)  # fmt: skip

    def _select(self, named: list[tuple[str, torch.Tensor]]) -> list[SourceTensor]:
        """select(), skipped while the trainer pushes the same tensors (updated in place) as last time."""
        key = tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device) for n, t in named)
        if key != self._sources_key:
            self._sources, self._sources_key, self._packer = select(named, self.config), key, None
        self._named = named
        return self._sources

    def _same_objects(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """The same names and tensor objects as last push: likely (not surely) the same tensors."""
        last = self._named
        if len(named) != len(last):
            return False
        return all(a[0] == b[0] and a[1] is b[1] for a, b in zip(named, last, strict=True))

    def _ensure_layout(self, sources: list[SourceTensor]) -> None:
        """Send the Layout when the tensors' names, dtypes or shapes change; make what every push replays when
        the tensors themselves change: the Packer's copies, or (direct mode) the exported storages."""
        if self._packer is not None:  # made for these very tensors (_select drops it when they change)
            return
        specs = tuple(s.spec for s in sources)
        new = self._layout is None or self._layout.tensors != specs
        layout_id = self._layout.layout_id + new if self._layout else 1
        # direct mode: check and export the storages before anything is sent
        shared = self._ring.share(layout_id, sources) if self._ring.direct else None
        if new:
            self._layout = Layout(layout_id, self.config.bucket_bytes, self.config.align_bytes, specs)
            self._layout_bytes = total_bytes(specs)
            self._buckets = plan_buckets(specs, self.config.bucket_bytes, self.config.align_bytes)
            self._channel.send(self._layout, "layout")
        if shared is not None:
            sizes = [b.storage_bytes for b in shared.storages]
            self._buckets = direct_buckets(specs, shared.storage, shared.offset_bytes, sizes)
            self._channel.send(shared, "layout: the trainer's storages")
            self._packer = shared
        else:
            self._packer = Packer(self._buckets, sources, self._ring.buffers, self.config.cuda_graphs)

    # --- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._packer = None  # its copies hold views of the ring: drop them first
        if self._ring is not None:
            self._channel.try_send(Close())
            self._ring.close()
            self._ring = None
        self._channel.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            self._bar = tqdm(total=self._total, initial=self._done - n, unit="B", unit_scale=True, desc=self._desc,
                             leave=False)  # fmt: skip
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
