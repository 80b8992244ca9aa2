#!/usr/bin/env bash
# What stays to be measured on one H200 for issues 19 and 24. Give the machine back (the device tool's
# give_back) when no next call is ready: a held machine's idle time counts, and a fresh start costs ~1.5 minutes
# of the budget. After stop 46 (docs/benchmarks.md 10 and 12, Latest): weightsync_forced is the issue 19 check in one
# run (Ray's share 0.32-0.59 ms in stop 45, at the 0.5 ms line); delta_shm_bf16 with delta_before (a tree carried as
# build/before: git archive REV raysync benchmarks) for any change to the delta path, twice each in one call (24, stop
# 46: every step within 1.5x its floor, the first delta 1.25-1.34x; a lease's host speed moves a push by ~5-10 ms);
# delta_cuda_ipc (the time rule sends full pushes there); delta_trace and delta_stack to see a bucket (both
# processes' kernels in turns, two switches, the sender's thread); bench_delta_push.py --profile --profile-step 1
# with RAYSYNC_PROFILE_HOST=1 for the first delta push's one-time work; benchmarks/first_apply_warm.py for the
# decoder's warm-up; ipc_rule_interleaved.py for the time rule's full pushes over a cuda_ipc ring against full
# pushes without delta mode, interleaved. On two GPUs (never lent so far): the delta benchmark over NCCL is not
# written yet.
# On the CPU machine first: bash ../shared/device/pack-wheels.sh (Ray and pyzmq for the device, under .whl/).
# Then, through the device tool, with carry [".whl"]:
#     source .whl/unpack-wheels.sh || exit 1; bash benchmarks/gpu_pending.sh
#     bash benchmarks/gpu_pending.sh delta_shm_bf16 weightsync   # only the steps named
# Each step's output goes to $OUT/<step>.txt, its exit status to $OUT/summary.txt; a step that fails
# or runs out of its time does not stop the next. With build/before/ (git archive REV raysync benchmarks, carried),
# the step delta_before runs the same delta benchmark on that tree, for a before / after in one call.
set -u
OUT=${OUT:-/tmp/gpu_pending}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the device tool brings back at most 8 files (each .txt ends with its run's JSON): the commit and the GPU go into
# the summary
git log --oneline -1 >> "$OUT/summary.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/summary.txt" 2>&1 || true

wanted=" $* "
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
    local t0=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name rc=$? $((SECONDS - t0))s" >> "$OUT/summary.txt"
}

# the GPU tests of what stop 38 landed unrun there: the grouped copy inside CopyList (direct mode's whole pushes
# in test_gpu.py, the special values in test_copies.py) and the one-launch compare (the delta kernels' tests)
step gpu_tests 500 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_copies.py \
    tests/test_delta_kernels.py tests/test_delta_gpu.py
# the delta kernels' GPU tests alone (their buffers kept in the workspace: Note [the sender's small tables are kept])
step delta_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_delta_kernels.py tests/test_delta_gpu.py
# 24: delta pushes over shm, bf16 weights read in place (cf02d51's one compare launch a bucket); for a before /
# after, run a copy of 0259ee6's tree (git archive 0259ee6 raysync benchmarks) the same way in the same call
step delta_shm_bf16 100 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm \
    --steps 4 --bf16-params
# 24: delta pushes over a cuda_ipc ring on the trainer's GPU (2 x 512 MiB, and torch's fused Adam: with the
# default ring and Adam the trainer ran out of memory in stop 43); the time rule's row says which way it sends
step delta_cuda_ipc 150 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports cuda_ipc \
    --steps 4 --bf16-params --ipc-mib 512 --fused-adam
before() {  # before NAME SECONDS COMMAND...: the step run in build/before (a tree carried for a before / after)
    [ -d build/before ] || return 0
    (cd build/before && export PYTHONPATH=$PWD:$PYTHONPATH && step "$@")
}
before delta_before 100 python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm \
    --steps 4 --bf16-params
# 24: one profiled delta push at 4.96%, both sides' timelines, read by timeline_delta.py (the copies) and
# timeline_turns.py (the compute engine's turns between the two processes) (torch.profiler slows
# the host: the bucket period it shows is longer than unprofiled)
step delta_trace 150 bash -c "mkdir -p $OUT/trace && python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b \
    --transports shm --steps 4 --bf16-params --profile --trace $OUT/trace && python3 benchmarks/timeline_delta.py $OUT/trace \
    && python3 benchmarks/timeline_turns.py $OUT/trace"
# 24: the same profiled push with Python's calls (torch.profiler's with_stack: slower still), read by host_share.py:
# where the sender's thread spends a bucket
step delta_stack 150 bash -c "mkdir -p $OUT/stack && RAYSYNC_PROFILE_STACK=1 python3 benchmarks/bench_delta_push.py \
    --device cuda --layout qwen2.5-7b --transports shm --steps 4 --bf16-params --profile --trace $OUT/stack && \
    python3 benchmarks/host_share.py $OUT/stack/sender.json --per 32 --top 60 && gzip $OUT/stack/*.json"
# 19: WeightSync with the default config (direct through the grouped copy), 7B and 1.5B, the raw session beside it;
# and the raw direct push (bench_ipc), each also on the before tree when one is carried (Note [start, then check]:
# build/before = git archive f11bbeb raysync benchmarks)
step weightsync 80 python3 benchmarks/bench_weightsync.py --layout qwen2.5-7b qwen2.5-1.5b --default-only
before weightsync_before 80 python3 benchmarks/bench_weightsync.py --layout qwen2.5-7b qwen2.5-1.5b --default-only
# 19: every forced mode through the loops beside the default (the default within 1.1x of the best forced mode)
step weightsync_forced 240 python3 benchmarks/bench_weightsync.py --layout qwen2.5-7b qwen2.5-1.5b --driver loop
step ipc_direct 80 python3 benchmarks/bench_ipc.py --layout qwen2.5-1.5b qwen2.5-7b --direct --no-ring
before ipc_direct_before 80 python3 benchmarks/bench_ipc.py --layout qwen2.5-1.5b qwen2.5-7b --direct --no-ring
# the direct-mode GPU tests alone (Note [start, then check])
step direct_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k direct
# where the delta sender's thread spends a bucket (py-spy from .whl/: pip download py-spy); read it with
# python benchmarks/pyspy_summary.py pyspy.txt
step pyspy 100 py-spy record --nonblocking -r 200 --subprocesses -f raw -o "$OUT/pyspy.txt" -- \
    python3 benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm --steps 3 --bf16-params
# 19: where a direct-mode push spends its host time beyond the copies (1.5B: the raw session ~1.5 ms over the
# copies), both processes sampled; read with python benchmarks/pyspy_summary.py pyspy_direct.txt PushSender.push
step pyspy_direct 100 py-spy record --nonblocking -r 1000 --subprocesses -f raw -o "$OUT/pyspy_direct.txt" -- \
    python3 benchmarks/bench_ipc.py --layout qwen2.5-1.5b --direct --no-ring --pushes 300
# 19: the GPU work of one direct-mode push on both processes' clock: the time before and after the copies
step timeline_direct 100 python3 benchmarks/timeline_ipc.py --layout qwen2.5-1.5b --ring direct \
    --out "$OUT/timeline_direct"
cat "$OUT/summary.txt"
