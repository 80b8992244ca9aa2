"""benchmarks/timeline_turns.py on two made-up timelines whose turns are known: where the GPU's compute engine
spent a delta bucket (each side's ops, switches, a thread late to launch, the engine waiting for its copy in)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "timeline_turns.py"


def _trace(path: Path, ops: list[tuple[str, float, float, float, int]]) -> None:
    """Chrome trace of GPU ops (name, start, duration, its launch call's end, stream), each with its launch."""
    events = []
    for n, (name, ts, dur, launched, stream) in enumerate(ops):
        cat = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                       "args": {"stream": stream, "correlation": n}})  # fmt: skip
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "launch", "ts": launched - 1, "dur": 1,
                       "args": {"correlation": n}})  # fmt: skip
    path.write_text(json.dumps({"traceEvents": events}))


def test_a_bucket_is_cut_into_both_sides_ops_switches_a_late_launch_and_a_copy_in_wait(tmp_path):
    # sender: compare 0-100; its thread launches the listing at 150: 150-200; the next compare, launched at 360,
    # runs 400-500
    _trace(tmp_path / "sender.json", [
        ("_compare_chunks", 0, 100, -10, 7), ("_list_blocks", 150, 50, 150, 7), ("_compare_chunks", 400, 100, 360, 7),
        ("_compare_chunks", 800, 100, 0, 7),
    ])  # fmt: skip
    # engine: its copy in 0-220 on a copy stream; its apply, launched at 50, waits for it: 260-360
    _trace(tmp_path / "receiver.json", [
        ("Memcpy HtoD (Pinned -> Device)", 0, 220, 10, 13), ("_apply_gaps", 260, 100, 50, 7),
        ("_apply_gaps", 600, 100, 520, 7),
    ])  # fmt: skip
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path), "--buckets", "0", "1"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["period"] == 400
    assert got["sender's ops"] == 150 and got["engine's ops"] == 100
    assert got["sender's thread"] == 50  # 100-150: nothing ready until the listing's launch
    assert got["engine waits for its copy in"] == 20  # 200-220: the sender's next compare is not launched yet
    assert got["switches"] == 80  # 220-260 (to the engine), 360-400 (back)
    assert got["engine's thread"] == 0 and got["same side"] == 0
