"""raysync: stream a model's weights from RL trainers into rollout engines, fast and safely."""

from raysync.config import SyncConfig
from raysync.coordinator import ActorGone, ActorUnavailable, SyncClosed, SyncError, SyncReport, WeightSync
from raysync.errors import (
    IntegrityError,
    LayoutError,
    PeerLost,
    PeerTimeout,
    PeerUnavailable,
    PushIncomplete,
    RaysyncError,
    RemoteError,
    ShmSegmentResized,
    ShmSpaceError,
    WeightsMixed,
    WireError,
)
from raysync.receiver import SessionClosed, WeightReceiver
from raysync.report import PushReport
from raysync.sender import WeightSender
from raysync.version import MIXED
from raysync.wire import SessionSecret

__all__ = [
    "MIXED",
    "ActorGone",
    "ActorUnavailable",
    "IntegrityError",
    "LayoutError",
    "PeerLost",
    "PeerTimeout",
    "PeerUnavailable",
    "PushIncomplete",
    "PushReport",
    "RaysyncError",
    "RemoteError",
    "SessionClosed",
    "SessionSecret",
    "ShmSegmentResized",
    "ShmSpaceError",
    "SyncClosed",
    "SyncConfig",
    "SyncError",
    "SyncReport",
    "WeightSync",
    "WeightReceiver",
    "WeightSender",
    "WeightsMixed",
    "WireError",
]
