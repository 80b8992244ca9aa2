"""Benchmark: delta pushes (SyncConfig.delta, issue 24) of a model trained like an RL run, per transport, beside
floors measured in the same run.

    python benchmarks/bench_delta_push.py --layout qwen2.5-0.5b --steps 3        # CPU: shm and gloo
    python benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --json out.json   # + cuda_ipc ring
    python benchmarks/bench_delta_push.py --device cuda --layout qwen2.5-7b --transports shm --steps 3

The trainer (this process) holds fp32 master weights of --layout's shapes (nothing downloaded) with a
checkpoint's magnitudes: matrices and biases ~N(0, 0.02), norm weights ~N(1, 0.02) (not unit-variance noise,
which would flatter the density). Each step is torch.optim.Adam at --lr (3e-6, an RL rate) on random N(0, 1)
gradients, one tensor at a time (no gradient for the whole model is ever held); pushes cast the master to
bf16 on the way (cast_dtype), so the deltas are those of the bf16 bits an engine holds. With --bf16-params the
trainer also holds bf16 model weights, which the master is cast into after each step (as Megatron's mixed
precision keeps them), and pushes send those: no cast on the way, so the buckets are read in place (Note [a
delta read in place] in raysync.core.delta_reference) and the floor's read is of them. The engine is a
spawned process holding bf16 tensors on --device (torch, pyzmq and msgpack only: no Ray, no vLLM).

Rows, per transport (shm; cuda_ipc ring with --device cuda, on one GPU; collective: gloo over TCP on the CPU,
NCCL is not run here), per step: the Adam step (not timed), then

* delta push: ``push(version)`` with the time rule off (``delta_by_time=False``), so a delta from the last
  version (its bytes and density from the PushReport), and where the sender's time went, stage by stage
  (its reference's StageClock, summed over buckets: pack = the source packed and cast into the scratch
  bucket; compare = ne + counts, with the one host sync; compact = indices, gaps and values written into
  the encoding, and the reference takes what was encoded; copy out = the bytes used copied into the ring buffer
  when it lives on another device; next compare = the next bucket's compare, while this one's bytes cross;
  reference = a full push's bytes copied into the reference; rest = the push's time outside these: waiting for
  a free buffer while the receiver decodes, the control messages). On a GPU each stage's end synchronizes the
  device, which undoes the overlaps of an ordinary push: the stages are timed there only with --stages;
* full push, delta on: ``push(version, full=True)`` in the same session (the reference keeps its bytes);
* full push, delta off: a session without delta, the same model, one push a step after its own Adam step, as
  the rule's (median over the steps);
* the rule: a third session with the time rule on (``delta_by_time``, the default), one ``push(version)`` a
  step after its own Adam step: what it sent (delta or full), in what time and why (PushReport.why). Its
  first push measures a full push, its second a delta (whose buckets go full from where it falls behind the
  full push), from its third on it chooses (so --steps >= 3);
* floor: one read of the trainer's tensors (what change detection must read at least: a sum of each fp32
  master tensor, which runs at memory speed; count_nonzero, the floor's read until 8cf1011, is a slower
  kernel and is reported beside it) plus moving the delta's bytes over the transport: shm from a GPU, a copy
  into pinned host memory and one out of it at the same time (both directions busy, the bound of a path
  pipelined by bucket; on the CPU one after the other); cuda_ipc, two device copies; the collective, one
  broadcast of that many bytes over the same gloo group.

Every session ends with a check that the engine holds the trainer's bf16 bits (raysync.core.digest). Times
are of ``push`` on the sender, which returns once the engine applied the push. Prints a table, then JSON
(also written to --json). GPU memory: the master and Adam's two states (12 bytes per parameter), the
sender's reference (2), the engine's tensors (2), the ring; freed between transports.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch
from common import emit, timed

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core import delta as raysync_delta
from raysync.core import digest
from raysync.tools.models import LAYOUTS

TRACE = "RAYSYNC_BENCH_TRACE"  # --trace's folder, for both processes

MiB = 1 << 20


def shapes(layout: str, layers: int | None) -> list[tuple[str, tuple[int, ...]]]:
    """--layout's tensors, the decoder layers cut to the first ``layers`` (None: all)."""
    out = []
    for name, shape in LAYOUTS[layout].named_shapes():
        if layers is not None and name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        out.append((name, shape))
    return out


class Trainer:
    """fp32 master weights with a checkpoint's magnitudes, and Adam on random gradients, tensor by tensor."""

    def __init__(
        self,
        named_shapes,
        device: torch.device,
        lr: float,
        seed: int = 0,
        bf16: bool = False,
        fused: bool = False,
    ):
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.params: list[tuple[str, torch.Tensor]] = []
        for name, shape in named_shapes:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            t.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.02, generator=self.gen)
            self.params.append((name, t.requires_grad_()))
        # --fused-adam: torch's fused Adam, which makes no temporary of a tensor's size (the 7B layout's embedding
        # took 2 GiB more in the default Adam's step: the cuda_ipc rows ran out of memory on one H200)
        self.optimizers = [torch.optim.Adam([p], lr=lr, fused=fused or None) for _, p in self.params]
        # --bf16-params: the model's bf16 weights, cast from the master after each step; what pushes send
        self.model = [(n, p.detach().to(torch.bfloat16)) for n, p in self.params] if bf16 else None

    def step(self) -> None:
        for (_, p), opt in zip(self.params, self.optimizers, strict=True):
            p.grad = torch.randn(p.shape, generator=self.gen, device=p.device)
            opt.step()
            p.grad = None
        for (_, w), (_, p) in zip(self.model or [], self.params, strict=False):
            w.copy_(p.detach())

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """What a push sends: the fp32 master (cast on the way), or with --bf16-params the bf16 weights."""
        return self.model if self.model is not None else [(n, p.detach()) for n, p in self.params]

    def digests(self) -> list[int]:
        """What the engine must hold: each tensor's digest of its bf16 bits (one cast at a time)."""
        return digests(p.detach().to(torch.bfloat16) for _, p in self.params)

    def read(self) -> None:
        """One read of every tensor pushed (the floor's change detection): a sum, which runs at memory speed."""
        for _, p in self.named():
            p.sum()

    def count(self) -> None:
        """The floor's read until 8cf1011: count_nonzero of every tensor pushed, a slower kernel than a read."""
        for _, p in self.named():
            p.count_nonzero()


def engine(
    kind: str,
    where,
    secret,
    config: SyncConfig,
    named_shapes,
    device: str,
    pushes: int,
    out,
    inbox,
    threads,
    profiled: int | None = None,
):
    """The engine: bf16 tensors on ``device``, ``pushes`` receives, then the digests of what it holds, and per
    receive its seconds and those spent in ``delta.decode`` (the receiver's thread, its syncs included), and
    torch.profiler's table of receive number ``profiled``; for the collective, then broadcasts of the sizes
    the sender asks for (its floor)."""
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    dest = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in named_shapes}
    group = None
    if kind == "collective":
        from raysync.transport.collective import CollectiveReceiver

        group = CollectiveReceiver(secret, config, rank=1, rendezvous=where)
        receiver = group.join()
    else:
        receiver = WeightReceiver(where, secret, config)
    decoding, decode = [0.0], raysync_delta.decode

    def timed_decode(*a, **k):
        t0 = time.perf_counter()
        try:
            return decode(*a, **k)
        finally:
            decoding[0] += time.perf_counter() - t0

    raysync_delta.decode = timed_decode  # the benchmark's instrument: the sink calls delta.decode
    times, table = [], None
    try:
        for i in range(pushes):
            decoding[0] = 0.0
            profiler = torch.profiler.profile() if i == profiled else contextlib.nullcontext()
            with profiler:
                t0 = time.perf_counter()
                receiver.receive(into=dest)
                times.append((time.perf_counter() - t0, decoding[0]))
            if i == profiled:
                table = profiler.key_averages().table(sort_by=_sort_by(dev), row_limit=25)
                if os.environ.get(TRACE):  # --trace: the timeline too
                    profiler.export_chrome_trace(os.path.join(os.environ[TRACE], "receiver.json"))
        out.put((digests(dest.values()), times, table))
        if group is not None:
            sizes = inbox.get(timeout=600)
            flat = torch.empty(max([1] + [s for s, _ in sizes]), dtype=torch.uint8)
            for size, repeats in sizes:
                for _ in range(repeats + 1):
                    broadcast(group.group, flat[:size])
    finally:
        group.close() if group is not None else receiver.close()


def digests(tensors) -> list[int]:
    """Each tensor's digest of its bytes (raysync.core.digest: the push's own verify)."""
    return digest.combine([[digest.partial(t.reshape(-1).view(torch.uint8), 0)] for t in tensors])


def answer(proc, queue, timeout_s: float = 600.0):
    """The engine's next answer; an engine that died is an error at once, not after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"the engine process ended (exit code {proc.exitcode})") from None
    raise TimeoutError(f"no answer from the engine in {timeout_s} s")


def broadcast(pg, t: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def run_transport(kind: str, trainer: Trainer, args, delta: bool, steps: int, rule: bool = False) -> dict:
    """One session over ``kind`` to a spawned engine: a first (full) push, then per step (delta on) an Adam
    step, a delta push and a full push, or (delta off) a full push, or (``rule``) an Adam step and a push the
    time rule chooses; checked bit-exact at the end."""
    config = SyncConfig(
        transport="shm" if kind == "collective" else kind,
        bucket_bytes=args.bucket_mib.get(kind) * MiB,
        num_buffers=args.buffers,
        direct=False,
        cast_dtype="bfloat16",
        delta=delta or rule,
        delta_by_time=rule,
        timeout_s=600,
        progress=False,
    )
    secret, ctx = SessionSecret.generate(), mp.get_context("spawn")
    out, inbox = ctx.Queue(), ctx.Queue()
    pushes = 1 + (2 * steps if delta else steps)
    named_shapes = [(n, tuple(t.shape)) for n, t in trainer.named()]
    group = None
    if kind == "collective":
        from raysync.transport.collective import CollectiveSender

        group = CollectiveSender(secret, config, host="127.0.0.1", num_receivers=1, backend="gloo")
        where, engine_device = group.rendezvous, "cpu"
    else:
        sender = WeightSender(secret, config)
        where, engine_device = sender.endpoint, args.device
    # the delta push of step --profile-step (default: the last), push number 1 + 2 (step - 1)
    profiled_step = args.profile_step or steps
    profiled = 2 * profiled_step - 1 if args.profile and delta and kind == "shm" else None
    proc = ctx.Process(
        target=engine,
        args=(
            kind,
            where,
            secret,
            config,
            named_shapes,
            engine_device,
            pushes,
            out,
            inbox,
            args.threads,
            profiled,
        ),
    )
    proc.start()
    rows = []
    try:
        sender = group.join(timeout_s=600) if group is not None else sender
        version = 0
        sender.push(trainer.named(), version)  # the first push: full (not timed)
        # the sender's stages (Reference.clock: delta_rule.StageClock); on a GPU each stage's end synchronizes
        # the device, which serializes what an ordinary push overlaps: only with --stages there
        sender._delta.clock.enabled = delta and (args.stages or args.device == "cpu")
        for step in range(1, steps + 1):
            row = {"step": step}
            trainer.step()  # each session pushes after an Adam step: the full pushes without delta as the rule's
            if delta or rule:
                version += 1
                profile = args.profile and delta and step == profiled_step and kind == "shm"
                row["delta" if delta else "rule"] = timed_push(sender, trainer, version, False, profile)
            if not rule:
                version += 1
                row["full"] = timed_push(sender, trainer, version, full=delta)
            rows.append(row)
        (got, times, table), want = answer(proc, out), trainer.digests()
        for r, (received, decoding) in zip(rows, times[1 :: 2 if delta else 1], strict=True):
            if delta or rule:  # the receiver's side of each step's delta (or rule) push
                r["delta" if delta else "rule"].update(receive_s=received, decode_s=decoding)
        if table is not None:
            print(f"--profile: the receiver's side of push v{profiled}\n{table}", flush=True)
        if got != want:
            raise AssertionError(f"{kind}: the engine's weights differ from the trainer's bf16 bits")
        if group is not None:  # the floor's broadcasts, on the same group, both sides
            sizes = [(r["delta"]["bytes"], args.repeats) for r in rows] if delta else []
            inbox.put(sizes)
            for r, (size, repeats) in zip(rows if delta else [], sizes, strict=True):
                flat = torch.empty(max(size, 1), dtype=torch.uint8)
                r["move_s"] = timed(
                    lambda f=flat[:size]: broadcast(group.group, f), torch.device("cpu"), repeats
                )
    finally:
        (group or sender).close()
        proc.join(timeout=600)
    return {
        "transport": kind,
        "delta": delta,
        "bucket_bytes": config.bucket_bytes,
        "num_buffers": config.num_buffers,
        "steps": rows,
    }


def timed_push(sender, trainer: Trainer, version: int, full: bool, profile: bool = False) -> dict:
    if trainer.params[0][1].is_cuda:
        torch.cuda.synchronize()
    # RAYSYNC_PROFILE_STACK=1: with Python's calls in the trace (benchmarks/host_share.py reads them)
    stacks = os.environ.get("RAYSYNC_PROFILE_STACK") == "1"
    profiler = torch.profiler.profile(with_stack=stacks) if profile else contextlib.nullcontext()
    with profiler:
        t0 = time.perf_counter()
        report = sender.push(trainer.named(), version, full=full)
        seconds = time.perf_counter() - t0
    if profile:  # the sender's side of the last delta push over shm, op by op (--profile)
        print(f"--profile: push v{version}, {seconds * 1e3:.1f} ms under the profiler")
        sort = _sort_by(trainer.params[0][1].device)
        print(profiler.key_averages().table(sort_by=sort, row_limit=30), flush=True)
        if os.environ.get(TRACE):
            profiler.export_chrome_trace(os.path.join(os.environ[TRACE], "sender.json"))
    stages = dict(sender._delta.clock.seconds) if sender._delta.clock.enabled else {}
    if stages:
        stages["rest"] = seconds - sum(stages.values())
    return {
        "seconds": seconds,
        "bytes": report.bytes,
        "density": report.density,
        "base": report.base_version,
        "why": report.why,
        "stages_s": stages,
    }


def _sort_by(device: torch.device) -> str:
    """The profile tables' order: GPU time on a GPU (RAYSYNC_PROFILE_HOST=1: host time, e.g. for the first delta
    push's one-time work), host time on the CPU."""
    host = device.type != "cuda" or os.environ.get("RAYSYNC_PROFILE_HOST") == "1"
    return "self_cpu_time_total" if host else "self_cuda_time_total"


def move_floor(kind: str, nbytes: int, device: torch.device, repeats: int) -> float:
    """Moving ``nbytes`` over a ring: cuda_ipc, two device copies; shm from a GPU, a copy into pinned host memory
    and one out of it at the same time on two streams (what a path pipelined by bucket is bound by: both
    directions busy, as the shm floor of docs/benchmarks.md, section 1); shm on the CPU, the two copies."""
    n = max(nbytes, 1)
    src, dst = (
        torch.empty(n, dtype=torch.uint8, device=device),
        torch.empty(n, dtype=torch.uint8, device=device),
    )
    if kind == "cuda_ipc":
        mid = torch.empty(n, dtype=torch.uint8, device=device)
    else:
        mid = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if kind == "shm" and device.type == "cuda":
        back = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # what the other direction reads
        d2h, h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)

        def both_at_once() -> None:
            with torch.cuda.stream(d2h):
                mid.copy_(src, non_blocking=True)
            with torch.cuda.stream(h2d):
                dst.copy_(back, non_blocking=True)

        return timed(both_at_once, device, repeats)
    return timed(lambda: (mid.copy_(src), dst.copy_(mid)), device, repeats)


def run(args) -> dict:
    device = torch.device(args.device)
    named_shapes = shapes(args.layout, args.layers)
    trainer = Trainer(named_shapes, device, args.lr, bf16=args.bf16_params, fused=args.fused_adam)
    nbytes = sum(2 * t.numel() for _, t in trainer.named())
    read_s = timed(trainer.read, device, args.repeats)
    count_s = timed(trainer.count, device, args.repeats)
    kinds = ["shm", "cuda_ipc"] if device.type == "cuda" else ["shm"]
    kinds += ["collective"] if args.collective and device.type == "cpu" else []
    kinds = [k for k in kinds if not args.transports or k in args.transports]
    results = []
    for kind in kinds:
        on = run_transport(kind, trainer, args, delta=True, steps=args.steps)
        free(device)
        off = run_transport(kind, trainer, args, delta=False, steps=args.steps)
        free(device)
        by_rule = run_transport(kind, trainer, args, delta=False, steps=args.steps, rule=True)
        free(device)
        full_off = statistics.median(r["full"]["seconds"] for r in off["steps"])
        for r in on["steps"]:
            if "move_s" not in r:
                r["move_s"] = move_floor(kind, r["delta"]["bytes"], device, args.repeats)
            r["floor_s"] = read_s + r.pop("move_s")
        results.append(
            {**on, "full_push_delta_off_s": full_off, "rule": [r["rule"] for r in by_rule["steps"]]}
        )
    return {
        "layout": args.layout,
        "layers": args.layers,
        "model_bytes_bf16": nbytes,
        "lr": args.lr,
        "pushed": "bf16 weights (read in place)" if args.bf16_params else "fp32 master, cast to bf16",
        "device": str(device),
        "hardware": hardware(device),
        "read_floor_s": read_s,
        "read_by_count_nonzero_s": count_s,
        "transports": results,
    }


def free(device: torch.device) -> None:
    """What the last session held (its ring, the sender's reference) goes before the next row."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def report(result: dict) -> None:
    print(
        f"{result['layout']} ({result['model_bytes_bf16'] / 1e6:.0f} MB in bf16), Adam lr {result['lr']}, "
        f"pushing the {result.get('pushed', 'fp32 master, cast to bf16')}, on {result['hardware']}; "
        f"floor = one read of what is pushed ({result['read_floor_s'] * 1e3:.1f} ms, a sum; "
        f"{result['read_by_count_nonzero_s'] * 1e3:.1f} ms by count_nonzero) + moving the delta's bytes"
    )
    head = f"{'transport':10}  {'step':>4}  {'density':>8}  {'delta MB':>8}  {'/ full':>7}  {'delta ms':>9}  "
    print(
        head + f"{'floor ms':>9}  {'x floor':>7}  {'full ms (on)':>12}  {'full ms (off)':>13}  {'x full':>6}"
    )
    for t in result["transports"]:
        off = t["full_push_delta_off_s"]
        for r in t["steps"]:
            d, f = r["delta"], r["full"]
            print(
                f"{t['transport']:10}  {r['step']:4}  {d['density']:8.2%}  {d['bytes'] / 1e6:8.2f}  "
                f"{d['bytes'] / result['model_bytes_bf16']:7.2%}  {d['seconds'] * 1e3:9.1f}  "
                f"{r['floor_s'] * 1e3:9.1f}  {d['seconds'] / r['floor_s']:7.1f}  {f['seconds'] * 1e3:12.1f}  "
                f"{off * 1e3:13.1f}  {d['seconds'] / off:6.2f}"
            )
    print(
        "\nwhere the sender's time went (ms, summed over buckets; rest: waiting for buffers, the receiver, control)"
    )
    for t in result["transports"]:
        for r in t["steps"]:
            for what in ("delta", "full"):
                stages = r[what]["stages_s"]
                line = "  ".join(f"{k} {v * 1e3:.1f}" for k, v in stages.items())
                print(f"{t['transport']:10}  {r['step']:4}  {what + ' push':10}  {line}")
            if "decode_s" in r["delta"]:
                d = r["delta"]
                print(
                    f"{t['transport']:10}  {r['step']:4}  {'receiver':10}  receive {d['receive_s'] * 1e3:.1f}  "
                    f"in delta.decode {d['decode_s'] * 1e3:.1f} (its syncs included)"
                )
    print("\nthe time rule (delta_by_time, its own session): what each push sent and why")
    for t in result["transports"]:
        for step, r in enumerate(t["rule"], 1):
            sent = "full" if r["base"] is None else "delta"
            print(f"{t['transport']:10}  {step:4}  {sent:5}  {r['seconds'] * 1e3:9.1f} ms  {r['why']}")


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="qwen2.5-7b" if cuda else "qwen2.5-0.5b", choices=sorted(LAYOUTS))
    p.add_argument("--layers", type=int, default=None, help="decoder layers kept (default: all)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--steps", type=int, default=3, help="Adam steps, one delta push each")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--repeats", type=int, default=3, help="for the floors (medians)")
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads, both processes")
    p.add_argument("--no-collective", dest="collective", action="store_false", help="CPU: no gloo rows")
    p.add_argument("--transports", nargs="+", default=None, help="only these (shm, cuda_ipc, collective)")
    p.add_argument("--shm-mib", type=int, default=None, help="shm bucket_bytes (default: 8 CPU, 512 GPU)")
    p.add_argument("--ipc-mib", type=int, default=2048, help="cuda_ipc ring bucket_bytes (one GPU)")
    p.add_argument("--gloo-mib", type=int, default=64, help="collective bucket_bytes")
    p.add_argument("--buffers", type=int, default=2, help="num_buffers: the ring's buffers")
    p.add_argument(
        "--bf16-params", action="store_true", help="push bf16 weights cast from the master (in place)"
    )
    p.add_argument(
        "--fused-adam", action="store_true", help="torch's fused Adam: no step temporaries (GPU memory)"
    )
    p.add_argument(
        "--stages",
        action="store_true",
        help="GPU: time the sender's stages (each one's end synchronizes the device: slower pushes)",
    )
    p.add_argument(
        "--profile", action="store_true", help="print torch.profiler's table of the last delta push over shm"
    )
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="with --profile: this step's delta push (default: the last)",
    )
    p.add_argument(
        "--trace",
        default=None,
        help="with --profile: write both sides' timelines (chrome traces) into this folder",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.profile_step is not None and not 1 <= args.profile_step <= args.steps:
        p.error(f"--profile-step {args.profile_step}: the steps are 1 to --steps ({args.steps})")
    if args.trace:
        os.environ[TRACE] = args.trace  # the engine's process inherits it
    if args.threads:
        torch.set_num_threads(args.threads)
    shm = args.shm_mib or (512 if args.device.startswith("cuda") else 8)
    args.bucket_mib = {"shm": shm, "cuda_ipc": args.ipc_mib, "collective": args.gloo_mib}
    result = run(args)
    report(result)
    emit(result, args.json)


if __name__ == "__main__":
    main()
