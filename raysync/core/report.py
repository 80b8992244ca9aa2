"""What a push returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raysync.core.agreement import SenderLayout
    from raysync.core.delta_stats import DeltaStats
    from raysync.core.sink import Sink
    from raysync.core.wire import TensorSpec


@dataclass(frozen=True)
class PushReport:
    version: int
    transport: str
    bytes: int  # payload bytes moved (tensor bytes, padding excluded)
    buckets: int
    tensors: int
    seconds: float
    skipped: bool = False  # the receiver had this version already
    # SyncConfig.delta (raysync.core.delta_stats.DeltaStats): ``bytes`` is their sum; a full push is all full
    sent_as_delta: int = 0  # headers, tables, changed elements with their positions
    sent_as_full: int = 0  # tensor bytes sent whole
    density: float | None = None  # changed elements / elements (delta pushes, on the sender)
    base_version: int | None = None  # the version a delta push was computed from; None for a full push
    why: str = ""  # delta mode, sender: which rule sent what full, and why (DeltaStats.explain)

    @classmethod
    def sent(
        cls,
        version: int,
        transport: str,
        agreed: SenderLayout,
        tensors: int,
        seconds: float,
        skipped: bool,
        stats: DeltaStats | None = None,
    ) -> PushReport:
        """The sender's report of a push of ``agreed``'s layout (nothing moved when skipped); ``stats``: what a
        push in delta mode sent."""
        moved = not skipped
        buckets = len(agreed.buckets) * moved
        if stats is None or skipped:
            nbytes = agreed.nbytes * moved
            return cls(version, transport, nbytes, buckets, tensors, seconds, skipped, 0, nbytes)
        delta, full = stats.sent_as_delta, stats.sent_as_full
        return cls(
            version,
            transport,
            delta + full,
            buckets,
            tensors,
            seconds,
            skipped,
            delta,
            full,
            stats.density,
            stats.base_version,
            stats.explain,
        )

    @classmethod
    def received(
        cls,
        version: int,
        transport: str,
        specs: Sequence[TensorSpec],
        buckets: int,
        seconds: float,
        skipped: bool,
        sink: Sink,
        layout_bytes: int | None = None,
    ) -> PushReport:
        """The receiver's report: a delta's bytes are those of the buffers it decoded. ``layout_bytes``: the
        specs' bytes, when known (Layout.nbytes)."""
        moved = not skipped
        base = sink.delta_base if moved else None
        total = sum(s.nbytes for s in specs) if layout_bytes is None else layout_bytes
        nbytes = total * moved if base is None else sink.moved
        full = nbytes if base is None else sink.moved_full
        return cls(
            version,
            transport,
            nbytes,
            buckets * moved,
            len(specs),
            seconds,
            skipped,
            nbytes - full,
            full,
            None,
            base,
        )

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        if self.skipped:
            return f"version {self.version}: skipped (already applied)"
        text = (
            f"version {self.version}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.buckets} buckets "
            f"over {self.transport}, {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s)"
        )
        if self.base_version is not None:
            density = "" if self.density is None else f", density {self.density:.2%}"
            text += (
                f"; a delta from version {self.base_version}: {self.sent_as_delta / 1e6:.2f} MB as delta, "
                f"{self.sent_as_full / 1e6:.2f} MB full{density}"
            )
        return f"{text} ({self.why})" if self.why else text
