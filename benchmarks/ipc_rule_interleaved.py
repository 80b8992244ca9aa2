"""A cuda_ipc ring on one GPU, 7B layout: sessions without delta mode ("off") and with the time rule ("rule", where
deltas are off: ONE_GPU_OFF in raysync.core.delta_rule), one after the other in one process, each pushing four
times after an Adam step (bench_delta_push.run_transport); "rule_plain" is the rule's session with its ring made
without ring_config's growth (the only difference delta mode makes there). Prints each session's push times (ms)
and their median, to tell a difference of the mode from one of the session's place in the order.

    python benchmarks/ipc_rule_interleaved.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_delta_push as bench  # noqa: E402

import raysync.core.session as session  # noqa: E402

ORDER = ("off", "rule", "rule_plain", "off", "rule")


def main() -> None:
    args = argparse.Namespace(
        device="cuda", layout="qwen2.5-7b", layers=None, lr=3e-6, bf16_params=True, fused_adam=True, buffers=2,
        threads=None, profile=False, profile_step=None, trace=None, stages=False, repeats=3,
        bucket_mib={"shm": 512, "cuda_ipc": 512, "collective": 64},
    )  # fmt: skip
    device, grow = torch.device("cuda"), session.ring_config
    trainer = bench.Trainer(bench.shapes(args.layout, None), device, args.lr, bf16=True, fused=True)
    for variant in ORDER:
        session.ring_config = (lambda config, specs: config) if variant == "rule_plain" else grow
        result = bench.run_transport("cuda_ipc", trainer, args, delta=False, steps=4, rule=variant != "off")
        bench.free(device)
        times = [
            round(s["full" if variant == "off" else "rule"]["seconds"] * 1e3, 2) for s in result["steps"]
        ]
        print(variant, times, "median", statistics.median(times), flush=True)


if __name__ == "__main__":
    main()
