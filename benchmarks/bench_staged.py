"""Benchmark: staged pushes with a flip (raysync.core.staging, issue 18) on this machine: how long the engine's
weights are unavailable per update, next to the transfer, and a floor measured in the same run.

    python benchmarks/bench_staged.py                        # CPU: Qwen2.5-0.5B's embedding + 4 layers, bf16
    python benchmarks/bench_staged.py --layers 24 --json out.json

A trainer process (spawned) pushes the tensors of --layout (the embedding, the first --layers decoder layers,
the final norm; allocated, not downloaded) over shm to a receiver in this process, --repeats times per mode:

* in place: ``receive(into=live)``: the bytes land in the live weights as they arrive, so an engine must not
  run a step during the whole transfer: the stall is the transfer;
* staged, whole: ``receive(into=live, flip=False)`` lands the push in staging memory (the engine may keep
  computing), then ``flip()``: one copy per destination. The stall is the flip;
* staged, groups: the same with ``staging_bytes`` = --groups-fraction of the push (at least the largest
  tensor): the engine's thread runs a
  step loop (a step is simulated by waiting --step-ms) and flips one group per step boundary; the stall per
  step is one group's flip;
* floor: one copy of the push's bytes as a single flat tensor (torch ``copy_``), in this process.

Every mode's result is checked bit-exact (every element equals the version pushed). Times are medians; the
transfer is the receiver's report (from the push's start to its end). No engine computes during the transfer
here: on a busy machine the transfer competes with it. Each process runs --threads intra-op threads (1 by
default, as Ray gives its actors). Prints a table, then JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import threading
import time

import torch
from common import emit

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.tools.models import LAYOUTS


def tensors_of(layout: str, layers: int) -> dict[str, torch.Tensor]:
    """The layout's embedding, first ``layers`` decoder layers and final norm, as bf16 CPU tensors."""
    keep = [
        (n, s)
        for n, s in LAYOUTS[layout].named_shapes()
        if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers
    ]
    return {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in keep}


def trainer(
    secret: SessionSecret, config: SyncConfig, layout: str, layers: int, threads: int, go, out
) -> None:
    """The sender process: fills its tensors with the version asked for (None: stop), pushes them."""
    torch.set_num_threads(threads)
    tensors = tensors_of(layout, layers)
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        while (version := go.get(timeout=600)) is not None:
            for t in tensors.values():
                t.fill_(version)  # small integers are exact in bf16
            sender.push(tensors.items(), version)
            out.put(version)


class Bench:
    def __init__(self, receiver: WeightReceiver, live: dict[str, torch.Tensor], go, out):
        self.receiver, self.live, self.go, self.out = receiver, live, go, out
        self.version = 0

    def _push(self) -> int:
        self.version += 1
        self.go.put(self.version)
        return self.version

    def _check(self, version: int) -> None:
        assert self.out.get(timeout=600) == version
        bad = [n for n, t in self.live.items() if not bool((t == version).all())]
        assert not bad and self.receiver.version == version, f"version {version}: {bad[:3]} differ"

    def in_place(self) -> dict:
        version = self._push()
        report = self.receiver.receive(into=self.live)
        self._check(version)
        return {"transfer_s": report.seconds, "stall_s": report.seconds}

    def staged_whole(self) -> dict:
        version = self._push()
        report = self.receiver.receive(into=self.live, flip=False)
        flip = self.receiver.flip()
        self._check(version)
        return {"transfer_s": report.seconds, "stall_s": flip.seconds, "flip_s": flip.seconds}

    def staged_groups(self, staging_bytes: int, step_s: float) -> dict:
        version = self._push()
        stop, flips = threading.Event(), []

        def engine() -> None:  # a step loop: a step is stop.wait(step_s); a flip between steps
            while not stop.is_set():
                flipped = self.receiver.flip()
                if flipped is not None:
                    flips.append(flipped)
                stop.wait(step_s)

        steps = threading.Thread(target=engine)
        steps.start()
        try:
            report = self.receiver.receive(into=self.live, flip=False, staging_bytes=staging_bytes)
            deadline = time.monotonic() + 60
            while self.receiver.version != version and time.monotonic() < deadline:  # the last group's flip
                stop.wait(step_s)
        finally:
            stop.set()
            steps.join(timeout=60)
        self._check(version)
        worst = max(f.seconds for f in flips)
        return {
            "transfer_s": report.seconds,
            "stall_s": worst,
            "flip_s": sum(f.seconds for f in flips),
            "groups": len(flips),
        }


def floor_s(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # warm-up: the pages are touched
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_of(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="qwen2.5-0.5b", choices=sorted(LAYOUTS))
    p.add_argument(
        "--layers", type=int, default=4, help="decoder layers pushed (with the embedding and norm)"
    )
    p.add_argument("--bucket-bytes", type=int, default=64 << 20)
    p.add_argument(
        "--groups-fraction", type=float, default=0.25, help="staging_bytes / push bytes, groups mode"
    )
    p.add_argument("--step-ms", type=float, default=5.0, help="a simulated engine step, groups mode")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads per process")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    live = tensors_of(args.layout, args.layers)
    nbytes = sum(t.nbytes for t in live.values())
    config = SyncConfig(bucket_bytes=args.bucket_bytes, num_buffers=2, timeout_s=120, progress=False)
    secret = SessionSecret.generate()
    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(
        target=trainer, args=(secret, config, args.layout, args.layers, args.threads, go, out)
    )
    child.start()
    try:
        with WeightReceiver(out.get(timeout=120), secret, config) as receiver:
            bench = Bench(receiver, live, go, out)
            budget = max(
                int(nbytes * args.groups_fraction), -(-max(t.nbytes for t in live.values()) // 256) * 256
            )
            runs = {
                "in place": [bench.in_place() for _ in range(args.repeats)],
                "staged, whole": [bench.staged_whole() for _ in range(args.repeats)],
                "staged, groups": [
                    bench.staged_groups(budget, args.step_ms / 1e3) for _ in range(args.repeats)
                ],
            }
            groups = receiver.staging  # the last mode run: groups
        go.put(None)
        child.join(timeout=120)
    finally:
        if child.is_alive():
            child.kill()
    floor = floor_s(nbytes, max(args.repeats, 5))
    result = {
        "layout": args.layout,
        "layers": args.layers,
        "tensors": len(live),
        "push_bytes": nbytes,
        "bucket_bytes": args.bucket_bytes,
        "staging_bytes_groups": budget,
        "step_ms": args.step_ms,
        "hardware": f"{platform.processor() or platform.machine()}, {args.threads} thread(s) per process, "
        f"torch {torch.__version__}",
        "floor_s": floor,
        "modes": {m: median_of(rows) for m, rows in runs.items()},
        "runs": runs,
        "groups_staging": {
            "mode": groups.mode,
            "groups": groups.groups,
            "nbytes": groups.nbytes,
            "why": groups.why,
        },
    }
    print(
        f"{nbytes / 1e6:.0f} MB: {args.layout}, embedding + {args.layers} layers, {len(live)} bf16 tensors, "
        f"over shm; on {result['hardware']}; medians of {args.repeats}"
    )
    print(f"{'mode':16}  {'transfer ms':>11}  {'stall ms':>9}  {'stall / floor':>13}  notes")
    for mode, r in result["modes"].items():
        note = f"{r['groups']:.0f} groups, stall = the largest group's flip" if "groups" in r else ""
        print(
            f"{mode:16}  {r['transfer_s'] * 1e3:11.1f}  {r['stall_s'] * 1e3:9.1f}  "
            f"{r['stall_s'] / floor:13.2f}  {note}"
        )
    print(f"{'floor':16}  {'':11}  {floor * 1e3:9.1f}  {1:13.2f}  one copy of {nbytes / 1e6:.0f} MB")
    emit(result, args.json)


if __name__ == "__main__":
    main()
