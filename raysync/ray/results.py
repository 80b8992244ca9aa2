"""What the endpoint functions (raysync.ray.endpoint) answer the driver: small frozen dataclasses, one per kind
of answer. Ray pickles them between its own processes; nothing here crosses a raysync socket or shared segment.

    sender_connect   -> SessionOpened    the address its receiver connects to, the bytes a push moves
    collective_open  -> GroupOpened      the rendezvous of its broadcast group, the bytes a push moves
    fanout_connect   -> FanoutOpened     the address each reader of its one ring connects to, the bytes
    sender_push      -> {receiver j: EndpointResult}
    receiver_receive -> EndpointResult    (receiver_stage too, with its StagingReport: raysync.ray.staged_endpoint)
    receiver_staged, receiver_flip, receiver_discard -> StagedState

An EndpointResult holds a PushReport, or the RemoteFailure that stopped that endpoint (stage, message, remote
traceback), never both; a receiver's also says which version its weights hold after the round. Inside vLLM
engine workers they cross vLLM's channel as plain values and are rebuilt on the other side (an allowlist of
these types: Note [what crosses vLLM's channel] in raysync.engines.vllm); a StagingReport crosses it as a
tuple of scalars, checked where the EndpointResult is rebuilt.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import NamedTuple

from raysync.core.errors import PeerUnavailable, PushIncomplete, RemoteError, SchemaError
from raysync.core.report import PushReport
from raysync.core.staging_memory import STAGING_MEMORY
from raysync.core.version import Version
from raysync.transport.process_group import Rendezvous


@dataclass(frozen=True)
class SessionOpened:
    """A sender's ring session for one receiver is open: ``address`` is where the receiver connects."""

    address: str
    push_bytes: int  # what a push of the sender's current source moves (for the driver's progress bar)


@dataclass(frozen=True)
class FanoutOpened:
    """A sender's fan-out session is open: its i-th reader connects to ``addresses[i]``."""

    addresses: tuple[str, ...]
    push_bytes: int  # what a push of the sender's current source moves to each reader


@dataclass(frozen=True)
class GroupOpened:
    """A sender's broadcast group is open: its receivers join it through ``rendezvous``."""

    rendezvous: Rendezvous
    push_bytes: int  # what a push of the sender's current source (its share, if sharded) moves


@dataclass(frozen=True)
class RemoteFailure:
    """Why an endpoint's part of a push failed, as seen inside its process."""

    stage: str  # where it failed: "session", "source", "push", "receive", or the peer's own stage
    error: str  # "TypeName: message", or the message a peer sent
    traceback: str  # the remote traceback ("" where there is none)

    @classmethod
    def of(cls, stage: str, error: BaseException) -> RemoteFailure:
        """``error`` raised at ``stage``. A RemoteError already names the stage and traceback of the side
        that failed first (a receiver's cause, heard by its sender): that is what travels on. A peer that
        was lost or timed out, and a push that stopped part-way, name their own stage (e.g. the all-gather of
        a sharded source's bucket)."""
        if isinstance(error, RemoteError):
            return cls(error.stage, error.message, error.remote_traceback)
        return cls(
            error.stage if isinstance(error, (PushIncomplete, PeerUnavailable)) else stage,
            f"{type(error).__name__}: {error}",
            "".join(traceback.format_exception(error)),
        )


STAGING_MODES = ("whole", "groups")
STAGING_MEMORIES = ("device", "host", "mixed")  # where it was staged (STAGING_MEMORY: what may be asked)


class StagingReport(NamedTuple):
    """Where a receiver staged a push, as its staged push answered it (raysync.core.staging_memory.StagingInfo,
    or a vLLM worker's host copies): ``mode`` "whole" or "groups" and ``why``; ``memory`` "device", "host" or
    "mixed" (several devices, not all with room) and ``memory_why``, given ``asked`` (WeightSync's
    ``staging_memory``); ``nbytes`` of staging memory held,
    ``push_bytes`` of the push's tensors, in ``groups`` flips. A tuple of scalars: it crosses vLLM's channel as
    a list and comes back through ``checked``."""

    mode: str
    why: str
    memory: str
    memory_why: str
    asked: str  # the staging_memory the receiver was given: "auto", "device" or "host"
    nbytes: int
    push_bytes: int
    groups: int

    @classmethod
    def checked(cls, values: object) -> StagingReport:
        """``values`` (a StagingReport, or its fields as a tuple or list) checked: SchemaError if not one."""
        types = (str, str, str, str, str, int, int, int)
        ok = (
            isinstance(values, (tuple, list))
            and len(values) == len(types)
            and all(type(v) is t for v, t in zip(values, types, strict=True))
        )
        if not ok or values[0] not in STAGING_MODES or values[2] not in STAGING_MEMORIES:
            raise SchemaError(f"staging report: {values!r:.300}")
        if values[4] not in STAGING_MEMORY or min(values[5:]) < 0 or values[7] < 1:
            raise SchemaError(f"staging report: negative bytes or no group: {values!r:.300}")
        return cls(*values)

    def __str__(self) -> str:
        return (
            f"{self.mode}, {self.memory} memory, {self.nbytes} bytes (staging_memory={self.asked!r}): {self.why}; "
            f"{self.memory_why}"
        )


@dataclass(frozen=True)
class EndpointResult:
    """One endpoint's part of a push round: a sender's for one of its receivers, or a receiver's."""

    report: PushReport | None = None
    failure: RemoteFailure | None = None
    version: Version = (
        None  # a receiver's weights after the round (Note [versions never lie]); None: a sender
    )
    staging: StagingReport | None = None  # a staged push's receiver: where it staged (None: it did not)

    def __post_init__(self) -> None:
        if self.staging is not None:
            object.__setattr__(self, "staging", StagingReport.checked(self.staging))
        if (self.report is None) == (self.failure is None):
            raise ValueError(
                f"an EndpointResult holds a report or a failure, exactly one of them; got report={self.report!r}, "
                f"failure={self.failure!r}"
            )

    @property
    def ok(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class StagedState:
    """A receiver's live and staged versions (raysync.core.staging) after a call of the flip round:
    ``flip_s`` the flip this call made (the engine's stall), ``failure`` why the call failed."""

    live: Version
    staged: int | None
    flip_s: float | None = None
    failure: RemoteFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None
