"""Staged pushes with a flip (issue 18): a push lands in staging memory while the engine keeps computing on the
live weights; at a step boundary the engine calls ``flip()`` and one copy per destination makes it live.

    receiving thread                                   engine thread (its step loop)
    receiver.receive(into=params, flip=False)          step on version v     (reads the live weights only)
      accept: Staging.begin(v + 1)                     receiver.flip()       -> None: nothing staged yet
      every bucket -> staging memory                   step on version v
      done: staged_version = v + 1, PushDone           receiver.flip()       -> FlipReport: live := v + 1
                                                       step on version v + 1

The live tensors are written only by the flip, in place (their addresses stay: CUDA graphs captured over them
stay valid), from the engine's own thread, between its steps: the lock around a step is the caller's.

Two modes (``StagingInfo.mode``, chosen per layout, with the reason in ``StagingInfo.why``):

* ``whole``: staging memory for every tensor of the push (no ``staging_bytes``, or the push fits in it). One
  flip applies the whole version.
* ``groups``: the push is larger than ``staging_bytes``: its tensors, in layout order, are cut into groups of
  consecutive tensors that each fit, all staged in the same memory. Group g lands only once the engine has
  flipped group g - 1 (the receiving thread waits for it, bounded by timeout_s), so a push spans several steps
  and the steps between its first and last flip run on MIXED weights (Note [flip and versions]).

Staging memory (raysync.core.staging_memory) is one byte buffer per device of the destinations, allocated when
the first push of a layout is accepted and reused by every push after it; ``StagingInfo`` gives its size, and
where it lives (``memory``, the reason in ``memory_why``), chosen by ``staging_memory``:

* ``device``: on the destinations' own device (for a GPU: spare GPU memory); the flip is a device copy.
* ``host``: in host memory, page-locked (pinned) for GPU destinations, so the push lands without taking GPU
  memory and the flip is one host -> device copy per tensor (non-blocking, then one synchronize: the flip is
  complete when it returns; its bytes cross the host link rather than staying in GPU memory).
* ``auto`` (the default): ``device`` when the GPU's free memory (``torch.cuda.mem_get_info``, plus what torch's
  allocator holds unused) less ``margin_bytes`` holds the buffer, else ``host``; decided per device when its
  buffer is allocated.

For destinations in host memory (a CPU engine) device and host staging are the same memory: ``memory`` is
"host" whatever ``staging_memory`` says.

# Note [flip and versions]
# ``version`` is the live weights' version and only a flip changes it (Note [versions never lie] in
# raysync.core.version); ``staged_version`` is a complete, verified push waiting for its flip. A push that fails
# while staging leaves the live weights and version untouched (in groups mode: unless groups were flipped
# already, which left them MIXED), and ``flip()`` then raises StagingFailed until ``discard()`` or the next push.
# A flip that fails part-way leaves MIXED: the next push repairs it. A new push while a version waits for its
# flip replaces it (it lands in the same memory): the older staged version is dropped, never flipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from raysync.core.errors import (
    PeerTimeout,
    StagingError,
    StagingFailed,
    StaleWeights,
    WeightsMixed,
)
from raysync.core.staging_memory import StagingMemory
from raysync.core.staging_sink import StagingSink
from raysync.core.version import MIXED, Version, is_version
from raysync.core.wire import TensorSpec

logger = logging.getLogger(__name__)

EMPTY, LANDING, READY, FAILED = "empty", "landing", "ready", "failed"


@dataclass(frozen=True)
class FlipReport:
    version: Version  # live after this flip: the staged version, or MIXED after a group that is not the last
    staged_version: int
    group: int
    groups: int
    nbytes: int
    seconds: float


class Staging:
    """The state of a staged push and its flip, over a StagingMemory. One receiving thread stages; the
    engine's thread flips, discards and waits (``max_version_lag``). ``owner``: what holds the live
    ``version`` (a PushReceiver); here only the flip writes it."""

    def __init__(self, memory: StagingMemory, owner: object, *, timeout_s: float, peer: str):
        self.memory, self._owner, self._timeout_s, self._peer = memory, owner, timeout_s, peer
        self.target = _Target(self)  # what the session's Sinks get as ``into``
        self._cond = threading.Condition()
        self.state, self._version, self._error = EMPTY, None, ""
        self.newest: int | None = None  # the newest version a push announced (max_version_lag counts from it)
        self._ready = self._flipped = 0  # groups landed, groups flipped, of the push in ``_version``

    @property
    def staged_version(self) -> int | None:
        """A complete push waiting for its flip (None while one lands, after a failure, after the flip)."""
        return self._version if self.state == READY and self._flipped == 0 else None

    # --- the receiving thread -----------------------------------------------------------------------------------
    def make_sink(self, specs: Sequence[TensorSpec], graphs: bool) -> StagingSink:
        """The sink of a push of ``specs`` (raysync.core.sink.Sinks calls it); a new layout is planned and
        sized first (a version still waiting for its flip is then dropped)."""
        with self._cond:
            if self.memory.specs != tuple(specs):
                self._drop_ready("its layout changed")
                self.memory.prepare(tuple(specs))
        return StagingSink(specs, self, graphs)

    def begin(self, version: int) -> None:
        """Push ``version`` was accepted: its bytes land from now on (a flip in progress finishes first)."""
        with self._cond:
            self._drop_ready(f"version {version} replaces it")
            self.state, self._version, self._error = LANDING, version, ""
            self._ready = self._flipped = 0
            self.newest = version if self.newest is None else max(self.newest, version)
            self._cond.notify_all()

    def group_landed(self, group: int) -> None:
        with self._cond:
            self._ready = group + 1
            self._cond.notify_all()

    def wait_room(self, group: int) -> None:
        """Group ``group`` may land once the group before it was flipped (groups share the memory)."""
        n = self.memory.plan.groups
        stage = f"stage group {group + 1}/{n}: waiting for the engine's flip() of group {group}/{n}"
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._flipped >= group or self.state != LANDING, self._timeout_s
            ):
                raise PeerTimeout("the engine (flip() at its step boundaries)", stage, self._timeout_s)
            if self.state != LANDING:
                raise StagingError(f"version {self._version} was dropped while it landed ({stage})")

    def landed(self, version: int) -> None:
        """The whole push landed (and was verified): ready to flip."""
        with self._cond:
            self.state, self._ready = READY, self.memory.plan.groups
            self._cond.notify_all()

    def failed(self, version: int, error: BaseException) -> None:
        with self._cond:
            self.state, self._error = FAILED, f"{type(error).__name__}: {error}".split("\n")[0][:300]
            self._cond.notify_all()

    # --- the engine's thread ------------------------------------------------------------------------------------
    def flip(self, max_version_lag: int | None = None, wait_s: float | None = None) -> FlipReport | None:
        """Apply the staged version, or its next group (groups mode); None when nothing is ready. With
        ``max_version_lag``, wait (up to ``wait_s``, default timeout_s) and flip until the live version is at
        most that far behind the newest version announced."""
        limit = self._timeout_s if wait_s is None else wait_s
        deadline = time.monotonic() + limit
        with self._cond:
            report = self._flip_one()
            while self._stale(max_version_lag):
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait_for(self._flippable, left):
                    live, stage = self._owner.version, "flip: waiting for a staged version"
                    raise StaleWeights(self._peer, stage, limit, live, self.newest, max_version_lag)
                report = self._flip_one() or report
            return report

    def _flippable(self) -> bool:
        """What ``_flip_one`` acts on: a group landed and not flipped, or a failure to raise."""
        return self.state == FAILED or (self.state in (LANDING, READY) and self._ready > self._flipped)

    def _flip_one(self) -> FlipReport | None:
        if self.state == FAILED:
            raise StagingFailed(self._version, self._error, self._flipped)
        if self.state not in (LANDING, READY) or self._ready <= self._flipped:
            return None
        group, groups, copies = self._flipped, self.memory.plan.groups, self.memory.flips[self._flipped]
        started = time.perf_counter()
        self._owner.version = MIXED  # until the last copy is in place (Note [flip and versions])
        try:
            copies.run()
            for device in copies.devices:
                torch.cuda.current_stream(device).synchronize()  # applied means in place
        except Exception as e:
            raise WeightsMixed(
                f"flip of version {self._version} (group {group + 1}/{groups}) failed part-way: "
                f"{type(e).__name__}: {e}; the next push repairs the weights"
            ) from e
        self._flipped = group + 1
        if self._flipped == groups and self.state == READY:
            self._owner.version, self.state = self._version, EMPTY
        self._cond.notify_all()
        seconds, nbytes = time.perf_counter() - started, self.memory.group_bytes[group]
        return FlipReport(self._owner.version, self._version, group, groups, nbytes, seconds)

    def _stale(self, lag: int | None) -> bool:
        if lag is None or self.newest is None:
            return False
        live = self._owner.version
        return not is_version(live) or self.newest - live > lag

    def discard(self) -> int | None:
        """Drop a staged version (or acknowledge a failed one); returns the version dropped."""
        with self._cond:
            if self.state == LANDING:
                raise StagingError(f"version {self._version} is landing; discard it after its receive ends")
            dropped = self._version if self.state in (READY, FAILED) else None
            self._drop_ready("discarded")
            self.state = EMPTY
            live = self._owner.version
            self.newest = live if is_version(live) else None
            return dropped

    def _drop_ready(self, why: str) -> None:
        if self.state == READY:  # groups mode, flipped part-way: the live weights stay MIXED
            log = logger.info if self._flipped == 0 else logger.warning
            log("staged version %s dropped after %d flips: %s", self._version, self._flipped, why)
            self.state = EMPTY
            self._ready = self._flipped  # nothing of it is left to flip

    def close(self) -> None:
        with self._cond:
            self.memory.close()
            self.state = EMPTY


class _Target(Mapping):
    """The live destinations, as a session's ``into``: raysync.core.sink.Sinks makes its sink with
    ``make_sink`` (a staging sink: the bytes land in the staging memory, never here)."""

    def __init__(self, staging: Staging):
        self.staging = staging

    def make_sink(self, specs: Sequence[TensorSpec], graphs: bool) -> StagingSink:
        return self.staging.make_sink(specs, graphs)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.staging.memory.dest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.staging.memory.dest)

    def __len__(self) -> int:
        return len(self.staging.memory.dest)
