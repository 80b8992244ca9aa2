"""The process group of a collective data plane (raysync.transport.collective): the rendezvous values a rank
needs to join, the standalone group itself (NCCL, gloo, hccl), its broadcasts and its bounded waits.
Note [no hangs in a collective] is in raysync.transport.collective."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raysync.core.config import SyncConfig
from raysync.core.errors import PeerTimeout
from raysync.transport.rendezvous import StoreClient


@dataclass(frozen=True)
class Rendezvous:
    """What a receiver needs to join: plain values, handed out by the coordinator. ``control``: the control
    endpoint of each receiver rank (rank r connects to ``control[r - 1]``)."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" | "nccl" | "hccl"
    control: tuple[str, ...] = ()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


class BroadcastGroup:
    """The store and the process group of one rank."""

    def __init__(self, config: SyncConfig, rank: int, rdv: Rendezvous, store: StoreClient):
        self.rank, self.rdv, self.config, self.store = rank, rdv, config, store
        self.timeout = datetime.timedelta(seconds=config.timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if rdv.backend == "nccl" else None
        self.pg = None

    def join(self, timeout_s: float) -> None:
        """Create the process group: blocks until every rank has joined (at most ``timeout_s``: ranks may take
        a while to start, so this is the set-up limit, not the per-stage ``SyncConfig.timeout_s``)."""
        self.store.set_timeout(datetime.timedelta(seconds=timeout_s))
        try:
            self._create(datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise PeerTimeout(f"the other ranks of the {self.rdv.backend} group", "join", timeout_s) from e
        finally:
            self.store.set_timeout(self.timeout)

    def _create(self, rendezvous_timeout: datetime.timedelta) -> None:
        backend = self.rdv.backend
        if backend == "gloo":  # gloo connects every pair at creation: give it the set-up limit
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = rendezvous_timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.rdv.host)]
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.rdv.world_size, opts)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.rdv.world_size, opts)
        elif backend == "hccl":  # pragma: no cover - Ascend, untested here
            import torch_npu  # noqa: F401

            self.pg = torch.distributed.ProcessGroupHCCL(
                self.store, self.rank, self.rdv.world_size, self.timeout
            )
        else:
            raise ValueError(f"unknown collective backend {backend!r} (gloo, nccl, hccl)")

    # --- collectives ---------------------------------------------------------------------------------------------
    def broadcast(self, views: list[torch.Tensor]) -> list:
        """Broadcast every view (rank 0's bytes into everyone's), as one NCCL group launch where it can."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        if self.rdv.backend != "nccl" or len(views) < 2:
            return [self.pg.broadcast([v], opts) for v in views]
        self.pg._start_coalescing()
        for v in views:
            self.pg.broadcast([v], opts)
        return [self.pg._end_coalescing()]

    def wait(self, works: list, stage: str, block: bool = True) -> None:
        """Wait for broadcasts, bounded by timeout_s. NCCL: the current stream waits for them (no host wait,
        so packing and unpacking keep the GPU busy), and ``block`` then polls that stream's progress from the
        host: torch's own bounded wait sleeps a millisecond between polls, which a push pays at every stage."""
        if self.rdv.backend == "nccl":
            for work in works:
                work.wait()
            if block:
                self.poll_stream(stage)
            return
        for work in works:
            try:
                ok = work.wait(self.timeout)
            except Exception as e:
                self.abort()
                why = f"{stage}: {str(e).splitlines()[0]}"
                raise PeerTimeout("a rank of the group", why, self.config.timeout_s) from e
            if ok is False:
                self.abort()
                raise PeerTimeout("a rank of the group", stage, self.config.timeout_s)

    def poll_stream(self, stage: str) -> None:
        done = torch.cuda.Event()
        done.record()
        started = time.monotonic()
        while not done.query():
            waited = time.monotonic() - started
            if waited > self.config.timeout_s:
                self.abort()
                raise PeerTimeout("a rank of the group", stage, self.config.timeout_s)
            time.sleep(0 if waited < 1e-3 else 5e-5)  # spin briefly, then poll every ~50 us

    def abort(self) -> None:
        """Note [no hangs in a collective]."""
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # already broken
                pass
            self.pg = None

    def close(self) -> None:
        self.abort()
        self.store.close()
