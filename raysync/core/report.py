"""What a push returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout


@dataclass(frozen=True)
class PushReport:
    version: int
    transport: str
    bytes: int  # payload bytes moved (tensor bytes, padding excluded)
    buckets: int
    tensors: int
    seconds: float
    skipped: bool = False  # the receiver had this version already

    @classmethod
    def sent(
        cls, version: int, transport: str, agreed: SenderLayout, tensors: int, seconds: float, skipped: bool
    ) -> PushReport:
        """The sender's report of a push of ``agreed``'s layout (nothing moved when skipped)."""
        moved = not skipped
        return cls(
            version, transport, agreed.nbytes * moved, len(agreed.buckets) * moved, tensors, seconds, skipped
        )

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        if self.skipped:
            return f"version {self.version}: skipped (already applied)"
        return (
            f"version {self.version}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.buckets} buckets "
            f"over {self.transport}, {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s)"
        )
