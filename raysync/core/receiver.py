"""WeightReceiver: the engine's half of a session. Connect once, receive many pushes.

A thin wrapper: it connects the control channel, and the push session (raysync.core.session_receiver.PushReceiver)
runs the stages of every push over the data plane the sender describes.
"""

from __future__ import annotations

from raysync.core.config import SyncConfig
from raysync.core.control import ReceiverChannel
from raysync.core.errors import SessionClosed
from raysync.core.session_receiver import PushReceiver
from raysync.core.wire import SessionSecret

__all__ = ["SessionClosed", "WeightReceiver"]


class WeightReceiver(PushReceiver):
    """Connects to a WeightSender's ``endpoint``; call ``receive`` once per push."""

    def __init__(self, endpoint: str, secret: SessionSecret, config: SyncConfig | None = None):
        config = config or SyncConfig()
        channel = ReceiverChannel(
            secret, endpoint=endpoint, timeout_s=config.timeout_s, max_frame_bytes=config.max_frame_bytes
        )
        super().__init__(channel, config)

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
