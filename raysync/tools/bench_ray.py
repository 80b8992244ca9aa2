"""Benchmark: a push through WeightSync (Ray actors) next to the raw session and the copy floor, in one run.

    raysync bench --ray --device cpu --layout qwen2-tiny qwen2.5-0.5b --out ws_cpu.json
    raysync bench --ray --layout qwen2.5-7b qwen2.5-1.5b --out ws_h200.json   # one GPU
    python benchmarks/bench_weightsync.py ...   # the same, from a checkout

A trainer actor and an engine actor share one GPU (``num_gpus=0.5`` each) or the CPU; the trainer holds a
layout's tensors (raysync.tools.models, allocated, not downloaded), the engine preallocated destinations. Rows:
``SyncConfig()`` once per way its push rounds reach the actors (``--driver``: persistent push loops, the default:
raysync.ray.push_loop; a compiled Ray graph; ordinary Ray calls), then every forced mode through the loops (a row that
says why where the plan refuses it; none with ``--default-only``); on a GPU, without ``--all-rows``, no row that
stages 15 GB through host memory (shm) or needs two NCCL ranks on one GPU (collective), so that the 7B and 1.5B
run fits in 4 minutes (the JSON's ``wall_s`` says what it took). Each row, after one warm-up push:

    setup        ``WeightSync(...)`` until the first push can start (placement, plan, sessions, rings, graph, loops)
    WeightSync   ``sync.push(version)`` on the driver, end to end (every pair's answer back on the driver)
    raw session  a WeightSender in this process, a WeightReceiver in a spawned one (no Ray), with the config the
                 plan gave the pair: what the transport costs without Ray. Its session is opened beside the
                 row's WeightSync (its actors alive), after one warm-up push of each the row runs ``--pushes``
                 iterations of one WeightSync push and one raw push, WeightSync first in odd iterations, the raw
                 session first in even ones, so that both medians come from the same minutes
    Ray's share  median(WeightSync) - median(raw session), the JSON's ``ray_share_s``; "paired": the median
                 over iterations of (WeightSync push i - raw push i), ``ray_share_paired_s``; every push's
                 seconds in ``weightsync_s`` and ``raw_s``

and the floor, measured in the trainer's process on its device in the same run: one copy of every tensor.
``--breakdown`` (on by default) splits the default config's push (each driver) into where the driver and the
actors spend it (Ray's calls timed in this process; the actors stamp when their source and sink are called),
after the row's interleaved pushes (no raw push among them).
The engine's destinations are checked against the trainer's tensors after every row. Between two timed pushes the
trainer runs a train step's stand-in (``Holder.step``: new first elements, the GPU synchronized), waited for as an
RL loop waits for its step; the raw session does the same in its sender (``RawSession.push``), and its receiver's
bytes are checked at the end of each row. The raw session's tensors live beside the actors' for the whole layout
(on a GPU: four copies of the layout). Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from raysync import SyncConfig, WeightSync
from raysync.core.errors import PlanError
from raysync.tools.bench_ray_measure import Holder, RawPeer, RawSession, breakdown, sink, source
from raysync.tools.models import allocate

MiB = 1 << 20


# --- one layout, every config ---------------------------------------------------------------------------------------
# --driver: how the default config's push rounds reach the actors, and the end of that row's name
DRIVERS = {"loop": "", "graph": ", compiled graph", "calls": ", ordinary calls"}  # "": WeightSync's default


def weight_sync(actors: tuple[Any, Any], config: SyncConfig, rounds: str) -> WeightSync:
    return WeightSync([actors[0]], [actors[1]], config, source=source, sink=sink, push_rounds=rounds)


def configs(args) -> dict[str, tuple[SyncConfig, str]]:
    """Each row's config and how its push rounds reach the actors (forced modes: the default, push loops)."""
    base = SyncConfig(timeout_s=120, progress=False)
    rows = {f"default: SyncConfig(){DRIVERS[d]}": (base, d) for d in args.driver}
    forced: dict[str, dict[str, Any]] = {}
    if args.device == "cpu" or args.all_rows:  # on a GPU: 15 GB through host memory, 2 NCCL ranks on one GPU
        forced |= {
            "shm, ring 2 x 512 MiB (the old default)": {
                "transport": "shm",
                "bucket_bytes": 512 * MiB,
                "num_buffers": 2,
            },
            "collective": {"transport": "collective"},
        }
    if args.device == "cuda":
        forced |= {
            "cuda_ipc ring, shape by the plan": {"transport": "cuda_ipc", "direct": False},
            "cuda_ipc ring 2 x 512 MiB": {
                "transport": "cuda_ipc",
                "direct": False,
                "bucket_bytes": 512 * MiB,
                "num_buffers": 2,
            },
            "cuda_ipc ring 2 x 2048 MiB": {
                "transport": "cuda_ipc",
                "direct": False,
                "bucket_bytes": 2048 * MiB,
                "num_buffers": 2,
            },
            "cuda_ipc direct": {"transport": "cuda_ipc", "direct": True},
        }
        if args.all_rows:
            forced["shm, shape by the plan"] = {"transport": "shm"}
    else:
        forced |= {"cuda_ipc direct": {"transport": "cuda_ipc", "direct": True}}
    forced_rows = {name: (dataclasses.replace(base, **values), "loop") for name, values in forced.items()}
    return rows if args.default_only else rows | forced_rows


def run_config(name: str, spec: tuple[SyncConfig, str], actors: tuple[Any, Any], args, peer: RawPeer) -> dict:
    """One row: WeightSync's pushes and, with the config the plan gave the pair, the raw session's (on ``peer``),
    one of each in turn (the order swapped every iteration), so that both medians come from the same minutes."""
    (config, rounds), (trainer, engine) = spec, actors
    row: dict[str, Any] = {"config": name, "rounds_by": rounds}
    ray.get(trainer.bump.remote(len(name) % 50 + 10))
    try:
        t0 = time.perf_counter()
        sync = weight_sync(actors, config, rounds)
        row["setup_s"] = time.perf_counter() - t0
    except PlanError as e:
        return row | {"refused": str(e)}
    with sync:
        [pair] = sync.plan
        row |= {
            "transport": pair.transport,
            "mode": pair.mode,
            "why": "; ".join(filter(None, (pair.reason, pair.how))),
            "rounds": sync.plan.rounds,
        }
        # collective: a broadcast group, not a WeightSender's ring (benchmarks/bench_collective.py has its raw figure)
        raw = None if pair.transport == "collective" else peer.session(pair.config(config))
        try:
            row |= interleaved(sync, raw, trainer, args.pushes)
        finally:
            if raw is not None:
                raw.close()  # checks the raw receiver's bytes
        want, got = ray.get([trainer.checksum.remote(), engine.checksum.remote()])
        assert want == got, f"{name}: the engine holds other bytes than the trainer"
        if args.breakdown and name.startswith("default"):  # each driver
            row["breakdown_ms"] = breakdown(sync, trainer, engine, args.pushes, args.pushes + 1)
    return row


def interleaved(sync: WeightSync, raw: RawSession | None, trainer: Any, pushes: int) -> dict[str, Any]:
    """After a warm-up push of each, ``pushes`` iterations of one WeightSync push and one raw push (WeightSync
    first in odd iterations, the raw session first in even ones), each after its train step's stand-in."""

    def weightsync(v: int) -> float:
        ray.get(trainer.step.remote(v % 50 + 60))  # waited for, as an RL loop waits for its train step
        t0 = time.perf_counter()
        report = sync.push(v)
        went.add(report.rounds)
        return time.perf_counter() - t0

    went: set[str] = set()
    sync.push(0)  # warm-ups: sessions, rings, exports
    if raw is not None:
        raw.push(0)
    ws, rs = [], []
    for v in range(1, pushes + 1):
        if raw is not None and v % 2 == 0:
            rs.append(raw.push(v))
        ws.append(weightsync(v))
        if raw is not None and v % 2 == 1:
            rs.append(raw.push(v))
    out = {
        "weightsync_median_s": statistics.median(ws),
        "weightsync_min_s": min(ws),
        "rounds_went": sorted(went),  # SyncReport.rounds of the timed pushes
        "weightsync_s": ws,
    }
    if raw is not None:
        out |= {"raw_median_s": statistics.median(rs), "raw_min_s": min(rs), "raw_s": rs}
        out["ray_share_s"] = out["weightsync_median_s"] - out["raw_median_s"]  # the medians' difference
        out["ray_share_paired_s"] = statistics.median(w - r for w, r in zip(ws, rs, strict=True))
    return out


def run_layout(layout: str, args) -> dict[str, Any]:
    share = {"num_gpus": 0.5, "num_cpus": 0} if args.device == "cuda" else {"num_cpus": 0}
    holder = ray.remote(**share)(Holder)
    trainer = holder.remote(layout, args.device, True, args.threads)
    engine = holder.remote(layout, args.device, False, args.threads)
    floor = ray.get(trainer.floor_s.remote(10))
    nbytes = sum(t.nbytes for t in allocate(layout, device="meta").values())
    peer = RawPeer(layout, args.device, args.threads)  # after the floor: its copies' memory is free again
    try:
        rows = [run_config(name, spec, (trainer, engine), args, peer) for name, spec in configs(args).items()]
    finally:
        peer.close()
    for a in (trainer, engine):
        ray.kill(a)
    return {"layout": layout, "bytes": nbytes, "floor_one_copy_s": floor, "rows": rows}


def print_layout(r: dict[str, Any], hardware: str) -> None:
    ms: Callable[[float], str] = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    print(
        f"\n{r['layout']}: {r['bytes'] / 1e9:.3f} GB, {hardware}; floor (one copy per tensor): "
        f"{ms(r['floor_one_copy_s'])} ms"
    )
    print(
        f"{'config':<42}{'transport':<11}{'mode':<20}{'setup ms':>9}{'WeightSync ms':>14}{'raw ms':>9}"
        f"{'Ray ms':>8}{'paired':>8}{'/floor':>8}"
    )
    for row in r["rows"]:
        if "refused" in row:
            print(f"{row['config']:<42}refused: {row['refused'][:110]}")
            continue
        keys = ("raw_median_s", "ray_share_s", "ray_share_paired_s")
        raw = [ms(row[k]) if k in row else "-" for k in keys]
        print(
            f"{row['config']:<42}{row['transport']:<11}{row['mode']:<20}{ms(row['setup_s']):>9}"
            f"{ms(row['weightsync_median_s']):>14}"
            f"{raw[0]:>9}{raw[1]:>8}{raw[2]:>8}"
            f"{row['weightsync_median_s'] / r['floor_one_copy_s']:>8.1f}"
        )
    if split := [row for row in r["rows"] if "breakdown_ms" in row]:  # one column per driver
        print(
            f"{'where the default config`s WeightSync push goes, median ms':<60}"
            + "".join(f"{row['rounds_by']:>8}" for row in split)
        )
        for k in dict.fromkeys(k for row in split for k in row["breakdown_ms"]):
            print(
                f"    {k:<56}"
                + "".join(
                    f"{row['breakdown_ms'].get(k, float('nan')):>8.{0 if k.endswith('count') else 3}f}"
                    for row in split
                )
            )


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``argv``: the options (default: sys.argv[1:]); ``prog``: the command's name in its usage (default: the
    script's). `raysync bench --ray` and benchmarks/bench_weightsync.py both run this."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add = ap.add_argument
    add("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    add("--layout", nargs="+", help="default: 7B and 1.5B on a GPU, tiny and 0.5B on CPU")
    add("--pushes", type=int, help="timed pushes per row (default: 20 GPU, 10 CPU)")
    add("--threads", type=int, default=1, help="torch intra-op threads of every process (raw, actors)")
    add("--no-breakdown", dest="breakdown", action="store_false")
    add(
        "--driver",
        nargs="+",
        choices=list(DRIVERS),
        default=list(DRIVERS),
        help="how the default config's push rounds reach the actors, a row each: ordinary Ray calls, a compiled "
        "Ray graph, persistent push loops (default: all three)",
    )
    add("--default-only", action="store_true", help="only the default config's rows (no forced mode)")
    add(
        "--all-rows",
        action="store_true",
        help="on a GPU, also the slow rows (shm: the layout through host memory; collective: two NCCL ranks on "
        "one GPU); left out by default so that a GPU run of 7B and 1.5B fits in 4 minutes",
    )
    add("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    gpu = args.device == "cuda"
    args.layout = args.layout or (["qwen2.5-7b", "qwen2.5-1.5b"] if gpu else ["qwen2-tiny", "qwen2.5-0.5b"])
    args.pushes = args.pushes or (20 if gpu else 10)
    torch.set_num_threads(args.threads)  # this process is the raw session's sender
    hardware = torch.cuda.get_device_name() if gpu else f"CPU, {mp.cpu_count()} cores"
    # the directory above the raysync package (a checkout's root): a checkout works as an install does
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(
        include_dashboard=False,
        logging_level="warning",
        num_gpus=1 if gpu else 0,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
        },
    )
    try:
        result = {
            "hardware": hardware,
            "torch": torch.__version__,
            "ray": ray.__version__,
            "pushes": args.pushes,
            "layouts": [],
        }
        for layout in args.layout:
            result["layouts"].append(run_layout(layout, args))
            print_layout(result["layouts"][-1], hardware)
    finally:
        ray.shutdown()
    result["wall_s"] = time.perf_counter() - started
    print(f"\nwall time: {result['wall_s']:.0f} s")
    print(json.dumps(result))  # one line of JSON after the table, and the file if --out
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
