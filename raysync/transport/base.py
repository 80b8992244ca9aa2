"""The two halves every ring transport provides. The sender owns the buffers; the receiver maps them.

A ring is ``num_buffers`` buffers of ``buffer_bytes`` each, exposed as uint8 tensors. The sender writes bucket
k into buffer k % num_buffers and tells the receiver over the control channel; the receiver says when it has
finished reading, and only then is that buffer written again. Nothing about flow control lives here.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from raysync.wire import RingInfo


class RingSender(Protocol):
    name: ClassVar[str]
    buffers: list[torch.Tensor]

    @classmethod
    def is_available(cls) -> bool: ...

    def info(self) -> RingInfo:
        """What the receiver needs to map the ring: plain names and sizes, never anything callable."""
        ...

    def receiver_attached(self) -> None:
        """The receiver mapped every buffer: drop whatever names still make the ring reachable by others."""
        ...

    def close(self) -> None: ...


class RingReceiver(Protocol):
    name: ClassVar[str]
    buffers: list[torch.Tensor]

    def close(self) -> None: ...
