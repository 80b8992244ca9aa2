"""Typed errors. Each says what went wrong, with the value, and what to do about it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysync.core.version import Version


class RaysyncError(Exception):
    """Base class of every error raysync raises on purpose."""


# --- the wire ---------------------------------------------------------------------------------------------------
class WireError(RaysyncError):
    """A frame was refused. The channel that refused it stays usable."""


class FrameTooLarge(WireError):
    pass


class MalformedFrame(WireError):
    """Truncated, not msgpack, or a header that is not ours."""


class BadSignature(WireError):
    """The HMAC does not match: the frame was forged, corrupted, or signed with another session's key."""


class ReplayedFrame(WireError):
    """The sequence number is not above the last accepted one."""


class SchemaError(WireError):
    """An authenticated frame whose body does not match the message schema."""


# --- peers and time -----------------------------------------------------------------------------------------------
class PeerUnavailable(RaysyncError):
    """The peer cannot be reached: it died, hung, or never came. ``peer`` and ``stage`` say who and where."""

    def __init__(self, peer: str, stage: str, message: str):
        self.peer, self.stage = peer, stage
        super().__init__(message)


class PeerTimeout(PeerUnavailable, TimeoutError):
    """A blocking wait ran past ``timeout_s``."""

    def __init__(self, peer: str, stage: str, timeout_s: float):
        self.timeout_s = timeout_s
        super().__init__(
            peer,
            stage,
            f"no answer from {peer} within {timeout_s:g}s at stage '{stage}': the peer died, hung or never "
            f"connected (raise SyncConfig.timeout_s if it is just slow)",
        )


class PeerLost(PeerUnavailable, ConnectionError):
    """The connection to the peer is gone: it ended (the peer closed it, or its process died), or a send found
    no one to deliver to."""

    def __init__(self, peer: str, stage: str, reason: str):
        super().__init__(peer, stage, f"lost the connection to {peer} at stage '{stage}': {reason}")


class RemoteError(RaysyncError):
    """The peer failed; carries its stage, message and traceback."""

    def __init__(self, peer: str, stage: str, message: str, remote_traceback: str = ""):
        self.peer, self.stage, self.message, self.remote_traceback = peer, stage, message, remote_traceback
        text = f"{peer} failed at stage '{stage}': {message}"
        if remote_traceback:
            text += f"\n--- remote traceback ({peer}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class PushIncomplete(RaysyncError):
    """A push stopped part-way. The receiver's version did not advance: it is the old one, or ``"mixed"`` when
    ``mixed`` (bytes of this push had reached the destinations: Note [versions never lie] in raysync.core.version)."""

    def __init__(
        self, version: int, stage: str, reason: str, undelivered: list[str], *, mixed: bool | None = None
    ):
        self.version, self.stage, self.reason, self.undelivered = version, stage, reason, undelivered
        self.mixed = mixed  # None: the raiser does not know
        shown = ", ".join(undelivered[:5]) + (
            f", ... ({len(undelivered)} in all)" if len(undelivered) > 5 else ""
        )
        state = {
            True: "; the destinations now hold a mix of old and new weights: the version is 'mixed' until a "
            "push completes (the next push is a full one)",
            False: "; the destinations were not touched by this push",
            None: "",
        }[mixed]
        super().__init__(
            f"push of version {version} stopped at stage '{stage}': {reason}; "
            f"{len(undelivered)} tensor(s) not delivered: [{shown}]{state}"
        )


class WeightsMixed(RaysyncError):
    """Raised by a staging loader's ``finish`` (raysync.core.sink) that failed part-way and could not put the old
    weights back: the destinations hold a mix of two versions, and the receiver's version becomes "mixed"."""


# --- setup and input ----------------------------------------------------------------------------------------------
class LayoutError(RaysyncError, ValueError):
    """The tensors offered do not fit the destination, the bucket size or the dtype allowlist."""


class BadLayout(LayoutError, SchemaError):
    """A layout that no side plans: a degenerate geometry (bucket_bytes, align_bytes), a tensor no real model
    has, or more tensors, buckets or chunks than the bounds in raysync.core.wire (Note [layout bounds] in
    raysync.core.plan). The same error with the same message where the layout is made (SyncConfig, the sender) and
    where it arrives (a decoded Layout frame): a ValueError there, a WireError here."""


class BadDelta(LayoutError):
    """A delta bucket that cannot be applied as it is: refused before any byte of its bucket is written
    (raysync.core.delta)."""


class BaseMismatch(BadDelta):
    """A delta computed from one version offered to a receiver that holds another (or none, or a mix)."""


class EndpointError(RaysyncError, OSError):
    """A control endpoint could not be used safely (exists already, wrong interface, ...)."""


class ShmSpaceError(RaysyncError, OSError):
    """There is too little memory (or no fd) for the shm ring's memfds."""


class IntegrityError(RaysyncError):
    """The bytes that landed differ from what the sender packed (SyncConfig.verify)."""


class TransportUnavailable(RaysyncError):
    """The requested transport cannot run here."""


class ShmSegmentResized(RaysyncError):
    """A mapped shm segment no longer has the size it was mapped with. Nothing raises it since the ring's segments
    are memfds sealed against resizing (Note [no SIGBUS] in raysync.transport.shm); kept for callers that catch it."""

    def __init__(self, peer: str, stage: str, name: str, expected_bytes: int, actual_bytes: int):
        self.peer, self.stage, self.name = peer, stage, name
        self.expected_bytes, self.actual_bytes = expected_bytes, actual_bytes
        super().__init__(
            f"shm segment {name} has {actual_bytes} bytes, {expected_bytes} when it was mapped, at stage "
            f"'{stage}': {peer} or another process of this user resized it. Touching it would kill this process "
            f"(SIGBUS), so this session stops here: close both sides and start a new session, and look for the "
            f"process that truncates files in /dev/shm"
        )


class ReloadFailed(RaysyncError):
    """An engine's reload of a push failed part-way and was undone: the engine keeps the weights it had."""


# --- the driver (raysync.ray.coordinator.WeightSync) ----------------------------------------------------------------
@dataclass(frozen=True)
class EndpointFailure:
    endpoint: str  # "receiver #1 (node ..., pid ..., GPU ...)"
    stage: str
    error: str
    traceback: str


class SyncError(RaysyncError):
    """A push round failed on one or more endpoints; each failure names the endpoint, stage and traceback.
    ``mixed``: the receivers whose weights the failed push left a mix of two versions (Note [versions never
    lie]): ``versions()`` says "mixed" for them until the next push, a full one, completes."""

    def __init__(self, version: int, failures: list[EndpointFailure], mixed: Sequence[int] = ()):
        self.version, self.failures, self.mixed = version, failures, tuple(mixed)
        first = failures[0]
        text = (
            f"push of version {version} failed on {len(failures)} endpoint(s); first: {first.endpoint} at "
            f"stage '{first.stage}': {first.error}"
        )
        if self.mixed:
            text += (
                f"\nreceiver(s) {', '.join(f'#{j}' for j in self.mixed)} now hold a mix of two versions "
                f"(versions() says 'mixed'): the next push sends them the full weights"
            )
        if first.traceback:
            text += f"\n--- remote traceback ({first.endpoint}) ---\n{first.traceback.rstrip()}"
        super().__init__(text)


class SyncClosed(RaysyncError):
    """``push`` or ``versions`` on a WeightSync that was closed."""


class ActorUnavailable(PeerUnavailable):
    """A Ray actor could not answer: Ray was still restarting it at the deadline, or could not reach it."""


class ActorGone(ActorUnavailable):
    """A Ray actor died and Ray will not restart it (its ``max_restarts`` are spent, or it had none)."""


class SessionClosed(RaysyncError):
    """The sender closed the session."""


class PlanError(RaysyncError):
    """No transport can serve a pair, or an override names one that cannot."""


# --- staged pushes and the flip (raysync.core.staging, raysync.ray.staged_round) -----------------------------------
class StagingError(RaysyncError):
    """A staged push cannot be flipped or discarded now (the message says why and what to do)."""


class StagingFailed(StagingError):
    """The push being staged failed: there is nothing to flip. ``discard()`` acknowledges it (the next push
    does too); the live weights and their version are the ones the engine is computing with."""

    def __init__(self, version: int, reason: str, flipped: int = 0):
        self.version, self.reason = version, reason
        live = (
            f"{flipped} of its groups were flipped: the live weights are MIXED until a push completes"
            if flipped
            else "the live weights were not touched by it"
        )
        super().__init__(
            f"flip refused: staging version {version} failed ({reason}); {live}; call discard() or wait for "
            f"the next push"
        )


class StaleWeights(PeerUnavailable, TimeoutError):
    """A step waited past its bound for a flip that ``max_version_lag`` required (the push did not land)."""

    def __init__(self, peer: str, stage: str, timeout_s: float, live: Version, newest: int, lag: int):
        self.timeout_s = timeout_s
        super().__init__(
            peer,
            stage,
            f"the live weights are version {live!r}, version {newest} was announced by {peer} and "
            f"max_version_lag={lag}; no staged version to flip came within {timeout_s:g}s at stage '{stage}' "
            f"(the push is slow or stuck: raise wait_s, or the bound)",
        )


class StageFailed(SyncError):
    """``push(version, staged=True)`` failed on one or more endpoints (each named, with its stage): nothing
    flips; every receiver that had staged the version discarded it; every engine keeps its live weights."""

    def __init__(self, version: int, failures: list[EndpointFailure], mixed: Sequence[int] = ()):
        super().__init__(version, failures, mixed)
        self.args = (
            f"staged {self.args[0]}\nnothing flips: every receiver dropped what it staged of version {version} "
            f"and keeps its live weights",
        )


class FlipFailed(SyncError):
    """``flip()`` could not apply the staged version everywhere. ``flipped``: the receivers that did (none when
    the check found the failure first: Note [all or nothing across engines]); the others discarded it."""

    def __init__(self, version: int, failures: list[EndpointFailure], flipped: Sequence[int] = ()):
        super().__init__(version, failures)
        self.flipped = tuple(flipped)
        first = failures[0]
        where = (
            f"receiver(s) {', '.join(f'#{j}' for j in self.flipped)} flipped before it; the others discarded it"
            if self.flipped
            else "no receiver flipped: every one discarded it and keeps its live weights"
        )
        text = f"flip of version {version} failed on {len(failures)} endpoint(s); first: {first.endpoint} at stage '{first.stage}': {first.error}; {where}"
        if first.traceback:
            text += f"\n--- remote traceback ({first.endpoint}) ---\n{first.traceback.rstrip()}"
        self.args = (text,)


class NothingStaged(RaysyncError):
    """``flip()`` with no staged push waiting for it."""
