"""The fused delta kernels (raysync.core.delta_kernels, Note [fused delta kernels]) write what torch's path
writes, byte for byte, and advance the references the same way: on a GPU compiled, and wherever Triton
imports through its interpreter on the CPU (a child process: the interpreter is chosen at import)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raysync.core import delta, delta_changes, delta_decode_kernels, delta_encode, delta_kernels

HERE = Path(__file__).parent
# Triton for its interpreter: installed here by ci/test.sh (apart from the venv, which vLLM's CPU build shares),
# or importable already (CUDA builds of torch bring it)
APART = Path(os.environ.get("RAYSYNC_TRITON_PATH", HERE.parent / ".venv" / "triton-interpreter"))
TRITON = importlib.util.find_spec("triton") is not None or (APART / "triton").is_dir()


def bucket(device: str) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """(reference, new) pairs of mixed widths and densities: sparse bf16 chunks longer than a gap's span (forced
    entries), a changed first and last element, fp8-wide and fp32 chunks, a dense chunk (FULL), an unchanged
    one (SAME), one without a reference (FULL), and one whose first change lies past its first block."""
    g = torch.Generator().manual_seed(7)
    specs = [
        (torch.bfloat16, 200_003, 0.05),
        (torch.bfloat16, 4096, 0.0),
        (torch.int8, 70_001, 0.03),
        (torch.float32, 9_999, 0.10),
        (torch.bfloat16, 8192, 0.9),
        (torch.bfloat16, 131_072 * 2, 0.001),
    ]
    pairs = []
    for dtype, n, density in specs:
        old = torch.randint(-100, 100, (n,), generator=g).to(dtype)
        new = old.clone()
        changed = torch.rand(n, generator=g) < density
        if density:
            changed[0] = changed[-1] = True
        new[changed] += 1
        pairs.append((old.to(device), new.to(device)))
    pairs.insert(3, (None, torch.randn(5000, generator=g).to(device)))
    old = torch.randint(-100, 100, (12_000,), generator=g).to(torch.bfloat16)
    new = old.clone()
    new[[5000, 5001, 8191, 8192, 11_999]] += 1  # none in its first block, two across a block's end
    pairs.append((old.to(device), new.to(device)))
    return pairs


def listed_changes(pairs, space, fused: bool, advance: bool = False) -> delta_encode.Changes:
    """The bucket's changes found the GPU's ways, without waiting: counted by the kernels (``advance``: their
    compare advances the references), or listed by torch's (nonzero_static, capped)."""
    os.environ["RAYSYNC_DELTA_KERNELS"] = "1" if fused else "0"
    if fused:
        return delta_encode.find_changes(pairs, based=True, space=space, wait=False, advance=advance)
    views = [(None if o is None else delta._bits(o, "reference"), delta._bits(n, "new")) for o, n in pairs]
    masks, span = delta_changes.compare(views, True, space, pairs[0][1].device)
    listing = delta_changes.start_listing(masks, span, space.spans)
    return delta_encode.Changes(views, span.device, True, masks, None, None, None, listing)


def compare_paths(device: str, interpreted: bool = False) -> None:
    """Encode one bucket with torch's kernels and with the fused ones (the references advanced by the write, or
    by the compare: Note [the reference advances at the compare]): the same bytes, the same references."""
    if interpreted:  # the kernels run on CPU tensors through Triton's interpreter
        delta_kernels.available = lambda d: os.environ.get("RAYSYNC_DELTA_KERNELS") != "0"
    results = []
    for fused, advance in ((False, False), (True, False), (True, True)):
        pairs = [(None if o is None else o.clone(), n) for o, n in bucket(device)]
        sizes = [[(n.numel(), n.element_size()) for _, n in pairs]]
        space = delta_encode.Workspace.for_buckets(sizes, torch.device(device))
        out = torch.zeros(delta.capacity(sizes[0]), dtype=torch.uint8, device=device)
        changes = listed_changes(pairs, space, fused, advance)
        if advance:  # the compare's counts in: the references hold the changed words already
            changes.ready()
            assert changes.entries.advanced and all(
                o is None or torch.equal(o.cpu(), n)
                for (o, _), (_, n) in zip(pairs, bucket("cpu"), strict=True)
            )
            with pytest.raises(delta.LayoutError, match="advanced the references"):
                delta_encode.encode(pairs, out, base_version=3, space=space, advance=False, changes=changes)
        code = delta_encode.encode(pairs, out, base_version=3, space=space, advance=True, changes=changes)
        assert (changes.entries is not None) == fused
        results.append((code, out[: code.nbytes].cpu(), [None if o is None else o.cpu() for o, _ in pairs]))
    (torch_code, torch_bytes, torch_refs), *kernels = results
    for code, got, refs in kernels:
        modes = [c.mode for c in code.chunks]
        assert modes == [c.mode for c in torch_code.chunks]
        assert {delta.Mode.GAPS, delta.Mode.FULL, delta.Mode.SAME} <= set(modes)
        assert torch.equal(got, torch_bytes)
        for r, t, (_, n) in zip(refs, torch_refs, bucket("cpu"), strict=True):
            assert (r is None and t is None) or (torch.equal(r, t) and torch.equal(r.view(-1), n.view(-1)))
    for fused in (False, True):  # it decodes onto the old bytes into the new ones, either way
        os.environ["RAYSYNC_DELTA_KERNELS"] = "1" if fused else "0"
        held = [torch.zeros_like(n) if o is None else o.clone() for o, n in bucket(device)]
        delta.decode(got.to(device), held, held_version=3)
        assert all(torch.equal(h.cpu(), n) for h, (_, n) in zip(held, bucket("cpu"), strict=True))
        # a last gap that runs past its destination: refused, and nothing written
        first = code.chunks[0]
        assert first.mode == delta.Mode.GAPS
        start = delta._align(delta.HEADER_BYTES + delta.ROW_BYTES * len(code.chunks))
        for last_gap in (32767, None):  # far past its destination, and one past (its last index: numel)
            hostile = got.clone()
            gaps = hostile[start : start + 2 * first.entries].view(torch.int16)
            gaps[-1] = last_gap if last_gap is not None else gaps[-1] + 1
            held = [torch.zeros_like(n) if o is None else o.clone() for o, n in bucket(device)]
            with pytest.raises(delta.BadDelta, match="chunk 0: a delta writes element"):
                delta.decode(hostile.to(device), held, held_version=3)
            assert all(
                torch.equal(h.cpu(), torch.zeros_like(n) if o is None else o)
                for h, (o, n) in zip(held, bucket("cpu"), strict=True)
            )


def dense_bucket_counted_after_all(device: str, interpreted: bool = False) -> None:
    """A bucket with more changes than torch's listing holds (its first delta push, listed on a guess): there
    counted after all, and written as the kernels write it (they count every bucket, no cap)."""
    if interpreted:
        delta_kernels.available = lambda d: os.environ.get("RAYSYNC_DELTA_KERNELS") != "0"
    g = torch.Generator().manual_seed(3)
    old = torch.randint(-100, 100, (300_000,), generator=g).to(torch.bfloat16)
    new = old.clone()
    new[torch.rand(old.numel(), generator=g) < 0.4] += 1  # 40%: past the cap (twice SPARSE_DENSITY)
    got = []
    for fused in (False, True):
        pairs = [(old.clone().to(device), new.to(device))]
        space = delta_encode.Workspace.for_buckets([[(new.numel(), 2)]], torch.device(device))
        out = torch.zeros(delta.capacity([(new.numel(), 2)]), dtype=torch.uint8, device=device)
        changes = listed_changes(pairs, space, fused)
        code = delta_encode.encode(pairs, out, base_version=1, space=space, advance=True, changes=changes)
        assert (changes.entries is not None) == fused and code.chunks[0].mode == delta.Mode.GAPS
        got.append((out[: code.nbytes].cpu(), pairs[0][0].cpu()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[1][1], new)


def a_sink_settles_a_refused_bucket_before_it_commits(device: str, interpreted: bool = False) -> None:
    """IntoTensors decodes a bucket of GAPS payloads checked on the device: a hostile one reaches commit,
    which names it (BadDelta), and its tensors count as undelivered, unwritten."""
    from raysync import SyncConfig
    from raysync.core.plan import plan_buckets
    from raysync.core.sink import IntoTensors
    from raysync.core.source import select

    if interpreted:
        delta_kernels.available = lambda d: True
    os.environ["RAYSYNC_DELTA_KERNELS"] = "1"
    pairs = [p for i, p in enumerate(bucket("cpu")) if i in (0, 6)]  # two sparse bf16 chunks
    named = {f"w{i}": n for i, (_, n) in enumerate(pairs)}
    specs = [s.spec for s in select(named.items(), SyncConfig(bucket_bytes=1 << 22))]
    (only,) = plan_buckets(specs, 1 << 22, 256)
    out = torch.zeros(delta.capacity([(n.numel(), 2) for _, n in pairs]), dtype=torch.uint8)
    code = delta_encode.encode(pairs, out, base_version=3)
    start = delta._align(delta.HEADER_BYTES + delta.ROW_BYTES * len(code.chunks))
    out[start : start + 2 * code.chunks[0].entries].view(torch.int16)[-1] = 32767
    held = {f"w{i}": o.clone().to(device) for i, (o, _) in enumerate(pairs)}
    sink = IntoTensors(specs, held)
    sink.delta_base = 3
    sink.write(only, out)
    assert sink.undelivered() == []  # landed, not yet settled
    with pytest.raises(delta.BadDelta, match="bucket 0: chunk 0: a delta writes element"):
        sink.commit()
    assert sorted(sink.undelivered()) == ["w0", "w1"]
    assert all(torch.equal(held[f"w{i}"].cpu(), o) for i, (o, _) in enumerate(pairs))


def warmed(device: str, interpreted: bool = False) -> None:
    """``warm`` launches each kernel once (the encoder's for three word sizes, the decoder's) and says so."""
    if interpreted:
        delta_kernels.available = lambda d: True
    os.environ["RAYSYNC_DELTA_KERNELS"] = "1"
    delta_kernels.warm(torch.device(device), {1, 2, 4})
    delta_decode_kernels.warm(torch.device(device), {2})
    assert (torch.device(device), frozenset({1, 2, 4})) in delta_kernels._warm
    assert (torch.device(device), frozenset({2})) in delta_decode_kernels._warm


def sparse_bucket_checked_on_the_device(device: str, interpreted: bool = False) -> None:
    """A bucket of GAPS and SAME payloads only, decoded with ``unsettled``: right, or (indices past a
    destination) nothing of it written and BadDelta at ``settle``, not before."""
    if interpreted:
        delta_kernels.available = lambda d: True
    os.environ["RAYSYNC_DELTA_KERNELS"] = "1"
    pairs = [p for i, p in enumerate(bucket("cpu")) if i in (0, 1, 2, 6)]  # sparse, SAME, fp8-wide, sparse
    sizes = [(n.numel(), n.element_size()) for _, n in pairs]
    out = torch.zeros(delta.capacity(sizes), dtype=torch.uint8)
    code = delta_encode.encode(pairs, out, base_version=3)
    assert {c.mode for c in code.chunks} == {delta.Mode.GAPS, delta.Mode.SAME}
    start = delta._align(delta.HEADER_BYTES + delta.ROW_BYTES * len(code.chunks))
    far, one_past = out.clone(), out.clone()
    far[start : start + 2 * code.chunks[0].entries].view(torch.int16)[-1] = 32767
    one_past[start : start + 2 * code.chunks[0].entries].view(torch.int16)[-1] += 1  # its last index: numel
    for buffer, bad in ((out, False), (far, True), (one_past, True)):
        held = [o.clone().to(device) for o, _ in pairs]
        unsettled: list = []
        delta.decode(buffer, held, held_version=3, unsettled=unsettled)  # a host buffer, as from a ring
        assert len(unsettled) == 1
        if bad:
            with pytest.raises(
                delta.BadDelta,
                match="chunk 0: a delta writes element .*none of its bucket's payloads was written",
            ):
                delta.settle(unsettled)
            assert all(torch.equal(h.cpu(), o) for h, (o, _) in zip(held, pairs, strict=True))
        else:
            delta.settle(unsettled)
            assert all(torch.equal(h.cpu(), n) for h, (_, n) in zip(held, pairs, strict=True))
        assert not unsettled


def edge_pairs(device: str, specs, seed: int = 0):
    """(reference or None, new) pairs from (dtype, elements, density, has a reference); each new a view one
    element into a larger tensor (a trainer's tensor read in place starts anywhere; on a GPU the kernels are
    compiled for such a pointer apart)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for dtype, n, density, based in specs:
        whole = torch.randint(-100, 100, (n + 1,), generator=g).to(dtype).to(device)
        new = whole[1:]  # sliced on the device: a copy there would start at an aligned address again
        old = new.clone()
        if n and density:
            old[torch.rand(n, generator=g).to(device) < density] += 1
        pairs.append((old if based else None, new))
    return pairs


def edge_buckets_write_what_torchs_kernels_write(device: str, interpreted: bool = False) -> None:
    """Buckets at the edges of the blocks' layout: chunks of no elements with a reference, forced entries at a
    chunk's and a block's ends, every chunk SAME or FULL, word sizes 8, 1, 2 and 4 in one bucket, no reference
    first, chunks of one element: the kernels write what torch's kernels write (found without waiting, as the
    push does)."""
    if interpreted:
        delta_kernels.available = lambda d: os.environ.get("RAYSYNC_DELTA_KERNELS") != "0"
    bf, i8, f32, f64 = torch.bfloat16, torch.int8, torch.float32, torch.float64
    buckets = [
        [(bf, 0, 0, True), (bf, 70_000, 0.01, True), (bf, 0, 0, True)],
        [
            (bf, 65_536, 0.001, True),
            (bf, 65_535, 0.001, True),
            (bf, 65_537, 0.001, True),
            (bf, 196_608, 5e-4, True),
        ],
        [(bf, 5000, 0.0, True), (bf, 4097, 0.0, True), (i8, 65_536, 0.0, True)],
        [(bf, 5000, 0.9, True), (bf, 3000, 0, False), (bf, 9000, 0.95, True)],
        [
            (f64, 70_000, 0.01, True),
            (i8, 70_001, 0.02, True),
            (bf, 70_002, 0.01, True),
            (f32, 70_003, 0.01, True),
        ],
        [(bf, 10, 0, False), (bf, 100_000, 0.02, True), (bf, 3, 0, False), (bf, 1, 1.0, True)],
    ]
    for b, specs in enumerate(buckets):
        got = []
        for fused in (False, True):
            os.environ["RAYSYNC_DELTA_KERNELS"] = "1" if fused else "0"
            pairs = edge_pairs(device, specs, seed=b)
            sizes = [(n.numel(), n.element_size()) for _, n in pairs]
            space = delta_encode.Workspace.for_buckets([sizes], torch.device(device))
            out = torch.zeros(delta.capacity(sizes), dtype=torch.uint8, device=device)
            changes = delta_encode.find_changes(pairs, based=True, space=space, wait=False)
            code = delta_encode.encode(pairs, out, base_version=1, space=space, advance=True, changes=changes)
            assert (changes.entries is not None) == fused, f"bucket {b}: counted by the kernels or torch's"
            got.append((out[: code.nbytes].cpu(), [None if o is None else o.cpu() for o, _ in pairs], code))
        (want, want_refs, want_code), (bytes_, refs, code) = got
        assert [c.mode for c in code.chunks] == [c.mode for c in want_code.chunks], f"bucket {b}"
        assert torch.equal(bytes_, want), f"bucket {b}"
        assert all(
            (r is None and w is None) or torch.equal(r, w) for r, w in zip(refs, want_refs, strict=True)
        )


def two_buckets_in_flight(device: str, interpreted: bool = False) -> None:
    """Buckets encoded as the push encodes them (Note [two buckets in flight] in raysync.core.delta_encode): the
    changes of the two buckets after each found without waiting, in the workspace's masks 0 and 1 by turns, the
    listing of each after its counts: the same bytes and references as torch's kernels give one at a time, in
    two pushes (the second reuses what the first left in the workspace)."""
    if interpreted:
        delta_kernels.available = lambda d: os.environ.get("RAYSYNC_DELTA_KERNELS") != "0"
    shapes = [([70_000, 5000], 0.02), ([130_000], 0.01), ([9000, 9000, 70_000], 0.03), ([65_536], 0.001)]

    def push(fused: bool):
        os.environ["RAYSYNC_DELTA_KERNELS"] = "1" if fused else "0"
        buckets = [
            edge_pairs(device, [(torch.bfloat16, n, d, True) for n in s], seed=i)
            for i, (s, d) in enumerate(shapes)
        ]
        space = delta_encode.Workspace.for_buckets(
            [[(n, 2) for n in s] for s, _ in shapes], torch.device(device)
        )
        outs = []
        for version in (1, 2):  # a second push reuses the workspace's buffers (the counts' sums, its tables)
            if version == 2:
                for pairs in buckets:
                    for _, n in pairs:
                        n[::97] += 1
            ahead = {}
            for k, pairs in enumerate(buckets):
                out = torch.zeros(
                    delta.capacity([(n.numel(), 2) for _, n in pairs]), dtype=torch.uint8, device=device
                )
                changes = ahead.pop(k, None)
                code = delta_encode.encode(
                    pairs, out, base_version=version, space=space, advance=True, changes=changes, slot=k % 2
                )
                outs.append(out[: code.nbytes].cpu())
                for j in (k + 1, k + 2):
                    if j < len(buckets) and j not in ahead and fused:
                        ahead[j] = delta_encode.find_changes(  # as the push does: advanced at the compare
                            buckets[j], based=True, space=space, slot=j % 2, wait=False, advance=True
                        )
        return outs, [o.cpu() for b in buckets for o, _ in b]

    (want, want_refs), (got, refs) = push(False), push(True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(refs, want_refs, strict=True))


@pytest.mark.skipif(not TRITON, reason="Triton is not installed (ci/test.sh installs it for this test)")
def test_the_fused_kernels_write_what_torchs_kernels_write_on_the_cpu_through_tritons_interpreter():
    path = [str(HERE), *sys.path, str(APART)]  # the venv's own Triton first, if it has one
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import test_delta_kernels as t; t.compare_paths('cpu', interpreted=True); "
            "t.sparse_bucket_checked_on_the_device('cpu', interpreted=True); "
            "t.dense_bucket_counted_after_all('cpu', interpreted=True); t.warmed('cpu', interpreted=True); "
            "t.a_sink_settles_a_refused_bucket_before_it_commits('cpu', interpreted=True); "
            "t.edge_buckets_write_what_torchs_kernels_write('cpu', interpreted=True); "
            "t.two_buckets_in_flight('cpu', interpreted=True)",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_fused_kernels_write_what_torchs_kernels_write_on_a_gpu(monkeypatch):
    monkeypatch.setenv("RAYSYNC_DELTA_KERNELS", "1")
    compare_paths("cuda")
    sparse_bucket_checked_on_the_device("cuda")
    dense_bucket_counted_after_all("cuda")
    warmed("cuda")
    a_sink_settles_a_refused_bucket_before_it_commits("cuda")
    edge_buckets_write_what_torchs_kernels_write("cuda")
    two_buckets_in_flight("cuda")


def test_a_mask_buffer_too_small_for_the_bitmask_is_refused_before_a_kernel_writes_past_it():
    from raysync.core import delta_blocks

    blocks = delta_blocks.Blocks.of([5000, 100], torch.device("cpu"))  # 3 blocks: 12288 bits, 384 words
    assert delta_blocks.mask_words(torch.empty(blocks.elements // 8, dtype=torch.bool), blocks).numel() == 384
    with pytest.raises(ValueError, match="bitmask"):
        delta_blocks.mask_words(torch.empty(blocks.elements // 8 - 1, dtype=torch.bool), blocks)
