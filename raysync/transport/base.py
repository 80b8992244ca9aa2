"""The two halves every ring transport provides. The sender owns the buffers; the receiver maps them.

A ring is ``num_buffers`` buffers of ``buffer_bytes`` each, exposed as uint8 tensors. The sender writes bucket
k into buffer k % num_buffers and tells the receiver over the control channel; the receiver says when it has
finished reading, and only then is that buffer written again. Nothing about flow control lives here.

# Note [ordering GPU buffers]
# A host buffer is ready when the copy call returns (device -> host copies are synchronized by the packer).
# A GPU buffer is ready when the GPU says so: the control messages only say "queued". So a GPU ring orders
# the two processes' streams with CUDA events, without ever blocking a host thread:
#     sender    wait(freed[s]) -> pack into buffer s -> record(packed[s]) -> BucketReady
#     receiver  BucketReady -> wait(packed[s]) -> unpack buffer s -> record(freed[s]) -> BucketFreed
# A stream that waits on an event waits for the record that preceded the wait call, and each record here
# precedes the message that lets the peer wait. ``end_push`` on the receiver waits (bounded) for its streams
# once, so a push counts as applied only when its bytes are in place. Host rings inherit the no-op hooks.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from raysync.wire import Attached, RingInfo


class RingSender(Protocol):
    name: ClassVar[str]
    direct: ClassVar[bool]  # no ring: the receiver reads the sender's tensors in place (cuda_ipc_direct)
    buffers: list[torch.Tensor]

    @classmethod
    def is_available(cls) -> bool: ...

    def info(self) -> RingInfo:
        """What the receiver needs to map the ring: plain names and sizes, never anything callable."""
        ...

    def receiver_attached(self, attached: Attached) -> None:
        """The receiver mapped every buffer: drop whatever names still make the ring reachable by others."""
        ...

    def before_pack(self, slot: int) -> None: ...  # Note [ordering GPU buffers]

    def after_pack(self, slot: int) -> None: ...

    def close(self) -> None: ...


class RingReceiver(Protocol):
    name: ClassVar[str]
    direct: ClassVar[bool]
    buffers: list[torch.Tensor]

    def attached(self) -> Attached: ...

    def before_unpack(self, slot: int) -> None: ...

    def after_unpack(self, slot: int) -> None: ...

    def end_push(self, timeout_s: float) -> None: ...

    def close(self) -> None: ...


class HostRing:
    """The hooks of a ring in host memory: nothing to order (Note [ordering GPU buffers])."""

    direct: ClassVar[bool] = False

    def before_pack(self, slot: int) -> None:
        pass

    def after_pack(self, slot: int) -> None:
        pass

    def attached(self) -> Attached:
        return Attached()

    def before_unpack(self, slot: int) -> None:
        pass

    def after_unpack(self, slot: int) -> None:
        pass

    def end_push(self, timeout_s: float) -> None:
        pass
