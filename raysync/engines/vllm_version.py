"""What an engine worker's version says about its weights, and when it says nothing.

Used inside vLLM workers by raysync.engines.vllm:

    coverage  note_receive: a version counts only over weights that pushes wrote, all of them (Note [a version
              over every weight])
    print     WeightPrint / take_print / check_weights: a cheap fingerprint of the weights a version was applied
              to, to see whether anything outside raysync changed them since (Note [an engine's version and its
              weights]); forget_version when it did
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch

from raysync.core.version import MIXED, is_version
from raysync.ray import endpoint as ep
from raysync.ray.results import EndpointResult

logger = logging.getLogger(__name__)

_PRINT = "_raysync_print"  # the WeightPrint of the weights the worker's pushes wrote
_FORGOTTEN = "_raysync_forgotten"  # the weights changed outside raysync since the last push that completed
_COVERED = "_raysync_covered"  # engine parameters that pushes wrote since the weights were last unknown
_WRITING = "_raysync_writing"  # engine parameters the receive now running writes (its PushCheck adds to it)


# Note [a version over every weight]
# A push names a version for the weights it writes. A full push writes every engine parameter (its check
# refuses one that does not); a partial push (SyncConfig.include/exclude) leaves some out, and they keep
# what they held. After a full push those are weights of earlier pushes, and the partial push's version is
# what the trainer says it is (the contract of a partial push: what it leaves out did not change). But on a
# fresh engine they are the checkpoint it started from, and after a change outside raysync they are
# whatever that left: the engine would claim a version for weights no push wrote. So every worker keeps the
# engine parameters that pushes wrote completely since its weights were last unknown (the start, a forget:
# Note [an engine's version and its weights]); a push that completes adds its own (counted by its check on the
# meta twin, Note [checking a push before loading]); the worker's version is the push's only when that covers
# every parameter of the engine, and None otherwise (the next push, of any version, is applied, never
# skipped). Partial pushes that together cover every parameter give the version of the last one.
def begin_receive(worker: Any) -> set[str]:
    """Before a receive: the set that this receive's checks fill with the parameters it writes completely."""
    worker.__dict__[_WRITING] = writing = set()
    return writing


def resume_receive(worker: Any, written: set[str]) -> None:
    """Before a staged push is applied (its flip, raysync.engines.vllm_staged): the set its checks filled when
    it was staged, for ``note_receive`` after the flip."""
    worker.__dict__[_WRITING] = written


def writing(worker: Any) -> set[str]:
    """The set of the receive now running (begin_receive), for its loader's PushCheck."""
    return worker.__dict__.setdefault(_WRITING, set())


def note_receive(worker: Any, result: EndpointResult, parameters: frozenset[str] | None) -> EndpointResult:
    """After a receive: add what it wrote to the worker's coverage; when that misses engine ``parameters``,
    the worker holds no version (and the result says so). Returns the result as it stands then."""
    written = worker.__dict__.pop(_WRITING, set())
    if not result.ok or result.report.skipped:
        return result
    covered = worker.__dict__.setdefault(_COVERED, set())
    covered |= written
    missing = sorted(parameters - covered) if parameters is not None else []
    version = ep.applied_version(worker)
    if not missing or not is_version(version):
        return result
    ep.forget_version(worker)
    logger.info(
        "vLLM worker %s holds no version after push %s: %d parameter(s) hold weights no push wrote (%s)",
        worker.rank,
        version,
        len(missing),
        ", ".join(missing[:3]),
    )
    return dataclasses.replace(result, version=None)


def take_print(worker: Any) -> None:
    """After a receive: print the weights the worker's pushes wrote (also while they cover only part of the
    engine, so that a change outside raysync between two partial pushes is seen too)."""
    if ep.applied_version(worker) != MIXED and worker.__dict__.get(_COVERED):
        worker.__dict__[_PRINT] = WeightPrint(worker.model_runner.get_model())
        if is_version(ep.applied_version(worker)):
            worker.__dict__[_FORGOTTEN] = False
    else:
        worker.__dict__.pop(_PRINT, None)


def check_weights(worker: Any) -> None:
    """Forget the worker's version (and coverage) if its weights no longer match the print."""
    weights = worker.__dict__.get(_PRINT)
    if weights is not None and not weights.matches(worker.model_runner.get_model()):
        forget_version(worker, "its weights changed outside raysync")


def forgotten(worker: Any) -> bool:
    """Whether the weights changed outside raysync since the last push that left a version."""
    return bool(worker.__dict__.get(_FORGOTTEN))


def forget_version(worker: Any, why: str) -> None:
    """Every session's receiver, and the worker, hold no version now, and no parameter counts as pushed; MIXED
    stays MIXED (also no version)."""
    old = ep.applied_version(worker)
    worker.__dict__.pop(_PRINT, None)
    worker.__dict__[_FORGOTTEN] = True
    worker.__dict__[_COVERED] = set()
    if old == MIXED:
        return
    ep.forget_version(worker)
    if old is not None:
        logger.warning("vLLM worker %s no longer holds version %s: %s", worker.rank, old, why)


# Note [an engine's version and its weights]
# A worker's version says which push its weights hold, but vLLM can drop or change the weights without raysync:
# sleep(level=2) discards them (they come back as whatever the memory holds), collective_rpc("reload_weights")
# loads a checkpoint, a user's own collective_rpc writes into a parameter. So when a push leaves a version, the
# worker records a WeightPrint of the weights, and before it says or uses its version (versions(), the skip
# decision of the next push) it checks the print: a print that no longer matches makes the version None, and
# the next push is applied (a full push), never skipped. The print is cheap enough for every such call:
#   * every parameter's identity: name, data_ptr, shape, dtype (a parameter replaced or re-allocated);
#   * SAMPLE_WINDOWS windows of SAMPLE_BYTES bytes spread over each parameter, kept as bytes and compared
#     exactly (a parameter of at most SAMPLE_WINDOWS * SAMPLE_BYTES bytes, a norm or a bias, whole);
#   * on the CPU backend, the identity of each layer's GEMM handle (``cpu_linear``): there the linear weights
#     live packed inside it (the Parameter left behind is empty), and every load or reload makes a new one.
# It is a sample, not a digest of every byte: a change that misses every sampled window of every parameter
# (a few elements written in place on GPU) goes unseen; a reload of a checkpoint, a sleep that dropped the
# weights, or any reload on the CPU backend does not. Where raysync drives the change itself (sleep level 2
# through raysync.engines.vllm.sleep), the worker forgets its version explicitly instead.
SAMPLE_WINDOWS = 16
SAMPLE_BYTES = 64
_GEMM_HANDLES = ("cpu_linear",)  # module attributes that hold weights of their own (the CPU backend's)


class WeightPrint:
    """The fingerprint of ``model``'s weights (Note [an engine's version and its weights])."""

    def __init__(self, model: torch.nn.Module):
        self._identity = _identity(model)
        self._sample = _sample(model)
        self._handles = [(name, _ref(h)) for name, h in _handles(model)]

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` still holds the weights this print was taken of."""
        if _identity(model) != self._identity:
            return False
        handles = _handles(model)
        if [n for n, _ in handles] != [n for n, _ in self._handles]:
            return False
        if any(ref() is not h for (_, ref), (_, h) in zip(self._handles, handles, strict=True)):
            return False
        return torch.equal(_sample(model), self._sample)


def _identity(model: torch.nn.Module) -> list[tuple]:
    return [(n, p.data_ptr(), tuple(p.shape), p.dtype, p.device) for n, p in model.named_parameters()]


@torch.no_grad()
def _sample(model: torch.nn.Module) -> torch.Tensor:
    """The sampled bytes of every parameter, in one tensor on the CPU (one copy per device)."""
    windows: dict[torch.device, list[torch.Tensor]] = {}
    for _, p in model.named_parameters():
        if p.numel() == 0 or p.is_meta:
            continue
        flat = (p.detach() if p.is_contiguous() else p.detach().contiguous()).reshape(-1).view(torch.uint8)
        if flat.numel() <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            windows.setdefault(flat.device, []).append(flat)
            continue
        step = (flat.numel() - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
        windows.setdefault(flat.device, []).extend(
            flat[k * step : k * step + SAMPLE_BYTES] for k in range(SAMPLE_WINDOWS)
        )
    parts = [torch.cat(ws).cpu() for ws in windows.values()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _handles(model: torch.nn.Module) -> list[tuple[str, Any]]:
    return [
        (f"{name}.{attr}", module.__dict__[attr])
        for name, module in model.named_modules()
        for attr in _GEMM_HANDLES
        if attr in module.__dict__
    ]


def _ref(handle: Any) -> Any:
    """A weak reference where the handle takes one (a print must not keep old packed weights alive); a
    builtin such as torch.nn.functional.linear takes none and holds no weights: held as it is."""
    try:
        return weakref.ref(handle)
    except TypeError:
        return lambda: handle
