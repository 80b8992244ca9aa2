"""Page-locking host memory that torch allocated or mapped (a shm ring's segment, a staging buffer), so that
copies between it and a GPU run at pinned speed: ``cudaHostRegister`` on the bytes as they are, undone with
``unregister`` before they are freed or unmapped.

Not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator (as its source reads; not measured
here) rounds every block up to a power of two, which is 16 GiB for a 15.2 GB staging buffer, and keeps freed
blocks pinned and cached, never returning them to the system. Registering pins exactly the bytes asked for,
for exactly as long as their owner holds them.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def register(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s bytes for every CUDA context (portable); False where there is no initialised CUDA,
    or where the driver refuses (then copies run at pageable speed, and a warning says so)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()) or tensor.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 1)
    if int(err) != 0:
        logger.warning(
            "cudaHostRegister of %d bytes failed (%s): copies run at pageable speed", tensor.numel(), err
        )
        return False
    return True


def unregister(tensor: torch.Tensor) -> None:
    """Undo ``register`` (before the bytes are freed or unmapped); the caller waited for the copies that use
    them."""
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
