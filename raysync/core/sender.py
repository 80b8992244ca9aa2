"""WeightSender: the trainer's half of a session. Set up once, push many times.

A thin wrapper: it binds the control channel, and the push session (raysync.core.session.PushSender) runs the
stages of every push over the data plane the config names (shm ring, cuda_ipc ring, cuda_ipc direct), to
one receiver or to N (fan-out: N readers of one shm or cuda_ipc ring, or of the trainer's tensors in direct mode).
"""

from __future__ import annotations

from raysync.core.config import SyncConfig
from raysync.core.control import SenderChannel
from raysync.core.fanout import Fanout
from raysync.core.session import PushSender
from raysync.core.wire import SessionSecret


class WeightSender(PushSender):
    """Binds the control endpoint at construction; give ``endpoint`` and the secret to the receiver.

    ``receivers=N`` (fan-out: shm, cuda_ipc ring or direct): one ring that N receivers read, each bucket packed
    once for all of them (direct: N receivers reading the trainer's tensors, nothing packed);
    receiver i connects to ``endpoints[i]`` (an explicit ``endpoint`` is for one receiver). A push returns when
    all N have applied it, and moves all N together: one that refuses it stops it for all, before any byte."""

    def __init__(
        self,
        secret: SessionSecret,
        config: SyncConfig | None = None,
        *,
        endpoint: str | None = None,
        allow_any_interface: bool = False,
        receivers: int = 1,
    ):
        config = config or SyncConfig()
        if receivers < 1 or (endpoint is not None and receivers != 1):
            raise ValueError(f"receivers={receivers}: at least 1, and 1 when an endpoint is given")
        channels: list[SenderChannel] = []
        try:
            for _ in range(receivers):
                channels.append(
                    SenderChannel(
                        secret,
                        endpoint=endpoint,
                        allow_any_interface=allow_any_interface,
                        timeout_s=config.timeout_s,
                        max_frame_bytes=config.max_frame_bytes,
                    )
                )
        except BaseException:
            for c in channels:
                c.close()
            raise
        super().__init__(Fanout(channels), config)
        self.endpoints = [c.endpoint for c in channels]
        self.endpoint = self.endpoints[0]

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
