"""raysync: stream a model's weights from RL trainers into rollout engines, fast and safely."""

from raysync.core.config import SyncConfig
from raysync.core.errors import (
    IntegrityError,
    LayoutError,
    PeerLost,
    PeerTimeout,
    PeerUnavailable,
    PlanError,
    PushIncomplete,
    RaysyncError,
    RemoteError,
    SessionClosed,
    ShmSegmentResized,
    ShmSpaceError,
    WeightsMixed,
    WireError,
)
from raysync.core.receiver import WeightReceiver
from raysync.core.report import PushReport
from raysync.core.sender import WeightSender
from raysync.core.version import MIXED
from raysync.core.wire import SessionSecret
from raysync.ray.coordinator import ActorGone, ActorUnavailable, SyncClosed, SyncError, SyncReport, WeightSync

__all__ = [
    "MIXED",
    "ActorGone",
    "ActorUnavailable",
    "IntegrityError",
    "LayoutError",
    "PeerLost",
    "PeerTimeout",
    "PeerUnavailable",
    "PlanError",
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
