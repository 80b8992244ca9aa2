"""Experiment: one Triton launch that copies a whole model's tensors (a table of source and destination
addresses), against torch's copies (one launch per tensor) and raysync's CopyList (raysync.core.copies), on
one CUDA device: what direct mode's receiver does when it copies every tensor of the trainer's model into the
engine's.

    python benchmarks/bench_grouped_copy.py [--layout qwen2.5-7b qwen2.5-1.5b] [--repeats 20] [--json o.json]
    python benchmarks/bench_grouped_copy.py --configs 256:16:8,64:16:4:stream   # other Triton configs
    python benchmarks/bench_grouped_copy.py --check-cpu   # correctness only, on the CPU, Triton interpreted

Per layout (raysync.tools.models.allocate, bf16, src filled with random bits, dst of the same shapes), the
rows, each the median ms of --repeats after warm-up (benchmarks/common.py's timed_cuda) and GB/s of read +
write traffic (2 x bytes / time):
  * one memcpy of the same bytes: one contiguous uint8 buffer's copy_ (the floor);
  * torch, one copy_ per tensor;
  * torch._foreach_copy_ of every tensor (one call; torch launches its multi-tensor kernel a few times);
  * CopyList (raysync's default): the grouped kernel's pairs in one launch, the others as below;
  * CopyList without the grouped kernel: small copies fused, large ones one by one, a CUDA graph where it
    chooses; and forced into a CUDA graph (copies.GRAPH_BELOW_MEAN_BYTES patched high while it is built);
  * Triton grouped copy, one launch, per config (chunk bytes per program, block bytes per loop step, warps).
Every row is checked: dst zeroed, the method run once, every tensor's bits equal to src's (torch.equal of the
bytes). A wrong row is marked WRONG and the script exits 1 after the table.

The kernel is raysync's (raysync.core.grouped_copy: its design, and this script's figures that chose it, in
Note [grouped copy]; CopyList launches it with 16 KB a program and 8 warps). The configs vary what a program
copies, and two variants the kernel keeps as flags: "every block masked" asks whether the unmasked path still
matters once the mask keeps vectors; "stream" loads with eviction_policy="evict_first" and stores with
cache_modifier=".cs" (data read and written once: L2 need not keep it). "CopyList without the grouped kernel"
is built with RAYSYNC_GROUPED_COPY=0: the list as it was before the kernel, but for its fused copies, which now
run on integer views (Note [bit-exact copies] in raysync.core.copies: they were WRONG here before).
The launch's PTX is looked at on the GPU too: each Triton row says which global loads and stores it compiled
to (expect ld.global.v4.b32 / st.global.v4.b32; the ld.global.b64 are the table's). A Triton row's time
includes its launch from Python (tens of microseconds), as a torch row's includes its launches.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from common import emit, timed_cuda

from raysync.core import copies, grouped_copy
from raysync.core.copies import CopyList
from raysync.core.grouped_copy import eligible
from raysync.tools.models import allocate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# Triton for its interpreter, apart from the venv (ci/test.sh installs it; tests/test_delta_kernels.py too)
APART = Path(os.environ.get("RAYSYNC_TRITON_PATH", ROOT / ".venv" / "triton-interpreter"))
Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source), as CopyList takes them


@dataclass(frozen=True)
class Config:
    chunk_kb: int  # bytes per program (a tensor's last chunk: what is left)
    block_kb: int  # bytes per loop step of a program
    warps: int
    stream: bool = False
    masked: bool = False  # every block masked (no unmasked path)

    @classmethod
    def parse(cls, text: str) -> Config:
        """CHUNK_KB:BLOCK_KB:WARPS[:stream][:masked], e.g. 256:16:8 or 64:16:4:stream."""
        chunk, block, warps, *flags = text.split(":")
        unknown = set(flags) - {"stream", "masked"}
        if unknown:
            raise ValueError(f"config {text!r}: unknown flags {sorted(unknown)}")
        return cls(int(chunk), int(block), int(warps), "stream" in flags, "masked" in flags)

    @property
    def name(self) -> str:
        flags = [f for f, on in (("stream", self.stream), ("every block masked", self.masked)) if on]
        what = [f"chunk {self.chunk_kb} KB", f"block {self.block_kb} KB", f"{self.warps} warps", *flags]
        return "Triton grouped copy, one launch: " + ", ".join(what)


DEFAULT_CONFIGS = [
    Config(64, 16, 4),
    Config(64, 16, 8),
    Config(256, 16, 4),
    Config(256, 16, 8),
    Config(1024, 16, 4),
    Config(1024, 16, 8),
    Config(16, 16, 8),  # one block per program: no loop
    Config(256, 32, 8),
    Config(256, 16, 8, stream=True),
    Config(256, 16, 8, masked=True),
]
# small ones for Triton's interpreter: several programs per tensor, several blocks per program, partial
# blocks and chunks (qwen2-tiny's tensors are 256 B to 128 KB)
CPU_CONFIGS = [
    Config(4, 1, 4),
    Config(3, 1, 2),
    Config(1, 1, 1),
    Config(4, 1, 4, masked=True),
    Config(4, 1, 4, stream=True),
]


class GroupedCopy:
    """``pairs`` ((destination, source), as CopyList takes them) copied by one launch of raysync's kernel with
    ``config``, its table made here once; the pairs the kernel cannot take (``fallback``) by torch's copy_
    after it."""

    def __init__(self, pairs: Pairs, config: Config):
        assert (config.chunk_kb % config.block_kb) == 0, "whole blocks per chunk"
        self.config = config
        self.fallback = [(d, s) for d, s in pairs if not eligible(d, s)]
        self.table = grouped_copy.table([(d, s) for d, s in pairs if eligible(d, s)], config.chunk_kb << 10)
        self.programs = 0 if self.table is None else self.table.shape[0]
        self.ptx: str | None = None

    def run(self) -> None:
        if self.programs:
            c = self.config
            compiled = grouped_copy.launch(self.table, c.block_kb << 10, c.warps, c.masked, c.stream)
            if self.ptx is None:  # what it compiled to (a CompiledKernel on a GPU; the interpreter: none)
                self.ptx = getattr(compiled, "asm", {}).get("ptx", "")
        for d, s in self.fallback:
            d.copy_(s)

    def global_accesses(self) -> str:
        """The global loads and stores in the launch's PTX, e.g. 'ld.global.b64 ld.global.v4.b32 st...'."""
        if not self.ptx:
            return "-"
        return " ".join(sorted(set(re.findall(r"\b(?:ld|st)\.global[\w.:]*", self.ptx))))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def same(pairs: Pairs) -> bool:
    return all(torch.equal(_bits(d), _bits(s)) for d, s in pairs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def without_kernel(pairs: Pairs, graph_always: bool = False) -> CopyList:
    """A CopyList built with RAYSYNC_GROUPED_COPY=0 (the list before the grouped kernel); ``graph_always``: it
    captures a CUDA graph whatever its large copies' sizes (copies.GRAPH_BELOW_MEAN_BYTES patched high)."""
    before = copies.GRAPH_BELOW_MEAN_BYTES, os.environ.get("RAYSYNC_GROUPED_COPY")
    os.environ["RAYSYNC_GROUPED_COPY"] = "0"
    if graph_always:
        copies.GRAPH_BELOW_MEAN_BYTES = 1 << 62
    try:
        return CopyList(pairs)
    finally:
        copies.GRAPH_BELOW_MEAN_BYTES = before[0]
        if before[1] is None:
            del os.environ["RAYSYNC_GROUPED_COPY"]
        else:
            os.environ["RAYSYNC_GROUPED_COPY"] = before[1]


@dataclass
class Method:
    name: str
    make: Callable[[], tuple[Callable[[], None], Pairs]]  # set-up: the copy, and what must be equal after it
    warm: int = 1
    note: Callable[[], str] = lambda: ""


def methods(pairs: Pairs, configs: list[Config], floor: bool) -> Iterator[Method]:
    """The rows, in order (each made when it is reached, and let go after it); ``floor``: with the one-buffer
    memcpy (it allocates the model's bytes twice more, while its row runs)."""
    dsts, srcs = [d for d, _ in pairs], [s for _, s in pairs]
    if floor:

        def one_buffer() -> tuple[Callable[[], None], Pairs]:
            total = sum(d.nbytes for d in dsts)
            flat_src = torch.empty(total, dtype=torch.uint8, device=dsts[0].device).random_(0, 256)
            flat_dst = torch.empty_like(flat_src)
            return (lambda: flat_dst.copy_(flat_src)), [(flat_dst, flat_src)]

        yield Method("one memcpy of the same bytes", one_buffer)

    def each() -> None:
        for d, s in pairs:
            d.copy_(s)

    yield Method("torch, one copy_ per tensor", lambda: (each, pairs))
    yield Method(
        "torch._foreach_copy_ of every tensor", lambda: ((lambda: torch._foreach_copy_(dsts, srcs)), pairs)
    )
    lists = (
        ("CopyList (raysync's default)", CopyList),
        ("CopyList without the grouped kernel", without_kernel),
        (
            "CopyList without the grouped kernel, forced into a CUDA graph",
            partial(without_kernel, graph_always=True),
        ),
    )
    for name, build in lists:
        made = build(pairs)
        yield Method(
            name,
            lambda made=made: (made.run, pairs),
            warm=3,  # its graph (where it makes one) is captured after its second run
            note=lambda made=made: ", ".join(
                [f"{g.programs} programs in one launch" for g in made._grouped]
                + ["graph" if made.graph_captured else "no graph"]
            ),
        )
    for config in configs:
        grouped = GroupedCopy(pairs, config)
        yield Method(
            config.name,
            lambda grouped=grouped: (grouped.run, pairs),
            warm=2,  # the first compiles
            note=lambda g=grouped: (
                f"{g.programs} programs, {len(g.fallback)} by torch; PTX: {g.global_accesses()}"
            ),
        )


def run_methods(pairs: Pairs, configs: list[Config], repeats: int | None, floor: bool) -> list[dict]:
    """Each method set up, warmed, checked (dst zeroed, one run, bits compared), timed given ``repeats``."""
    device = pairs[0][0].device
    nbytes = sum(d.nbytes for d, _ in pairs)
    rows = []
    for m in methods(pairs, configs, floor):
        fn, check = m.make()
        for _ in range(m.warm):
            fn()
        for d, _ in check:
            d.zero_()
        fn()
        sync(device)
        row = {"name": m.name, "ok": same(check), "note": m.note()}
        if repeats:
            seconds = timed_cuda(fn, repeats)
            row.update(ms=seconds * 1e3, gbps=2 * nbytes / seconds / 1e9)
        rows.append(row)
        print(_line(row), flush=True)
        del fn, check
    return rows


def _line(row: dict) -> str:
    timing = f"{row['ms']:9.3f} ms {row['gbps']:8.0f} GB/s" if "ms" in row else ""
    check = "ok" if row["ok"] else "WRONG"
    return f"  {row['name']:<96} {timing} {check:>5}  {row['note']}"


def fill_random(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        _bits(t).random_(0, 256)


def bench_layout(layout: str, configs: list[Config], repeats: int, floor: bool) -> dict:
    src = allocate(layout, dtype=torch.bfloat16, device="cuda")
    # random bits: a copy from the wrong place shows (allocate fills each tensor with one value)
    fill_random(list(src.values()))
    dst = {name: torch.empty_like(t) for name, t in src.items()}
    pairs = [(dst[name], src[name]) for name in src]
    nbytes = sum(t.nbytes for t in src.values())
    fallback = [name for name in src if not eligible(dst[name], src[name])]
    print(
        f"{layout}: {len(pairs)} tensors, {nbytes / 1e9:.2f} GB, copied by torch in the Triton rows:",
        fallback,
    )
    rows = run_methods(pairs, configs, repeats, floor)
    count = len(pairs)
    del src, dst, pairs
    torch.cuda.empty_cache()
    return {"tensors": count, "bytes": nbytes, "fallback": fallback, "rows": rows}


def check_cpu() -> int:
    """Every method on CPU tensors (qwen2-tiny and a few edge tensors), the Triton kernel through Triton's
    interpreter (this file run again in a child process with TRITON_INTERPRET=1 where it is not already)."""
    if os.environ.get("TRITON_INTERPRET") != "1" or grouped_copy.triton is None:
        path = [str(ROOT), *filter(None, sys.path), str(APART)]  # a venv's own Triton first, if it has one
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    torch.manual_seed(0)
    src = allocate("qwen2-tiny", dtype=torch.bfloat16, device="cpu")
    wide = torch.empty(4097, dtype=torch.bfloat16)
    src.update(
        {
            "edge.odd_bytes": torch.empty(1001, dtype=torch.bfloat16),  # 2002 bytes: torch copies it
            "edge.misaligned": wide[1:],  # 2 bytes past an aligned address: torch copies it
            "edge.empty": torch.empty(0, dtype=torch.bfloat16),
            "edge.one_word": torch.empty(8, dtype=torch.bfloat16),
            "edge.block_and_a_word": torch.empty(520, dtype=torch.bfloat16),  # 1 KB + 16 B
            "edge.chunk_and_a_word": torch.empty(3 * 512 + 8, dtype=torch.bfloat16),  # 3 KB + 16 B
            "edge.fp32": torch.empty(64, 3, dtype=torch.float32),
        }
    )
    fill_random(list(src.values()))
    dst = {name: torch.empty_like(t) for name, t in src.items()}
    dst["edge.misaligned"] = torch.empty(4097, dtype=torch.bfloat16)[1:]
    pairs = [(dst[name], src[name]) for name in src]
    fallback = [name for name in src if not eligible(dst[name], src[name])]
    assert fallback == ["edge.odd_bytes", "edge.misaligned"], fallback
    print(f"qwen2-tiny + edges on the CPU, Triton interpreted: {len(pairs)} tensors, by torch: {fallback}")
    rows = run_methods(pairs, CPU_CONFIGS + DEFAULT_CONFIGS, None, floor=True)
    return 0 if all(r["ok"] for r in rows) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", nargs="+", default=["qwen2.5-7b", "qwen2.5-1.5b"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--configs",
        type=lambda text: [Config.parse(c) for c in text.split(",")],
        default=DEFAULT_CONFIGS,
        help="Triton configs, CHUNK_KB:BLOCK_KB:WARPS[:stream][:masked], comma-separated",
    )
    p.add_argument(
        "--no-floor", action="store_true", help="skip the one-buffer memcpy (2 x the model's bytes)"
    )
    p.add_argument(
        "--check-cpu", action="store_true", help="correctness only, CPU tensors, Triton's interpreter"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.check_cpu:
        return check_cpu()
    assert grouped_copy.triton is not None, "Triton is not installed (torch's CUDA builds bring it)"
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": grouped_copy.triton.__version__,
        "repeats": args.repeats,
        "layouts": {},
    }
    for layout in args.layout:
        result["layouts"][layout] = bench_layout(layout, args.configs, args.repeats, not args.no_floor)
    emit(result, args.json)
    wrong = [r["name"] for v in result["layouts"].values() for r in v["rows"] if not r["ok"]]
    if wrong:
        print(f"WRONG: {wrong}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
