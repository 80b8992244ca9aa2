"""vLLM serving pushed LoRA adapters (issue 23): each adapter push (raysync.sources.lora) is loaded into vLLM from
the pushed tensors, never from a directory, as a new adapter version; several versions are served at once, each
held while requests run on it.

Engine side, a worker extension (vLLM mixes it into each worker; LoRA enabled):

    llm = LLM(model, enable_lora=True, max_lora_rank=r, max_cpu_loras=n,
              worker_extension_cls="raysync.engines.vllm_lora.LoraWorkerExtension", ...)

Where the requests are made (the process that holds ``llm``):

    adapters = VllmAdapters(llm)
    adapters.connect(sender.endpoints, secret, config)      # one receiver per worker (a fan-out sender)
    adapters.receive()                                      # one push -> one adapter version
    with adapters.request() as lease:                       # the latest version, held until the request ends
        llm.generate(prompts, params, lora_request=lease.lora_request)

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

import itertools
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raysync.core.config import SyncConfig
from raysync.core.errors import LayoutError, RaysyncError, RemoteError
from raysync.core.receiver import WeightReceiver
from raysync.core.wire import SessionSecret, TensorSpec
from raysync.engines.torch_lora import HeldVersions
from raysync.sources.lora import MANIFEST, Manifest, specs_by_module

PLACEHOLDER = "raysync-pushed-adapter"  # a LoRARequest's lora_path: never read (Note [adapters from tensors])
_RECEIVER = "_raysync_lora_receiver"
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


class LoraWorkerExtension:
    """``LLM(..., enable_lora=True, worker_extension_cls="raysync.engines.vllm_lora.LoraWorkerExtension")``. Every
    name starts with ``raysync_lora_``: vLLM refuses an extension whose names clash with its Worker's. Arguments
    and results are plain values (Note [what crosses vLLM's channel] in raysync.engines.vllm)."""

    def raysync_lora_connect(self, endpoints: list[str], secret: dict, config: dict) -> None:
        """Connect this worker's receiver to ``endpoints[rank]``; ``secret`` and ``config`` as to_plain makes
        them (raysync.engines.vllm: only allowlisted types are rebuilt)."""
        from raysync.engines.vllm import from_plain

        secret, config = from_plain(secret), from_plain(config)
        if not isinstance(secret, SessionSecret) or not isinstance(config, SyncConfig):
            raise LayoutError("raysync_lora_connect takes a SessionSecret and a SyncConfig")
        old = self.__dict__.pop(_RECEIVER, None)
        if old is not None:
            old.close()
        self.__dict__[_RECEIVER] = WeightReceiver(endpoints[self.rank], secret, config)

    def raysync_lora_receive(self, wait_s: float | None = None) -> dict[str, Any]:
        """Serve one adapter push; the adapter is registered before the push counts as applied."""
        receiver = self.__dict__.get(_RECEIVER)
        if receiver is None:
            raise RuntimeError("raysync_lora_receive before raysync_lora_connect")
        load = TensorsLoad(self)
        try:
            report = receiver.receive(load_fn=load, wait_s=wait_s)
        except BaseException as e:
            if load.lora_int_id is not None:  # registered, then the push failed after all
                self.raysync_lora_remove(load.lora_int_id)
            if not isinstance(e, RaysyncError):
                raise
            # plain values: vLLM's channel (and Ray's) cannot rebuild raysync's errors; the driver raises it
            stage = getattr(e, "stage", "receive")
            return {"failed": [type(e).__name__, stage, str(e), traceback.format_exc()], "rank": self.rank}
        return {
            "version": report.version,
            "skipped": report.skipped,
            "bytes": report.bytes,
            "lora_int_id": load.lora_int_id,
        }

    def raysync_lora_remove(self, lora_int_id: int) -> bool:
        """Unregister (and unpin) one adapter version."""
        return self.model_runner.lora_manager.remove_adapter(lora_int_id)

    def raysync_lora_held(self) -> list[int]:
        return sorted(self.model_runner.lora_manager.list_adapters())

    def raysync_lora_close(self) -> None:
        receiver = self.__dict__.pop(_RECEIVER, None)
        if receiver is not None:
            receiver.close()


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

    def connect(self, endpoints: list[str], secret: SessionSecret, config: SyncConfig) -> None:
        from raysync.engines.vllm import to_plain

        self.llm.collective_rpc(
            "raysync_lora_connect",
            args=(list(endpoints), to_plain(secret), to_plain(config.resolved())),  # plain values only
        )

    def receive(self, wait_s: float | None = None) -> dict[str, Any]:
        """Serve one adapter push on every worker; the new version is then the latest (what ``request()`` gets).
        A push a worker refused or that failed there raises RemoteError naming the worker, its stage and error;
        the versions held stay as they were."""
        replies = self.llm.collective_rpc("raysync_lora_receive", args=(wait_s,))
        for reply in replies:
            if "failed" in reply:
                name, stage, message, remote = reply["failed"]
                raise RemoteError(f"vLLM worker {reply['rank']}", stage, f"{name}: {message}", remote)
        first = replies[0]
        if any((r["version"], r["lora_int_id"]) != (first["version"], first["lora_int_id"]) for r in replies):
            raise LayoutError(f"the engine's workers disagree on the adapter they hold: {replies}")
        if not first["skipped"]:
            held = Held(first["version"], first["lora_int_id"], f"{self.name}-v{first['version']}")
            self._remove(self._held.install(held.version, held))
        return first

    def request(self, version: int | None = None) -> VllmLease:
        return VllmLease(self, self._held.acquire(version))

    def release(self, held: Held) -> None:
        self._remove(self._held.release(held))

    def versions(self) -> dict[int, int]:
        """The adapter versions held -> how many requests run on each."""
        return self._held.versions()

    def close(self) -> None:
        self.llm.collective_rpc("raysync_lora_close")

    def _remove(self, dropped: list[Held]) -> None:
        for held in dropped:
            self.llm.collective_rpc("raysync_lora_remove", args=(held.lora_int_id,))
