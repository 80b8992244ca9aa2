"""What the endpoint functions (raysync.ray.endpoint) answer the driver: small frozen dataclasses, one per kind
of answer. Ray pickles them between its own processes; nothing here crosses a raysync socket or shared segment.

    sender_connect   -> SessionOpened    the address its receiver connects to, the bytes a push moves
    collective_open  -> GroupOpened      the rendezvous of its broadcast group, the bytes a push moves
    sender_push      -> {receiver j: EndpointResult}
    receiver_receive -> EndpointResult, as plain values (EndpointResult.to_plain; see below)

An EndpointResult holds a PushReport, or the RemoteFailure that stopped that endpoint (stage, message, remote
traceback), never both; a receiver's also says which version its weights hold after the round.

# Note [receive results as plain values]
# receiver_receive also runs inside vLLM engine workers, whose channel carries plain values only and whose
# adapter reads the answer's "ok" and "report"/"skipped" keys (Note [what crosses vLLM's channel] in
# raysync.engines.vllm). So a receiver answers ``EndpointResult.to_plain()``, and the driver reads it back with
# ``EndpointResult.from_plain`` as soon as it arrives; past that point the driver only sees the dataclass.
"""

from __future__ import annotations

import traceback
from dataclasses import asdict, dataclass
from typing import Any

from raysync.core.errors import PushIncomplete, RemoteError
from raysync.core.report import PushReport
from raysync.core.version import Version
from raysync.transport.process_group import Rendezvous


@dataclass(frozen=True)
class SessionOpened:
    """A sender's ring session for one receiver is open: ``address`` is where the receiver connects."""

    address: str
    push_bytes: int  # what a push of the sender's current source moves (for the driver's progress bar)


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
        that failed first (a receiver's cause, heard by its sender): that is what travels on."""
        if isinstance(error, RemoteError):
            return cls(error.stage, error.message, error.remote_traceback)
        return cls(
            error.stage if isinstance(error, PushIncomplete) else stage,
            f"{type(error).__name__}: {error}",
            "".join(traceback.format_exception(error)),
        )


@dataclass(frozen=True)
class EndpointResult:
    """One endpoint's part of a push round: a sender's for one of its receivers, or a receiver's."""

    report: PushReport | None = None
    failure: RemoteFailure | None = None
    version: Version = (
        None  # a receiver's weights after the round (Note [versions never lie]); None: a sender
    )

    def __post_init__(self) -> None:
        if (self.report is None) == (self.failure is None):
            raise ValueError(
                f"an EndpointResult holds a report or a failure, exactly one of them; got report={self.report!r}, "
                f"failure={self.failure!r}"
            )

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_plain(self) -> dict[str, Any]:
        """Plain values for a channel that carries no classes (Note [receive results as plain values])."""
        return {
            "ok": self.ok,
            "report": asdict(self.report) if self.report is not None else None,
            "failure": asdict(self.failure) if self.failure is not None else None,
            "version": self.version,
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> EndpointResult:
        """The inverse of ``to_plain``."""
        report, failure = plain["report"], plain["failure"]
        return cls(
            report=PushReport(**report) if report is not None else None,
            failure=RemoteFailure(**failure) if failure is not None else None,
            version=plain["version"],
        )
