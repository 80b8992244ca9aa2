"""Where each endpoint runs, and which transport each (sender, receiver) pair uses.

Every endpoint reports a Placement from inside its own process (``probe``). ``choose`` turns two of them
into a transport, by these rules, first match wins:

    same node, same GPU (by UUID)           -> cuda_ipc
    same node, GPUs with peer access        -> cuda_ipc (peer)
    same node otherwise (CPU, NPU, no IPC)  -> shm
    other nodes                             -> collective (NCCL on GPUs, gloo on CPUs)

Where the rules' choice cannot run (a transport missing from the list given to ``choose``), the pair falls
back to the first one that can (shm needs the two processes on one host), and the plan says so. GPUs are matched by UUID, never by index: each process
numbers its GPUs after its own CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from raysync.core.errors import PlanError


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

    def label(self) -> str:
        where = f"node {self.node_id[:8]} ({self.host}, pid {self.pid})"
        return where + (f", GPU {self.current_gpu}" if self.current_gpu else "")


def probe(node: tuple[str, str] | None = None) -> Placement:
    """This process's Placement (call it inside the endpoint's process). ``node`` (Ray node id, ip) stands in
    where Ray is not initialized in this process: a vLLM worker started by its engine inside a Ray actor."""
    import torch

    node_id, ip = node or (socket.gethostname(), "127.0.0.1")
    try:
        import ray

        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            ip = ray.util.get_node_ip_address()
    except ImportError:
        pass
    uuids: tuple[str, ...] = ()
    current = None
    peers: tuple[tuple[bool, ...], ...] = ()
    device = "cpu"
    ipc_ok = False
    if torch.cuda.is_available():
        from raysync.transport.cuda_ipc import ipc_works

        device, ipc_ok = "cuda", ipc_works()
        n = torch.cuda.device_count()
        uuids = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(n))
        current = uuids[torch.cuda.current_device()] if n else None
        peers = tuple(
            tuple(i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)) for i in range(n)
        )
    elif hasattr(torch, "npu") and torch.npu.is_available():  # pragma: no cover - Ascend, untested here
        device = "npu"
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
    )


@dataclass(frozen=True)
class PairPlan:
    sender: int
    receiver: int
    wanted: str  # what the rules pick
    transport: str  # what will run (differs when ``wanted`` is not built, or overridden)
    reason: str


def _wanted(s: Placement, r: Placement) -> tuple[str, str]:
    if s.node_id != r.node_id:
        return "collective", "other nodes"
    if s.device == r.device == "cuda" and s.ipc_ok and r.ipc_ok:
        if s.current_gpu and s.current_gpu == r.current_gpu:
            return "cuda_ipc", "same GPU"
        if s.current_gpu in r.gpu_uuids:
            i, j = r.gpu_uuids.index(s.current_gpu), r.gpu_uuids.index(r.current_gpu)
            if r.peer_access[j][i]:
                return "cuda_ipc", "GPUs with peer access"
    return "shm", "same node" + ("" if s.device == "cpu" else ", no CUDA IPC")


def _works(transport: str, s: Placement, r: Placement) -> bool:
    same_host = s.host == r.host and s.ip == r.ip  # (Ray's simulated nodes of one host share its memory)
    if transport == "shm":
        return same_host
    if transport == "cuda_ipc":
        return same_host and s.ipc_ok and r.ipc_ok and s.current_gpu in r.gpu_uuids
    return True


def choose(
    i: int, j: int, s: Placement, r: Placement, built: Sequence[str], override: str | None = None
) -> PairPlan:
    """The transport for sender ``i`` -> receiver ``j``; ``built`` lists the transports that exist, best first."""
    if override is not None:
        if override not in built or not _works(override, s, r):
            raise PlanError(
                f"override {override!r} cannot serve {s.label()} -> {r.label()} (built: {list(built)})"
            )
        return PairPlan(i, j, override, override, "override")
    wanted, reason = _wanted(s, r)
    if wanted in built:
        return PairPlan(i, j, wanted, wanted, reason)
    for fallback in built:
        if _works(fallback, s, r):
            return PairPlan(
                i, j, wanted, fallback, f"{reason}; {wanted} not built yet, {fallback} instead (same host)"
            )
    raise PlanError(
        f"no built transport can serve {s.label()} -> {r.label()}: the rules want {wanted} ({reason}), "
        f"built so far: {list(built)}"
    )


def check_groups(
    plans: Sequence[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]
) -> None:
    """Each sender's collective pairs make one group: the sender and those receivers. NCCL refuses a group
    with two ranks on one GPU, and says so only at the first push, from deep inside: refuse such a plan here,
    naming the two ranks and the GPU (a forced collective, or sharded sources, between colocated actors)."""
    groups: dict[int, list[int]] = {}
    for p in plans:
        if p.transport == "collective":
            groups.setdefault(p.sender, []).append(p.receiver)
    for i, js in groups.items():
        if senders[i].device != "cuda":
            continue  # the sender's tensors are in host memory: its group runs gloo (endpoint.collective_open)
        seen: dict[str, str] = {}
        for name, at in [(f"sender #{i}", senders[i])] + [(f"receiver #{j}", receivers[j]) for j in js]:
            if at.device != "cuda" or not at.current_gpu:
                continue  # gloo: any number of ranks per machine
            key = f"{at.node_id}/{at.current_gpu}"
            if key in seen:
                raise PlanError(
                    f"{seen[key]} and {name} would be two ranks of one NCCL group on the same GPU "
                    f"{at.current_gpu} ({at.label()}), which NCCL refuses: give the pair another transport "
                    f"(same GPU: cuda_ipc) or put the actors on different GPUs"
                )
            seen[key] = name


def assign(senders: Sequence[Placement], receivers: Sequence[Placement]) -> list[tuple[int, int]]:
    """Which sender serves each receiver: the one on the same GPU, else on the same node, else sender 0.
    One sender gives the disaggregated topology; one per GPU the colocated one; mixed placements mix both."""
    pairs = []
    for j, r in enumerate(receivers):
        same_gpu = [
            i
            for i, s in enumerate(senders)
            if s.node_id == r.node_id and s.current_gpu and s.current_gpu == r.current_gpu
        ]
        same_node = [i for i, s in enumerate(senders) if s.node_id == r.node_id]
        pairs.append(((same_gpu or same_node or [0])[0], j))
    return pairs


def format_plan(
    plans: Sequence[PairPlan], senders: Sequence[Placement], receivers: Sequence[Placement]
) -> str:
    rows = [("sender", "receiver", "transport", "why")]
    for p in plans:
        rows.append(
            (
                f"#{p.sender} {senders[p.sender].label()}",
                f"#{p.receiver} {receivers[p.receiver].label()}",
                p.transport,
                p.reason,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
