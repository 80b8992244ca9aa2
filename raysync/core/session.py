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
| accept       | pack ahead, PushStart, wait for Accept (read   | check every destination; Accept or Abort       |
|              | in place: the check after PushStart, Checked)  |                                                |
| stream       | bucket k: claim -> pack -> packed -> publish   | bucket k: receive -> unpack -> release         |
| verify       | PushDigest of what was packed                  | compare with what landed                       |
| commit       | wait for PushDone                              | drain, apply (sink.commit), version := pushed  |
| report       | PushReport                                     | PushReport                                     |

A session is one sender and N receivers (control.Fanout: N = 1 for a ring; a collective group's receivers).
A plane that moves every receiver together (``all_or_none``: a broadcast) and a delta push (pack: encode;
unpack: decode; raysync.core.delta_push) get the sender's go after accept: skip if all have the version,
full if any cannot take the delta, or an Abort for all when any receiver refused.

# Note [start, then check]
# A plane that reads the trainer's tensors in place (direct mode, one reader) gets the same tensor objects push
# after push in a training loop. Checking that they still are the tensors it maps (pointer, dtype, shape, stride
# and device of each: ~0.4 ms for 338 tensors on the H200's host) then runs after PushStart, while the receiver
# accepts and copies: PushStart says ``checks``, and a Checked follows. The receiver commits only once Checked
# says ``same``; a staged sink (or staging load function) waits for it before its first read. When the tensors
# moved (new storages or shapes: rare), the receiver lets its reads end, drops the push (an in-place sink is
# MIXED meanwhile: Note [versions never lie]), answers Checked, and waits for the push again within the same
# receive; the sender keeps the old storages exported until that answer, then pushes the tensors as new ones.
# Destinations that refuse such a start (a new shape on both sides) wait for Checked before refusing: when the
# sender takes the start back, the refusal goes with it. Only a plane whose reads ask nothing more of the
# sender runs this with an in-place sink: a ring's receiver waits for BucketReady, not Checked, as it reads.

Every wait is bounded by ``timeout_s``. A push that fails here before it starts (the trainer's source raised,
a layout over the bounds, a pack ahead) is announced to the receiver with an Abort, so it raises at once.
Once it started, a failure here is an Abort of that push; the receiver's version then follows Note [versions
never lie] (raysync.core.version).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from raysync.core.agreement import SenderLayout
from raysync.core.config import SyncConfig
from raysync.core.control import SenderChannel
from raysync.core.delta_buffers import ring_config
from raysync.core.delta_push import Reference
from raysync.core.errors import RaysyncError, RemoteError
from raysync.core.fanout import Fanout
from raysync.core.report import PushReport
from raysync.core.sender_stream import SenderStream
from raysync.core.source import Source, is_source
from raysync.core.wire import Accept, Attached, Checked, Close, Hello, PushDone, PushStart, TensorSpec
from raysync.transport import registry
from raysync.transport.base import DataPlane

logger = logging.getLogger(__name__)


class OnPlane:
    """Either half of a session: what tools and tests may look at of the data plane it runs on."""

    _plane: object | None

    @property
    def ring(self) -> object | None:
        """The transport's own object this session runs on (a ring: its ``buffers``, to inspect them; direct:
        the exported or mapped storages); None before the first push."""
        return self._plane.transport if self._plane is not None else None


class PushSender(OnPlane):
    """The sender's half of a session over ``channel`` (bound; the receiver connects to it), or over a Fanout
    to several receivers. ``plane``: the data plane, when the transport made it before the session (a
    collective group); else the session makes the one ``config`` names once the receiver is there."""

    def __init__(self, channel: SenderChannel | Fanout, config: SyncConfig, plane: DataPlane | None = None):
        self.config = config
        self._channel = channel if isinstance(channel, Fanout) else Fanout([channel])
        self._given_plane = plane
        self._plane: DataPlane | None = None
        self._agreed = SenderLayout(config)  # the layout, its buckets, the Packer (raysync.core.agreement)
        self._push_id = 0
        self._stream: SenderStream | None = None  # made with the plane
        self._delta = Reference(config)  # SyncConfig.delta (raysync.core.delta_push)
        self.last_stages_s: dict[str, float] = {}  # where the last push spent its time

    @property
    def delta_off(self) -> str | None:
        """Why this session pushes full although SyncConfig.delta asked for deltas (Note [the delta reference]:
        direct mode, a layout whose encoding does not fit the buffers); None when it can send deltas."""
        return self._delta.off

    @property
    def packed_buckets(self) -> int:
        """How many buckets the last push packed (each once, for every receiver; 0 when read in place)."""
        return self._stream.packs if self._stream is not None else 0

    # --- the push ----------------------------------------------------------------------------------------------
    def push(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Source, version: int, *, full: bool = False
    ) -> PushReport:
        """Send ``named_tensors`` as ``version``; returns once the receiver has applied all of it. A lazy
        ``Source`` (raysync.core.source) is packed bucket by bucket by its own packer (``_push_source``).
        ``full``: no delta this time (SyncConfig.delta; a push is full anyway when a receiver needs it)."""
        self._delta.start(full, lazy=is_source(named_tensors))
        if is_source(named_tensors):
            return self._push_source(named_tensors, version)
        start = time.perf_counter()
        try:
            named = list(named_tensors)  # a generator runs the trainer's code: it may raise
        except Exception as e:
            self.abort(e, "source")
            raise
        stream = self._stream
        if stream is not None:
            stream.reset()
        # the same tensor objects as last push (a training loop): the device packs the first buckets while the
        # host checks the tensors; what was packed is dropped if they changed after all (new data pointers)
        agreed = self._agreed
        placed = agreed.placed if agreed.is_placed else -1
        try:
            same_objects = placed >= 0 and agreed.same_objects(named)
            if same_objects and self._checks_after_start:  # Note [start, then check]
                skipped = self._deliver(version, 0, start, check=named)
                if skipped is not None:
                    return self._report(version, len(agreed.sources), skipped, time.perf_counter() - start)
                placed, same_objects = -1, False  # they moved: pushed as new tensors, below
            ahead = stream.pack_ahead(self.abort) if same_objects else 0
            sources = self._or_abort("select", agreed.select, named)
            self._ensure_session([s.spec for s in sources])
            self._or_abort("layout", agreed.agree, sources, self._plane, self._channel)
            stream = self._stream
            if agreed.placed != placed:  # new copies: what was packed ahead read other tensors (or nothing)
                ahead = stream.go_full()
                self._delta.prepare(agreed, self._plane.buffers)
            if not ahead:
                ahead = stream.pack_ahead(self.abort)
            skipped = self._deliver(version, ahead, start)
        finally:
            self._delta.drain()  # a delta's copies into the ring, packed ahead of a push that did not stream
        return self._report(version, len(sources), skipped, time.perf_counter() - start)

    def _push_source(self, source: Source, version: int) -> PushReport:
        """The same stages for a lazy source: the layout from its metadata, each bucket packed by its packer
        when claimed (a sharded source gathers it then), and the packer told how the push ended, whatever
        happened (a sharded source's other ranks learn it through it)."""
        start = time.perf_counter()
        try:
            self._ensure_session()
            self._agreed.agree_source(source, self._plane, self._channel)
            if self._delta.active:  # a collective fits its buffers to the layout's encoding
                self._plane.place(self._agreed.layout, ())
            self._delta.prepare_source(self._agreed, source, self._plane.buffers)
            packer = self._delta.source_packer or self._agreed.packer  # delta mode: over its scratch
            packer.start(version)
        except Exception as e:  # the receiver is waiting for a push: tell it
            self.abort(e, "source")
            raise
        try:
            self._stream.reset()
            skipped = self._deliver(version, self._stream.pack_ahead(self.abort), start)
        except BaseException:
            self._delta.drain()  # Note [a bucket is encoded while the one before crosses]
            try:
                packer.finish("failed")
            except Exception as e:  # this push's own error is the one to raise
                logger.warning("the source's other ranks may not have heard that this push failed: %s", e)
            raise
        packer.finish("skipped" if skipped else "done")
        tensors = len(self._agreed.layout.tensors)
        return self._report(version, tensors, skipped, time.perf_counter() - start)

    @property
    def _checks_after_start(self) -> bool:
        """Note [start, then check]: a plane that reads the trainer's tensors in place, for one reader."""
        plane = self._plane
        return plane is not None and plane.reads_in_place and not plane.all_or_none and not self._delta.active

    def _deliver(
        self, version: int, ahead: int, start: float, check: list[tuple[str, torch.Tensor]] | None = None
    ) -> bool | None:
        """accept, stream (the first ``ahead`` buckets packed already) and commit; True when skipped. ``check``:
        the tensors, checked after PushStart (Note [start, then check]); None when they moved (nothing
        committed: the caller pushes them again as new tensors)."""
        self._push_id += 1
        selected = time.perf_counter()
        accept, stale = self._accept(version, check)
        if accept is None:
            return None
        self._delta.accepted()
        accepted = streamed = time.perf_counter()
        if stale:  # fan-out readers that cannot take the delta: the others get it, then they a full push
            self._stream.run_in_turns(self._push_id, version, ahead, stale)
            streamed = time.perf_counter()
        else:
            if accept.full:  # a receiver cannot take the delta: a full push, in this round (for all)
                ahead = self._stream.go_full()
            if not accept.skip:
                self._stream.run(self._push_id, version, ahead)
                streamed = time.perf_counter()
                self._channel.expect(PushDone, self._push_id, "finish")
        self._delta.finish(version, accept.skip)
        self.last_stages_s = {
            "select": selected - start,
            "accept": accepted - selected,
            "stream": streamed - accepted,
            "finish": time.perf_counter() - streamed,
        }
        return accept.skip

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

    def _or_abort(self, stage: str, fn: Callable, *args: object) -> object:
        """``fn(*args)``; what it raises is told to the receivers first, once there are any (they wait)."""
        try:
            return fn(*args)
        except Exception as e:
            if self._plane is not None:
                self.abort(e, stage)
            raise

    def _accept(
        self, version: int, check: list[tuple[str, torch.Tensor]] | None = None
    ) -> tuple[Accept | None, list[int]]:
        pid, base = self._push_id, self._delta.base
        self._plane.begin(pid, self._agreed.buckets)
        start = PushStart(
            pid,
            version,
            self._agreed.layout.layout_id,
            self.config.verify,
            base is not None,
            base or 0,
            checks=check is not None,
        )
        if check is not None:
            return self._accept_checking(start, check), []
        return accept_round(self._channel, self._plane, start, in_turns=not self._delta.lazy)

    def _accept_checking(self, start: PushStart, named: list[tuple[str, torch.Tensor]]) -> Accept | None:
        """accept, Note [start, then check]: PushStart, then the check of the tensors while the receiver accepts
        and reads, then Checked; the receiver's Accept. None when they moved: the receiver has answered that
        its reads ended and it dropped the push."""
        pid = start.push_id
        self._channel.send(start, "accept")
        try:
            self._agreed.select(named)
        except Exception as e:  # the receiver reads already: it hears now, and its version is not this one
            self._channel.abort(pid, "select", e)
            raise
        same = self._agreed.is_placed  # select clears it when the tensors moved
        self._channel.send(Checked(pid, same), "accept: the sender's check of its tensors")
        [accept] = self._channel.expect(Accept, pid, "accept")
        if same:
            return accept
        self._channel.expect(Checked, pid, "accept: the receiver drops what it read of the moved tensors")
        return None

    # --- set-up, once per session ------------------------------------------------------------------------------
    def _ensure_session(self, specs: Sequence[TensorSpec] = ()) -> None:
        if self._plane is None:
            config = ring_config(self.config, specs) if self._delta.enabled else self.config
            self._plane, hellos = open_plane(self._channel, config, self._given_plane)
            self._stream = SenderStream(self._plane, self._channel, self._agreed, self.config, self._delta)
            attach_receivers(self._plane, self._channel, config, hellos)
            self._delta.on_plane(self._plane, made_here=self._given_plane is None)  # knows its readers now

    def _report(self, version: int, tensors: int, skipped: bool, seconds: float) -> PushReport:
        stats = self._delta.stats if self._delta.active else None
        report = PushReport.sent(version, self._plane.name, self._agreed, tensors, seconds, skipped, stats)
        logger.info("pushed to %s: %s", self._channel.peer, report)
        return report

    # --- teardown ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        self._agreed.packer = None  # its copies hold views of the ring: drop them first
        self._delta.drain()  # no delta's copy still writes into the ring it unmaps
        if self._plane is not None:
            self._channel.try_send(Close())
            self._plane.close()
            self._plane = self._stream = None
        self._channel.close()


def accept_round(
    channel: Fanout, plane: DataPlane, start: PushStart, in_turns: bool = True
) -> tuple[Accept, list[int]]:
    """The accept stage, sender half: PushStart, every receiver's Accept, and the go for a plane that moves
    all receivers together and for a delta (skip if all have the version; full if any cannot take the delta).
    A refusal by one is an Abort for all: nothing moved anywhere. Also returns the readers of a fan-out ring
    that cannot take a delta the others take: they are served in turns (``PushSender._in_turns``; not for a
    lazy source, whose packer walks its buckets once a push), and no go is sent here."""
    pid = start.push_id
    channel.send(start, "accept")
    try:
        answers = channel.expect(Accept, pid, "accept")
    except RemoteError as e:
        if len(channel.channels) > 1:
            channel.abort(pid, "accept", e)
        raise
    go = Accept(pid, all(a.skip for a in answers), any(a.full for a in answers))
    stale = [i for i, a in enumerate(answers) if a.full]
    if in_turns and start.delta and plane.name == "shm" and 0 < len(stale) < len(answers) and not go.skip:
        return Accept(pid, False, False), stale  # a fan-out ring (shm only) serves its readers in turns
    if plane.all_or_none or start.delta:
        getattr(plane, "send_go", channel.send)(go, "accept: the go")  # readers in turns: one after another
    return go, []


def open_plane(channel: Fanout, config: SyncConfig, given: DataPlane | None) -> tuple[DataPlane, list[Hello]]:
    """The session's set-up, sender half, first step: every receiver's Hello, then the data plane (the one
    given, or the ring ``config`` names; a failure is told to the receivers, which raise at once)."""
    hellos = channel.accept("handshake: waiting for the receiver's Hello")
    try:
        name = registry.ring_name(config.transport, config.direct)
        plane = given or registry.sender_plane(name, config, channel)
    except Exception as e:  # e.g. not enough memory for the ring: tell the receiver, not let it time out
        channel.abort(0, "handshake: ring", e)
        raise
    return plane, hellos


def attach_receivers(plane: DataPlane, channel: Fanout, config: SyncConfig, hellos: list[Hello]) -> None:
    """Second step: describe the plane, wait for every receiver's Attached (they mapped it)."""
    channel.send(plane.describe(), "handshake: ring")
    for attached in channel.expect(Attached, 0, "handshake: waiting for the receiver to map the ring"):
        plane.attached(attached)
    logger.info(
        "session up with %s (pids %s): %s plane, %d x %d bytes",
        channel.peer,
        [h.pid for h in hellos],
        plane.name,
        plane.slots,
        config.bucket_bytes,
    )
