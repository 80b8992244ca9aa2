"""The collectives of a sharded source: every rank of the mesh walks the same buckets, each wait bounded.

Note [every rank walks the same buckets]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A push of a sharded source is, on every rank of the mesh (the sending rank and the others alike), the same
sequence of all-gathers on a process group of the source's own:

    start      headers only: each rank's push count, version, bucket count and layout hash. Any difference is
               a LayoutError on every rank, before any data moves
    bucket k   each rank's header (status OK, STOP or FAILED) and its pieces of bucket k (gather_plan)
    end        headers only: each rank's outcome (done, skipped, failed, followed)

A rank leaves the walk early only through a header that every rank reads: STOP (the sending rank's push was
skipped, or ended) sends every rank to ``end``; FAILED makes every rank raise, naming that rank and the bucket.
So no rank waits on a gather the others skipped.

Every wait is bounded. The group's own timeout (WAIT_SHARE of timeout_s) ends a gather that a rank does not join
(it lags, hangs, died, or never came); every rank that gave up then takes a census in the store: it writes where
it gave up and waits, until CENSUS_SHARE of timeout_s after that gather began, for the others to write theirs.
The ranks that wrote nothing are the ones named in the error every surviving rank raises (PeerTimeout when the
gather ran out of time, PeerLost when it saw a connection close). A rank whose census finds that every other
rank gave up before it names itself: it came late. After such a failure the group is unusable, and the walk says
so at its next start: make a new source (a new group).
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from raysync.core.errors import LayoutError, PeerLost, PeerTimeout, RaysyncError, RemoteError
from raysync.sources.gather_plan import HEADER_BYTES

MAGIC = 0x7261797379  # "raysy"
OK, STOP, FAILED = 1, 2, 3  # a bucket's status; FAILED is an outcome too
OUTCOMES = {"done": 10, "skipped": 11, "failed": FAILED, "followed": 12}
WAIT_SHARE = 0.7  # of timeout_s: how long a gather waits for every rank
CENSUS_SHARE = 0.9  # of timeout_s after a gather began: the end of the census of who gave up where
START = -1  # the stage of the start exchange; bucket k is stage k, the end exchange stage ``count``
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older versions have only the old one
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_timeout(timeout_s: float) -> timedelta:
    """The timeout of a source's process group: a gather that a rank does not join ends after this."""
    return timedelta(seconds=timeout_s * WAIT_SHARE)


@dataclass(frozen=True)
class Header:
    """A rank's header: the first HEADER_BYTES of its segment in every gather, as 8 int64."""

    magic: int
    status: int
    seq: int  # pushes walked by this source, this one included
    version: int
    stage: int
    count: int  # buckets of the push
    layout: int  # layout hash (buckets, tensors, segment sizes)
    world: int

    def values(self) -> list[int]:
        return list(astuple(self))


class GatherWalk:
    """The walk of one sharded source on its process group (Note [every rank walks the same buckets]).
    ``bind`` gives it the gather buffer and each bucket's segment size; the packer fills this rank's pieces
    before each ``issue``."""

    def __init__(
        self, group, rank: int, world: int, store, timeout_s: float, device: torch.device, name: str
    ):
        self._group, self.rank, self.world, self._store = group, rank, world, store
        self.timeout_s, self._name = timeout_s, name
        self._small = torch.zeros(world * HEADER_BYTES, dtype=torch.uint8, device=device)
        self._buffer: torch.Tensor | None = None
        self._segments: list[int] = []
        self._seq = self.version = self.count = self._layout = 0
        self.next = 0  # the next bucket to gather
        self._pending: tuple | None = None  # (bucket, work, buffer, segment, began)
        self._active = self._stopped = False
        self._broken = ""  # why the group is unusable

    def bind(self, buffer: torch.Tensor, segments: list[int]) -> None:
        self._buffer, self._segments = buffer, segments

    # --- one push ----------------------------------------------------------------------------------------------
    def start(self, version: int, layout_hash: int) -> None:
        """Every rank's header: the same push count, version and layout on every rank, or a LayoutError on
        every rank naming those that differ."""
        if self._broken:
            raise PeerLost(self._ranks(range(self.world)), "start", f"{self._broken}; make a new source")
        self._seq += 1
        self.version, self.count, self._layout = version, len(self._segments), layout_hash
        self.next, self._pending, self._stopped = 0, None, False
        rows = self._exchange(OK, START)
        mine = rows[self.rank]
        odd = [
            r
            for r, h in enumerate(rows)
            if (h.seq, h.version, h.count, h.layout) != (mine.seq, version, mine.count, mine.layout)
        ]
        if odd:
            shown = "; ".join(
                f"rank {r}: push {h.seq}, version {h.version}, {h.count} buckets, layout "
                f"{h.layout & 0xFFFF:04x}"
                for r, h in enumerate(rows)
            )
            raise LayoutError(
                f"the trainer ranks do not walk the same push ({shown}): every rank must make its source from "
                f"the same tensors and SyncConfig, and take part in every push with the same version"
            )
        self._active = True

    def issue(self, k: int, status: int = OK) -> None:
        """Start the all-gather of bucket k (this rank's pieces are in place)."""
        seg, buffer = self._segments[k], self._buffer
        header = Header(MAGIC, status, self._seq, self.version, k, self.count, self._layout, self.world)
        mine = buffer[self.rank * seg : (self.rank + 1) * seg]
        mine[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header.values(), dtype=torch.int64))
        work = _all_gather(buffer[: self.world * seg], mine, group=self._group, async_op=True)
        self._pending = (k, work, buffer, seg, time.monotonic())
        self.next = k + 1

    def wait(self) -> bool:
        """Wait for the gather in flight. False when a rank ended the walk (STOP); raises when one failed."""
        k, work, buffer, seg, began = self._pending
        self._pending = None
        rows = self._finish(work, buffer, seg, k, began)
        failed = [r for r, h in enumerate(rows) if h.status == FAILED and r != self.rank]
        if failed:
            self._active = False
            raise RemoteError(
                self._ranks(failed), self._stage(k), "that rank failed this push (its own error says why)"
            )
        self._stopped = any(h.status != OK for h in rows)
        return not self._stopped

    def end(self, outcome: str) -> str:
        """End the walk on this rank with ``outcome``: ends a walk still under way (STOP, or FAILED) and runs
        the end exchange. Returns the push's outcome as every rank sees it: "done" or "skipped" (a sending
        rank's), "followed" when no rank sent, "failed" when this rank failed; raises when another rank did."""
        if not self._active:
            return outcome  # never started, or already raised: nothing more may run on the group
        code = OUTCOMES[outcome]
        if self._pending is not None:
            self.wait()
        if not self._stopped and self.next < self.count:
            self.issue(self.next, FAILED if code == FAILED else STOP)
            self.wait()
            if code == FAILED:
                self._active = False
                return outcome  # every other rank raises, naming this one: no end exchange
        self._active = False
        rows = self._exchange(code, self.count)
        failed = [r for r, h in enumerate(rows) if h.status == FAILED and r != self.rank]
        if failed:
            raise RemoteError(self._ranks(failed), self._stage(self.count), "that rank failed this push")
        codes = {h.status for h in rows}
        return next((o for o in ("failed", "skipped", "done") if OUTCOMES[o] in codes), "followed")

    # --- the collectives, bounded --------------------------------------------------------------------------------
    def _exchange(self, status: int, stage: int) -> list[Header]:
        header = Header(MAGIC, status, self._seq, self.version, stage, self.count, self._layout, self.world)
        mine = self._small[self.rank * HEADER_BYTES : (self.rank + 1) * HEADER_BYTES]
        mine.view(torch.int64).copy_(torch.tensor(header.values(), dtype=torch.int64))
        work = _all_gather(self._small, mine, group=self._group, async_op=True)
        return self._finish(work, self._small, HEADER_BYTES, stage, time.monotonic())

    def _finish(self, work, buffer: torch.Tensor, seg: int, stage: int, began: float) -> list[Header]:
        left = max(0.001, began + self.timeout_s * WAIT_SHARE - time.monotonic())
        try:
            work.wait(timeout=timedelta(seconds=left))
            raw = buffer[: self.world * seg].view(self.world, seg)[:, :HEADER_BYTES].cpu()
        except Exception as e:  # a rank did not join: it lags, hangs or died
            self._active = False
            self._broken = f"the gather group failed at {self._stage(stage)} of push {self._seq}: {e}"
            raise self._census(stage, began, e) from e
        rows = [Header(*row) for row in raw.contiguous().view(torch.int64).tolist()]
        bad = [r for r, h in enumerate(rows) if h.magic != MAGIC or h.seq != self._seq or h.stage != stage]
        if bad:
            self._active = False
            raise LayoutError(
                f"trainer rank(s) {bad} are at another stage than {self._stage(stage)} of push {self._seq}: "
                f"{[rows[r] for r in bad]}; every rank must take part in every push"
            )
        return rows

    def _census(self, stage: int, began: float, error: Exception) -> RaysyncError:
        """The error every rank that gave up raises: the ranks that did not give up here are named."""
        where = self._stage(stage)
        key = f"raysync-walk/{self._name}/{self._seq}/"
        others = [r for r in range(self.world) if r != self.rank]
        try:
            self._store.set(key + str(self.rank), str(stage))
            left = max(0.01, began + self.timeout_s * CENSUS_SHARE - time.monotonic())
            try:
                self._store.wait([key + str(r) for r in others], timedelta(seconds=left))
            except Exception:  # some never wrote: found below
                pass
            missing = [r for r in others if not self._store.check([key + str(r)])]
            peer = self._ranks(missing) if missing else f"trainer rank {self.rank} (this rank came late)"
        except Exception as e:  # the store itself is gone (its host rank died)
            peer = f"a trainer rank of {self.world} (the census failed: {type(e).__name__}: {e})"
        text = str(error)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return PeerTimeout(peer, where, self.timeout_s)
        return PeerLost(peer, where, f"{type(error).__name__}: {text.strip()[:300]}")

    def _ranks(self, ranks) -> str:
        ranks = list(ranks)
        which = "rank" if len(ranks) == 1 else "ranks"
        return f"trainer {which} {', '.join(map(str, ranks))} of {self.world}"

    def _stage(self, stage: int) -> str:
        if stage == START:
            return f"the start of the push of version {self.version}"
        if stage >= self.count:
            return f"the end of the push of version {self.version}"
        return f"the all-gather of bucket {stage} of {self.count} (push of version {self.version})"
