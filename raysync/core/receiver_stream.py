"""The stream stage of a push, receiver half (raysync.core.session_receiver runs the other stages): every batch of
buckets received, unpacked into the sink and released; then drained, verified and committed.

    plane.batches -> plane.read(batch) -> sink.write_all -> plane.release(batch) ... drain -> verify -> commit
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Generator

from raysync.core.agreement import ReceiverLayout
from raysync.core.config import SyncConfig
from raysync.core.control import ReceiverChannel
from raysync.core.errors import IntegrityError, PushIncomplete, RemoteError, SchemaError, WeightsMixed
from raysync.core.sink import Sink
from raysync.core.wire import Checked, PushDigest, PushStart
from raysync.transport.base import PlaneReader


class ReceiverStream:
    """The stream stage, receiver half: every batch of buckets received, unpacked into the sink and released;
    then drained, verified and committed. Made with the plane; the version it marks MIXED and the errors it
    raises are its PushReceiver's (Note [versions never lie])."""

    def __init__(
        self,
        plane: PlaneReader,
        channel: ReceiverChannel,
        agreed: ReceiverLayout,
        config: SyncConfig,
        mixed: Callable[[], None],
        incomplete: Callable[..., PushIncomplete],
    ):
        self._plane, self._channel, self._agreed, self._config = plane, channel, agreed, config
        self._mixed, self._incomplete = mixed, incomplete

    def run(self, start: PushStart, sink: Sink, staging: bool) -> Generator[None, None, float | None]:
        """Every bucket into the sink (yielding after each batch), then the end of the push (drained, verified,
        applied); returns when the buckets were done, for ``last_stages_s``. None: the push was dropped, the
        sender's tensors moved after its PushStart (Note [start, then check] in raysync.core.session)."""
        pid, buckets = start.push_id, self._agreed.buckets
        count = len(buckets)
        stage = "stream"
        parts: list | None = None
        if hasattr(self._plane, "encoded"):  # it moves only a delta bucket's bytes used (the collective)
            self._plane.encoded(sink.delta_base is not None)
        # the sender's word on its tensors: before the first read for a sink that must not take a byte it may
        # drop (staged), else once the reads are queued
        check_first = start.checks and (staging or not sink.in_place)
        try:
            if check_first:
                stage = "the sender's check of its tensors"
                if not self.checked(start):
                    return None
            for batch in self._plane.batches(count):
                named = f"bucket {batch[0]}" if len(batch) == 1 else f"buckets {batch[0]}-{batch[-1]}"
                stage = f"wait for {named}/{count}"
                parts = list(zip([buckets[k] for k in batch], self._plane.read(batch, pid), strict=True))
                stage = f"unpack {named}/{count}"
                if batch[0] == 0 and not staging:
                    self._touching(sink)
                sink.write_all(parts)
                self._plane.release(batch, pid)
                parts = None
                yield
            streamed = time.perf_counter()
            if start.checks and not check_first:
                stage = "the sender's check of its tensors"
                if not self.checked(start):
                    return None
            self._plane.drain(self._config.timeout_s)  # Note [ordering GPU buffers]
            if start.verify:
                stage = "verify"
                self._verify(sink, self._channel.expect(PushDigest, pid, "verify: waiting for the digests"))
            stage = "apply"
            sink.commit()
            return streamed
        except RemoteError as e:  # the sender failed and told us
            self._plane.fail()
            undelivered = sink.undelivered()
            sink = parts = None  # noqa: F841 -- Note [a kept error keeps nothing mapped]
            traceback.clear_frames(e.__traceback__)
            raise self._incomplete(start, f"sender: {e.stage}", e.message, undelivered) from e
        except Exception as e:
            # Note [a kept error keeps nothing mapped]: the error's traceback keeps this frame alive for as long
            # as the caller keeps the error; ``parts`` and the sink's copies hold views of ring buffers (or of a
            # dead sender's mapped tensors), which close() must be able to unmap. The frames below this one (the
            # sink's, the load function's) are done: their locals go too, the traceback's lines stay.
            undelivered = sink.undelivered()
            sink = parts = None  # noqa: F841
            traceback.clear_frames(e.__traceback__)
            if isinstance(e, WeightsMixed):  # an atomic sink that could not keep its promise
                self._mixed()
            self._channel.abort(pid, stage, e)  # first: the sender looks for it when its broadcasts fail
            self._plane.fail()
            raise self._incomplete(start, stage, str(e), undelivered) from e

    def checked(self, start: PushStart) -> bool:
        """The sender's Checked of push ``start`` (Note [start, then check]); when its tensors moved, the reads
        of this push end first (drained), then the sender hears that it may drop the old storages: False."""
        if self._channel.expect(Checked, start.push_id, "the sender's check of its tensors").same:
            return True
        self._plane.drain(self._config.timeout_s)
        self._channel.send(
            Checked(start.push_id, False), "drop the push read before the sender's tensors moved"
        )
        return False

    def _touching(self, sink: Sink) -> None:
        """The first byte of the push is about to reach the destinations. Note [versions never lie]: from here
        until the push completes, a failure anywhere leaves them a mix of two versions, so say so first. An
        atomic sink (staged) touches them only in ``finish`` and says itself when that fails (WeightsMixed)."""
        if sink.in_place:
            self._mixed()

    def _verify(self, sink: Sink, sent: PushDigest) -> None:
        """Compare what landed with what the sender packed; the tensors that differ count as undelivered."""
        got = sink.digests()
        if len(sent.digests) != len(got):
            raise SchemaError(f"{len(sent.digests)} digests for {len(got)} tensors")
        bad = [i for i, (a, b) in enumerate(zip(sent.digests, got, strict=True)) if a != b]
        if bad:
            sink.done -= set(bad)
            names = [self._agreed.names[i] for i in bad]
            raise IntegrityError(f"{len(bad)} tensor(s) differ from what the sender packed: {names[:5]}")
