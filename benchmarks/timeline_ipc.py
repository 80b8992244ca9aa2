"""Where a cuda_ipc push spends its GPU time: both processes' GPU activity on one clock.

    python benchmarks/timeline_ipc.py --ring 2x2048 1x4096 --out /tmp/timeline
    python benchmarks/timeline_ipc.py --layout qwen2.5-1.5b --ring direct   # direct mode: what a push spends
                                                                            # before and after its GPU copies

The sender (this process, GPU 0) and the receiver (a spawned process, --receiver-gpu) each run torch's profiler
around one push after a few warm-ups; their traces (kineto, GPU timestamps on the host clock) are merged and
the push's GPU work printed as runs of one process's copies (S: sender, R: receiver; ms, and in brackets the
microseconds the GPU sat idle before the run): how long each hand-over between the two processes takes, and
how much their copies overlap (two contexts on one GPU take turns: a copy's duration then also counts the time
it waited for its turn). The profiler slows the host side: use push_ms from bench_ipc.py, and this for where
the GPU time goes. Prints a table and JSON; the raw traces go to --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import torch
from common import emit, ipc_config
from torch.profiler import ProfilerActivity, profile

from raysync import SessionSecret, WeightReceiver, WeightSender
from raysync.tools.models import allocate

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def receiver_main(endpoint, secret, config, layout, gpu, warmup, trace, profiling) -> None:
    torch.cuda.set_device(gpu)
    dest = allocate(layout, device="cuda", fill=False)
    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(warmup):
            receiver.receive(into=dest)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiling.set()  # the profiler is up (its start takes seconds): the sender may push
            receiver.receive(into=dest)
        prof.export_chrome_trace(trace)


def gpu_events(path: str, who: str) -> list[tuple[float, float, str, str]]:
    """(start us, end us, who, name) of every GPU activity in a kineto trace, on the host's clock."""
    with open(path) as f:
        data = json.load(f)
    base = data.get("baseTimeNanoseconds", 0) / 1e3
    return [
        (base + e["ts"], base + e["ts"] + e["dur"], who, e["name"])
        for e in data["traceEvents"]
        if e.get("cat") in GPU_CATS and e.get("ph") == "X"
    ]


def runs(events: list[tuple[float, float, str, str]]) -> list[dict]:
    """Consecutive activities of one process merged: who ran when, and the idle gap before each run."""
    out: list[dict] = []
    for start, end, who, _ in sorted(events):
        if out and out[-1]["who"] == who:
            out[-1]["end"] = max(out[-1]["end"], end)
            out[-1]["copies"] += 1
        else:
            gap = start - out[-1]["end"] if out else 0.0
            out.append({"who": who, "start": start, "end": end, "copies": 1, "gap_before_us": gap})
    return out


def one(src, layout, ring: str, gpu: int, warmup: int, out_dir: str) -> dict:
    direct = ring == "direct"  # no ring: the receiver copies out of the trainer's tensors (cuda_ipc_direct)
    num_buffers, bucket_mb = (2, 512) if direct else (int(x) for x in ring.split("x"))  # direct: unused
    config = ipc_config(bucket_mb, num_buffers, direct)
    secret = SessionSecret.generate()
    trace_s, trace_r = (os.path.join(out_dir, f"trace_{ring}_{w}.json") for w in ("sender", "receiver"))
    ctx = mp.get_context("spawn")
    profiling = ctx.Event()
    with WeightSender(secret, config) as sender:
        proc = ctx.Process(
            target=receiver_main,
            args=(sender.endpoint, secret, config, layout, gpu, warmup, trace_r, profiling),
        )
        proc.start()
        for v in range(warmup):
            sender.push(src.items(), v)
        if not profiling.wait(timeout=120):
            raise TimeoutError("the receiver's profiler did not start")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            started = time.time()  # the host clock, the one kineto puts GPU timestamps on
            sender.push(src.items(), warmup)
            ended = time.time()
        proc.join(timeout=120)
    prof.export_chrome_trace(trace_s)
    events = gpu_events(trace_s, "S") + gpu_events(trace_r, "R")
    merged = runs(events)
    span = merged[-1]["end"] - merged[0]["start"]
    busy = {w: sum(e - s for s, e, who, _ in events if who == w) for w in "SR"}
    gaps = [r["gap_before_us"] for r in merged[1:]]
    return {
        "ring": ring,
        "push_ms": (ended - started) * 1e3,
        "gpu_span_ms": span / 1e3,
        "before_gpu_ms": (merged[0]["start"] - started * 1e6) / 1e3,
        "after_gpu_ms": (ended * 1e6 - merged[-1]["end"]) / 1e3,
        "sender_copy_ms": busy["S"] / 1e3,
        "receiver_copy_ms": busy["R"] / 1e3,
        "hand_overs": len(merged) - 1,
        "idle_between_ms": sum(g for g in gaps if g > 0) / 1e3,
        "overlap_ms": -sum(g for g in gaps if g < 0) / 1e3,
        "runs": [
            {
                "who": r["who"],
                "at_ms": (r["start"] - merged[0]["start"]) / 1e3,
                "ms": (r["end"] - r["start"]) / 1e3,
                "copies": r["copies"],
                "gap_before_us": r["gap_before_us"],
            }
            for r in merged
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="qwen2.5-7b")
    ap.add_argument("--ring", nargs="+", default=["2x2048"], help="NUMxMB, or direct")
    ap.add_argument("--receiver-gpu", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="timeline")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.cuda.set_device(0)
    src = allocate(args.layout, device="cuda")
    rows = [one(src, args.layout, r, args.receiver_gpu, args.warmup, args.out) for r in args.ring]
    print(
        f"\n{args.layout}, {torch.cuda.get_device_name()}, receiver on GPU {args.receiver_gpu} (times under the profiler)"
    )
    cols = (
        "ring",
        "push_ms",
        "before_gpu_ms",
        "gpu_span_ms",
        "after_gpu_ms",
        "sender_copy_ms",
        "receiver_copy_ms",
        "hand_overs",
        "idle_between_ms",
        "overlap_ms",
    )
    print("".join(f"{c:>17}" for c in cols))
    for r in rows:
        print("".join(f"{r[c]:>17.2f}" if isinstance(r[c], float) else f"{r[c]:>17}" for c in cols))
        print("   " + " ".join(f"{x['who']}{x['ms']:.2f}({x['gap_before_us']:.0f})" for x in r["runs"]))
    emit({"hardware": torch.cuda.get_device_name(), "layout": args.layout, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
