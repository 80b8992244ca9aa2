"""WeightSender: the trainer's half of a session. Set up once, push many times.

A push, as a sequence of stages (each wait bounded by ``timeout_s``):

    select    filter names, fix wire dtypes                        (source.select)
    session   first push only: wait for the receiver's Hello, create the ring, wait until it is mapped
    layout    only when the tensors changed: send names/dtypes/shapes; both sides plan the buckets from it
    accept    PushStart -> the receiver checks its destinations and answers Accept (or Abort)
    stream    for bucket k: wait until buffer k % N is free, pack, signal BucketReady
    finish    wait for the last frees and PushDone: only then is the version applied on the receiver
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from tqdm import tqdm

from raysync.config import SyncConfig
from raysync.control import SenderChannel
from raysync.errors import RemoteError
from raysync.plan import plan_buckets, total_bytes
from raysync.report import PushReport
from raysync.source import SourceTensor, pack_bucket, select
from raysync.transport import registry
from raysync.wire import (
    Accept,
    Attached,
    BucketFreed,
    BucketReady,
    Close,
    Layout,
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
        self._buckets: list = []
        self._push_id = 0
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time

    # --- the push ----------------------------------------------------------------------------------------------
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> PushReport:
        """Send ``named_tensors`` as ``version``; returns once the receiver has applied all of it."""
        start = time.perf_counter()
        sources = select(named_tensors, self.config)
        self._ensure_session()
        self._ensure_layout(sources)
        self._push_id += 1
        selected = time.perf_counter()
        self._channel.send(PushStart(self._push_id, version, self._layout.layout_id, True), "accept")
        accept = self._channel.expect(Accept, self._push_id, "accept")
        accepted = streamed = time.perf_counter()
        if not accept.skip:
            self._stream(sources, version)
            streamed = time.perf_counter()
            self._channel.expect(PushDone, self._push_id, "finish")
        self.last_stages_s = {"select": selected - start, "accept": accepted - selected,
                              "stream": streamed - accepted, "finish": time.perf_counter() - streamed}  # fmt: skip
        moved = not accept.skip
        report = PushReport(
            version, self._ring.name, total_bytes(self._layout.tensors) * moved, len(self._buckets) * moved,
            len(sources), time.perf_counter() - start, skipped=accept.skip,
        )  # fmt: skip
        logger.info("pushed to %s: %s", self._channel.peer, report)
        return report

    def _stream(self, sources: list[SourceTensor], version: int) -> None:
        n = len(self._ring.buffers)
        pid = self._push_id
        bar = tqdm(total=total_bytes(self._layout.tensors), unit="B", unit_scale=True, delay=1.0,
                   desc=f"push v{version}", disable=not self.config.progress, leave=False)  # fmt: skip
        stage = "stream"
        try:
            for k, bucket in enumerate(self._buckets):
                if k >= n:
                    stage = f"wait for buffer {k % n} (bucket {k}/{len(self._buckets)})"
                    self._channel.expect(BucketFreed, pid, stage)
                stage = f"pack bucket {k}/{len(self._buckets)}"
                self._ring.before_pack(k % n)
                pack_bucket(bucket, sources, self._ring.buffers[k % n])
                self._ring.after_pack(k % n)
                self._channel.send(BucketReady(pid, k, k % n), stage)
                bar.update(sum(c.nbytes for c in bucket.chunks))
                logger.debug("bucket %d: %d chunks, %d bytes", k, len(bucket.chunks), bucket.nbytes)
            for _ in range(min(n, len(self._buckets))):
                self._channel.expect(BucketFreed, pid, "finish")
        except RemoteError:
            raise
        except Exception as e:  # tell the receiver now, rather than let it wait for timeout_s
            self._channel.abort(pid, stage, e)
            raise
        finally:
            bar.close()

    # --- set-up, once per session ------------------------------------------------------------------------------
    def _ensure_session(self) -> None:
        if self._ring is not None:
            return
        hello = self._channel.accept("handshake: waiting for the receiver's Hello")
        cfg = self.config
        try:
            self._ring = registry.sender_class(cfg.transport)(cfg.num_buffers, cfg.bucket_bytes)
        except Exception as e:  # e.g. /dev/shm too small: tell the receiver instead of letting it time out
            self._channel.abort(0, "handshake: ring", e)
            raise
        self._channel.send(self._ring.info(), "handshake: ring")
        attached = self._channel.expect(Attached, 0, "handshake: waiting for the receiver to map the ring")
        self._ring.receiver_attached(attached)
        logger.info("session up with %s (pid %d): %s ring, %d x %d bytes", self._channel.peer, hello.pid,
                    self._ring.name, cfg.num_buffers, cfg.bucket_bytes)  # fmt: skip

    def _ensure_layout(self, sources: list[SourceTensor]) -> None:
        specs = tuple(s.spec for s in sources)
        if self._layout is not None and self._layout.tensors == specs:
            return
        layout_id = self._layout.layout_id + 1 if self._layout else 1
        self._layout = Layout(layout_id, self.config.bucket_bytes, self.config.align_bytes, specs)
        self._buckets = plan_buckets(specs, self.config.bucket_bytes, self.config.align_bytes)
        self._channel.send(self._layout, "layout")

    # --- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._ring is not None:
            self._channel.try_send(Close())
            self._ring.close()
            self._ring = None
        self._channel.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
