"""Read the two timelines a profiled delta push wrote (bench_delta_push.py --profile --trace DIR: sender.json(.gz),
receiver.json(.gz)) and say where the GPU's compute engine spent each bucket, when trainer and engine share one GPU
(the GPU runs the two processes' kernels in turns, never at once):

* each side's ops on its compute stream (the stream of the sender's ``_compare_chunks``, of the engine's
  ``_apply_gaps``: kernels and the small copies queued there);
* an idle gap, cut where the first op of either side became ready (its launch call had returned, the op before it
  on its stream had ended, and for the engine its bucket's copy in had ended): before that no work was ready
  (``<side>'s thread``: its launch came late; ``engine waits for its copy in``); after it, a ``switch`` when the
  op that ran next is the other side's, else ``same side`` latency.

Per bucket period (from one ``_compare_chunks`` to the next), medians over --buckets, in microseconds; then one line
of JSON. GPU ops are joined to their launch calls by correlation id.

    python benchmarks/timeline_turns.py DIR [--buckets 6 26]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics

PERIOD_KERNEL = "_compare_chunks"  # the sender's, once a bucket: periods run from one to the next
PARTS = ("sender's ops", "engine's ops", "switches", "sender's thread", "engine's thread",
         "engine waits for its copy in", "same side")  # fmt: skip


def load(folder: str, file: str, side: str, marker: str) -> tuple[list[dict], list[dict]]:
    """``side``'s ops (from ``file``.json(.gz)) on its compute stream (the stream of its first ``marker`` kernel),
    each with ``end`` and ``ready`` (its launch's end, or the end of the op before it), and its other host-to-device
    copies (a bucket's copy in)."""
    path = next(
        p for p in (os.path.join(folder, f"{file}.json{z}") for z in (".gz", "")) if os.path.exists(p)
    )
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    stream = next(e["args"].get("stream") for e in gpu if e["name"] == marker)
    ops, copies, before = [], [], None
    for e in gpu:
        launch = launches.get(e["args"].get("correlation"))
        op = {"side": side, "name": e["name"], "ts": e["ts"], "end": e["ts"] + e["dur"]}
        op["launched"] = launch["ts"] if launch else e["ts"]
        if e["args"].get("stream") != stream:
            if e["name"].startswith("Memcpy HtoD"):
                copies.append(op)
            continue
        op["ready"], op["why"] = (launch["ts"] + launch["dur"] if launch else e["ts"]), "thread"
        if before is not None and before["end"] > op["ready"]:
            op["ready"], op["why"] = before["end"], "stream"
        ops.append(op)
        before = op
    return ops, copies


def intervals(
    sender: list[dict], engine: list[dict], copies_in: list[dict]
) -> list[tuple[float, float, str]]:
    """The compute engine's time, cut into (start, end, part) by the rules of the module's docstring."""
    for op in engine:  # an engine's op waits for the last copy in queued before it was
        came = [c["end"] for c in copies_in if c["launched"] < op["launched"]]
        if came and came[-1] > op["ready"]:
            op["ready"], op["why"] = came[-1], "copy in"
    ops = sorted(sender + engine, key=lambda o: o["ts"])
    out = [(o["ts"], o["end"], f"{o['side']}'s ops") for o in ops]
    busy_until, last = ops[0]["end"], ops[0]  # the op that ends last so far
    for i in range(1, len(ops)):
        start, nxt = busy_until, ops[i]
        if nxt["ts"] > start:
            waiting = [next((o for o in ops[i:] if o["side"] == s), None) for s in ("sender", "engine")]
            first = min((o for o in waiting if o is not None), key=lambda o: o["ready"])
            ready = min(first["ready"], nxt["ts"])
            if ready > start:
                why = (
                    "engine waits for its copy in"
                    if first["why"] == "copy in"
                    else f"{first['side']}'s thread"
                )
                out.append((start, ready, why))
            out.append(
                (max(start, ready), nxt["ts"], "switches" if last["side"] != nxt["side"] else "same side")
            )
        if nxt["end"] > busy_until:
            busy_until, last = nxt["end"], nxt
    return out


def periods(folder: str, first: int, last: int) -> dict:
    sender, _ = load(folder, "sender", "sender", PERIOD_KERNEL)
    engine, copies_in = load(folder, "receiver", "engine", "_apply_gaps")
    cut = intervals(sender, engine, copies_in)
    marks = [o["ts"] for o in sender if o["name"] == PERIOD_KERNEL]
    last = min(last, len(marks) - 1)
    rows = []
    for k in range(first, last):
        a, b = marks[k], marks[k + 1]
        row = dict.fromkeys(PARTS, 0.0)
        row["period"] = b - a
        for s, e, part in cut:
            row[part] += max(0.0, min(b, e) - max(a, s))
        rows.append(row)
    return {
        "buckets": [first, last],
        **{p: statistics.median(r[p] for r in rows) for p in ("period", *PARTS)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--buckets", nargs=2, type=int, default=(6, 26), help="periods from compare FIRST to LAST")
    args = p.parse_args()
    got = periods(args.folder, *args.buckets)
    print(f"periods {got['buckets'][0]}-{got['buckets'][1]} (one {PERIOD_KERNEL} to the next), medians, us:")
    for part in ("period", *PARTS):
        print(f"  {part:30s} {got[part]:8.1f}")
    print(json.dumps(got))


if __name__ == "__main__":
    main()
