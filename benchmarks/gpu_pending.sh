#!/usr/bin/env bash
# What stays to be measured on one H200 for issues 19 and 24, in one device call (about 8 minutes).
# On the CPU machine first: bash ../shared/device/pack-wheels.sh (Ray and pyzmq for the device, under .whl/).
# Then, through the device tool, with carry [".whl"]:
#     source .whl/unpack-wheels.sh || exit 1; bash benchmarks/gpu_pending.sh
# Each step's output goes to $OUT/<step>.txt, its exit status to $OUT/summary.txt; a step that fails
# or runs out of its time does not stop the next.
set -u
OUT=${OUT:-/tmp/gpu_pending}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the device tool brings back at most 8 files (each .txt ends with its run's JSON): the commit and the GPU go into
# the summary
git log --oneline -1 >> "$OUT/summary.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/summary.txt" 2>&1 || true

step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    local t0=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
}

# the delta GPU tests first: df31d78's (a bucket copied in ahead of its views) has not run on a GPU yet
step delta_gpu_tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_delta_kernels.py tests/test_delta_gpu.py
# 19: WeightSync with the default config and each forced mode (Ray actors sharing the GPU), 7B and 1.5B, with the
# raw session's figure and the floors in the same run.
step weightsync 240 python3 benchmarks/bench_weightsync.py --device cuda
# 24: delta pushes over shm, bf16 weights read in place (ordinary pushes, then the last push profiled with both
# sides' timelines), and the fp32 master cast on the way.
step delta_shm_bf16 120 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm \
    --steps 4 --bf16-params
step delta_trace 120 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm \
    --steps 3 --bf16-params --profile --trace "$OUT"
python3 benchmarks/timeline_delta.py "$OUT" >> "$OUT/delta_trace.txt" 2>&1  # the buckets' copies, the kernels
gzip -f "$OUT/sender.json" "$OUT/receiver.json" 2>/dev/null  # both sides' timelines of the last delta push
step delta_shm 120 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm \
    --steps 3
cat "$OUT/summary.txt"
