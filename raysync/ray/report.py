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
    staged: bool = False  # push(staged=True): in every receiver's staging memory, not applied until flip()
    rounds: str = (
        "calls"  # how the round reached the actors: "loop", "graph", or "calls" and why (GraphKeeper)
    )

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.pairs)

    @property
    def slowest(self) -> PairReport:
        return max(self.pairs, key=lambda p: p.seconds)

    def __str__(self) -> str:
        staged = " staged (not applied: flip() applies it)" if self.staged else ""
        lines = [
            f"version {self.version}{staged}: {len(self.pairs)} pair(s), {self.bytes / 1e6:.1f} MB in "
            f"{self.seconds * 1e3:.1f} ms"
        ]
        for p in self.pairs:
            lines.append(
                f"  #{p.sender} -> #{p.receiver} over {p.transport}: {p.bytes / 1e6:.1f} MB, "
                f"{p.seconds * 1e3:.1f} ms, {p.gbps:.2f} GB/s"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class FlipReport:
    """What WeightSync.flip returns: ``version`` is live on every receiver; ``stalls`` per receiver j, the
    seconds its engine stopped for the flip (0.0 where the version was live already)."""

    version: int
    seconds: float  # the whole flip round, on the driver: the check, then the flips
    stalls: tuple[float, ...]

    def __str__(self) -> str:
        worst = max(self.stalls, default=0.0)
        return (
            f"version {self.version} flipped on {len(self.stalls)} receiver(s) in {self.seconds * 1e3:.1f} ms; "
            f"longest stall {worst * 1e3:.2f} ms"
        )
