"""A list of tensor copies made once and replayed every push.

A push of a 7B model is ~340 tensor copies on each side. Slicing views and checking them costs several
microseconds of Python per copy, which on a GPU that copies a 1 MB tensor in under a microsecond is most of
a push. So the views are made once per (layout, tensors, buffers) and kept, and a replay is the copies alone:

* Where Triton runs (torch's CUDA builds bring it), every pair on one GPU that the grouped kernel can take
  (the same device, dtype and shape, contiguous, 16-byte aligned, a multiple of 16 bytes: raysync.core
  .grouped_copy.eligible) is copied by one launch of it per device, from a table of addresses made here once.
  Measured on one H200 (torch 2.11, Triton 3.6; ``python benchmarks/bench_grouped_copy.py``, copies only, bf16):
  the 7B layout (339 tensors, 15.23 GB) 7.45 ms, against 8.08 for this list before it (its copies launched
  one by one), 8.18 one copy_ per tensor and 7.19 one memcpy of the same bytes; the 1.5B layout (338 tensors,
  3.09 GB) 1.59 ms, against 1.76 before (a graph), 3.49 per tensor and 1.65 a memcpy (Note [grouped copy] in
  raysync.core.grouped_copy). With this list routing to it (the same script, a later run): 7.43 ms against
  7.98 without the kernel on the 7B layout, 1.51 against 1.74 on the 1.5B one, every copy bit-exact. A lone
  eligible pair on a device keeps its copy_: one launch either way, and a memcpy is the floor. It needs no
  CUDA graph. RAYSYNC_GROUPED_COPY=0 leaves every pair to torch.
* The other pairs as before: the small ones fused into one launch per device (``torch._foreach_copy_``, on
  integer views: Note [bit-exact copies]), the large ones each a copy_ (a DMA copy where it can be one).

Launching ~340 copies costs the host 1-2 ms (~6 us each), more than the GPU needs to copy a small model. So
the pairs left to torch, where they all stay on one GPU, are captured once into a CUDA graph at the list's
second run (a list used once is not worth it), and from then on replayed with one launch. The capture runs on
a side stream and executes nothing; the graph replays on the current stream, ordered like the copies it stands
for. But the graph's copies of large tensors run ~4% slower than launched one by one, and where each large copy
keeps the GPU busy far longer than its launch takes the host, the launches cost nothing the GPU waits for. So
copies whose large ones average GRAPH_BELOW_MEAN_BYTES or more are launched one by one. Measured on an H200
before the grouped kernel (direct mode, one list of every tensor, cuda_graphs on / off; docs/benchmarks.md,
section 13): the 7B layout (large copies ~77 MB on average) 8.64 / 8.27 ms until PushDone, the 1.5B layout
(~16 MB) 2.04 / 2.39 ms. Where Triton runs, the grouped kernel takes those layouts' tensors now (the run above
left none of them to torch).
SyncConfig.cuda_graphs=False never captures (the grouped launch is no graph: it runs either way).

# Note [bit-exact copies]
# A copy must give the source's bits (a delta push compares bits, a verify digest hashes them). On CUDA,
# torch._foreach_copy_ of a list of one dtype loads bf16 and fp16 into float and stores them back (its opmath),
# and the conversion back writes every NaN as one NaN: payloads and signs were lost (an H200 run of
# benchmarks/bench_grouped_copy.py, tensors of random bits, found this list's copies wrong on both layouts,
# where copy_ and the grouped kernel were right; tests/test_copies.py saw a bf16 0x7FC4 come back 0x7FFF,
# torch 2.11). So the fused copies run on integer views of the same element size (bf16 -> int16, fp32 ->
# int32, 1-byte types -> uint8, ...): a copy of integers converts nothing. A dtype of another element size
# (complex128) is copied by copy_, which copies elements as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from raysync.core import grouped_copy

logger = logging.getLogger(__name__)

FUSE_BELOW_BYTES = 1 << 20  # copies smaller than this share one launch; larger ones run at DMA speed alone
GRAPH_BELOW_MEAN_BYTES = 32 << 20  # large copies this size on average: launched one by one (docstring)
# integer dtypes by element size: the fused copies' views (Note [bit-exact copies])
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CopyList:
    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], graph: bool = True):
        """``pairs``: (destination, source) views of the same shape; ``graph``: may be captured."""
        self.devices = {t.device for pair in pairs for t in pair if t.device.type == "cuda"}
        self._grouped, rest = _grouped(pairs)
        small = [(d, s) for d, s in rest if _fusable(d, s)]
        self._large = [(d, s) for d, s in rest if not _fusable(d, s)]
        by_device: dict[torch.device, tuple[list, list]] = {}
        for d, s in small:
            dsts, srcs = by_device.setdefault(d.device, ([], []))
            bits = _BITS[d.element_size()]
            dsts.append(d.view(bits))
            srcs.append(s.view(bits))
        self._fused = list(by_device.values())
        gpus = {t.device for pair in rest for t in pair if t.device.type == "cuda"}
        one_gpu = len(gpus) == 1 and all(d.is_cuda and s.is_cuda for d, s in rest)
        large = sum(d.nbytes for d, _ in self._large) / max(len(self._large), 1)
        worth = graph and one_gpu and len(rest) > 1 and large < GRAPH_BELOW_MEAN_BYTES
        self._gpu = next(iter(gpus)) if worth else None
        self._runs = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def graph_captured(self) -> bool:
        """Whether ``run`` replays one captured CUDA graph for the copies left to torch (from its third run on,
        copies on one GPU only)."""
        return self._graph is not None

    def run(self) -> None:
        for grouped in self._grouped:
            grouped.run()
        if self._graph is not None:
            with torch.cuda.device(self._gpu):
                self._graph.replay()
            return
        self._run_each()
        self._runs += 1
        if self._runs == 2 and self._gpu is not None:
            self._graph = _capture(self._run_each, self._gpu)

    def _run_each(self) -> None:
        for dsts, srcs in self._fused:
            torch._foreach_copy_(dsts, srcs)
        for d, s in self._large:
            d.copy_(s, non_blocking=d.device != s.device)


def _grouped(pairs) -> tuple[list[grouped_copy.GroupedCopy], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The grouped copies (one per device with two pairs or more that the kernel takes, where it runs), and
    the pairs left to torch."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (d, s) in enumerate(pairs):
        if grouped_copy.available(d.device) and grouped_copy.eligible(d, s):
            by_device.setdefault(d.device, []).append(i)
    taken: set[int] = set()
    made = []
    for device, which in by_device.items():
        if len(which) > 1 and grouped_copy.warm(device):
            made.append(grouped_copy.GroupedCopy([pairs[i] for i in which]))
            taken.update(which)
    return made, [pair for i, pair in enumerate(pairs) if i not in taken]


def _fusable(d: torch.Tensor, s: torch.Tensor) -> bool:
    return (
        d.is_cuda
        and d.device == s.device
        and d.dtype == s.dtype
        and d.nbytes < FUSE_BELOW_BYTES
        and d.element_size() in _BITS
        and not (d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg())
    )


def _capture(copies, device: torch.device) -> torch.cuda.CUDAGraph | None:
    """``copies`` captured into a CUDA graph (nothing runs), or None where capture is refused: the copies are
    then launched one by one, as before."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
            graph.capture_begin(capture_error_mode="thread_local")  # other threads may use the GPU meanwhile
            try:
                copies()
            finally:
                graph.capture_end()
    except RuntimeError as e:
        logger.info("copies on %s not captured in a CUDA graph, launched one by one: %s", device, e)
        return None
    return graph
