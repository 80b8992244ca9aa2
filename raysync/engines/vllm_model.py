"""The engine's model, seen from a push: what it accepts, its tied output heads, and undoing a failed reload.

Used inside vLLM workers by raysync.engines.vllm's loaders (imports vllm's internals inside the functions that need
them, so it is importable without vllm):

    check     PushCheck / check_push: a push runs through vLLM's own loader on a meta twin of the model first
              (Note [checking a push before loading]); a mismatch refuses it before a byte moves
    tied      tied_heads / follow_embedding: an output head that is the embedding is re-processed after a CPU
              reload (Note [tied output heads])
    undo      Undo: what a reload may change, put back if it fails part-way (Note [undoing a failed reload])
"""

from __future__ import annotations

import dataclasses
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
# touches must still be written completely, and so must every parameter of a layer it touches (vLLM's layerwise
# reload processes a layer once, from all of its parameters: one left out would come from uninitialized memory,
# e.g. qkv_proj.bias pushed without qkv_proj.weight). A tensor tied to another in the engine's model (lm_head with
# tie_word_embeddings) is refused: the engine has no separate tensor for it.
class PushCheck:
    """Checks a push's tensors against the engine's model (Note [checking a push before loading]); the verdict
    for a layout is kept in ``cache`` (one per worker), so a push of the same layout costs a dict lookup. The
    engine parameters each checked push writes completely are added to ``written`` (Note [a version over
    every weight], in raysync.engines.vllm_version)."""

    def __init__(self, model_runner: Any, partial: bool, cache: dict, written: set[str] | None = None):
        self._runner, self._partial, self._cache = model_runner, partial, cache
        self._written = written if written is not None else set()

    def __call__(self, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        key = (tuple(entries), self._partial)
        if self._cache.get("key") != key:
            verdict = check_push(self._runner.get_model(), list(entries), self._partial)
            self._cache.update(key=key, verdict=verdict)
        verdict: Verdict = self._cache["verdict"]
        if verdict.problems:
            raise LayoutError(
                f"the push does not fit the engine's model {describe_engine(self._runner)}: "
                f"{'; '.join(verdict.problems)}. Nothing was loaded: the engine keeps its weights. Give the "
                f"trainer the engine's model (same architecture and config), cast with SyncConfig.cast_dtype, or "
                f"leave tensors out with SyncConfig.include/exclude (a partial push)"
            )
        self._written |= verdict.written

    @property
    def written(self) -> set[str]:
        """The engine parameters the pushes checked by this PushCheck write completely."""
        return self._written


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What vLLM's loader makes of a push: ``problems`` (one line per kind; empty when it would load), the engine
    parameters it writes completely (``written``) out of all of them (``parameters``), by their engine names."""

    problems: tuple[str, ...]
    written: frozenset[str]
    parameters: frozenset[str]


def check_push(
    model: torch.nn.Module, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], partial: bool
) -> Verdict:
    """Runs a push of ``entries`` (name, dtype, shape) through vLLM's loader on a meta twin of ``model``: nothing
    of the model is touched. A loader that needs real data cannot be checked ahead: a full push is then taken at
    its word (every parameter written), a partial one as writing none."""
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
    complete = {p for p, t in params.items() if written.get(p, 0) >= t.numel()}
    if checkable:
        short = [
            f"{p} ({min(written.get(p, 0), t.numel())} of {t.numel()} elements)"
            for p, t in params.items()
            if p not in complete and (written.get(p, 0) or not partial)
        ]
        what = "touches but does not write completely" if partial else "does not write"
        problems.append(_listed(f"of its parameter(s) that the push {what}", short))
        if partial:
            split = _split(params, complete)
            problems.append(
                _listed("layer(s) the push writes only part of (vLLM reloads a layer whole)", split)
            )
    elif not partial:
        complete = set(params)
    else:
        complete = set()
    return Verdict(tuple(p for p in problems if p), frozenset(complete), frozenset(params))


def _split(params: dict[str, torch.Tensor], complete: set[str]) -> list[str]:
    """Layers (modules) with some of their own parameters in ``complete`` and some not: vLLM's layerwise reload
    processes a layer once, from all its parameters, and would take the ones left out from uninitialized memory."""
    layers: dict[str, set[str]] = {}
    for p in params:
        layers.setdefault(p.rpartition(".")[0], set()).add(p)
    return [
        f"{layer} ({', '.join(sorted(p.rpartition('.')[2] for p in own - complete))} left out)"
        for layer, own in layers.items()
        if own & complete and own - complete
    ]


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
