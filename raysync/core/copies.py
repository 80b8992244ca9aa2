"""A list of tensor copies made once and replayed every push.

A push of a 7B model is ~340 tensor copies on each side. Slicing views and checking them costs several
microseconds of Python per copy, which on a GPU that copies a 1 MB tensor in under a microsecond is most of
a push. So the views are made once per (layout, tensors, buffers) and kept; a replay is the copies alone, the
small ones fused into one launch per device (``torch._foreach_copy_``), the large ones each a DMA copy.

Launching ~340 copies still costs the host 1-2 ms (~6 us each), more than the GPU needs to copy a small
model. So a list whose copies all stay on one GPU is captured once into a CUDA graph, at its second run (a
list used once is not worth it), and from then on replayed with one launch. The capture runs on a side
stream and executes nothing; the graph replays on the current stream, ordered like the copies it stands for.

But the graph's copies of large tensors run ~4% slower than launched one by one, and where each large copy
keeps the GPU busy far longer than its launch takes the host, the launches cost nothing the GPU waits for. So
a list whose large copies average GRAPH_BELOW_MEAN_BYTES or more is launched one by one. Measured on an H200,
direct mode (one list of every tensor), cuda_graphs on / off: the 7B layout (large copies ~77 MB on average)
8.64 / 8.27 ms until PushDone, the 1.5B layout (~16 MB) 2.04 / 2.39 ms (docs/benchmarks.md, section 13).
SyncConfig.cuda_graphs=False never captures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

FUSE_BELOW_BYTES = 1 << 20  # copies smaller than this share one launch; larger ones run at DMA speed alone
GRAPH_BELOW_MEAN_BYTES = 32 << 20  # large copies this size on average: launched one by one (docstring)


class CopyList:
    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], graph: bool = True):
        """``pairs``: (destination, source) views of the same shape; ``graph``: may be captured."""
        small = [(d, s) for d, s in pairs if _fusable(d, s)]
        self._large = [(d, s) for d, s in pairs if not _fusable(d, s)]
        by_device: dict[torch.device, tuple[list, list]] = {}
        for d, s in small:
            dsts, srcs = by_device.setdefault(d.device, ([], []))
            dsts.append(d)
            srcs.append(s)
        self._fused = list(by_device.values())
        self.devices = {t.device for pair in pairs for t in pair if t.device.type == "cuda"}
        one_gpu = len(self.devices) == 1 and all(d.is_cuda and s.is_cuda for d, s in pairs)
        large = sum(d.nbytes for d, _ in self._large) / max(len(self._large), 1)
        worth = graph and one_gpu and len(pairs) > 1 and large < GRAPH_BELOW_MEAN_BYTES
        self._gpu = next(iter(self.devices)) if worth else None
        self._runs = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    @property
    def graph_captured(self) -> bool:
        """Whether ``run`` replays one captured CUDA graph (from its third run on, copies on one GPU only)."""
        return self._graph is not None

    def run(self) -> None:
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


def _fusable(d: torch.Tensor, s: torch.Tensor) -> bool:
    return d.is_cuda and d.device == s.device and d.dtype == s.dtype and d.nbytes < FUSE_BELOW_BYTES


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
