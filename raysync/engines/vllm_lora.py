"""vLLM serving pushed LoRA adapters (issue 23): each adapter push (raysync.sources.lora) is loaded into vLLM from
the pushed tensors, never from a directory, as a new adapter version; several versions are served at once, each
held while requests run on it.

Engine side, in the user's rollout actor, an LLM with LoRA enabled and this module's worker extension (vLLM
mixes it into each worker; it is also raysync.engines.vllm's WorkerExtension, for full pushes of the base weights),
and the adapter versions that requests take:

    self.llm = LLM(model, enable_lora=True, max_lora_rank=r, max_cpu_loras=n,
                   worker_extension_cls="raysync.engines.vllm_lora.LoraWorkerExtension", ...)
    self.adapters = VllmAdapters(self.llm)
    with self.adapters.request() as lease:                  # the latest version, held until the request ends
        self.llm.generate(prompts, params, lora_request=lease.lora_request)

Driver side (Note [adapter pushes through WeightSync] in raysync.engines.torch_lora):

    WeightSync([trainer], [VllmEngine(rollout, lora="adapters")], config, source=AdapterOf(lora_config))

# Note [adapters from tensors in vLLM]
# vLLM (0.32) loads an adapter from a directory: a request's LoRARequest.lora_path reaches the worker's
# LRUCacheWorkerLoRAManager.add_adapter, which, for an id it has not registered, reads the directory
# (_load_adapter: PEFTHelper.from_local_dir, LoRAModel.from_local_checkpoint -> LoRAModel.from_lora_tensors). The
# worker here makes the LoRAModel itself: ``LoRAModel.from_lora_tensors`` with the pushed tensors and a PEFTHelper
# made from the push's manifest (Note [the adapter manifest] in raysync.sources.lora), and registers it with the
# worker's adapter manager under a new id, pinned in its CPU cache. A request names it with a LoRARequest of that
# id whose lora_path is a placeholder: the manager finds the id registered and only touches it, so the path is
# never read. Pinned, the adapter is never evicted from the CPU cache (evicted, vLLM would try to load it again
# from the placeholder); ``raysync_lora_remove`` unregisters it, which unpins it. The adapters vLLM keeps in
# its GPU slots (``max_loras``) come and go as vLLM needs them, from the registered tensors. So ``max_cpu_loras``
# bounds the versions held at once (plus any adapters loaded from disk).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raysync.core.errors import LayoutError
from raysync.core.wire import TensorSpec
from raysync.engines.torch_lora import HeldVersions, endpoint_of, with_adapter_sink
from raysync.engines.vllm import WorkerExtension, from_plain, to_plain
from raysync.ray import endpoint as ep
from raysync.ray.results import EndpointResult, RemoteFailure
from raysync.sources.lora import MANIFEST, Manifest, specs_by_module

PLACEHOLDER = "raysync-pushed-adapter"  # a LoRARequest's lora_path: never read (Note [adapters from tensors])
_IDS = "_raysync_lora_ids"


class TensorsLoad:
    """The load function of one adapter push in a vLLM worker: ``check`` refuses, before a byte moves, an adapter
    whose modules the model cannot adapt or whose rank is over ``max_lora_rank``; each call keeps a copy of what
    it is given; ``finish`` checks the manifest against the tensors and registers the adapter (``register``)."""

    def __init__(self, worker: Any):
        self._worker = worker
        self.tensors: dict[str, torch.Tensor] = {}
        self._modules: tuple[str, ...] = ()
        self.lora_int_id: int | None = None

    def check(self, specs: Sequence[TensorSpec]) -> None:
        modules, manifest = specs_by_module(specs)
        if manifest is None:
            raise LayoutError(f"an adapter push carries its manifest {MANIFEST!r}; this one does not")
        manager = self._worker.model_runner.lora_manager
        expected, max_rank = adaptable_modules(manager), manager.lora_config.max_lora_rank
        for module, (a, _) in modules.items():
            if module.rsplit(".", 1)[-1] not in expected:
                raise LayoutError(
                    f"adapter module {module!r}: vLLM adapts only {sorted(expected)} in this model"
                )
            if specs[a].shape[0] > max_rank:
                raise LayoutError(
                    f"{module!r}: rank {specs[a].shape[0]} is over the engine's max_lora_rank {max_rank}"
                )
        self.tensors, self._modules = {}, tuple(modules)

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in batch:
            self.tensors[name] = tensor.to("cpu", copy=True)  # Note [ring buffer views]

    def finish(self) -> None:
        manifest = Manifest.decode(self.tensors.pop(MANIFEST))
        shapes = {
            m: (
                tuple(self.tensors[f"{m}.lora_A.weight"].shape),
                tuple(self.tensors[f"{m}.lora_B.weight"].shape),
            )
            for m in self._modules
        }
        manifest.check(shapes)
        try:
            self.lora_int_id = register(self._worker, self.tensors, manifest)
        except LayoutError:
            raise
        except (ValueError, RuntimeError, KeyError) as e:  # vLLM's own checks of an adapter
            raise LayoutError(f"vLLM refused the adapter: {type(e).__name__}: {e}") from e
        self.tensors = {}


def adaptable_modules(manager: Any) -> set[str]:
    """The module names (last components) vLLM's LoRA layers of this model take, packed ones unpacked (as
    vLLM's own _load_adapter lists them)."""
    inner = manager._adapter_manager
    packed = inner.packed_modules_mapping
    names: set[str] = set()
    for module in inner.supported_lora_modules:
        names.update(packed.get(module, [module]))
    return names


def register(worker: Any, tensors: dict[str, torch.Tensor], manifest: Manifest) -> int:
    """Make a LoRAModel of ``tensors`` and register it, pinned, under a new id (Note [adapters from tensors])."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    c = manifest.config
    helper = PEFTHelper.from_dict(
        {
            "r": c.r,
            "lora_alpha": c.alpha,
            "target_modules": list(c.target_modules),
            "use_rslora": c.use_rslora,
        }
    )
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora_int_id = next(worker.__dict__.setdefault(_IDS, itertools.count(1)))
    lora = LoRAModel.from_lora_tensors(
        lora_int_id,
        tensors,
        helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    inner = manager._adapter_manager
    if len(inner) + 1 > inner.capacity:
        raise LayoutError(
            f"the engine holds {len(inner)} adapters, its max_cpu_loras: a new version needs one more; finish the "
            f"requests on older versions or raise max_cpu_loras"
        )
    inner.add_adapter(lora)
    inner._registered_adapters.pin(lora_int_id)
    return lora_int_id


class LoraWorkerExtension(WorkerExtension):
    """``LLM(..., enable_lora=True, worker_extension_cls="raysync.engines.vllm_lora.LoraWorkerExtension")``: the
    WorkerExtension of full pushes, and adapter pushes beside them. Every name starts with ``raysync_``: vLLM
    refuses an extension whose names clash with its Worker's. Arguments and results are plain values (Note [what
    crosses vLLM's channel] in raysync.engines.vllm)."""

    def raysync_lora_call(self, name: str, args: list | dict[str, list]) -> dict[str, Any]:
        """``raysync_call`` for adapter pushes: endpoint function ``name`` on this worker's AdapterEndpoint, the
        driver's sink replaced by TensorsLoad (Note [adapter pushes through WeightSync] in
        raysync.engines.torch_lora). Returns {rank: {"result": ..., "lora_int_id": the adapter a receive
        registered, or None}}; an adapter registered by a receive that then failed is removed here."""
        fn, values = self._raysync_args(name, args)
        if values is None:
            return {}
        endpoint = endpoint_of(self, "vllm", self, TensorsLoad)
        result = fn(endpoint, *with_adapter_sink(values))
        lora_int_id = None
        if fn is ep.receiver_receive and endpoint.load is not None:
            lora_int_id, endpoint.load = endpoint.load.lora_int_id, None
            if lora_int_id is not None and not result.ok:  # registered, then the push failed after all
                self.raysync_lora_remove(lora_int_id)
                lora_int_id = None
        return {str(self.rank): {"result": to_plain(result), "lora_int_id": lora_int_id}}

    def raysync_lora_remove(self, lora_int_id: int) -> bool:
        """Unregister (and unpin) one adapter version."""
        return self.model_runner.lora_manager.remove_adapter(lora_int_id)

    def raysync_lora_forget(self) -> None:
        """The engine did not take the adapter this worker received: its sessions hold no version now, so the
        next push is applied, never skipped (Note [versions never lie])."""
        ep.forget_version(endpoint_of(self, "vllm", self, TensorsLoad))

    def raysync_lora_held(self) -> list[int]:
        return sorted(self.model_runner.lora_manager.list_adapters())


def on_adapter_engine(llm: Any, adapters: Any, name: str, args: list | dict[str, list]) -> dict[int, Any]:
    """Runs in the engine's actor (raysync.engines.vllm._on_engine, ``VllmEngine(lora=...)``): endpoint function
    ``name`` in every worker, on its adapter sessions; a receive that every worker completed is installed in
    ``adapters`` as the push's version. No prefix-cache reset: a version's cached blocks are keyed by its own
    adapter name (``Held.name``), which no other version has."""
    if not isinstance(adapters, VllmAdapters):
        raise TypeError(
            f"VllmEngine(lora=...) names the actor's VllmAdapters, not a {type(adapters).__name__}"
        )
    if inspect.iscoroutinefunction(llm.collective_rpc):
        raise TypeError("adapter pushes reach an LLM; an AsyncLLM does not take them (not built)")
    results: dict[int, Any] = {}
    ids: dict[int, int | None] = {}
    for reply in llm.collective_rpc("raysync_lora_call", args=(name, args)):
        for rank, answer in reply.items():
            results[int(rank)] = from_plain(answer["result"])
            ids[int(rank)] = answer["lora_int_id"]
    return adapters.landed(results, ids) if name == "receiver_receive" else results


@dataclass(frozen=True)
class Held:
    """One adapter version as vLLM serves it."""

    version: int
    lora_int_id: int
    name: str

    def lora_request(self) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, lora_path=f"{PLACEHOLDER}/{self.name}")


class VllmLease:
    """One request's hold on one adapter version: pass ``lora_request`` to vLLM; ``close`` when it finished."""

    def __init__(self, adapters: VllmAdapters, held: Held):
        self._adapters, self.held, self.closed = adapters, held, False
        self.lora_request = held.lora_request()

    @property
    def version(self) -> int:
        return self.held.version

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._adapters.release(self.held)

    def __enter__(self) -> VllmLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VllmAdapters:
    """The adapter versions of a vLLM ``LLM`` made with ``LoraWorkerExtension`` (Note [adapter versions and
    requests] in raysync.engines.torch_lora): each push a new version; a version no longer the latest is removed
    from vLLM when its last request is done."""

    def __init__(self, llm: Any, name: str = "raysync"):
        self.llm, self.name = llm, name
        self._held = HeldVersions()

    def landed(
        self, results: dict[int, EndpointResult], ids: dict[int, int | None]
    ) -> dict[int, EndpointResult]:
        """One receive's answers, by worker rank, and the adapter id each registered: when every worker
        registered the same adapter it becomes the latest version (what ``request()`` gets). Otherwise it is
        removed from every worker, their sessions forget the version (the next push is applied, not skipped),
        and a worker that received it answers a failure: the engine does not serve it."""
        done = [r for r in results.values() if r.ok and not r.report.skipped]
        if not done:
            return results
        registered = set(ids.values())
        if len(done) == len(results) and len(registered) == 1 and None not in registered:
            [lora_int_id], version = registered, done[0].report.version
            held = Held(version, lora_int_id, f"{self.name}-v{version}-{lora_int_id}")  # a name of its own
            self._remove(self._held.install(version, held))
            return results
        for lora_int_id in registered - {None}:
            self.llm.collective_rpc("raysync_lora_remove", args=(lora_int_id,))
        self.llm.collective_rpc("raysync_lora_forget")
        why = RemoteFailure(
            "apply",
            f"the engine's workers did not all register one adapter (ids by rank: {ids}): removed",
            "",
        )
        return {k: EndpointResult(failure=why) if r.ok else r for k, r in results.items()}

    def request(self, version: int | None = None) -> VllmLease:
        return VllmLease(self, self._held.acquire(version))

    def release(self, held: Held) -> None:
        self._remove(self._held.release(held))

    def versions(self) -> dict[int, int]:
        """The adapter versions held -> how many requests run on each."""
        return self._held.versions()

    def _remove(self, dropped: list[Held]) -> None:
        for held in dropped:
            self.llm.collective_rpc("raysync_lora_remove", args=(held.lora_int_id,))
