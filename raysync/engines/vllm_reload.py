"""How a push reaches an engine worker's weights: as if the engine had loaded them from a checkpoint at start.

Used inside vLLM workers by raysync.engines.vllm (imports vllm's internals inside the functions that need them):

    loader_for     picks the loader for a worker: Note [a reload as if from a checkpoint]
    StagedReload   CPU: the push kept whole, applied at its end by ``model_runner.reload_weights`` (vLLM's
                   layerwise reload inside), undone if it fails part-way
    LayerwiseLoad  GPU, vLLM with layerwise reload: every bucket through ``model.load_weights``, each layer
                   processed by vLLM once all of its tensors are in
    ProcessedLoad  GPU, vLLM without it: every bucket through ``model.load_weights``, then
                   ``process_weights_after_loading`` of each module the push wrote
    refusal        what about a model raysync cannot reload that way, said before any byte moves

# Note [a reload as if from a checkpoint]
# vLLM does not run a model on the tensors it loads: after loading, ``process_weights_after_loading`` turns
# them into what the kernels take (the CPU backend packs linear weights into a GEMM handle and leaves the
# Parameter empty; FP8 methods quantize or transpose; fused-MoE methods pad and set up their kernel; MLA
# attention derives its absorbed matrices). A push must end in that state, not in the checkpoint's.
#   * vLLM with ``vllm/model_executor/model_loader/reload/`` (0.32 here) has layerwise reload: it puts every
#     layer's checkpoint-format tensors back (on the meta device), lets the model's own load_weights fill
#     them, processes each layer once all its tensors are in, and copies the result into the tensors the engine
#     runs on. raysync uses it: on CPU through ``model_runner.reload_weights`` at the end of a staged push
#     (atomic: Note [undoing a failed reload]), on GPU bucket by bucket (LayerwiseLoad: a layer is processed
#     as soon as it is complete, and ``finalize_layerwise_reload`` runs after the last bucket, or after a
#     push that failed, so that no layer stays on the meta device; such a push leaves the weights MIXED).
#     Refused: weights offloaded to host memory (vLLM's layerwise reload does not handle offloading).
#   * Without it, on GPU, every bucket goes through load_weights and the modules it wrote are processed again.
#     That is right only where processing keeps the checkpoint's layout in the Parameters (unquantized
#     linear, embedding and fused-MoE methods); refused: a quantized model, MLA attention, and the CPU backend
#     (whose packed linear weights cannot be loaded twice).
# A refusal comes from the loader's check, when the push is accepted: nothing is touched, and the engine
# keeps generating on the weights it has.

# Note [fused experts after a weight update]
# vLLM 0.32's unquantized fused-MoE method, on a weight update (its kernel already set up), copies the new
# weights into the experts' Parameters but skips the experts' own post-load step
# (``moe_kernel.fused_experts.process_weights_after_loading``), which on the CPU backend prepacks w13/w2 into
# the layout its grouped GEMM reads. After vLLM's own reload_weights the experts then hold the checkpoint's
# layout while the kernel reads them as packed: wrong outputs, silently (found by tests/test_vllm_reload.py,
# whose tokens differed; after vLLM's reload_weights alone, w13 held the checkpoint's gate|up rows as they
# are, and in the engine loaded from disk the same values were permuted by the prepack). So after a reload on CPU, raysync runs that step for every fused-MoE layer the push wrote
# (``redo_expert_packing``); a layer the push left out keeps its packed weights and is not packed twice. On
# GPU the step is a no-op for vLLM's default experts and is not run by raysync (untested there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raysync.core.errors import LayoutError, ReloadFailed, WeightsMixed
from raysync.core.wire import DTYPES, TensorSpec
from raysync.engines.vllm_model import PushCheck, Undo, describe_engine, follow_embedding, tied_heads

_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod")


def has_layerwise_reload() -> bool:
    """Whether the installed vLLM has layerwise reload (vllm/model_executor/model_loader/reload/)."""
    try:
        from vllm.model_executor.model_loader.reload import (  # noqa: F401
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return False
    return True


def refusal(model_runner: Any, *, layerwise: bool, on_cpu: bool) -> str | None:
    """Why raysync cannot leave this engine as if it had loaded a push from a checkpoint, or None
    (Note [a reload as if from a checkpoint])."""
    offload = getattr(model_runner.vllm_config, "offload_config", None)
    uva = getattr(offload, "uva", None)
    prefetch = getattr(offload, "prefetch", None)
    if getattr(uva, "cpu_offload_gb", 0) > 0 or getattr(prefetch, "offload_group_size", 0) > 0:
        return (
            "its weights are offloaded to host memory (offload_config), which vLLM's reload does not handle"
        )
    if layerwise:
        return None
    if on_cpu:
        return (
            "this vLLM has no layerwise reload, and its CPU backend packs linear weights after loading "
            "(they cannot be loaded twice)"
        )
    model = model_runner.get_model()
    quantized = sorted(
        {
            type(m.quant_method).__name__
            for m in model.modules()
            if getattr(m, "quant_method", None) is not None
            and type(m.quant_method).__name__ not in _UNQUANTIZED
        }
    )
    if quantized:
        return (
            f"it is quantized ({', '.join(quantized)}) and this vLLM has no layerwise reload: processing "
            f"again weights loaded into processed Parameters would be wrong"
        )
    if getattr(model_runner.vllm_config.model_config, "use_mla", False):
        return "it uses MLA attention, whose derived matrices this vLLM (no layerwise reload) cannot redo"
    return None


def loader_for(worker: Any, check: PushCheck) -> Any:
    """The load function for one push into ``worker`` (Note [a reload as if from a checkpoint]): its
    extension's ``raysync_reload_refusal()`` says whether raysync can reload it at all, its
    ``raysync_cpu_staged`` whether a CPU worker stages the push (atomic) or loads it bucket by bucket."""
    why = worker.raysync_reload_refusal()
    if why is not None:
        return Refused(worker.model_runner, why)
    on_cpu = worker.device.type == "cpu"
    if on_cpu and worker.raysync_cpu_staged:
        return StagedReload(worker.model_runner, check)
    if has_layerwise_reload():
        return LayerwiseLoad(worker.model_runner, check, on_cpu=on_cpu)
    return ProcessedLoad(worker.model_runner, check)


def redo_expert_packing(model: torch.nn.Module, written: set[str]) -> list[str]:
    """After a reload on CPU: the fused experts' own post-load step for each fused-MoE layer with a Parameter in
    ``written`` (engine names): Note [fused experts after a weight update]. Returns the layers redone."""
    redone = []
    for name, module in model.named_modules():
        experts = getattr(
            getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None
        )
        if experts is None or not any(
            f"{name}.{p}" in written for p, _ in module.named_parameters(recurse=False)
        ):
            continue
        experts.process_weights_after_loading(module)
        redone.append(name)
    return redone


class _Checked:
    """The part every loader shares: its check when the push is accepted, and nothing to close."""

    def __init__(self, model_runner: Any, check: PushCheck):
        self._runner, self._check = model_runner, check

    def check(self, specs: Sequence[TensorSpec]) -> None:
        """Called by the receiver when a push is accepted, before any byte moves."""
        self._check([(s.name, DTYPES[s.dtype], tuple(s.shape)) for s in specs])

    def close(self) -> None:
        """After the receive, whatever became of it."""


class Refused(_Checked):
    """An engine raysync cannot reload as from a checkpoint: every push is refused at accept."""

    def __init__(self, model_runner: Any, why: str):
        super().__init__(model_runner, None)
        self._why = why

    def check(self, specs: Sequence[TensorSpec]) -> None:
        raise LayoutError(
            f"raysync cannot load a push into {describe_engine(self._runner)} as vLLM loads a checkpoint: "
            f"{self._why}. Nothing was loaded: the engine keeps its weights (docs/vllm.md says what each vLLM "
            f"version supports)"
        )

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        raise LayoutError(self._why)  # never reached: check refused the push


# Note [layerwise reload keeps tensors]
# vLLM's layerwise reload does not copy a tensor when its loader is called: it keeps the call's arguments until
# every tensor of the layer is in, and loads them all then. The tensors a receiver hands over are views of the
# ring buffer, which the sender overwrites with the next bucket (Note [ring buffer views] in raysync.core.sink),
# so LayerwiseLoad hands vLLM a copy of each (tests/test_vllm_reload.py, bucket by bucket: without the copy
# the pushed engine's tokens differed from those of the engine loaded from disk; with it they are the same).
# A copy lives until its layer is processed.
class LayerwiseLoad(_Checked):
    """vLLM with layerwise reload, on GPU (or on CPU without staging): each bucket through
    ``model.load_weights``; vLLM processes each layer once all of its tensors are in. Not atomic: a push that
    fails part-way leaves the weights mixed (and ``close`` puts every layer back off the meta device).
    ``on_cpu``: re-make tied output heads (the CPU backend's packed copy: Note [tied output heads]; on GPU the
    head is the embedding's Parameter) and fused experts (Note [fused experts after a weight update]) after."""

    def __init__(self, model_runner: Any, check: PushCheck, *, on_cpu: bool = False):
        super().__init__(model_runner, check)
        self._open, self._on_cpu = False, on_cpu
        self._heads: list[torch.nn.Module] = []

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self._runner.get_model()
        if not self._open:
            self._heads = tied_heads(model) if self._on_cpu else []  # before: while it runs, ties are broken
            initialize_layerwise_reload(model)
            self._open = True
        model.load_weights([(name, t.clone()) for name, t in batch])  # Note [layerwise reload keeps tensors]

    def close(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._open:
            self._open = False
            model = self._runner.get_model()
            finalize_layerwise_reload(model, self._runner.vllm_config.model_config)
            follow_embedding(self._heads)
            if self._on_cpu:
                redo_expert_packing(model, self._check.written)


class ProcessedLoad(_Checked):
    """GPU, vLLM without layerwise reload: each bucket through ``model.load_weights``, then each module the
    push wrote processed again (only for models ``refusal`` lets through). Not atomic."""

    def __init__(self, model_runner: Any, check: PushCheck):
        super().__init__(model_runner, check)
        self._loaded: set[str] = set()

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self._loaded |= set(self._runner.get_model().load_weights(batch) or ())

    def close(self) -> None:
        loaded, self._loaded = self._loaded, set()
        model = self._runner.get_model()
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is not None and any(n.startswith(f"{name}.") for n in loaded):
                method.process_weights_after_loading(module)


class StagedReload(_Checked):
    """CPU: keeps a copy of every tensor of a push and applies the whole push at its end through
    ``reload_weights`` (a second plain load_weights fails on the CPU backend, which repacks linear weights).
    Atomic: a reload that fails part-way is undone (Note [undoing a failed reload]), or says WeightsMixed.
    ``hold``: a staged push (raysync.engines.vllm_staged): ``finish`` checks the copies and keeps them, and
    ``apply`` reloads them later, at the flip."""

    def __init__(self, model_runner: Any, check: PushCheck, *, hold: bool = False):
        super().__init__(model_runner, check)
        self._staged: list[tuple[str, torch.Tensor]] = []
        self.hold = hold

    @property
    def nbytes(self) -> int:
        """Host (or device) memory held by the copies: the push's tensors in the checkpoint's format."""
        return sum(t.nbytes for _, t in self._staged)

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self._staged.extend((name, t.clone()) for name, t in batch)  # Note [ring buffer views]

    def finish(self) -> None:
        """After the last bucket: the copies checked (also where no receiver asked), then applied now, or
        kept for ``apply`` (``hold``)."""
        self._check([(name, t.dtype, tuple(t.shape)) for name, t in self._staged])
        if not self.hold:
            self.apply()

    def drop(self) -> None:
        """Free the copies (a staged push discarded)."""
        self._staged = []

    def apply(self) -> None:
        staged, self._staged = self._staged, []
        model = self._runner.get_model()
        heads = tied_heads(model)  # found before the reload: while it runs, ties are broken
        undo = Undo(model)
        try:
            self._runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
            follow_embedding(heads)
            redo_expert_packing(model, self._check.written)
        except Exception as e:
            self._undo(undo, e)
            raise ReloadFailed(
                f"vLLM's reload of the push into {describe_engine(self._runner)} failed part-way "
                f"({type(e).__name__}: {e}); the engine's weights were put back as they were before the push"
            ) from e

    def _undo(self, undo: Undo, error: Exception) -> None:
        try:
            undo.restore()
        except Exception as e:
            raise WeightsMixed(
                f"vLLM's reload of the push into {describe_engine(self._runner)} failed part-way "
                f"({type(error).__name__}: {error}) and the old weights could not be put back ({type(e).__name__}: "
                f"{e}): the engine holds a mix of two versions until a push of every tensor completes"
            ) from error
