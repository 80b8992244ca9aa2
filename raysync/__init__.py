"""raysync: stream a model's weights from RL trainers into rollout engines, fast and safely."""

from raysync.core.config import SyncConfig
from raysync.core.errors import (
    FlipFailed,
    IntegrityError,
    LayoutError,
    NothingStaged,
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
    StageFailed,
    StaleWeights,
    WeightsMixed,
    WireError,
)
from raysync.core.receiver import WeightReceiver
from raysync.core.report import PushReport
from raysync.core.sender import WeightSender
from raysync.core.version import MIXED
from raysync.core.wire import SessionSecret
from raysync.ray.coordinator import ActorGone, ActorUnavailable, SyncClosed, SyncError, SyncReport, WeightSync
from raysync.ray.staged_endpoint import engine_steps

__all__ = [
    "engine_steps",
    "StaleWeights",
    "StageFailed",
    "NothingStaged",
    "FlipFailed",
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
