"""Benchmark: a push through WeightSync (Ray actors) next to the raw session and the copy floor, in one run.

    python benchmarks/bench_weightsync.py --device cpu --layout qwen2-tiny qwen2.5-0.5b --out ws_cpu.json
    python benchmarks/bench_weightsync.py --layout qwen2.5-7b qwen2.5-1.5b --out ws_h200.json   # one GPU

The same as ``raysync bench --ray [options]``: the benchmark lives in raysync/tools/bench_ray.py (what it
measures, its options, its table and JSON) and raysync/tools/bench_ray_measure.py (the actors, the raw session,
the breakdown); this script only runs it, so that the commands in docs/ and gpu_pending.sh keep working.
"""

from __future__ import annotations

import sys

from raysync.tools.bench_ray import main

if __name__ == "__main__":
    sys.exit(main())
