"""Benchmark: a sharded trainer's push (raysync.sources.DTensorSource) next to the plain source (issue 16, items 1-2).

    python benchmarks/bench_sharded_source.py                       # CPU: plain, a one-rank mesh, 2 ranks on gloo
    python benchmarks/bench_sharded_source.py --layout qwen2.5-0.5b --bucket-mb 32
    python benchmarks/bench_sharded_source.py --device cuda --layout qwen2.5-7b --bucket-mb 512 --ranks 1
    python benchmarks/bench_sharded_source.py --shard-dims 0 1      # also tensor-parallel Shard(1) rows (item 3)

Rows: "plain" (whole tensors, the plain path), "dtensor" on a mesh of 1 rank, and on a mesh of W ranks (each rank
a spawned process holding only its Shard(0) rows, made with DTensor.from_local: no rank ever holds the whole
model; rank 0 sends, the others follow). With ``--shard-dims 0 1`` the W-rank rows are repeated with every
matrix placed ``Shard(1)`` (a tensor-parallel row split; vectors stay Shard(0)): the sending rank then
re-interleaves each gathered piece into the global layout in its copy into the ring. One engine process receives into preallocated tensors and checks, after
the last push, every byte against the pattern the shards were made from (``exact``).

Per row: the median push; the floor measured in the same run (one copy of every tensor; with W ranks the
all-gather of every rank's shards in one collective plus that copy); and the sending rank's peak extra memory
during its first push (CPU: VmHWM - VmRSS from /proc, after resetting the peak; GPU:
torch.cuda.max_memory_allocated over memory_allocated) next to the bound it must stay under: the ring
(num_buffers x bucket_bytes) plus one gathered bucket, and the model's size (what materializing it would
cost). Prints a table, then JSON.

On gloo (CPU) each all-gather allocates a temporary the size of its output (one more bucket), in whichever of
gloo's worker threads runs it, and the allocator may keep one per thread: expect the W-rank rows above the bound
by one or two buckets there. NCCL gathers in place (the input is the rank's own segment of the output).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.sources.gather_plan import chunk_range
from raysync.tools.models import LAYOUTS


def pattern(i: int, lo: int, hi: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Flat elements [lo, hi) of tensor i: exact in every dtype used here (integers below 256)."""
    return _at(i, torch.arange(lo, hi, device=device), dtype)


def _at(i: int, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return ((index * 7 + i) % 251).to(dtype)


def local_part(i: int, shape, world: int, rank: int, dim: int, dtype, device: str) -> torch.Tensor:
    """Rank ``rank``'s Shard(dim) part of tensor i (dim 0 for a vector), made without the whole tensor."""
    dim = dim if len(shape) > 1 else 0
    a, b = chunk_range(shape[dim], world, rank)
    if dim == 0:
        row = torch.Size(shape[1:]).numel()
        return pattern(i, a * row, b * row, dtype, device).view(b - a, *shape[1:])
    rows, rest = torch.Size(shape[:dim]).numel(), torch.Size(shape[dim + 1 :]).numel()
    width = shape[dim] * rest
    cols = torch.arange(a * rest, b * rest, device=device)
    index = torch.arange(rows, device=device)[:, None] * width + cols[None, :]
    return _at(i, index, dtype).view(*shape[:dim], b - a, *shape[dim + 1 :])


def peak_extra(device: str, fn) -> int:
    """Bytes this process held at its peak during ``fn()`` beyond what it held before."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    before = _status("VmRSS")
    fn()
    return _status("VmHWM") - before


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine(endpoint_q, secret, config, layout, dtype, device, pushes, out) -> None:
    shapes = LAYOUTS[layout].named_shapes()
    dest = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes}
    with WeightReceiver(endpoint_q.get(timeout=600), secret, config) as receiver:
        for _ in range(pushes):
            receiver.receive(into=dest)
    _sync(device)
    exact = all(
        torch.equal(dest[n].reshape(-1), pattern(i, 0, dest[n].numel(), dtype, device))
        for i, (n, _) in enumerate(shapes)
    )
    out.put(("engine", exact))


def trainer(
    rank, world, mode, dim, store, endpoint_q, secret, config, layout, dtype, device, pushes, out
) -> None:
    """One trainer rank: makes its tensors (whole, or its rows only), pushes (rank 0) or follows, measures."""
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    shapes = LAYOUTS[layout].named_shapes()
    model_bytes = sum(torch.Size(s).numel() for _, s in shapes) * dtype.itemsize
    if mode == "plain":
        source = [
            (n, pattern(i, 0, torch.Size(s).numel(), dtype, device).view(s))
            for i, (n, s) in enumerate(shapes)
        ]
        floor = _copy_floor(source)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        from raysync.sources import DTensorSource

        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        mesh = init_device_mesh(device, (world,))
        named = []
        for i, (n, s) in enumerate(shapes):
            local = local_part(i, s, world, rank, dim, dtype, device)
            stride = torch.empty(s, device="meta").stride()
            placement = Shard(dim if len(s) > 1 else 0)
            named.append(
                (n, DTensor.from_local(local, mesh, [placement], run_check=False, shape=s, stride=stride))
            )
        source = DTensorSource(named, config)
        locals_ = [t.to_local() for _, t in named]
        floor = _gather_floor(locals_, world, device)
    sender = WeightSender(secret, config) if rank == 0 else None
    if sender is not None:
        endpoint_q.put(sender.endpoint)

    def push(version: int) -> None:
        if sender is not None:
            sender.push(source, version)
        else:
            source.follow(version)

    extra = peak_extra(
        device, lambda: push(0)
    )  # the first push: the ring and the gather buffer are made in it
    times = []
    for version in range(1, pushes + 1):
        if mode != "plain":
            dist.barrier()
        t0 = time.perf_counter()
        push(version)
        _sync(device)
        times.append(time.perf_counter() - t0)
    floor()  # warm-up: its buffers' first touch
    floor_s = statistics.median(_timed(floor, device) for _ in range(3))
    if sender is not None:
        sender.close()
        out.put(("sender", statistics.median(times), floor_s, extra, model_bytes))
    if mode != "plain":
        source.close()
        dist.destroy_process_group()


def _timed(fn, device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _copy_floor(named):
    """One copy of every tensor into preallocated memory like it."""
    pairs = [(torch.empty_like(t), t) for _, t in named]

    def once() -> None:
        for d, t in pairs:
            d.copy_(t)

    return once


def _gather_floor(locals_: list[torch.Tensor], world: int, device: str):
    """Every rank's shards in one all-gather over one flat buffer (each rank's part padded to the largest),
    then one copy of the gathered bytes; the buffers preallocated."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in locals_])
    most = torch.tensor([flat.numel()], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    gathered = torch.zeros(world * int(most), dtype=torch.uint8, device=device)
    mine = gathered[dist.get_rank() * int(most) :][: int(most)]
    out = torch.empty_like(gathered)

    def once() -> None:
        mine[: flat.numel()].copy_(flat)
        dist.all_gather_into_tensor(gathered, mine)
        out.copy_(gathered)

    return once


def run(mode: str, world: int, args, config: SyncConfig, dim: int = 0) -> dict:
    ctx = mp.get_context("spawn")
    secret, out, endpoint_q = SessionSecret.generate(), ctx.Queue(), ctx.Queue()
    dtype = getattr(torch, args.dtype)
    common = (secret, config, args.layout, dtype, args.device, args.pushes + 1)
    store = f"/tmp/raysync-bench-store-{os.getpid()}-{mode}-{world}-{dim}"
    procs = [ctx.Process(target=engine, args=(endpoint_q, *common, out))]
    procs += [
        ctx.Process(
            target=trainer, args=(r, world, mode, dim, store, endpoint_q, *common[:-1], args.pushes, out)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(_tagged(out.get(timeout=1800)) for _ in range(2))
    for p in procs:
        p.join(timeout=120)
    if os.path.exists(store):
        os.unlink(store)
    push_s, floor_s, extra, model_bytes = got["sender"]
    name = mode if mode == "plain" else f"dtensor, {world} rank(s)" + (f", Shard({dim})" if dim else "")
    return {
        "source": name,
        "push_ms": push_s * 1e3,
        "floor_ms": floor_s * 1e3,
        "peak_extra_mb": extra / 2**20,
        "model_mb": model_bytes / 2**20,
        "exact": got["engine"][0],
    }


def _tagged(event: tuple) -> tuple[str, tuple]:
    return event[0], event[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="qwen2-tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bucket-mb", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="mesh sizes of the dtensor rows")
    p.add_argument("--shard-dims", type=int, nargs="+", default=[0], help="0: FSDP rows; 1: TP columns too")
    p.add_argument("--pushes", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    transport = "cuda_ipc" if args.device == "cuda" else "shm"
    config = SyncConfig(bucket_bytes=args.bucket_mb << 20, timeout_s=300, progress=False, transport=transport)
    rows = [run("plain", 1, args, config)] + [run("dtensor", w, args, config) for w in args.ranks]
    rows += [run("dtensor", w, args, config, d) for d in args.shard_dims if d for w in args.ranks if w > 1]
    bound_mb = (config.num_buffers + 1) * config.bucket_bytes / 2**20
    where = f"{platform.node()}, {os.cpu_count()} CPUs" + (
        f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    )
    print(
        f"{args.layout} ({args.dtype}) on {args.device} ({where}), {transport}, buckets of {args.bucket_mb} MiB x {config.num_buffers}"
    )
    print(
        f"{'source':<30} {'push ms':>9} {'floor ms':>9} {'x floor':>8} {'peak extra MiB':>15} {'bound MiB':>10} {'model MiB':>10} exact"
    )
    for r in rows:
        print(
            f"{r['source']:<30} {r['push_ms']:>9.1f} {r['floor_ms']:>9.1f} {r['push_ms'] / r['floor_ms']:>8.2f} "
            f"{r['peak_extra_mb']:>15.1f} {bound_mb:>10.1f} {r['model_mb']:>10.1f} {r['exact']}"
        )
    if args.device == "cpu" and any(w > 1 for w in args.ranks):
        print(
            "(gloo: each all-gather allocates a temporary of its output, one more bucket: see the docstring)"
        )
    emit(
        {
            "bench": "sharded_source",
            "layout": args.layout,
            "dtype": args.dtype,
            "device": args.device,
            "where": where,
            "transport": transport,
            "bucket_mb": args.bucket_mb,
            "num_buffers": int(config.num_buffers),
            "pushes": args.pushes,
            "bound_mb": bound_mb,
            "rows": rows,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
