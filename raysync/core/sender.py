"""WeightSender: the trainer's half of a session. Set up once, push many times.

A thin wrapper: it binds the control channel, and the push session (raysync.core.session.PushSender) runs the
stages of every push over the data plane the config names (shm ring, cuda_ipc ring, cuda_ipc direct).
"""

from __future__ import annotations

from raysync.core.config import SyncConfig
from raysync.core.control import SenderChannel
from raysync.core.session import PushSender
from raysync.core.wire import SessionSecret


class WeightSender(PushSender):
    """Binds the control endpoint at construction; give ``endpoint`` and the secret to the receiver."""

    def __init__(
        self,
        secret: SessionSecret,
        config: SyncConfig | None = None,
        *,
        endpoint: str | None = None,
        allow_any_interface: bool = False,
    ):
        config = config or SyncConfig()
        channel = SenderChannel(
            secret,
            endpoint=endpoint,
            allow_any_interface=allow_any_interface,
            timeout_s=config.timeout_s,
            max_frame_bytes=config.max_frame_bytes,
        )
        super().__init__(channel, config)
        self.endpoint = channel.endpoint

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
