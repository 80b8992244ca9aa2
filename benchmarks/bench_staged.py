"""Benchmark: staged pushes with a flip (issue 18) while an engine generates: how long generation stops per
update, next to the one-copy floor measured in the same run, and how much the transfer slows generation.

    python benchmarks/bench_staged.py                    # GPU: Qwen2.5-7B's layout over cuda_ipc, then shm
    python benchmarks/bench_staged.py --device cpu       # CPU (the default without a GPU): 0.5B, 2 layers, shm
    python benchmarks/bench_staged.py --json out.json
    python benchmarks/bench_staged.py --staging-memory host   # staged in pinned host memory, not on the GPU

A trainer process (spawned, torch + pyzmq + msgpack only: no Ray) pushes the tensors of --layout (allocated on
its device, filled with the version's number, so every push is checked bit-exact) to the engine in this
process, once per transport of --transports. The engine's live weights are on --device; its generation loop
(a thread with its own CUDA stream) runs steps of matmuls over every decoder layer's matrices and (--head, the default
on cuda) the vocabulary matrix, each step synchronized and timed: a stand-in for a decode step, which reads
every weight once.

* in place: ``receive(into=live)``, the loop stopped (the bytes land in the live weights as they arrive, so no
  step may run): generation stops for the whole transfer.
* staged: ``receive(into=live, flip=False)`` while the loop runs; the loop calls ``flip()`` between its steps
  and makes the version live there. Generation stops for the flip: ``stall`` is the time from the end of the
  last step on the old weights to the start of the first step on the new ones (the flip's own copies,
  synchronized, are ``flip``). ``slowdown`` is 1 - (steps per second while the push streams) / (steps per
  second with no push), from the steps that ended inside the transfer.
* floor: one copy of the push's bytes as a single flat tensor (``copy_``) on --device, in this process.
  With ``--staging-memory host`` on cuda (the staging memory in pinned host memory, so the flip copies host ->
  device) also ``floor h2d``: one copy of those bytes from a pinned host tensor to the GPU; stall/floor is then
  taken against it. The default, ``device``, stages on --device as before.

Times are medians of --repeats (after one warm-up push of each kind: the ring, the staging memory and the
flip's copies are made then). Prints a table, then JSON (also written to --json).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import platform
import statistics
import threading
import time

import torch
from common import emit, timed

from raysync import SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.tools.models import LAYOUTS

MiB = 1 << 20
RING_MB = {("cuda", "cuda_ipc"): 2048, ("cuda", "shm"): 512, ("cpu", "shm"): 64}  # the plan's rings, on GPU


def tensors_of(layout: str, layers: int | None, device: torch.device) -> dict[str, torch.Tensor]:
    """The layout's tensors (the first ``layers`` decoder layers, all when None) as zeroed bf16 tensors."""
    keep = [
        (n, s)
        for n, s in LAYOUTS[layout].named_shapes()
        if layers is None or not n.startswith("model.layers.") or int(n.split(".")[2]) < layers
    ]
    return {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in keep}


def trainer(secret, config, layout: str, layers: int | None, device: str, threads: int, go, out) -> None:
    """The sender process: fills its tensors with the version asked for (None: stop), pushes them."""
    torch.set_num_threads(threads)
    tensors = tensors_of(layout, layers, torch.device(device))
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        while (version := go.get(timeout=600)) is not None:
            for t in tensors.values():
                t.fill_(version)  # small integers are exact in bf16
            sender.push(tensors.items(), version)
            out.put(version)


class Generation(threading.Thread):
    """The engine's loop: ``flip()`` at each step boundary, then one step of matmuls over the live weights."""

    def __init__(self, receiver: WeightReceiver, live: dict[str, torch.Tensor], batch: int, head: bool):
        super().__init__(daemon=True)
        self.receiver, self.live, self.head = receiver, live, head
        self.device = next(iter(live.values())).device
        h = live["model.embed_tokens.weight"].shape[1]
        self.x = torch.randn(batch, h, dtype=torch.bfloat16, device=self.device) * 0.01
        self.layers = sorted({n.split(".")[2] for n in live if n.startswith("model.layers.")}, key=int)
        self.steps: list[tuple[float, float]] = []  # (start, end) of each step
        self.flips: list[dict] = []
        self.stop, self.flipped = threading.Event(), threading.Condition()
        self.error: BaseException | None = None

    def step(self) -> None:
        w, x = self.live, self.x
        for i in self.layers:
            p = f"model.layers.{i}."
            a = x @ w[p + "self_attn.q_proj.weight"].T
            (x @ w[p + "self_attn.k_proj.weight"].T, x @ w[p + "self_attn.v_proj.weight"].T)
            o = a @ w[p + "self_attn.o_proj.weight"].T
            g, u = o @ w[p + "mlp.gate_proj.weight"].T, o @ w[p + "mlp.up_proj.weight"].T
            x = torch.tanh((g * u) @ w[p + "mlp.down_proj.weight"].T)
        if self.head:
            x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def run(self) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while not self.stop.is_set():
                    boundary = time.perf_counter()
                    flip = self.receiver.flip()
                    start = time.perf_counter()
                    if flip is not None:
                        last_end = self.steps[-1][1] if self.steps else boundary
                        with self.flipped:
                            self.flips.append(
                                {"version": flip.version, "flip_s": flip.seconds, "stall_s": start - last_end}
                            )
                            self.flipped.notify_all()
                    self.step()
                    self.steps.append((start, time.perf_counter()))
        except BaseException as e:
            self.error = e
            with self.flipped:
                self.flipped.notify_all()

    def wait_flip(self, version: int, timeout_s: float = 600) -> dict:
        with self.flipped:
            done = lambda: self.error is not None or any(f["version"] == version for f in self.flips)  # noqa: E731
            if not self.flipped.wait_for(done, timeout_s) or self.error is not None:
                raise RuntimeError(f"the generation loop did not flip version {version}") from self.error
            return next(f for f in self.flips if f["version"] == version)

    def rate(self, start: float, end: float) -> float:
        """Steps per second over the steps that ended in [start, end]."""
        ended = [s for s in self.steps if start <= s[1] <= end]
        return len(ended) / (end - start) if ended else 0.0


class Run:
    """One transport: the trainer process, the receiver, the engine's live weights."""

    def __init__(self, args, transport: str, device: torch.device):
        ring = args.bucket_mb or RING_MB[(device.type, transport)]
        self.config = SyncConfig(
            transport=transport, bucket_bytes=ring * MiB, num_buffers=2, timeout_s=300, progress=False
        )
        self.args, self.device, self.version = args, device, 0
        self.live = tensors_of(args.layout, args.layers, device)
        ctx = mp.get_context("spawn")
        self.go, self.out, secret = ctx.Queue(), ctx.Queue(), SessionSecret.generate()
        self.child = ctx.Process(
            target=trainer,
            args=(
                secret,
                self.config,
                args.layout,
                args.layers,
                str(device),
                args.threads,
                self.go,
                self.out,
            ),
        )
        self.child.start()
        self.receiver = WeightReceiver(self.out.get(timeout=300), secret, self.config)

    def _push(self) -> int:
        self.version += 1
        self.go.put(self.version)
        return self.version

    def _check(self, version: int) -> None:
        assert self.out.get(timeout=600) == version
        bad = [n for n, t in self.live.items() if not bool((t == version).all())]
        assert not bad and self.receiver.version == version, f"version {version}: {bad[:3]} differ"

    def in_place(self) -> dict:
        version = self._push()
        report = self.receiver.receive(into=self.live)
        self._check(version)
        return {"transfer_s": report.seconds, "stall_s": report.seconds}

    def staged(self, gen: Generation) -> dict:
        version = self._push()
        started = time.perf_counter()
        report = self.receiver.receive(into=self.live, flip=False, staging_memory=self.args.staging_memory)
        ended = time.perf_counter()
        flip = gen.wait_flip(version)
        self._check(version)
        return {
            "transfer_s": report.seconds,
            "stall_s": flip["stall_s"],
            "flip_s": flip["flip_s"],
            "steps_per_s": gen.rate(started, ended),
        }

    def measure(self) -> dict:
        self.in_place()  # warm-up: the session and the ring
        in_place = [self.in_place() for _ in range(self.args.repeats)]
        gen = Generation(self.receiver, self.live, self.args.batch, self.args.head)
        gen.start()
        try:
            self.staged(gen)  # warm-up: the staging memory and the flip's copies
            idle_from = time.perf_counter()
            time.sleep(self.args.idle_s)  # the loop runs alone: its rate with no push
            idle = gen.rate(idle_from, time.perf_counter())
            staged = [self.staged(gen) for _ in range(self.args.repeats)]
        finally:
            gen.stop.set()
            gen.join(timeout=60)
        for row in staged:
            row["slowdown"] = 1 - row["steps_per_s"] / idle if idle else float("nan")
        step_s = statistics.median(e - s for s, e in gen.steps)
        return {
            "in place": in_place,
            "staged": staged,
            "idle_steps_per_s": idle,
            "step_s": step_s,
            "staging": self.receiver.staging,
        }

    def close(self) -> None:
        self.receiver.close()
        self.go.put(None)
        self.child.join(timeout=120)
        if self.child.is_alive():
            self.child.kill()


def floor_s(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return timed(lambda: dst.copy_(src), device, max(repeats, 5))


def h2d_floor_s(nbytes: int, device: torch.device, repeats: int) -> float:
    """One copy of ``nbytes`` from pinned host memory to ``device`` (what a host-staged flip moves)."""
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return timed(lambda: dst.copy_(src, non_blocking=True), device, max(repeats, 5))


def median_of(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    p.add_argument(
        "--layout",
        default=None,
        choices=sorted(LAYOUTS),
        help="default: qwen2.5-7b on cuda, qwen2.5-0.5b on cpu",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers pushed (default: all on cuda, 2 on cpu)"
    )
    p.add_argument("--transports", nargs="+", default=None, help="default: cuda_ipc shm on cuda, shm on cpu")
    p.add_argument(
        "--bucket-mb", type=int, default=None, help="ring buffer size (default: the plan's, per path)"
    )
    p.add_argument("--batch", type=int, default=8, help="rows of the generation loop's activations")
    p.add_argument(
        "--head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the step also multiplies by the vocabulary matrix (default: on cuda only)",
    )
    p.add_argument(
        "--staging-memory",
        default="device",
        choices=["device", "host", "auto"],
        help="where a staged push lands (receive(staging_memory=)): on --device (default), pinned host memory, "
        "or auto (the device when it has room)",
    )
    p.add_argument("--idle-s", type=float, default=1.0, help="the loop alone, for its rate with no push")
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads per process")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    args.layout = args.layout or ("qwen2.5-7b" if cuda else "qwen2.5-0.5b")
    args.layers = args.layers if args.layers is not None or cuda else 2
    args.head = cuda if args.head is None else args.head
    transports = args.transports or (["cuda_ipc", "shm"] if cuda else ["shm"])
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    rows: dict[str, dict] = {}
    for transport in transports:
        run = Run(args, transport, device)
        try:
            rows[transport] = run.measure()
        finally:
            run.close()
        nbytes, tensors = sum(t.nbytes for t in run.live.values()), len(run.live)
        del run
    floor = floor_s(nbytes, device, args.repeats)
    host = cuda and any(r["staging"].memory != "device" for r in rows.values())
    h2d = h2d_floor_s(nbytes, device, args.repeats) if host else None
    hardware = (
        torch.cuda.get_device_name(device)
        if cuda
        else f"{platform.processor() or platform.machine()}, {args.threads} thread(s) per process"
    )
    result = {
        "layout": args.layout,
        "layers": args.layers,
        "tensors": tensors,
        "push_bytes": nbytes,
        "device": str(device),
        "hardware": f"{hardware}, torch {torch.__version__}",
        "batch": args.batch,
        "head": args.head,
        "floor_s": floor,
        "floor_h2d_s": h2d,
        "staging_memory": args.staging_memory,
        "transports": {
            t: {
                "in place": median_of(r["in place"]),
                "staged": median_of(r["staged"]),
                "idle_steps_per_s": r["idle_steps_per_s"],
                "step_s": r["step_s"],
                "staging": {
                    "mode": r["staging"].mode,
                    "nbytes": r["staging"].nbytes,
                    "why": r["staging"].why,
                    "memory": r["staging"].memory,
                    "memory_why": r["staging"].memory_why,
                },
                "runs": {"in place": r["in place"], "staged": r["staged"]},
            }
            for t, r in rows.items()
        },
    }
    layers = "all" if args.layers is None else args.layers
    print(
        f"{nbytes / 1e6:.0f} MB: {args.layout}, {layers} layers, {tensors} bf16 tensors on {device}; {result['hardware']}; "
        f"a generation step {statistics.median(r['step_s'] for r in rows.values()) * 1e3:.2f} ms (batch {args.batch}); medians of {args.repeats}"
    )
    print(
        f"{'transport':9}  {'mode':8}  {'transfer ms':>11}  {'stall ms':>9}  {'flip ms':>8}  {'stall/floor':>11}  {'slowdown':>8}"
    )
    for t, r in result["transports"].items():
        for mode in ("in place", "staged"):
            m = r[mode]
            flip = f"{m['flip_s'] * 1e3:8.2f}" if "flip_s" in m else f"{'':8}"
            slow = f"{m['slowdown'] * 100:7.1f}%" if "slowdown" in m else f"{'(stopped)':>8}"
            host_flip = mode == "staged" and h2d is not None and r["staging"]["memory"] != "device"
            ref = h2d if host_flip else floor  # a flip from host memory, against a copy from host memory
            print(
                f"{t:9}  {mode:8}  {m['transfer_s'] * 1e3:11.1f}  {m['stall_s'] * 1e3:9.2f}  {flip}  "
                f"{m['stall_s'] / ref:11.2f}  {slow}"
            )
    print(
        f"{'floor':9}  {'':8}  {'':11}  {floor * 1e3:9.2f}  {'':8}  {1:11.2f}            one copy of {nbytes / 1e6:.0f} MB"
    )
    if h2d is not None:
        print(
            f"{'floor h2d':9}  {'':8}  {'':11}  {h2d * 1e3:9.2f}  {'':8}  {1:11.2f}            "
            f"pinned host -> {device}, {nbytes / 1e6:.0f} MB"
        )
    for t, r in result["transports"].items():
        print(f"{t}: staging memory {r['staging']['memory']} ({r['staging']['memory_why']})")
    emit(result, args.json)


if __name__ == "__main__":
    main()
