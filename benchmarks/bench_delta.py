"""Benchmark: delta encoding (raysync.core.delta) of one bucket, at several densities of changed elements, next to
a floor measured in the same run on the same bytes: one copy of the bucket's full bytes (what a full push does
with them at least once).

    python benchmarks/bench_delta.py                          # CPU: one layer of Qwen2.5-0.5B as the bucket
    python benchmarks/bench_delta.py --device cuda --layout qwen2.5-7b --json out.json
    python benchmarks/bench_delta.py --push                   # whole pushes over shm: delta vs full (below)

The bucket is every tensor of decoder layer 0 of --layout (--layers for more), in bf16, with the magnitudes
of a real checkpoint (matrices ~N(0, 0.02), norm weights ~1). A change flips the lowest bit of an element (one
bf16 step, as an RL update does), at uniformly random positions: --densities says what fraction. Rows:

* encode: ``delta_encode.encode`` (the compare, the counts, the gaps and values written into a bucket buffer)
  with a Workspace reused across calls, as a push's sender does;
* decode: ``delta.decode`` into the engine's tensors (the checks, then the scatter), as a receiver runs it;
* bitmask encode / decode: the other encoding considered (a bit per element, then the changed values), made
  here only to compare (into fresh tensors, not a bucket buffer, so slightly flattered): its size is
  numel / 8 + changed * itemsize;
* floor: a copy of the bucket's full bytes into a buffer.

--push times whole pushes instead (SyncConfig.delta through the push session, sender and receiver as two
threads of this process over an shm ring): a full push with delta off, then per density a delta push and a
full push in delta mode (``full=True``, which also copies each bucket into the sender's reference), next to
the floor of one copy of the model's bytes in the same run; every push is checked bit-exact at the end.

Under each density, encode's and decode's stages (raysync.core.delta_rule.StageClock, means over --repeats;
on a GPU each stage's end synchronizes). --buffer-device cpu with --device cuda puts the bucket buffer in
pinned host memory: the shm case of a GPU trainer and a GPU engine (encode crosses PCIe once with the bytes
used, decode once back).

GB/s are of the full bytes (what a full push would move), so the rows compare directly. Times are medians
over --repeats after a warm-up, on --threads CPU threads (1 by default, as Ray runs its actors; on a busy
machine more threads than free cores make every row slower and noisier). Prints a table per density, then
JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch
from common import emit, timed

from raysync.core import delta
from raysync.core.delta_encode import Workspace, encode
from raysync.core.delta_rule import StageClock
from raysync.tools.models import LAYOUTS

_WEIGHTS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


def bucket(layout: str, layers: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """Layer 0 .. layers - 1 of ``layout`` as bf16 tensors with a checkpoint's magnitudes."""
    keep = tuple(f"model.layers.{i}." for i in range(layers))
    return [t.reshape(-1) for name, t in weights(layout, device, seed) if name.startswith(keep)]


def weights(layout: str, device: torch.device, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``layout`` in bf16: matrices ~N(0, 0.02), norm weights ~1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, shape in LAYOUTS[layout].named_shapes():
        t = torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)
        if name.endswith("norm.weight"):
            t += 1.0
        out.append((name, t.to(torch.bfloat16)))
    return out


def changed(old: torch.Tensor, density: float, seed: int) -> torch.Tensor:
    """``old`` with the lowest bit of a ``density`` fraction of its elements flipped (one bf16 step)."""
    gen = torch.Generator(device=old.device).manual_seed(seed)
    mask = torch.rand(old.numel(), device=old.device, generator=gen) < density
    new = old.clone()
    new.view(torch.int16).bitwise_xor_(mask.to(torch.int16))
    return new


# --- the bitmask encoding, only to compare ----------------------------------------------------------------------------
def bitmask_encode(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = old.view(torch.int16) != new.view(torch.int16)
    pad = -mask.numel() % 8
    padded = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    bits = (padded.view(-1, 8).view(torch.uint8) * _WEIGHTS.to(mask.device)).sum(1, dtype=torch.uint8)
    return bits, new.view(torch.int16)[mask.nonzero().view(-1)]


def bitmask_decode(bits: torch.Tensor, values: torch.Tensor, dest: torch.Tensor) -> None:
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    mask = ((bits[:, None] >> shifts) & 1).view(-1)[: dest.numel()].bool()
    dest.view(torch.int16).masked_scatter_(mask, values)


def stage_times(fn, device: torch.device, repeats: int) -> dict[str, float]:
    """Mean seconds per stage of ``fn(mark)`` over ``repeats`` calls, after one warm-up."""
    clock = StageClock()
    fn(clock.mark)
    clock.enabled = True
    clock.start(device)
    for _ in range(repeats):
        clock.restart()
        fn(clock.mark)
    return {k: v / repeats for k, v in clock.seconds.items()}


def run_density(
    olds: list[torch.Tensor], density: float, device: torch.device, buffer_device: torch.device, repeats: int
) -> dict:
    news = [changed(o, density, seed=i) for i, o in enumerate(olds)]
    pairs = list(zip(olds, news, strict=True))
    pin = buffer_device.type == "cpu" and device.type == "cuda"
    size = delta.capacity([(n.numel(), 2) for n in news])
    out = torch.empty(size, dtype=torch.uint8, device=buffer_device, pin_memory=pin)
    space = Workspace.for_buckets([[(n.numel(), 2) for n in news]], device)
    engine = [o.clone() for o in olds]
    code = encode(pairs, out, base_version=1, space=space)
    delta.decode(out, engine, held_version=1)
    assert all(
        torch.equal(e.view(torch.int16), n.view(torch.int16)) for e, n in zip(engine, news, strict=True)
    )
    masks = [bitmask_encode(o, n) for o, n in pairs]
    for (bits, values), old, new in zip(masks, olds, news, strict=True):  # the comparison is bit-exact too
        dest = old.clone()
        bitmask_decode(bits, values, dest)
        assert torch.equal(dest.view(torch.int16), new.view(torch.int16))
    seconds = {
        "encode": timed(lambda: encode(pairs, out, base_version=1, space=space), device, repeats),
        "decode": timed(lambda: delta.decode(out, engine, held_version=1), device, repeats),
        "bitmask encode": timed(lambda: [bitmask_encode(o, n) for o, n in pairs], device, repeats),
        "bitmask decode": timed(
            lambda: [bitmask_decode(b, v, d) for (b, v), d in zip(masks, engine, strict=True)],
            device,
            repeats,
        ),
    }
    flat_new = torch.cat(news).view(torch.uint8)
    copy = torch.empty_like(flat_new)
    seconds["floor: copy of the full bytes"] = timed(lambda: copy.copy_(flat_new), device, repeats)
    bitmask_bytes = sum(b.numel() + 2 * v.numel() for b, v in masks)
    return {
        "density": density,
        "changed": code.changed,
        "modes": {m.name: sum(c.mode == m for c in code.chunks) for m in delta.Mode},
        "gaps_bytes": code.nbytes,
        "bitmask_bytes": bitmask_bytes,
        "seconds": seconds,
        "stages_s": {
            "encode": stage_times(
                lambda mark: encode(pairs, out, base_version=1, space=space, mark=mark), device, repeats
            ),
            "decode": stage_times(
                lambda mark: delta.decode(out, engine, held_version=1, mark=mark), device, repeats
            ),
        },
    }


# --- whole pushes over shm (--push) ---------------------------------------------------------------------------------
def flip_in_place(named: list[tuple[str, torch.Tensor]], density: float, seed: int) -> None:
    """One bf16 step (the lowest bit) at ``density`` * numel random positions of each tensor (with repeats:
    the push reports the density it found)."""
    gen = torch.Generator(device=named[0][1].device).manual_seed(seed)
    for _, t in named:
        bits = t.view(-1).view(torch.int16)
        index = torch.randint(0, bits.numel(), (int(density * bits.numel()),), generator=gen, device=t.device)
        bits[index] ^= 1


def run_push(
    layout: str, densities: list[float], device: torch.device, repeats: int, bucket_bytes: int
) -> dict:
    """Whole pushes of ``layout`` over shm, sender and receiver in this process (two threads): full pushes
    with delta off, then in a delta session per density: delta pushes (the trainer's tensors changed in place
    between pushes, not timed) and full pushes (``full=True``: they also copy every bucket into the
    reference). Medians of ``repeats`` pushes; the floor is one copy of the model's bytes, in the same run."""
    from concurrent.futures import ThreadPoolExecutor

    from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender

    named = weights(layout, device, seed=0)
    dest = {n: torch.zeros_like(t, device="cpu") for n, t in named}
    nbytes = sum(t.nbytes for _, t in named)
    pool = ThreadPoolExecutor(1)

    def pushes(config: SyncConfig, density: float | None, full: bool) -> tuple[float, list]:
        secret = SessionSecret.generate()
        times, reports = [], []
        with (
            WeightSender(secret, config) as sender,
            WeightReceiver(sender.endpoint, secret, config) as receiver,
        ):
            for version in range(repeats + 1):  # push 0: the first, full one
                if density is not None and version:
                    flip_in_place(named, density, seed=version)
                got = pool.submit(receiver.receive, into=dest)
                t0 = time.perf_counter()
                report = sender.push(named, version, full=full)
                got.result(timeout=config.timeout_s)
                if version:
                    times.append(time.perf_counter() - t0)
                    reports.append(report)
        assert all(torch.equal(dest[n].view(torch.int16), t.cpu().view(torch.int16)) for n, t in named)
        return statistics.median(times), reports

    base = SyncConfig(bucket_bytes=bucket_bytes, timeout_s=600, progress=False, transport="shm")
    flat = torch.empty(nbytes, dtype=torch.uint8)
    copy_src = torch.empty(nbytes, dtype=torch.uint8)
    floor = timed(lambda: flat.copy_(copy_src), torch.device("cpu"), repeats)
    full_off, _ = pushes(base, None, False)
    delta_cfg = dataclasses.replace(base, delta=True, delta_by_time=False)  # every push a delta
    runs = []
    for density in densities:
        delta_s, reports = pushes(delta_cfg, density, False)
        full_on, _ = pushes(delta_cfg, density, True)
        runs.append(
            {
                "density_asked": density,
                "density": statistics.median(r.density for r in reports),
                "delta_bytes": statistics.median(r.bytes for r in reports),
                "seconds": {"delta push": delta_s, "full push (delta on)": full_on},
            }
        )
    return {
        "layout": layout,
        "model_bytes": nbytes,
        "bucket_bytes": bucket_bytes,
        "floor_copy_s": floor,
        "full_push_delta_off_s": full_off,
        "runs": runs,
    }


def print_push(r: dict) -> None:
    full, floor = r["full_push_delta_off_s"], r["floor_copy_s"]
    print(
        f"pushes of {r['layout']} over shm ({r['model_bytes'] / 1e6:.0f} MB, buckets of {r['bucket_bytes'] >> 20} MiB); "
        f"floor (one copy of the model's bytes) {floor * 1e3:.1f} ms; full push, delta off {full * 1e3:.1f} ms"
    )
    print(f"{'density':>8}  {'':22}  {'ms':>9}  {'x full':>6}  {'x floor':>7}  {'bytes / full':>12}")
    for run in r["runs"]:
        for name, s in run["seconds"].items():
            ratio = f"{run['delta_bytes'] / r['model_bytes']:12.3%}" if name == "delta push" else ""
            print(
                f"{run['density']:8.2%}  {name:22}  {s * 1e3:9.1f}  {s / full:6.2f}  {s / floor:7.1f}  {ratio}"
            )


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="qwen2.5-7b" if cuda else "qwen2.5-0.5b", choices=sorted(LAYOUTS))
    p.add_argument("--layers", type=int, default=1, help="decoder layers in the bucket")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--buffer-device", default=None, help="the bucket buffer's (default: --device; cpu: shm)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.005, 0.036, 0.09, 0.3])
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (Ray gives its actors one)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--push", action="store_true", help="whole pushes over shm, delta vs full (the trainer on --device)"
    )
    p.add_argument("--bucket-mib", type=int, default=64, help="--push: bucket_bytes in MiB")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.push:
        result = run_push(args.layout, args.densities, device, args.repeats, args.bucket_mib << 20)
        result["hardware"] = hardware(device)
        print_push(result)
        emit(result, args.json)
        return
    buffer_device = torch.device(args.buffer_device or args.device)
    olds = bucket(args.layout, args.layers, device, seed=0)
    full = sum(2 * o.numel() for o in olds)
    result = {
        "layout": args.layout,
        "layers": args.layers,
        "chunks": len(olds),
        "full_bytes": full,
        "device": str(device),
        "hardware": hardware(device),
        "buffer_device": str(buffer_device),
        "runs": [run_density(olds, d, device, buffer_device, args.repeats) for d in args.densities],
    }
    print(
        f"bucket: {args.layers} layer(s) of {args.layout}, {len(olds)} bf16 tensors, {full / 1e6:.1f} MB, on "
        f"{device}, bucket buffer on {buffer_device}; on {result['hardware']}"
    )
    print(f"{'density':>8}  {'':30}  {'ms':>8}  {'GB/s':>6}  {'x floor':>7}  {'bytes / full':>12}")
    for r in result["runs"]:
        floor = r["seconds"]["floor: copy of the full bytes"]
        size = {"encode": r["gaps_bytes"], "bitmask encode": r["bitmask_bytes"]}
        for name, s in r["seconds"].items():
            ratio = f"{size[name] / full:12.3%}" if name in size else ""
            print(
                f"{r['density']:8.1%}  {name:30}  {s * 1e3:8.2f}  {full / s / 1e9:6.2f}  {s / floor:7.1f}  {ratio}"
            )
        modes = ", ".join(f"{n} {c}" for n, c in r["modes"].items() if c)
        both = (r["seconds"]["encode"] + r["seconds"]["decode"]) / floor
        print(
            f"{'':8}  chunks: {modes}; changed {r['changed']} of {full // 2}; encode + decode {both:.1f} x floor"
        )
        for name, stages in r["stages_s"].items():
            print(
                f"{'':8}  {name} stages (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in stages.items())
            )
    emit(result, args.json)


if __name__ == "__main__":
    main()
