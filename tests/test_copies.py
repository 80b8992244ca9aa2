"""CopyList (raysync.core.copies) gives every destination its source's bits, NaN payloads and signs included
(Note [bit-exact copies]), and the grouped kernel (raysync.core.grouped_copy, Note [grouped copy]) copies the
pairs it takes bit for bit, nothing past them: on a GPU compiled, and wherever Triton imports through its
interpreter on the CPU (a child process: the interpreter is chosen at import)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import random_tensor, same_bits

from raysync.core import grouped_copy
from raysync.core.copies import FUSE_BELOW_BYTES, CopyList

HERE = Path(__file__).parent
# Triton for its interpreter: installed apart from the venv by ci/test.sh (tests/test_delta_kernels.py says why),
# or importable already (CUDA builds of torch bring it)
APART = Path(os.environ.get("RAYSYNC_TRITON_PATH", HERE.parent / ".venv" / "triton-interpreter"))
TRITON = importlib.util.find_spec("triton") is not None or (APART / "triton").is_dir()
CUDA_TRITON = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
CHUNK = grouped_copy.CHUNK_BYTES

# bit patterns a float conversion does not keep: NaNs with payloads (quiet and signalling), negative NaNs,
# infinities, denormals (smallest and largest, both signs), signed zeros
SPECIAL = {
    torch.bfloat16: (16, [0x7FC1, 0x7F81, 0xFFC0, 0xFFFF, 0xFF81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0, 0x8000]),
    torch.float16: (16, [0x7E01, 0x7C01, 0xFE00, 0xFFFF, 0xFC01, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0, 0x8000]),
    torch.float32: (
        32,
        [0x7FC00001, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0xFF800001, 0x7F800000, 0xFF800000, 1, 0x807FFFFF, 0]
        + [0x80000000],
    ),
}


INTS = {2: torch.int16, 4: torch.int32}


def special(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` on the CPU, with SPECIAL's patterns spread over it and at its end."""
    t = random_tensor(dtype, shape, torch.Generator().manual_seed(seed)).clone()
    if dtype in SPECIAL:
        width, patterns = SPECIAL[dtype]
        ints = t.view(-1).view(INTS[width // 8])
        signed = torch.tensor(
            [p - (1 << width) if p >> (width - 1) else p for p in patterns], dtype=ints.dtype
        )
        n = ints.numel()
        spread = torch.arange(0, n, max(1, n // 64))
        ints[spread] = signed.repeat(len(spread) // len(signed) + 1)[: len(spread)]
        ints[-min(n, len(signed)) :] = signed[: min(n, len(signed))]
    return t


def differ(d: torch.Tensor, s: torch.Tensor) -> str:
    """Where ``d``'s bytes first differ from ``s``'s, for a message."""
    a, b = (t.contiguous().reshape(-1).view(torch.uint8).cpu() for t in (d, s))
    at = int((a != b).nonzero()[0]) if a.shape == b.shape and (a != b).any() else 0
    return f"byte {at} of {a.numel()}: {a[at : at + 8].tolist()} != {b[at : at + 8].tolist()}"


def special_pairs(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs of bf16, fp16 and fp32 holding SPECIAL's patterns: on a GPU, small ones the
    grouped kernel takes, and small ones fused (odd sizes, strided, one element past an aligned address),
    large ones (over FUSE_BELOW_BYTES) the kernel takes, and large ones each a copy_ (misaligned)."""
    pairs = []
    for i, dtype in enumerate(SPECIAL):
        large = FUSE_BELOW_BYTES // dtype.itemsize + 4096
        for j, (n, skew, strided) in enumerate(
            [(1000, 0, False), (1001, 0, False), (1200, 0, True), (1000, 1, False), (large, 0, False)]
            + [(large, 1, False)]
        ):
            src = special(dtype, (n + skew,), seed=10 * i + j).to(device)[skew:]
            dst = torch.zeros(n + skew, dtype=dtype, device=device)[skew:]
            if strided:  # a (30, 40) transpose of each: not contiguous
                src, dst = src.view(40, 30).t(), dst.view(40, 30).t()
            pairs.append((dst, src))
    return pairs


def special_values_survive(device: str) -> list[CopyList]:
    """The pairs of ``special_pairs`` copied by CopyLists: one of every pair, and one per dtype (torch's fused
    copy takes its fast path, the one that converted, only for a list of one dtype), with and without a CUDA
    graph, three runs each (a graph is captured at the second run, replayed at the third), the sources' bits
    changed before each run: each destination's bits are its source's. The lists, for the caller to look into."""
    pairs = special_pairs(device)
    made = []
    for graph in (True, False):
        for dtype in (None, *SPECIAL):
            some = [(d, s) for d, s in pairs if dtype in (None, s.dtype)]
            copies = CopyList(some, graph)
            for run in range(3):
                for d, s in some:
                    d.zero_()
                    s.view(INTS[s.element_size()]).add_(run)  # other bits each run: what the sources hold now
                copies.run()
                if device == "cuda":
                    torch.cuda.current_stream().synchronize()
                for k, (d, s) in enumerate(some):
                    where = f"graph={graph} list of {dtype or 'all'} run {run} pair {k} ({s.dtype})"
                    assert same_bits(d, s), f"{where}: {differ(d, s)}"
            made.append(copies)
    return made


def test_special_values_survive_copies_bit_exactly_on_the_cpu():
    special_values_survive("cpu")


# On a GPU this failed before the fused copies ran on integer views: torch._foreach_copy_ on CUDA, given a list of
# one dtype, loads bf16 and fp16 into float (its opmath) and stores them back, and the conversion writes every NaN
# as one NaN, so the small pairs' NaN payloads and signs changed (Note [bit-exact copies] in raysync.core.copies).
# Seen on an H200 (torch 2.11) with the CopyList before that change: "list of torch.bfloat16 run 0 pair 0: byte 0
# of 2000: [255, 127, ...] != [196, 127, ...]" (0x7FC4 came back 0x7FFF). On the CPU every pair is a copy_,
# which never converted: the CPU test above passes either way.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel", ["1", "0"], ids=["grouped kernel", "RAYSYNC_GROUPED_COPY=0"])
def test_special_values_survive_copies_bit_exactly_on_a_gpu(monkeypatch, kernel):
    monkeypatch.setenv("RAYSYNC_GROUPED_COPY", kernel)
    torch.cuda.set_device(0)
    made = special_values_survive("cuda")
    with_graph, without = made[0], made[len(made) // 2]  # every pair's lists
    assert with_graph._fused and not without.graph_captured  # some copies fused, on integer views
    assert all(copies.graph_captured for copies in made[: len(made) // 2])  # small and 1 MB ones on one GPU
    grouped = kernel == "1" and CUDA_TRITON
    assert all(bool(copies._grouped) == grouped for copies in made)


def sizes_and_dtypes() -> list[tuple[int, torch.dtype]]:
    """(bytes, dtype): no bytes, one 16-byte word, one program's chunk, a chunk and a word, several chunks and a
    partial one; in bytes of several widths."""
    sizes = [0, 16, CHUNK, CHUNK + 16, 3 * CHUNK + 48]
    dtypes = [torch.bfloat16, torch.float32, torch.uint8, torch.complex64, torch.int64, torch.float8_e4m3fn]
    return [(n, dtype) for n in sizes for dtype in dtypes]


def arena_pairs(device: str, specs, gap: int = 16, seed: int = 0):
    """(destination, source) pairs of (bytes, dtype) ``specs``: sources of random bits, destinations laid in
    one uint8 arena filled with 0xAB, ``gap`` bytes apart (16-byte aligned). The arena too, to check that
    nothing past a destination was written."""
    total = sum(n + gap for n, _ in specs) + gap
    arena = torch.full((total,), 0xAB, dtype=torch.uint8, device=device)
    pairs, at = [], gap
    for k, (n, dtype) in enumerate(specs):
        src = special(dtype, (n // dtype.itemsize,), seed=seed + k).to(device)
        pairs.append((arena[at : at + n].view(dtype), src))
        at += n + gap
    return pairs, arena


def untouched_gaps(arena: torch.Tensor, specs, gap: int = 16) -> bool:
    at, gaps = 0, []
    for n, _ in specs:
        gaps.append(arena[at : at + gap])
        at += gap + n
    gaps.append(arena[at:])
    return all(bool((g == 0xAB).all()) for g in gaps)


def grouped_kernel_copies_bits(device: str) -> None:
    """GroupedCopy over pairs of every size and width of ``sizes_and_dtypes``: a program per chunk, each
    destination its source's bits, nothing between them written; the pairs it cannot take refused."""
    specs = sizes_and_dtypes()
    pairs, arena = arena_pairs(device, specs)
    assert all(grouped_copy.eligible(d, s) for d, s in pairs)
    grouped = grouped_copy.GroupedCopy(pairs)
    assert grouped.programs == sum(-(-n // CHUNK) for n, _ in specs)
    assert grouped.table.device.type == torch.device(device).type and grouped.table.shape[1] == 3
    grouped.run()
    grouped.run()  # again: the table is kept
    if device == "cuda":
        torch.cuda.synchronize()
    for k, (d, s) in enumerate(pairs):
        assert same_bits(d, s), f"pair {k} ({specs[k]}): {differ(d, s)}"
    assert untouched_gaps(arena, specs)
    wide = torch.zeros(4 * CHUNK, dtype=torch.bfloat16, device=device)
    complex_ = torch.zeros(8, dtype=torch.complex64, device=device)
    refused = {
        "misaligned": (wide[1 : 1 + CHUNK], torch.zeros(CHUNK, dtype=torch.bfloat16, device=device)),
        "odd bytes": (wide[:1001], wide[1008:2009]),
        "strided": (wide[: 2 * CHUNK].view(2, -1).t(), wide[2 * CHUNK :].view(-1, 2)),
        "dtypes": (wide[:64], torch.zeros(64, device=device)),
        "shapes": (wide[:64], wide[64:128].view(8, 8)),
        "conjugate": (torch.zeros(8, dtype=torch.complex64, device=device), complex_.conj()),
    }
    for name, (d, s) in refused.items():
        assert not grouped_copy.eligible(d, s), name
        with pytest.raises(ValueError, match=r"pairs \[1\] cannot be copied"):
            grouped_copy.GroupedCopy([pairs[1], (d, s)])


def copylist_routes_to_the_kernel(device: str, interpreted: bool = False) -> None:
    """A CopyList gives the pairs the kernel takes to one grouped launch per run, the others to torch (a cast
    included); a lone eligible pair keeps its copy_; where the kernel does not compile, torch copies all."""
    if interpreted:  # the kernel runs on CPU tensors through Triton's interpreter
        assert grouped_copy.available(torch.device("cuda", 0)) and not grouped_copy.available(
            torch.device("cpu")
        )
        os.environ["RAYSYNC_GROUPED_COPY"] = "0"
        assert not grouped_copy.available(torch.device("cuda", 0))
        del os.environ["RAYSYNC_GROUPED_COPY"]
        grouped_copy.available = lambda d: True
    specs = [(n, dtype) for n, dtype in sizes_and_dtypes() if dtype in (torch.bfloat16, torch.float32)]
    taken, arena = arena_pairs(device, specs, seed=100)
    wide = special(torch.bfloat16, (CHUNK + 1,), seed=7).to(device)
    left = [
        (torch.zeros(CHUNK, dtype=torch.bfloat16, device=device), wide[1:]),  # misaligned
        (torch.zeros(1001, dtype=torch.bfloat16, device=device), wide[:1001]),  # odd bytes
        (
            torch.zeros(64, 48, dtype=torch.bfloat16, device=device).t(),
            wide[: 48 * 64].view(48, 64),
        ),  # strided
        (torch.zeros(64, dtype=torch.bfloat16, device=device), torch.randn(64, device=device)),  # a cast
    ]
    pairs = [p for pair in zip(taken, left, strict=False) for p in pair] + taken[len(left) :]
    launches = []
    launch = grouped_copy.launch
    grouped_copy.launch = lambda *a, **k: launches.append(a[0]) or launch(*a, **k)
    try:
        copies = CopyList(pairs)
        launches.clear()  # (warm's, the first time on this device)
        for run in range(3):
            for d, _ in pairs:
                d.zero_()
            copies.run()
            if device == "cuda":
                torch.cuda.synchronize()
            for k, (d, s) in enumerate(pairs):
                want = s.to(d.dtype) if d.dtype != s.dtype else s
                assert same_bits(d, want), f"run {run} pair {k}: {differ(d, want)}"
            assert untouched_gaps(arena, specs)
        (grouped,) = copies._grouped
        assert [id(p) for p in grouped.pairs] == [id(p) for p in taken]
        assert len(launches) == 3 and all(t is grouped.table for t in launches)
        lone = CopyList([taken[3], left[0]])  # one eligible pair: its copy_
        assert lone._grouped == []
        grouped_copy._warm.clear()
        grouped_copy.launch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler"))
        refused = CopyList(pairs)  # the kernel does not compile here: torch copies every pair
        assert refused._grouped == [] and grouped_copy._warm == {pairs[0][0].device: False}
        for d, _ in pairs:
            d.zero_()
        refused.run()
        assert all(same_bits(d, s) for d, s in taken)
    finally:
        grouped_copy.launch = launch
        grouped_copy._warm.clear()


def test_without_triton_or_a_gpu_every_copy_is_torchs():
    pairs, _ = arena_pairs("cpu", sizes_and_dtypes())
    copies = CopyList(pairs)
    copies.run()
    assert copies._grouped == [] and all(same_bits(d, s) for d, s in pairs)


# Triton 3.6's interpreter (a CUDA build of torch 2.11 brings it) turns a loop bound loaded from memory into an
# int through a 1-element numpy array, which numpy 2.5 refuses (TypeError; 2.3 only warns); 3.9's squeezes it
OLD_INTERPRETER, OLD_INTERPRETER_ERROR = 3, "only 0-dimensional arrays can be converted to Python scalars"


def interpreted() -> None:
    """The kernel's checks on CPU tensors, in a child process whose Triton was imported for its interpreter;
    exit status OLD_INTERPRETER where that interpreter cannot run the kernel's loops."""
    assert grouped_copy.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
    try:
        grouped_kernel_copies_bits("cpu")
    except Exception as e:
        if OLD_INTERPRETER_ERROR in repr(e):
            sys.exit(OLD_INTERPRETER)
        raise
    copylist_routes_to_the_kernel("cpu", interpreted=True)


@pytest.mark.skipif(not TRITON, reason="Triton is not installed (ci/test.sh installs it for this test)")
def test_the_grouped_kernel_copies_bits_on_the_cpu_through_tritons_interpreter(monkeypatch, spawn):
    # a spawned child starts with this environment and this sys.path: the venv's own Triton first, if it has one
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("RAYSYNC_GROUPED_COPY", raising=False)
    monkeypatch.setattr(sys, "path", [*sys.path, str(APART)])
    child = spawn(interpreted)
    child.join(timeout=600)
    if child.exitcode == OLD_INTERPRETER:
        pytest.skip(f"Triton's interpreter here stops at the kernel's loops ({OLD_INTERPRETER_ERROR})")
    assert child.exitcode == 0, "the child's traceback is in its stderr, above"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_TRITON, reason="needs a CUDA GPU and Triton")
def test_the_grouped_kernel_copies_bits_on_a_gpu(monkeypatch):
    monkeypatch.delenv("RAYSYNC_GROUPED_COPY", raising=False)
    torch.cuda.set_device(0)
    grouped_kernel_copies_bits("cuda")
    copylist_routes_to_the_kernel("cuda")
