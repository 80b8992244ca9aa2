"""The sink of a staged push: a push lands in a Staging's memory (raysync.core.staging), group by group, and
reaches the destinations only at the engine's flip; beside raysync.core.sink's sinks, which it extends."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from raysync.core import digest
from raysync.core.copies import CopyList
from raysync.core.plan import Bucket
from raysync.core.sink import IntoTensors
from raysync.core.wire import TensorSpec

if TYPE_CHECKING:
    from raysync.core.staging import Staging


class StagingSink(IntoTensors):
    """Lands a push in a Staging's memory (raysync.core.staging), group by group: when the first chunk of group
    g comes, group g - 1 is complete (its digests taken first, with verify) and handed to the flip, and the
    chunk waits until the engine flipped it (the groups share the memory). Nothing reaches the live weights."""

    def __init__(self, specs: Sequence[TensorSpec], staging: Staging, graphs: bool):
        # no delta: the staging memory holds no version the delta is from
        super().__init__(specs, staging.memory.views, staged=False, graphs=graphs, deltas=False)
        self._staging, self._group_of = staging, staging.memory.plan.group_of
        self._segments: dict[tuple, list[tuple[int, CopyList]]] = {}
        self._group = 0
        self._sums: dict[int, int] = {}  # digests of the tensors of groups handed to the flip

    def reset(self) -> None:
        super().reset()
        self._group, self._sums = 0, {}

    def write_all(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> None:
        key = tuple((bucket.index, buffer.data_ptr()) for bucket, buffer in parts)
        segments = self._segments.get(key)
        if segments is None:  # made once per buckets and buffers, replayed every push
            segments = self._segments[key] = self._split(parts)
        for group, copies in segments:
            if group != self._group:
                self._close(self._group)
                self._staging.wait_room(group)
                self._group = group
            copies.run()
        for bucket, buffer in parts:
            self._sync(buffer)
            self.landed(bucket)

    def _split(self, parts: Sequence[tuple[Bucket, torch.Tensor]]) -> list[tuple[int, CopyList]]:
        runs: list[tuple[int, list]] = []
        for bucket, buffer in parts:
            for c in bucket.chunks:
                group = self._group_of[c.index]
                if not runs or runs[-1][0] != group:
                    runs.append((group, []))
                if c.nbytes:
                    runs[-1][1].append((self.target(c), buffer[c.bucket_offset : c.bucket_offset + c.nbytes]))
            if buffer.is_cuda:  # into host staging, its copies run on this device's stream: synchronized too
                self._devices.add(buffer.device)
        return [(group, CopyList(pairs, self._graphs)) for group, pairs in runs]

    def _close(self, group: int) -> None:
        self._synchronize()
        if self.verify:
            mine = [i for i, g in enumerate(self._group_of) if g == group]
            sums = digest.combine([[digest.partial(self._bytes[i], 0)] for i in mine])
            self._sums.update(zip(mine, sums, strict=True))
        self._staging.group_landed(group)

    def digests(self) -> list[int]:
        rest = [i for i in range(len(self.specs)) if i not in self._sums]
        sums = dict(
            zip(rest, digest.combine([[digest.partial(self._bytes[i], 0)] for i in rest]), strict=True)
        )
        return [self._sums.get(i, sums.get(i)) for i in range(len(self.specs))]

    def commit(self) -> None:
        self._synchronize()  # the flip runs on the engine's thread: the copies must be done before

    def _synchronize(self) -> None:
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
