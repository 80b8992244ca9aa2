"""Where a staged push lands (raysync.core.staging): the group plan (pure), the placement of the staging memory
(on the destinations' device or in host memory), its buffers, and the flip's copies.

    destinations (live)        staging memory, one buffer per destination device
    cuda:0  a.weight, a.bias   [a.weight | a.bias | ...]   on cuda:0 ("device"), or pinned host memory ("host")
                               each tensor at a multiple of ALIGN_BYTES; in groups mode the groups share it
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from raysync.core import host_memory
from raysync.core.copies import CopyList
from raysync.core.errors import LayoutError
from raysync.core.sink import byte_view
from raysync.core.wire import DTYPES, TensorSpec

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256  # every staged tensor starts at a multiple of this in its buffer: a view of any dtype
MARGIN_BYTES = 1 << 30  # staging_memory="auto": GPU memory left free for the engine's own allocations
STAGING_MEMORY = ("auto", "device", "host")


@dataclass(frozen=True)
class StagingInfo:
    """What the staging memory is: ``mode`` "whole" or "groups" and why, its bytes per destination device, and
    where it lives: ``memory`` "device", "host" or (``auto``, several devices, not all with room) "mixed"."""

    mode: str
    why: str
    groups: int
    push_bytes: int  # of the push's tensors
    nbytes: int  # staging memory allocated, all devices
    devices: tuple[tuple[str, int], ...]  # (destination device, bytes staged for it)
    memory: str
    memory_why: str


@dataclass(frozen=True)
class GroupPlan:
    """Where each tensor of a push is staged: its group and byte offset in its device's buffer."""

    group_of: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: dict[torch.device, int]  # buffer bytes per device
    groups: int


def plan_groups(
    nbytes: Sequence[int], devices: Sequence[torch.device], budget: int | None, names: Sequence[str] = ()
) -> GroupPlan:
    """Pure: one group when ``budget`` is None or the push fits in it; else consecutive tensors, each group at
    most ``budget`` bytes (alignment included). A tensor larger than the budget is a LayoutError."""
    total = sum(_up(n) for n in nbytes)
    whole = budget is None or total <= budget
    group_of: list[int] = []
    offsets: list[int] = []
    sizes: dict[torch.device, int] = {}
    used: dict[torch.device, int] = {}
    group = group_bytes = 0
    for i, (n, device) in enumerate(zip(nbytes, devices, strict=True)):
        need = _up(n)
        if not whole and need > budget:
            name = names[i] if i < len(names) else f"#{i}"
            raise LayoutError(
                f"tensor {name!r} ({n} bytes) does not fit staging_bytes={budget}; raise staging_bytes to at "
                f"least {need} or stage the whole push (staging_bytes=None)"
            )
        if not whole and group_bytes + need > budget:
            group, group_bytes, used = group + 1, 0, {}
        group_of.append(group)
        offsets.append(used.get(device, 0))
        used[device] = offsets[-1] + need
        group_bytes += need
        sizes[device] = max(sizes.get(device, 0), used[device])
    return GroupPlan(tuple(group_of), tuple(offsets), sizes, group + 1 if nbytes else 1)


def _up(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def place(device: torch.device, nbytes: int, staging_memory: str, margin_bytes: int) -> tuple[str, str]:
    """Where ``nbytes`` of staging for destinations on ``device`` go: ("device" | "host", why)."""
    if device.type == "cpu":
        return "host", "the destinations are in host memory: device and host staging are the same memory"
    if staging_memory != "auto":
        return staging_memory, f"staging_memory={staging_memory!r}"
    if device.type != "cuda":
        return "device", f"auto: no free-memory probe for {device.type} devices, staged on the device"
    driver, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch reuses it first
    free = driver + cached
    room = (
        f"{device} has {free} bytes free ({driver} in the driver, {cached} cached by this process's allocator), "
        f"{margin_bytes} of them kept free (margin_bytes)"
    )
    if nbytes <= free - margin_bytes:
        return "device", f"auto: {nbytes} bytes of staging fit: {room}"
    return "host", f"auto: {nbytes} bytes of staging do not fit ({room}): pinned host memory"


def allocate(device: torch.device, nbytes: int, memory: str) -> tuple[torch.Tensor, bool]:
    """A staging buffer for destinations on ``device``: there, or in host memory, page-locked for a GPU
    (raysync.core.host_memory: exactly ``nbytes``, unpinned when the buffer is dropped); and whether it was
    page-locked."""
    if memory == "device":
        return torch.empty(nbytes, dtype=torch.uint8, device=device), False
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    return buffer, device.type == "cuda" and host_memory.register(buffer)


class StagingMemory:
    """The staging memory of one set of live destinations: planned and sized per layout, allocated once (a
    buffer per destination device, on it or in host memory: ``staging_memory``; grown only when a layout needs
    more), and the flip's copies, one list per group."""

    def __init__(
        self,
        dest: Mapping[str, torch.Tensor],
        staging_bytes: int | None,
        graphs: bool = True,
        *,
        staging_memory: str = "auto",
        margin_bytes: int = MARGIN_BYTES,
    ):
        if staging_bytes is not None and staging_bytes < ALIGN_BYTES:
            raise ValueError(
                f"staging_bytes={staging_bytes}: at least {ALIGN_BYTES}, or None for the whole push"
            )
        if staging_memory not in STAGING_MEMORY:
            raise ValueError(f"staging_memory={staging_memory!r}: one of {', '.join(STAGING_MEMORY)}")
        self.dest, self.staging_bytes, self._graphs = dest, staging_bytes, graphs
        self.staging_memory, self.margin_bytes = staging_memory, margin_bytes
        self.buffers: dict[torch.device, torch.Tensor] = {}  # per destination device
        self.placed: dict[torch.device, tuple[str, str]] = {}  # per destination device: (memory, why)
        self.pinned: set[torch.device] = set()  # whose host buffer is page-locked (unlocked when dropped)
        self.specs: tuple[TensorSpec, ...] | None = None
        self.plan: GroupPlan | None = None
        self.views: dict[str, torch.Tensor] = {}  # name -> its staging tensor (groups share the memory)
        self.flips: list[CopyList] = []  # per group: (live, staged) of each of its destinations
        self.group_bytes: list[int] = []
        self.info: StagingInfo | None = None

    def prepare(self, specs: tuple[TensorSpec, ...]) -> None:
        """Plan ``specs`` (a new layout): groups, offsets, views, the flip's copies; allocate what is missing."""
        live = [byte_view(s, self.dest) for s in specs]  # names, shapes, dtypes checked before anything
        names = [s.name for s in specs]
        plan = plan_groups([s.nbytes for s in specs], [t.device for t in live], self.staging_bytes, names)
        self.specs, self.views, self.flips = None, {}, []  # a prepare that fails is redone at the next push
        for device, size in plan.sizes.items():
            if device not in self.buffers or self.buffers[device].numel() < size:
                self._drop(device)  # its memory back before the probe and the new buffer
                self.placed[device] = place(device, size, self.staging_memory, self.margin_bytes)
                self.buffers[device], pinned = allocate(device, size, self.placed[device][0])
                if pinned:
                    self.pinned.add(device)
        staged = [self.buffers[t.device][o : o + t.numel()] for t, o in zip(live, plan.offsets, strict=True)]
        self.views = {
            s.name: b.view(DTYPES[s.dtype]).view(s.shape) for s, b in zip(specs, staged, strict=True)
        }
        pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(plan.groups)]
        for g, d, s in zip(plan.group_of, live, staged, strict=True):
            if d.numel():
                pairs[g].append((d, s))
        self.flips = [CopyList(p, self._graphs) for p in pairs]
        self.group_bytes = [sum(d.numel() for d, _ in p) for p in pairs]
        self.specs, self.plan, self.info = specs, plan, self._describe(specs, plan)
        logger.info("staging for %d tensors: %s", len(specs), self.info)

    def _describe(self, specs: tuple[TensorSpec, ...], plan: GroupPlan) -> StagingInfo:
        push = sum(s.nbytes for s in specs)
        if plan.groups > 1:
            mode, why = (
                "groups",
                (
                    f"the push ({push} bytes) exceeds staging_bytes={self.staging_bytes}: {plan.groups} groups of "
                    f"consecutive tensors, one flip each; steps between the first and last flip run on MIXED weights"
                ),
            )
        elif self.staging_bytes is None:
            mode, why = "whole", "no staging_bytes: staging for the whole push"
        else:
            mode, why = "whole", f"the push ({push} bytes) fits staging_bytes={self.staging_bytes}"
        devices = tuple((str(d), b.numel()) for d, b in self.buffers.items())
        placed = [self.placed[d] for d in self.buffers]
        memory = placed[0][0] if len({m for m, _ in placed}) == 1 else "mixed"
        if len(placed) == 1:
            memory_why = placed[0][1]
        else:
            memory_why = "; ".join(f"{d}: {m}, {w}" for d, (m, w) in zip(self.buffers, placed, strict=True))
        return StagingInfo(
            mode=mode,
            why=why,
            groups=plan.groups,
            push_bytes=push,
            nbytes=sum(b for _, b in devices),
            devices=devices,
            memory=memory,
            memory_why=memory_why,
        )

    def _drop(self, device: torch.device) -> None:
        """Drop ``device``'s buffer (the plan's views of it went at ``prepare``), page-locked or not."""
        buffer = self.buffers.pop(device, None)
        if buffer is not None and device in self.pinned:
            torch.cuda.synchronize(device)  # no copy out of it is in flight
            host_memory.unregister(buffer)
        self.pinned.discard(device)

    def close(self) -> None:
        self.views, self.flips, self.specs = {}, [], None
        for device in list(self.buffers):
            self._drop(device)
        self.placed = {}
