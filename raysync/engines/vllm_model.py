"""The engine's model, seen from a push: what it accepts, its tied output heads, and undoing a failed reload.

Used inside vLLM workers by raysync.engines.vllm's loaders (imports vllm's internals inside the functions that need
them, so it is importable without vllm):

    check     PushCheck / refusals: a push runs through vLLM's own loader on a meta twin of the model first
              (Note [checking a push before loading]); a mismatch refuses it before a byte moves
    tied      tied_heads / follow_embedding: an output head that is the embedding is re-processed after a CPU
              reload (Note [tied output heads])
    undo      Undo: what a reload may change, put back if it fails part-way (Note [undoing a failed reload])
    print     WeightPrint: a cheap fingerprint of the weights a version was applied to, to see whether anything
              outside raysync changed them since (Note [an engine's version and its weights])
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from types import MethodType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raysync.core.errors import LayoutError


# --- what the engine's model accepts ------------------------------------------------------------------------------
# Note [checking a push before loading]
# vLLM refuses a tensor deep inside its loader (an AssertionError for a shape, a ValueError for a name), after
# the tensors before it were loaded; on CPU the layerwise reload has then moved the model to the meta device.
# So every push is first run through vLLM's own loader on a twin of the model whose tensors are on the meta
# device (no memory, no data): the same module tree, the same load_weights, name mapping (hf_to_vllm_mapper,
# stacked q/k/v -> qkv_proj), weight loaders and tensor-parallel shards as the real load, but the loaders
# write into the model-format meta tensors vLLM recorded when it built the model. A tensor the loader
# refuses or does not take, a dtype it cannot cast, and an engine parameter that the push does not write
# completely refuse the push before a byte moves. "Completely" counts the elements the loaders write (copy_,
# fill_), so a fused parameter needs all its parts (qkv_proj: q, k and v). A partial push (the session's
# SyncConfig has include or exclude) may leave engine parameters out: they keep their weights; a parameter it
# touches must still be written completely. A tensor tied to another in the engine's model (lm_head with
# tie_word_embeddings) is refused: the engine has no separate tensor for it.
class PushCheck:
    """Checks a push's tensors against the engine's model (Note [checking a push before loading]); the verdict
    for a layout is kept in ``cache`` (one per worker), so a push of the same layout costs a dict lookup."""

    def __init__(self, model_runner: Any, partial: bool, cache: dict):
        self._runner, self._partial, self._cache = model_runner, partial, cache

    def __call__(self, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        key = (tuple(entries), self._partial)
        if self._cache.get("key") != key:
            problems = refusals(self._runner.get_model(), list(entries), self._partial)
            self._cache.update(key=key, problems=problems)
        problems = self._cache["problems"]
        if problems:
            raise LayoutError(
                f"the push does not fit the engine's model {describe_engine(self._runner)}: {'; '.join(problems)}. "
                f"Nothing was loaded: the engine keeps its weights. Give the trainer the engine's model (same "
                f"architecture and config), cast with SyncConfig.cast_dtype, or leave tensors out with "
                f"SyncConfig.include/exclude (a partial push)"
            )


def refusals(
    model: torch.nn.Module, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], partial: bool
) -> list[str]:
    """What vLLM's loader finds wrong with a push of ``entries`` (name, dtype, shape), one line per kind of
    problem; empty when it would load. Runs on a meta twin of ``model``: nothing of the model is touched."""
    twin = meta_twin(model)
    params = dict(twin.named_parameters())  # a tied parameter once, under its first name
    tied = {alias: first for alias, first in tied_names(model).items() if alias not in params}
    written: dict[str, int] = {}
    refused, dtypes = [], []
    checkable = True
    for name, dtype, shape in entries:
        shown = f"{name} {str(dtype).removeprefix('torch.')}{list(shape)}"
        if name in tied:
            refused.append(
                f"{shown} (the engine's model ties it to {tied[name]}: it has no tensor of its own)"
            )
            continue
        try:
            with _Writes() as writes:
                loaded = set(
                    twin.load_weights([(name, torch.empty(shape, dtype=dtype, device="meta"))]) or ()
                )
        except NotImplementedError:  # a loader that needs real data: it cannot be checked ahead
            checkable = False
            continue
        except Exception as e:
            refused.append(f"{shown} (vLLM: {_first_sentence(e)})")
            continue
        if not loaded & params.keys():
            refused.append(f"{shown} (vLLM's loader has no parameter for it and skips it)")
        for p in loaded & params.keys():
            written[p] = written.get(p, 0) + writes.numel
            if not _castable(dtype, params[p].dtype):
                dtypes.append(f"{shown} into {p} of {str(params[p].dtype).removeprefix('torch.')}")
    problems = [
        _listed("tensor(s) it does not take", refused),
        _listed("tensor(s) of a dtype it cannot take", dtypes),
    ]
    if checkable:
        short = [
            f"{p} ({min(written.get(p, 0), t.numel())} of {t.numel()} elements)"
            for p, t in params.items()
            if written.get(p, 0) < t.numel() and (written.get(p, 0) or not partial)
        ]
        what = "touches but does not write completely" if partial else "does not write"
        problems.append(_listed(f"of its parameter(s) that the push {what}", short))
    return [p for p in problems if p]


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model``'s module tree whose parameters and buffers are meta tensors in model format: the
    ones vLLM recorded when it built the model (CPU linear weights are packed away since), else the tensor's
    own shape. Ties are kept (one twin tensor per tensor); weight loaders are bound to the twin modules, so
    loading into the twin changes nothing of the model."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    twins: dict[int, torch.nn.Module] = {}
    metas: dict[int, torch.Tensor] = {}

    def twin_of(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) not in twins:
            twin = twins[id(module)] = object.__new__(type(module))
            twin.__dict__.update(module.__dict__)  # then its own tensors and submodules:
            info = LAYERWISE_INFO.get(module)
            params, buffers = info.restore_metadata if info is not None else ({}, {})

            def meta(name: str, t: torch.Tensor | None, recorded: dict) -> torch.Tensor | None:
                if t is not None and id(t) not in metas:
                    metas[id(t)] = _meta_like(recorded.get(name, t), module, twin)
                return None if t is None else metas[id(t)]

            twin._parameters = {n: meta(n, t, params) for n, t in module._parameters.items()}
            twin._buffers = {n: meta(n, t, buffers) for n, t in module._buffers.items()}
            twin._modules = {n: None if m is None else twin_of(m) for n, m in module._modules.items()}
        return twins[id(module)]

    return twin_of(model)


def _meta_like(t: torch.Tensor, module: torch.nn.Module, twin: torch.nn.Module) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, class and attributes; its loaders unwrapped from vLLM's reload
    wrappers and bound to ``twin`` instead of ``module``."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    meta = torch.empty_strided(tuple(t.size()), tuple(t.stride()), dtype=t.dtype, device="meta")
    meta.__class__ = t.__class__
    attrs = {}
    for key, value in t.__dict__.items():
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__  # vLLM's layerwise wrapper around the real loader
        if isinstance(value, MethodType) and value.__self__ in (module, layer_ref_sentinel):
            value = MethodType(value.__func__, twin)
        attrs[key] = value
    meta.__dict__ = attrs
    return meta


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """{name: the name it is tied to} for each parameter of ``model`` that another name holds first."""
    first: dict[int, str] = {}
    return {
        n: first[id(p)]
        for n, p in model.named_parameters(remove_duplicate=False)
        if first.setdefault(id(p), n) != n
    }


class _Writes(TorchDispatchMode):
    """Counts the elements written in place (what weight loaders do to their parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _WRITES:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


_WRITES = {
    torch.ops.aten.copy_.default,
    torch.ops.aten.fill_.Scalar,
    torch.ops.aten.fill_.Tensor,
    torch.ops.aten.zero_.default,
}


def _castable(pushed: torch.dtype, param: torch.dtype) -> bool:
    """vLLM's loaders cast one floating dtype to another (as they do a checkpoint's); nothing else."""
    return pushed == param or (pushed.is_floating_point and param.is_floating_point)


def _first_sentence(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}".split(". ")[0]
    return text if len(text) <= 200 else text[:197] + "..."


def _listed(what: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f", ... ({len(items)} in all)" if len(items) > 5 else ""
    return f"{len(items)} {what}: [{', '.join(items[:5])}{more}]"


def describe_engine(model_runner: Any) -> str:
    """The engine's model in words, for messages: architecture, checkpoint, tied embeddings."""
    config = model_runner.vllm_config.model_config
    tied = getattr(config.hf_text_config, "tie_word_embeddings", False)
    return f"{type(model_runner.get_model()).__name__} ({config.model}, tie_word_embeddings={tied})"


# Note [tied output heads]
# With tie_word_embeddings the output head (lm_head) is the embedding's Parameter, and a trainer sends that
# tensor once, as the embedding. On GPU the push writes the shared Parameter and the head follows. On the CPU
# backend the head also holds a packed copy of the weight for its GEMM (made by process_weights_after_loading),
# and vLLM's layerwise reload re-processes only the layers it loaded: the head would keep multiplying with
# the old embedding. After the reload, a head tied to another module is processed again from the shared
# Parameter, which now holds the new embedding.
def tied_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose parameters belong to a module met earlier in the model (the output head of a model with
    tie_word_embeddings): Note [tied output heads]."""
    owner: dict[int, torch.nn.Module] = {}
    heads: list[torch.nn.Module] = []
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and owner.setdefault(id(p), module) is not module and module not in heads:
                heads.append(module)
    return heads


def follow_embedding(heads: list[torch.nn.Module]) -> None:
    """Re-make what vLLM derived from the weights of each tied head (Note [tied output heads])."""
    for head in heads:
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)


# Note [undoing a failed reload]
# vLLM's layerwise reload moves every layer's parameters to the meta device, buffers the tensors of each
# layer until it is complete, then materializes the layer, loads it, re-processes it (on CPU: packs its
# linear weights into a new GEMM handle kept in the layer's attributes) and copies the result into the
# original tensors. An exception part-way leaves later layers on meta (the next generate fails inside the
# engine step, and vLLM's in-process engine then hangs on the request it kept), and leaves vLLM's per-layer
# bookkeeping (LAYERWISE_INFO) half-filled: the next reload skips those layers' set-up and replays the failed
# push's buffered tensors. So before a reload, Undo keeps what it may change: every module's attributes
# (parameter and buffer entries, GEMM handles), every tensor's attributes (weight loaders) and a copy of its
# data (on CPU the linear weights are packed into the handles, so that copy is mostly embeddings and norms);
# restore() resets vLLM's bookkeeping and puts all of it back.
class Undo:
    """What a reload may change in ``model``, to put back if it fails: Note [undoing a failed reload]."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._modules = [
            (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()
        ]
        tensors = {
            id(t): t for _, _, ps, bs in self._modules for t in (*ps.values(), *bs.values()) if t is not None
        }
        self._tensors = [(t, dict(t.__dict__), t.detach().clone()) for t in tensors.values()]

    @torch.no_grad()
    def restore(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, LOADING_LAYERS

        for module, attrs, params, buffers in self._modules:
            info = LAYERWISE_INFO.get(module)
            if info is not None:
                info.reset()  # drops the failed push's buffered tensors and wrapped loaders' progress
            for key in [k for k in module.__dict__ if k not in attrs]:
                del module.__dict__[key]
            module.__dict__.update(attrs)
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        LOADING_LAYERS.clear()
        for t, attrs, data in self._tensors:
            t.__dict__.clear()
            t.__dict__.update(attrs)
            if t.shape == data.shape and t.dtype == data.dtype:
                t.data.copy_(data)  # the same storage: whatever holds the tensor sees the old values
            else:
                t.data = data
        on_meta = [n for n, t in (*self._model.named_parameters(), *self._model.named_buffers()) if t.is_meta]
        if on_meta:
            raise RuntimeError(f"{len(on_meta)} tensor(s) still on the meta device: {on_meta[:5]}")


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
