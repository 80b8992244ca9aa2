"""Read a py-spy profile of a push (``py-spy record --nonblocking --subprocesses -f raw -o FILE -- python
benchmarks/bench_delta_push.py ...``) and print, for the samples under each given frame (default: the sender's
``SenderStream.run``), the share of samples in each function below it (inclusive) and in each innermost raysync
frame with the function it was in (self).

    python benchmarks/pyspy_summary.py FILE [FRAME ...]
"""

import collections
import sys

path = sys.argv[1]
roots = sys.argv[2:] or ["SenderStream.run"]
for root in roots:
    incl, leaf, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(root + " ")), None)
        if at is None:
            continue
        n = int(n)
        total += n
        below = frames[at:]
        seen = set()
        for f in below:
            name = f.split(" (")[0]
            if name not in seen:
                incl[name] += n
                seen.add(name)
        inner = [f for f in below if "raysync/" in f]
        leaf[(inner[-1] if inner else below[-1]) + " -> " + below[-1].split(" (")[0]] += n
    print(f"== {root}: {total} samples")
    for name, n in incl.most_common(45):
        print(f"  incl {100 * n / max(total, 1):5.1f}%  {name}")
    for name, n in leaf.most_common(40):
        print(f"  self {100 * n / max(total, 1):5.1f}%  {name[:150]}")
