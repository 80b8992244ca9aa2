"""How long a delta receiver's first bucket-shaped decode takes after each way of warming its kernels, in a fresh
process on a CUDA GPU (Note [the first delta push's one-time work] in raysync.core.delta_workspace): ``none`` (no
warm: Triton compiles or loads the kernels in it), ``one`` (one payload of one entry, how ``warm`` was shaped before
stop 46), ``warm`` (raysync.core.delta_decode_kernels.warm as it is). Each trial decodes two buckets (17 and 5
payloads of tens of thousands of entries) and joins their checks, as a push's settle does; three trials a process,
host time with the device synchronized, in ms. Run each way in its own process:

    for way in none one warm; do python benchmarks/first_apply_warm.py $way; done
"""

from __future__ import annotations

import argparse
import time

import torch

from raysync.core import delta_decode_kernels
from raysync.core.delta_kernels import INTS


def bucket(device: torch.device, payloads: int, entries: int) -> tuple:
    """``payloads`` GAPS payloads of ``entries`` int16 words each (every gap 1), destinations three times as long."""
    gaps = torch.full((payloads, entries), 1 - 32769, dtype=torch.int16, device=device)
    values = torch.randint(0, 100, (payloads, entries), dtype=torch.int16, device=device)
    dests = [torch.zeros(3 * entries, dtype=torch.int16, device=device) for _ in range(payloads)]
    rows = [(entries, gaps[i].data_ptr(), values[i].data_ptr(), dests[i]) for i in range(payloads)]
    return gaps, values, dests, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("way", choices=["none", "one", "warm"])
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    device = torch.device("cuda")
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    if args.way == "one":
        dest, gaps, values = torch.zeros(3, 2 * 4096 + 16, dtype=INTS[2], device=device)
        apply = delta_decode_kernels.GapsApply([(1, gaps.data_ptr(), values.data_ptr(), dest)])
        apply.ends()
        apply.run()
    elif args.way == "warm":
        delta_decode_kernels.warm(device, {2})
    torch.cuda.synchronize()
    times = []
    for trial in range(args.trials):
        buckets = [bucket(device, 17, 50_000 + 1000 * trial), bucket(device, 5, 80_000)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        applies = [delta_decode_kernels.GapsApply(b[3]) for b in buckets]
        for apply in applies:
            apply.run()
        torch.cat([apply.lasts for apply in applies]).tolist()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    print(args.way, " ".join(f"{t:.2f}ms" for t in times), flush=True)


if __name__ == "__main__":
    main()
