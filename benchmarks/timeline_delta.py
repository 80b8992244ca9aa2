"""Read the two timelines a delta push wrote (bench_delta_push.py --profile --trace DIR: sender.json(.gz),
receiver.json(.gz), torch.profiler's Chrome traces) and print, per bucket, when its copy out of the trainer's GPU
and its copy into the engine's ran, the gaps between them, and the sender's kernels in order around them.

    python benchmarks/timeline_delta.py DIR [--from MS] [--to MS]

Times are ms from the sender's first copy out of the profiled push (both sides are on the host's monotonic clock).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics


def events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]


def find(folder: str, side: str) -> str:
    for name in (f"{side}.json.gz", f"{side}.json"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise FileNotFoundError(f"no {side}.json(.gz) in {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--from", dest="start", type=float, default=None, help="kernels listed from this ms")
    p.add_argument("--to", type=float, default=None, help="... to this ms")
    args = p.parse_args()
    sender, receiver = events(find(args.folder, "sender")), events(find(args.folder, "receiver"))
    big = 100.0  # us: a bucket's copy, not a table's or a count's
    outs = sorted(
        (e for e in sender if e["name"].startswith("Memcpy DtoH") and e["dur"] > big), key=lambda e: e["ts"]
    )
    ins = sorted(
        (e for e in receiver if e["name"].startswith("Memcpy HtoD") and e["dur"] > big), key=lambda e: e["ts"]
    )
    # the profiled push: the copies out that the receiver's copies in answer (an earlier push's may lead)
    outs = outs[len(outs) - len(ins) :]
    t0 = outs[0]["ts"]

    def ms(t: float) -> float:
        return (t - t0) / 1e3

    print(
        "bucket  copy out (sender)      copy in (engine)      out end -> in start   in end -> next out start"
    )
    lag, idle = [], []
    for k, (o, i) in enumerate(zip(outs, ins, strict=True)):
        after = ms(i["ts"]) - ms(o["ts"] + o["dur"])
        nxt = ms(outs[k + 1]["ts"]) - ms(i["ts"] + i["dur"]) if k + 1 < len(outs) else float("nan")
        lag.append(after)
        if k + 1 < len(outs):
            idle.append(ms(outs[k + 1]["ts"]) - ms(o["ts"] + o["dur"]))
        print(
            f"{k:6d}  {ms(o['ts']):8.3f}-{ms(o['ts'] + o['dur']):8.3f}  {ms(i['ts']):8.3f}-{ms(i['ts'] + i['dur']):8.3f}"
            f"  {after:18.3f}  {nxt:22.3f}"
        )
    # (the median: the first buckets are packed ahead of the push's start, which may lie long before)
    period = statistics.median(ms(b["ts"]) - ms(a["ts"]) for a, b in zip(outs, outs[1:], strict=False))
    print(
        f"a bucket every {period:.3f} ms; copy out {statistics.median(o['dur'] for o in outs) / 1e3:.3f} ms, copy in "
        f"{statistics.median(i['dur'] for i in ins) / 1e3:.3f} ms (medians); no copy out between two: "
        f"{statistics.median(idle):.3f} ms; a copy out's end to its copy in: {statistics.median(lag):.3f} ms"
    )
    start = args.start if args.start is not None else ms(outs[len(outs) // 2]["ts"]) - period / 2
    end = args.to if args.to is not None else start + 3 * period
    print(
        f"\nthe sender's GPU from {start:.1f} to {end:.1f} ms (kernels and copies over 50 us; stream, ms, name)"
    )
    for e in sorted(sender, key=lambda e: e["ts"]):
        if (
            e["dur"] > 50
            and start <= ms(e["ts"]) <= end
            or "Memcpy DtoH" in e["name"]
            and start <= ms(e["ts"]) <= end
        ):
            print(
                f"  {e['args'].get('stream')!s:>4} {ms(e['ts']):8.3f} +{e['dur'] / 1e3:.3f}  {e['name'][:60]}"
            )


if __name__ == "__main__":
    main()
