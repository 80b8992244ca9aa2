"""What a push in delta mode sent (raysync.core.delta_push): its bytes as delta and as full, the elements that
changed, and why it went as it did, summed over its buckets; the sender's PushReport carries them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raysync.core import delta


@dataclass(frozen=True)
class DeltaStats:
    """What one push sent, summed over its buckets (raysync.core.delta.BucketCode's fields), and why."""

    base_version: int | None = None  # the version the deltas were computed from (None: a full push)
    sent_as_delta: int = 0  # SAME and GAPS payloads, headers, tables, padding
    sent_as_full: int = 0  # FULL payloads (a full push: every tensor byte)
    changed: int | None = None  # elements whose bits changed (known for delta pushes only)
    numel: int = 0
    why: str = ""  # why the push went full, or why the time rule let it be a delta (Note [the density ...])
    full_by_size: int = 0  # FULL payloads of a delta push whose gaps would not have been smaller
    full_by_density: int = 0  # FULL payloads of a delta push denser than SyncConfig.delta_max_density

    @property
    def density(self) -> float | None:
        return None if self.changed is None else self.changed / max(self.numel, 1)

    @property
    def explain(self) -> str:
        """Which rule sent what full, and why: the report's words."""
        parts = [self.why] if self.why else []
        for rule, nbytes in (("size", self.full_by_size), ("density", self.full_by_density)):
            if nbytes:
                parts.append(f"{nbytes / 1e6:.2f} MB full by {rule}")
        return "; ".join(parts)

    def add_full(self, payload: int) -> DeltaStats:
        """A bucket of a full push: ``payload`` tensor bytes sent whole."""
        return dataclasses.replace(
            self, base_version=None, sent_as_full=self.sent_as_full + payload, changed=None
        )

    def in_turns(self, full: int) -> DeltaStats:
        """These, a push's delta turn, with its full turn's ``full`` bytes (a fan-out served in turns)."""
        why = f"in turns: the delta turn: {self.explain}" if self.explain else "in turns"
        return dataclasses.replace(
            self, base_version=None, sent_as_full=self.sent_as_full + full, changed=None, why=why
        )

    def add(self, code: delta.BucketCode) -> DeltaStats:
        changed = code.changed
        return dataclasses.replace(
            self,
            sent_as_delta=self.sent_as_delta + code.sent_as_delta,
            sent_as_full=self.sent_as_full + code.sent_as_full,
            changed=None if self.changed is None or changed is None else self.changed + changed,
            numel=self.numel + code.numel,
            full_by_size=self.full_by_size + code.full_by("size"),
            full_by_density=self.full_by_density + code.full_by("density"),
        )
