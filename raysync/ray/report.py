"""What WeightSync.push returns: a SyncReport of the round, one PairReport per (sender, receiver) pair."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PairReport:
    sender: int
    receiver: int
    transport: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SyncReport:
    version: int
    seconds: float
    pairs: tuple[PairReport, ...]

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.pairs)

    @property
    def slowest(self) -> PairReport:
        return max(self.pairs, key=lambda p: p.seconds)

    def __str__(self) -> str:
        lines = [
            f"version {self.version}: {len(self.pairs)} pair(s), {self.bytes / 1e6:.1f} MB in "
            f"{self.seconds * 1e3:.1f} ms"
        ]
        for p in self.pairs:
            lines.append(
                f"  #{p.sender} -> #{p.receiver} over {p.transport}: {p.bytes / 1e6:.1f} MB, "
                f"{p.seconds * 1e3:.1f} ms, {p.gbps:.2f} GB/s"
            )
        return "\n".join(lines)
