"""Where each endpoint runs, and how each (sender, receiver) pair moves the weights.

Every endpoint reports a Placement from inside its own process (``probe``), every sender what its source gives
(``report_source``); ``choose`` turns them into a PairPlan, and says why. The transport, first match wins:

    same node, same GPU (by UUID)                -> cuda_ipc
    same node, GPUs with peer access             -> cuda_ipc (peer)
    same node, a GPU the receiver does not see   -> collective (NCCL; shm for a 2nd rank on a GPU: check_groups)
    same node otherwise (CPU, NPU, no IPC)       -> shm
    other nodes                                  -> collective (NCCL on GPUs, gloo on CPUs)
then, on cuda_ipc, direct mode or the ring (Note [direct or ring]), and the ring's shape (Note [ring shape]).
What the user sets (SyncConfig's transport, direct, bucket_bytes, num_buffers; WeightSync's ``transport=``) is
forced (if it cannot serve a pair: PlanError, before any session); a transport not built falls back. UUIDs, not indices.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from raysync.core.config import MiB, SyncConfig
from raysync.core.errors import PlanError

# Note [direct or ring]
# ~~~~~~~~~~~~~~~~~~~~~
# Direct mode (transport.cuda_ipc_direct) makes one copy per tensor and stages nothing, so a cuda_ipc pair runs
# it wherever it is correct, and the ring otherwise. It is correct when the sender's report (report_source: the
# tensors a push would send, through the same select() and config) says
#   - every tensor is on the sender's current GPU, dense, contiguous and in its wire dtype (no cast_dtype
#     applies to it): the very check the direct plane makes when it exports them (cuda_ipc_direct._not_in_place);
#   - the source is stable: a second call gives the same tensors (the same data pointers; the first call's
#     tensors are held meanwhile, so that no address can be reused).
# Tensors that move anyway stay correct: the session keys the tensors it placed by data pointer, dtype, shape,
# stride and device (core.agreement.SenderLayout.select); a new pointer re-exports the storages and sends their
# handles before that push starts, and the receiver maps them again. A source that makes new tensors at every
# call (a gather, a cast) would pay that export and mapping at every push, holding both sets meanwhile: the
# ring serves it instead. With no report (raysync doctor's hypothetical pairs) no pair is planned direct.
#
# Note [ring shape]
# ~~~~~~~~~~~~~~~~~
# A ring left to the plan starts from the shape measured fastest on its path (_SWEET_SPOTS, with the sections of
# docs/benchmarks.md that measured them; on one GPU two processes take turns: fewer, larger buckets) and shrinks
# it: no bucket larger than the push (a small model is one bucket in one buffer), and no ring larger
# than 1/RING_SHARE of the memory free where it lives, at probe time, split between the rings planned there:
# the sender's GPU (cuda_ipc), the host (shm), each rank's device (collective). A size the user sets is kept as
# set; a ring that cannot fit the memory free is a PlanError.
RING_SHARE = 4
NOT_VISIBLE = "same node, the sender's GPU is not visible to the receiver (CUDA_VISIBLE_DEVICES): NCCL"
_SWEET_SPOTS = {  # path -> (bucket bytes, buffers)
    "cuda_ipc, one GPU": (2048 * MiB, 2),  # sections 1, 2
    "cuda_ipc, peer GPUs": (1024 * MiB, 2),  # section 3
    "shm, GPU endpoints": (512 * MiB, 2),  # section 4
    "shm, CPU endpoints": (8 * MiB, 2),  # section 6
    "collective": (512 * MiB, 2),  # NCCL, section 5; gloo not measured
}


@dataclass(frozen=True)
class Placement:
    node_id: str
    host: str
    ip: str
    pid: int
    device: str  # "cuda" | "npu" | "cpu"
    gpu_uuids: tuple[str, ...]  # visible GPUs, in this process's numbering
    current_gpu: str | None  # UUID of the GPU this process works on
    cuda_visible_devices: str | None
    ipc_ok: bool  # CUDA IPC verified by a probe (an export opened by a child process)
    peer_access: tuple[tuple[bool, ...], ...]
    gpu_free_bytes: int | None = None  # what this process could allocate on current_gpu when probed
    host_free_bytes: int | None = None  # what a shm ring may take on this host (shm.ring_memory_bytes)

    def label(self) -> str:
        where = f"node {self.node_id[:8]} ({self.host}, pid {self.pid})"
        return where + (f", GPU {self.current_gpu}" if self.current_gpu else "")


def probe(node: tuple[str, str] | None = None) -> Placement:
    """This process's Placement (call it inside the endpoint's process). ``node`` (Ray node id, ip) stands in
    where Ray is not initialized in this process: a vLLM worker started by its engine inside a Ray actor."""
    import torch

    from raysync.transport.shm import ring_memory_bytes

    node_id, ip = node or (socket.gethostname(), "127.0.0.1")
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            ip = ray.util.get_node_ip_address()
    except ImportError:
        pass
    uuids: tuple[str, ...] = ()
    current = gpu_free = None
    peers: tuple[tuple[bool, ...], ...] = ()
    device, ipc_ok = "cpu", False
    if torch.cuda.is_available():
        from raysync.transport.cuda_ipc import ipc_works

        device, ipc_ok = "cuda", ipc_works()
        n = torch.cuda.device_count()
        uuids = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(n))
        current = uuids[torch.cuda.current_device()] if n else None
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # this process's, reusable
        gpu_free = torch.cuda.mem_get_info()[0] + cached if n else None
        peers = tuple(
            tuple(i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)) for i in range(n)
        )
    elif hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - Ascend, untested here
        device = "npu"
    host_free = ring_memory_bytes()
    return Placement(
        node_id,
        socket.gethostname(),
        ip,
        os.getpid(),
        device,
        uuids,
        current,
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        ipc_ok,
        peers,
        gpu_free,
        host_free if host_free < 1 << 62 else None,  # (1 << 62: neither MemAvailable nor a cgroup was read)
    )


@dataclass(frozen=True)
class SourceReport:
    """What a sender's source gives under the sync's config, reported from inside the sender (report_source)."""

    push_bytes: int  # what a push moves, in wire dtypes
    not_in_place: str  # why direct mode cannot read the tensors in place, naming one; "" where it can
    stable: bool  # a second call of the source gave the same tensors (Note [direct or ring])
    note: str = ""  # what the source says of itself in the plan (``source.plan_note``: LoRA's mode)


def report_source(
    actor: Any, source: Callable[[Any], Iterable[tuple[str, Any]]], config: SyncConfig
) -> SourceReport:
    """The sender's SourceReport (run inside the sender, like raysync.ray.endpoint's functions)."""
    import torch

    from raysync.core.source import is_source, select
    from raysync.core.wire import DTYPES
    from raysync.transport.cuda_ipc_direct import _not_in_place  # the direct plane's own rule

    given, note = source(actor), str(getattr(source, "plan_note", ""))
    if is_source(given):  # a lazy Source: the layout from metadata, tensors made as their buckets are packed
        return SourceReport(sum(s.nbytes for s in given.specs(config)), "the source is lazy", False, note)
    first = select(given, config)  # held until the second call is compared
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    why = "" if device is not None else "the sender has no GPU"
    for s in first if device is not None else ():
        why = _not_in_place(s.tensor, DTYPES[s.spec.dtype], device)
        if why:
            why = f"{s.spec.name!r} {why}"
            break
    pointers = {s.spec.name: s.tensor.data_ptr() for s in first}
    seen, stable = 0, True
    for name, tensor in source(actor):  # lazily: the first tensor that moved ends it
        if name in pointers:
            seen += 1
            if not isinstance(tensor, torch.Tensor) or tensor.data_ptr() != pointers[name]:
                stable = False
                break
    return SourceReport(sum(s.spec.nbytes for s in first), why, stable and seen == len(pointers), note)


@dataclass(frozen=True)
class PairPlan:
    sender: int
    receiver: int
    wanted: str  # what the rules pick
    transport: str  # what will run (differs when ``wanted`` is not built, or overridden)
    reason: str  # why this transport
    direct: bool = False  # cuda_ipc read in place (no ring)
    bucket_bytes: int = 0  # the ring's shape; 0 in direct mode
    num_buffers: int = 0
    how: str = ""  # why this mode and ring shape

    @property
    def mode(self) -> str:
        return "direct" if self.direct else f"ring {self.num_buffers} x {_size(self.bucket_bytes)}"

    def config(self, config: SyncConfig) -> SyncConfig:
        """What this pair's endpoints run: ``config`` with this plan's choices, in plain values."""
        ring = {"bucket_bytes": self.bucket_bytes, "num_buffers": self.num_buffers}
        return config.resolved(
            transport=self.transport, direct=self.direct, **(ring if self.num_buffers else {})
        )


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n / MiB:.1f} MiB" if n > MiB else f"{n} B"


def _wanted(s: Placement, r: Placement) -> tuple[str, str]:
    if s.node_id != r.node_id:
        return "collective", "other nodes"
    if not (s.device == r.device == "cuda" and s.ipc_ok and r.ipc_ok and s.current_gpu):
        return "shm", "same node" + ("" if s.device == "cpu" else ", no CUDA IPC")
    if s.current_gpu == r.current_gpu:
        return "cuda_ipc", "same GPU"
    if s.current_gpu not in r.gpu_uuids:  # Ray gives each GPU actor only its own GPU: NCCL reaches it anyway
        return "collective", NOT_VISIBLE
    if r.peer_access[r.gpu_uuids.index(r.current_gpu)][r.gpu_uuids.index(s.current_gpu)]:
        return "cuda_ipc", "GPUs with peer access"
    return "shm", "same node, no peer access between the GPUs"


def _works(transport: str, s: Placement, r: Placement) -> bool:
    same_host = s.host == r.host and s.ip == r.ip  # (Ray's simulated nodes of one host share its memory)
    if transport == "shm":
        return same_host
    if transport == "cuda_ipc":  # the GPU the receiver sees and reaches (_wanted's rules), with IPC on both
        return same_host and _wanted(s, r)[0] == "cuda_ipc"
    return True


def choose(
    i: int,
    j: int,
    s: Placement,
    r: Placement,
    built: Sequence[str],
    override: str | None = None,
    *,
    config: SyncConfig | None = None,
    source: SourceReport | None = None,
    rings: Mapping[str, int] | None = None,
) -> PairPlan:
    """The plan of sender ``i`` -> receiver ``j``; ``built`` lists the transports that exist, best first.
    ``override``: WeightSync's ``transport=`` for this pair; ``source``: the sender's report; ``rings``: how
    many rings each memory holds (``ring_places``), which share it."""
    config = config or SyncConfig()
    forced_by = ""  # WeightSync's transport=
    if override is None and not config.is_auto("transport"):
        override, forced_by = str(config.transport), " (SyncConfig.transport)"
    transport, wanted, reason = _transport(s, r, built, override, forced_by)
    direct, why = _mode(transport, s, r, config, source)
    note = getattr(source, "note", "")  # None: no report
    if direct:
        return PairPlan(i, j, wanted, transport, reason, True, how="; ".join(filter(None, (why, note))))
    bucket, buffers, shape = _ring_shape(transport, s, r, config, source, rings or {})
    how = "; ".join(filter(None, (why, shape, note)))
    return PairPlan(i, j, wanted, transport, reason, False, bucket, buffers, how)


def _transport(
    s: Placement, r: Placement, built: Sequence[str], override: str | None, forced_by: str
) -> tuple[str, str, str]:
    if override is not None:
        if override not in built or not _works(override, s, r):
            raise PlanError(
                f"override {override!r}{forced_by} cannot serve {s.label()} -> {r.label()} (built: {list(built)})"
            )
        return override, override, "override" + forced_by
    wanted, reason = _wanted(s, r)
    if wanted in built:
        return wanted, wanted, reason
    for fallback in built:
        if _works(fallback, s, r):
            return fallback, wanted, f"{reason}; {wanted} not built yet, {fallback} instead (same host)"
    raise PlanError(
        f"no built transport can serve {s.label()} -> {r.label()}: the rules want {wanted} ({reason}), "
        f"built so far: {list(built)}"
    )


def _mode(
    transport: str, s: Placement, r: Placement, config: SyncConfig, source: SourceReport | None
) -> tuple[bool, str]:
    """Direct or ring, and why (Note [direct or ring]); a forced direct mode that cannot work is refused."""
    forced = config.direct
    if transport != "cuda_ipc":
        if forced:
            raise PlanError(
                f"direct=True reads the sender's tensors in place over CUDA IPC, and {s.label()} -> "
                f"{r.label()} runs {transport}: "
                f"put both on one GPU (or GPUs with peer access), or leave direct=None to let the plan choose"
            )
        return False, ""
    if forced is False:
        return False, "ring: direct=False"
    if source is None:
        return (True, "direct: forced") if forced else (False, "ring: the sender's tensors were not reported")
    if source.not_in_place:
        if forced:
            raise PlanError(
                f"direct=True, but on {s.label()} {source.not_in_place}, which direct mode cannot read in "
                f"place: leave direct=None (the plan takes the ring) or send tensors as they are"
            )
        return False, f"ring: {source.not_in_place}"
    if not source.stable:
        if forced:
            return True, "direct: forced; the source gives new tensors at every call (re-exported every push)"
        return False, "ring: the source gives new tensors at every call (direct would re-export every push)"
    return True, "direct: the sender's tensors are read in place"


def _path(transport: str, s: Placement, r: Placement) -> str:
    if transport == "cuda_ipc":
        return "cuda_ipc, one GPU" if s.current_gpu == r.current_gpu else "cuda_ipc, peer GPUs"
    if transport == "shm":
        return "shm, GPU endpoints" if "cuda" in (s.device, r.device) else "shm, CPU endpoints"
    return "collective"


def ring_places(transport: str, s: Placement, r: Placement) -> list[tuple[str, int | None]]:
    """Where a pair's ring lives, and the bytes free there (None: not reported)."""
    if transport == "shm":
        known = [b for b in (s.host_free_bytes, r.host_free_bytes) if b is not None]
        return [(f"host {s.host}", min(known, default=None))]
    ends = [s] if transport == "cuda_ipc" else [s, r]  # the collective: a ring on every rank
    return [
        (f"GPU {a.current_gpu}", a.gpu_free_bytes)
        if a.device == "cuda"
        else (f"host {a.host}", a.host_free_bytes)
        for a in ends
    ]


def _ring_shape(
    transport: str,
    s: Placement,
    r: Placement,
    config: SyncConfig,
    source: SourceReport | None,
    rings: Mapping[str, int],
) -> tuple[int, int, str]:
    """The ring's bucket size and count, and why (Note [ring shape])."""
    from raysync.core.wire import MAX_LAYOUT_BUCKETS

    path = _path(transport, s, r)
    unit = max(config.align_bytes, MiB)
    up = lambda n: -(-n // unit) * unit  # noqa: E731 - rounded up to a whole unit
    auto_bucket, auto_buffers = config.is_auto("bucket_bytes"), config.is_auto("num_buffers")
    bucket, buffers = _SWEET_SPOTS[path]
    bucket = bucket if auto_bucket else int(config.bucket_bytes)
    buffers = buffers if auto_buffers else int(config.num_buffers)
    notes = [f"{path}" if auto_bucket or auto_buffers else "set by SyncConfig"]
    smallest = unit
    if source is not None:
        smallest = max(unit, up(2 * source.push_bytes // MAX_LAYOUT_BUCKETS))
        if auto_bucket and source.push_bytes < bucket:
            bucket, notes = max(unit, up(source.push_bytes)), [*notes, "the push in one bucket"]
        if auto_buffers:
            buffers = min(buffers, max(1, math.ceil(source.push_bytes / bucket)))
    for place, free in ring_places(transport, s, r):
        if free is None:
            continue
        room = free // max(1, rings.get(place, 1))
        shrunk = False
        while auto_bucket and bucket > smallest and bucket * buffers * RING_SHARE > room:
            bucket, shrunk = max(smallest, up(bucket // 2)), True
        if shrunk:
            notes.append(f"1/{RING_SHARE} of the {_size(room)} free on {place}")
        if bucket * buffers > room:
            raise PlanError(
                f"a ring of {buffers} x {_size(bucket)} for {s.label()} -> {r.label()} does not fit the "
                f"{_size(room)} free on {place} (shared by {rings.get(place, 1)} ring(s)): lower "
                f"SyncConfig.bucket_bytes or num_buffers, or leave them to the plan (None)"
            )
    return bucket, buffers, f"ring {buffers} x {_size(bucket)}: " + ", ".join(notes)


def check_groups(plans: list[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]) -> None:
    """Each sender's collective pairs make one group: the sender and those receivers. NCCL refuses a group
    with two ranks on one GPU, and says so only at the first push, from deep inside: a pair the rules put on
    the collective only because its GPU is not visible (NOT_VISIBLE) goes over shm instead, in ``plans``, when
    its GPU already has a rank in the group; any other such plan is refused here, naming the two ranks and the
    GPU (a forced collective, or sharded sources, between colocated actors)."""
    groups: dict[int, list[int]] = {}
    for k, p in enumerate(plans):
        if p.transport == "collective":
            groups.setdefault(p.sender, []).append(k)
    for i, ks in groups.items():
        if senders[i].device != "cuda":
            continue  # the sender's tensors are in host memory: its group runs gloo (endpoint.collective_open)
        seen: dict[str, str] = {f"{senders[i].node_id}/{senders[i].current_gpu}": f"sender #{i}"}
        for k in ks:
            name, at = f"receiver #{plans[k].receiver}", receivers[plans[k].receiver]
            key = f"{at.node_id}/{at.current_gpu}"
            if at.device != "cuda" or not at.current_gpu or key not in seen:
                seen[key] = name  # (gloo: any number of ranks per machine)
            elif plans[k].reason == NOT_VISIBLE:
                why = f"; {seen[key]} holds GPU {at.current_gpu} in this sender's NCCL group: shm"
                plans[k] = replace(plans[k], transport="shm", reason=NOT_VISIBLE + why)
            else:
                raise PlanError(
                    f"{seen[key]} and {name} would be two ranks of one NCCL group on the same GPU "
                    f"{at.current_gpu} ({at.label()}), which NCCL refuses: give the pair another transport "
                    f"(same GPU: cuda_ipc) or put the actors on different GPUs"
                )
