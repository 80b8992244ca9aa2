"""raysync: stream a model's weights from RL trainers into rollout engines, fast and safely."""

from raysync.config import SyncConfig
from raysync.coordinator import SyncError, SyncReport, WeightSync
from raysync.errors import (
    LayoutError,
    PeerLost,
    PeerTimeout,
    PeerUnavailable,
    PushIncomplete,
    RaysyncError,
    RemoteError,
    ShmSpaceError,
    WireError,
)
from raysync.receiver import SessionClosed, WeightReceiver
from raysync.report import PushReport
from raysync.sender import WeightSender
from raysync.wire import SessionSecret

__all__ = [
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
    "ShmSpaceError",
    "SyncConfig",
    "SyncError",
    "SyncReport",
    "WeightSync",
    "WeightReceiver",
    "WeightSender",
    "WireError",
]
