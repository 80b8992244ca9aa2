"""The receiver's half of a push session (the stages: raysync.core.session), for every data plane
(transport.base.PlaneReader).

A push that fails part-way raises PushIncomplete naming the tensors not delivered. ``version`` then says
what the destinations hold (Note [versions never lie] in raysync.core.version): the last push that completed, when
the failed push touched nothing or was atomic (``SyncConfig.staged``, a staging load function), else MIXED.
A sender that fails before its push starts (its source raised) sends an Abort that ends the wait at once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Generator, Mapping

import torch

from raysync.core.agreement import ReceiverLayout
from raysync.core.config import SyncConfig
from raysync.core.control import ReceiverChannel
from raysync.core.errors import (
    LayoutError,
    PeerLost,
    PushIncomplete,
    RaysyncError,
    RemoteError,
)
from raysync.core.receiver_stream import ReceiverStream
from raysync.core.report import PushReport
from raysync.core.session import OnPlane
from raysync.core.sink import LoadFn, Sink
from raysync.core.staging import FlipReport, Staging
from raysync.core.staging_memory import StagingInfo, StagingMemory
from raysync.core.version import MIXED, Version
from raysync.core.wire import (
    Accept,
    Checked,
    Hello,
    PushDone,
    PushStart,
    RingInfo,
)
from raysync.transport import registry
from raysync.transport.base import PlaneReader

logger = logging.getLogger(__name__)


class StagedFlips:
    """A receiver's staged pushes (raysync.core.staging): what the engine's thread calls between its steps. The
    receiving thread stages through ``receive(..., flip=False)``."""

    config: SyncConfig
    version: Version
    _channel: ReceiverChannel
    _staging: Staging | None = None  # made at the first staged push
    _staging_key: tuple | None = None

    @property
    def staged_version(self) -> int | None:
        """A staged push waiting for ``flip()`` (``version`` is the live one: Note [flip and versions])."""
        return self._staging.staged_version if self._staging else None

    @property
    def staging(self) -> StagingInfo | None:
        """The staging memory (mode and why, bytes per device); None before the first staged push."""
        return self._staging.memory.info if self._staging else None

    def flip(self, *, max_version_lag: int | None = None, wait_s: float | None = None) -> FlipReport | None:
        """At a step boundary of the engine: make the staged version live (groups mode: its next group); None
        when nothing is ready. ``max_version_lag``: first wait (up to ``wait_s``, default timeout_s) for the
        flips that bring the live version within that many versions of the newest announced (StaleWeights)."""
        return self._staging.flip(max_version_lag, wait_s) if self._staging else None

    def discard(self) -> int | None:
        """Drop the staged version, or acknowledge a failed stage (``flip()`` refuses until then)."""
        return self._staging.discard() if self._staging else None

    def _landing(self, version: int, area: Staging | None) -> None:
        """Push ``version`` was accepted: it lands in ``area``, or in the live weights, which drops a staged
        version (flipped later, it would go back in time: Note [flip and versions])."""
        if self._staging is not None:
            self._staging.begin(version) if area else self._staging.discard()

    def _landed(self, version: int, area: Staging | None, error: BaseException | None = None) -> None:
        if area is not None:
            area.failed(version, error) if error else area.landed(version)
        elif error is None:
            self.version = version

    def _staging_for(
        self, into: Mapping[str, torch.Tensor] | None, staging_bytes: int | None, staging_memory: str
    ) -> Staging:
        """The Staging of these destinations, budget and placement: made once, its memory reused by every push."""
        if into is None:
            raise TypeError(
                "flip=False stages into= destinations; a load function stages itself (its finish)"
            )
        key = (
            tuple((n, t.data_ptr(), t.dtype, t.shape) for n, t in into.items()),
            staging_bytes,
            staging_memory,
        )
        if self._staging is None or self._staging_key != key:
            if self._staging is not None:
                self._staging.close()
            memory = StagingMemory(
                into, staging_bytes, self.config.cuda_graphs, staging_memory=staging_memory
            )
            self._staging = Staging(memory, self, timeout_s=self.config.timeout_s, peer=self._channel.peer)
            self._staging_key = key
        return self._staging


class PushReceiver(OnPlane, StagedFlips):
    """The receiver's half of a session over ``channel`` (connected to the sender's endpoint). ``plane``: the
    data plane, when the transport made it before the session (a collective group); else the one the sender
    describes is attached at the first receive."""

    def __init__(self, channel: ReceiverChannel, config: SyncConfig, plane: PlaneReader | None = None):
        self.config = config
        self._channel = channel
        self._given_plane = plane
        self._plane: PlaneReader | None = None
        self._stream: ReceiverStream | None = None  # made with the plane
        self._agreed = ReceiverLayout(config)  # the layout, its buckets, the sinks (raysync.core.agreement)
        self.version: Version = None  # what the destinations hold (Note [versions never lie])
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time here

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors of the last layout received."""
        return tuple(self._agreed.names)

    def receive(
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        load_fn: LoadFn | None = None,
        wait_s: float | None = None,
        flip: bool = True,
        staging_bytes: int | None = None,
        staging_memory: str = "auto",
    ) -> PushReport:
        """Serve one push: copy it ``into`` a dict of destination tensors, or hand each bucket to ``load_fn``.
        Waits up to ``wait_s`` (default timeout_s) for the push to start. The destinations are checked when
        this is called (again when the push brings a new layout): do not change ``into`` from another thread
        while it waits. ``flip=False`` (``into`` only): stage the push, leave the live weights and ``version``
        alone; ``flip()`` applies it at the engine's next step boundary (raysync.core.staging: staging memory
        for the whole push, or groups of at most ``staging_bytes``; ``staging_memory`` "device", "host" (pinned)
        or "auto": device memory when the GPU has room, raysync.core.staging_memory)."""
        steps = self.receiving(
            into=into,
            load_fn=load_fn,
            wait_s=wait_s,
            flip=flip,
            staging_bytes=staging_bytes,
            staging_memory=staging_memory,
        )
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def receiving(
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        load_fn: LoadFn | None = None,
        wait_s: float | None = None,
        staging: bool = False,
        flip: bool = True,
        staging_bytes: int | None = None,
        staging_memory: str = "auto",
    ) -> Generator[None, None, PushReport]:
        """``receive`` in steps: yields after each batch of buckets, returns the report (raysync.transport.sharded runs
        several sessions' pushes from one thread, taking turns). ``staging``: ``load_fn`` only stages what it
        is given and the caller applies it after the push, so a failure here leaves the destinations as they
        were (Note [versions never lie]). ``flip``, ``staging_bytes``, ``staging_memory``: as for ``receive``."""
        if (into is None) == (load_fn is None):
            raise TypeError(
                "pass exactly one of into= (destination tensors) or load_fn= (a load_weights function)"
            )
        area = None if flip else self._staging_for(into, staging_bytes, staging_memory)
        into = area.target if area else into
        self._ensure_session()
        ahead = self._agreed.check_ahead(into, load_fn)
        # once, or again when the sender's tensors moved after its PushStart (Note [start, then check])
        while True:
            try:
                start = self._agreed.next_push(self._channel, self._plane, wait_s)
            except BaseException:
                # the error's traceback keeps this frame: the sink checked ahead holds views of the ring (direct
                # mode: of the sender's mapped tensors), which must not stay mapped for as long as the error lives
                ahead = None  # noqa: F841
                raise
            started = time.perf_counter()
            sink = self._accept(start, into, load_fn, ahead)
            ahead = None
            if sink is None:
                continue
            skip = self._agree(start, area, sink)
            accepted = streamed = time.perf_counter()
            if skip and start.checks and not self._skip_checked(start):
                continue
            if skip:
                break
            self._landing(start.version, area)
            try:
                streamed = yield from self._stream.run(start, sink, staging or area is not None)
            except BaseException as e:
                sink = None  # noqa: F841 -- Note [a kept error keeps nothing mapped]
                self._landed(start.version, area, e)
                raise
            if streamed is not None:
                break
            sink = None  # its copies read the moved tensors' mappings, which the next DirectSources replace
        if not skip:
            self._landed(start.version, area)
            try:
                self._channel.send(PushDone(start.push_id, start.version), "finish")
            except PeerLost as e:
                # every byte of this version is here (verified when asked): the weights are exactly it, so the
                # push stands (Note [versions never lie] in raysync.core.version); a sender that died after its
                # last byte is found by the next push, which cannot start
                logger.warning(
                    "push %d landed whole, but its PushDone did not reach the sender: %s", start.version, e
                )
        self.last_stages_s = {
            "accept": accepted - started,
            "stream": streamed - accepted,
            "finish": time.perf_counter() - streamed,
        }
        return self._report(start.version, skip, time.perf_counter() - started, sink)

    def _agree(self, start: PushStart, area: Staging | None, sink: Sink) -> bool:
        """Answer accept (skip: this version is here already, live or staged; never while MIXED, the next push
        repairs the weights; full: a delta that does not apply here, raysync.core.delta). A plane that moves
        every receiver together, and a delta, then wait for the sender's go: skip only if all have it, full
        when any needs it, or an Abort when another receiver refused (nothing has moved)."""
        skip = start.version in (self.version, area and area.staged_version)
        full = not sink.offered(start, self.version)  # even when skipping: a plane moving all streams it
        self._channel.send(Accept(start.push_id, skip, full), "accept")
        if not (self._plane.all_or_none or start.delta):
            return skip
        try:
            go = self._channel.expect(Accept, start.push_id, "accept: waiting for the other receivers")
        except RemoteError as e:
            raise self._incomplete(start, f"sender: {e.stage}", e.message, self._agreed.names) from e
        if go.full:
            sink.delta_base = None
        return go.skip

    def _taken_back(self, start: PushStart) -> bool:
        """A push that ``checks`` and that these destinations refuse: its tensors may have moved to what the
        destinations now are (a new shape on both sides), so the sender's Checked decides. True when they moved:
        the push is dropped as any moved one is (Accept, then Checked back) and the refusal with it."""
        pid = start.push_id
        try:
            if self._channel.expect(Checked, pid, "accept: the sender's check of its tensors").same:
                return False
        except RemoteError as e:  # the sender failed its check: that is what this push ends with
            raise self._incomplete(start, f"sender: {e.stage}", e.message, self._agreed.names) from e
        self._channel.send(Accept(pid, False), "accept: a push the sender takes back")
        self._channel.send(Checked(pid, False), "accept: a push the sender takes back")  # nothing read
        return True

    def _skip_checked(self, start: PushStart) -> bool:
        """A skipped push that ``checks`` (Note [start, then check]): the sender's Checked; False when its tensors
        moved (it pushes them again now)."""
        try:
            return self._stream.checked(start)
        except RemoteError as e:
            raise self._incomplete(start, f"sender: {e.stage}", e.message, []) from e

    def _report(self, version: int, skipped: bool, seconds: float, sink: Sink) -> PushReport:
        layout, buckets = self._agreed.layout, len(self._agreed.buckets)
        report = PushReport.received(
            version, self._plane.name, layout.tensors, buckets, seconds, skipped, sink, layout.nbytes
        )
        logger.info("received from %s: %s", self._channel.peer, report)
        return report

    def _accept(
        self,
        start: PushStart,
        into: Mapping[str, torch.Tensor] | None,
        load_fn: LoadFn | None,
        ahead: tuple | None = None,
    ) -> Sink | None:
        """Check the layout and every destination; on any mismatch tell the sender, touch nothing, raise. None:
        the sender took this push back (Note [start, then check]), and the refusal with it."""
        try:
            self._plane.check_start(start.push_id, start.layout_id)
            sink = self._agreed.sink_for(start, into, load_fn, ahead)
            sink.verify = start.verify
            return sink
        except RaysyncError as e:
            if start.checks and self._taken_back(start):
                return None
            self._channel.abort(start.push_id, "accept", e)
            raise self._incomplete(start, "accept", str(e), self._agreed.names) from e
        except Exception as e:  # not a refusal but a failure here: the sender hears it now, not at timeout_s
            self._channel.abort(start.push_id, "accept", e)
            raise

    def _incomplete(
        self, start: PushStart, stage: str, reason: str, undelivered: list[str]
    ) -> PushIncomplete:
        return PushIncomplete(start.version, stage, reason, undelivered, mixed=self.version == MIXED)

    def _mixed(self) -> None:
        self.version = MIXED

    # --- set-up and layout -------------------------------------------------------------------------------------
    def _ensure_session(self) -> None:
        if self._plane is None:
            self._plane = attach(self._channel, self.config, self._given_plane)
            self._stream = ReceiverStream(
                self._plane, self._channel, self._agreed, self.config, self._mixed, self._incomplete
            )
            self._channel.send(self._plane.attached(), "handshake: attached")

    # --- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._agreed.drop_sinks()  # Note [a kept error keeps nothing mapped]: the sinks go before the ring
        if self._staging is not None:
            self._staging.close()
        if self._plane is not None:
            self._plane.close()
            self._plane = self._stream = None
        self._channel.close()


def attach(channel: ReceiverChannel, config: SyncConfig, given: PlaneReader | None) -> PlaneReader:
    """The session's set-up, receiver half: Hello, then the plane the sender's RingInfo describes (or the one
    given, if it is that plane), attached (the caller answers Attached). A failure is told to the sender
    instead of letting it time out."""
    channel.send(Hello(os.getpid(), socket.gethostname()), "handshake")
    info = channel.expect(RingInfo, 0, "handshake: waiting for the ring description")
    try:
        if info.num_buffers and not config.align_bytes <= info.buffer_bytes <= 1 << 40:
            raise LayoutError(f"ring buffer size {info.buffer_bytes} is out of range")
        if given is not None and info.transport != given.name:
            raise LayoutError(f"the sender runs a {info.transport} plane, this receiver a {given.name} one")
        plane = given or registry.reader_plane(info, channel)
    except Exception as e:
        channel.abort(0, "handshake: map the ring", e)
        raise
    return plane
