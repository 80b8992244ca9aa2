"""Where a thread's host time goes in a torch.profiler trace taken with Python stacks
(RAYSYNC_PROFILE_STACK=1 python benchmarks/bench_delta_push.py ... --profile --trace DIR): per Python function
(file:line name), its self time (its own time less the functions and ops it called) and its total time, summed
over the push, on the thread that spent the most; and per torch op, its self time on that thread.

    python benchmarks/host_share.py DIR/sender.json [--top 40] [--per N]

``--per N`` divides by N (e.g. the push's buckets) to give times per bucket.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--per", type=float, default=1.0, help="divide the times by this (e.g. buckets)")
    args = p.parse_args()
    host = [
        e
        for e in load(args.trace)
        if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")
    ]
    threads = collections.Counter()
    for e in host:
        threads[(e["pid"], e["tid"])] += e["dur"] if e.get("cat") == "python_function" else 0
    thread = threads.most_common(1)[0][0]
    mine = sorted((e for e in host if (e["pid"], e["tid"]) == thread), key=lambda e: (e["ts"], -e["dur"]))
    self_us, total_us, calls = collections.Counter(), collections.Counter(), collections.Counter()
    # each event's children: the events that start inside it, nested, on the same thread
    children = collections.Counter()
    stack = []
    for e in mine:
        while stack and stack[-1][1] <= e["ts"]:
            stack.pop()
        if stack:
            children[id(stack[-1][0])] += e["dur"]
        stack.append([e, e["ts"] + e["dur"]])
    for e in mine:
        name = f"[{e['cat']}] {e['name']}"
        self_us[name] += e["dur"] - children[id(e)]
        total_us[name] += e["dur"]
        calls[name] += 1
    span = (mine[-1]["ts"] + mine[-1]["dur"] - mine[0]["ts"]) if mine else 0
    print(f"thread {thread}: {len(mine)} events over {span / 1e3:.1f} ms; times in us / {args.per:g}")
    print(f"{'self':>9} {'total':>9} {'calls':>7}  name")
    for name, us in self_us.most_common(args.top):
        print(
            f"{us / args.per:9.1f} {total_us[name] / args.per:9.1f} {calls[name] / args.per:7.1f}  {name[:110]}"
        )


if __name__ == "__main__":
    main()
