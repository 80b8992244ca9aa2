"""`raysync bench`: every transport that runs here x bucket sizes x the parameter layouts of real models
(shapes only: tensors are allocated, nothing is downloaded), next to plain copies measured in the same run.

    raysync bench                                   # CPU: shm and collective (gloo), Qwen2.5-0.5B layout
    raysync bench --device cuda --layout qwen2.5-7b # GPU: cuda_ipc, shm (and collective with 2 GPUs)
    raysync bench --json out.json --plot out.png    # --plot needs matplotlib (pip install raysync[plot])
    raysync bench --ray --help                      # a push through WeightSync (Ray actors): raysync.tools.bench_ray

Each point: a sender in this process, a receiver in a spawned one (on GPU: the same GPU for the rings, GPU 1
for the collective); one warm-up push sets the session up, then ``--pushes`` pushes are timed end to end
(the receiver's bytes in its preallocated destination tensors before the sender's push returns), and the
receiver's tensors are checked against the sender's at the end. Floors: one copy of every tensor into a
destination on the same device (memcpy on CPU, a device copy on GPU). The deeper benchmarks of each transport
live in benchmarks/ (bench_shm.py, bench_ipc.py, bench_collective.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from typing import Any

import torch

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.tools.models import LAYOUTS, allocate
from raysync.transport import registry


def checksum(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(t.reshape(-1).view(torch.uint8)[::4099].double().sum().item() for t in tensors.values()))


def _receiver(
    kind: str, where: Any, secret, config, layout: str, device: str, gpu: int, pushes: int, out
) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(gpu)
    dest = allocate(layout, device=device, fill=False)
    owner = receiver_for(kind, where, secret, config)
    try:
        receiver = session(owner)
        for _ in range(pushes):
            receiver.receive(into=dest)
        out.put(checksum(dest))
    finally:
        owner.close()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floor_s(src: dict[str, torch.Tensor], device: str, repeats: int = 3) -> float:
    """One copy of every tensor into its own destination on the same device: the floor of any path."""
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def sender_for(
    transport: str, secret: SessionSecret, config: SyncConfig, device: str = "cpu"
) -> tuple[Any, Any]:
    """What owns the sender for one local receiver over ``transport`` (a ring's WeightSender, or rank 0 of a
    group of two), and what that receiver needs to find it (an endpoint, or the group's rendezvous).
    ``device``: where the tensors live, which picks the collective's backend (gloo for CPU tensors also on a
    machine with GPUs). ``session(owner)`` is the push session; ``owner.close()`` ends all of it."""
    if transport == "collective":
        from raysync.transport.collective import CollectiveSender

        backend = "nccl" if device == "cuda" else "gloo"
        group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=1, backend=backend)
        return group, group.rendezvous
    sender = WeightSender(secret, config)
    return sender, sender.endpoint


def receiver_for(transport: str, where: Any, secret: SessionSecret, config: SyncConfig) -> Any:
    """What owns the receiver of ``sender_for``'s sender (``where``: what sender_for returned with it)."""
    if transport == "collective":
        from raysync.transport.collective import CollectiveReceiver

        return CollectiveReceiver(secret, config, rank=1, rendezvous=where)
    return WeightReceiver(where, secret, config)


def session(owner: Any) -> Any:
    """The push session of ``sender_for``'s or ``receiver_for``'s owner: a ring's is the owner itself; a
    group's is made when both ranks have joined (each calls this at the same time)."""
    from raysync.transport.collective import CollectiveReceiver, CollectiveSender

    return owner.join() if isinstance(owner, (CollectiveSender, CollectiveReceiver)) else owner


def run_point(
    transport: str,
    src: dict[str, torch.Tensor],
    layout: str,
    device: str,
    bucket_mb: int,
    pushes: int,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Time ``pushes`` pushes of ``src`` over ``transport`` (after one warm-up push)."""
    ctx = mp.get_context("spawn")
    config = SyncConfig(
        transport="shm" if transport == "collective" else transport,
        bucket_bytes=bucket_mb << 20,
        timeout_s=timeout_s,
        progress=False,
    )
    secret, out = SessionSecret.generate(), ctx.Queue()
    gpu = 1 if transport == "collective" and device == "cuda" else 0
    owner, where = sender_for(transport, secret, config, device)
    proc = ctx.Process(
        target=_receiver, args=(transport, where, secret, config, layout, device, gpu, pushes + 1, out)
    )
    proc.start()
    try:
        sender = session(owner)
        sender.push(src.items(), 0)
        times = []
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            sender.push(src.items(), version)
            times.append(time.perf_counter() - t0)
        got = out.get(timeout=timeout_s)
    finally:
        owner.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    if got != checksum(src):
        raise RuntimeError(f"{transport}: the receiver's tensors differ from the sender's")
    return {
        "transport": transport,
        "bucket_mb": bucket_mb,
        "median_s": statistics.median(times),
        "min_s": min(times),
    }


def transports_here(device: str) -> list[str]:
    available = registry.available()
    picked = [t for t in ("cuda_ipc", "shm") if t in available and (t != "cuda_ipc" or device == "cuda")]
    if "collective" in available and (device == "cpu" or torch.cuda.device_count() >= 2):
        picked.append("collective")
    return picked


def run(layouts: list[str], bucket_mbs: list[int], transports: list[str], device: str, pushes: int) -> dict:
    hw = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    result: dict[str, Any] = {"device": device, "hardware": hw, "torch": torch.__version__, "layouts": []}
    for layout in layouts:
        src = allocate(layout, device=device)
        nbytes = sum(t.nbytes for t in src.values())
        floor = floor_s(src, device)
        rows = [run_point(t, src, layout, device, mb, pushes) for t in transports for mb in bucket_mbs]
        for r in rows:
            r["gbps"] = nbytes / r["median_s"] / 1e9
            r["pct_of_floor"] = 100 * floor / r["median_s"]
        result["layouts"].append(
            {
                "layout": layout,
                "bytes": nbytes,
                "tensors": len(src),
                "floor": {"name": "one copy per tensor", "s": floor, "gbps": nbytes / floor / 1e9},
                "runs": rows,
            }
        )
        del src
    return result


def format_table(result: dict) -> str:
    lines = []
    for lay in result["layouts"]:
        lines.append(
            f"{lay['layout']}: {lay['tensors']} tensors, {lay['bytes'] / 1e9:.2f} GB, "
            f"device={result['device']} ({result['hardware']})"
        )
        lines.append(f"{'path':<34}{'bucket':>8}{'median ms':>11}{'GB/s':>8}{'% floor':>9}")
        f = lay["floor"]
        lines.append(f"{'floor: ' + f['name']:<34}{'-':>8}{f['s'] * 1e3:>11.2f}{f['gbps']:>8.2f}{100:>8}%")
        for r in lay["runs"]:
            lines.append(
                f"{r['transport']:<34}{r['bucket_mb']:>6}MB{r['median_s'] * 1e3:>11.2f}{r['gbps']:>8.2f}"
                f"{r['pct_of_floor']:>8.0f}%"
            )
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'raysync[plot]'") from None
    layouts = result["layouts"]
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
    for ax, lay in zip(axes[0], layouts, strict=True):
        for t in dict.fromkeys(r["transport"] for r in lay["runs"]):
            runs = [r for r in lay["runs"] if r["transport"] == t]
            ax.plot([r["bucket_mb"] for r in runs], [r["gbps"] for r in runs], marker="o", label=t)
        ax.axhline(lay["floor"]["gbps"], linestyle="--", color="gray", label="floor: " + lay["floor"]["name"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("GB/s (end to end)")
        ax.set_title(f"{lay['layout']} on {result['device']} ({result['hardware']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ray" in argv:  # the WeightSync benchmark: the other arguments are its own
        from raysync.tools import bench_ray  # imports Ray: only for --ray

        argv.remove("--ray")
        return bench_ray.main(argv, prog="raysync bench --ray")
    ap = argparse.ArgumentParser(prog="raysync bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ray",
        action="store_true",
        help="instead: a push through WeightSync between Ray actors, next to the raw session (no Ray) and the "
        "copy floor, Ray's share their difference; every other option is then its own "
        "(raysync bench --ray --help)",
    )
    ap.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument(
        "--layout",
        nargs="+",
        default=None,
        choices=sorted(LAYOUTS),
        help="default: qwen2.5-0.5b on CPU, qwen2.5-7b on GPU",
    )
    ap.add_argument(
        "--bucket-mb", type=int, nargs="+", default=None, help="default: 8 32 128 (CPU), 256 512 1024"
    )
    ap.add_argument("--transports", nargs="+", default=None, help="default: every one that runs here")
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--plot", help="draw GB/s against bucket size here (a .png)")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    layouts = args.layout or (["qwen2.5-0.5b"] if cpu else ["qwen2.5-7b"])
    buckets = args.bucket_mb or ([8, 32, 128] if cpu else [256, 512, 1024])
    transports = args.transports or transports_here(args.device)
    if cpu:
        torch.set_num_threads(1)  # one core per process: see docs/design.md, "Performance notes"
    result = run(layouts, buckets, transports, args.device, args.pushes)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 0
