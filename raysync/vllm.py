"""vLLM engines as WeightSync receivers.

Engine side, a worker extension (vLLM mixes it into each of its workers):

    llm = LLM(model, worker_extension_cls="raysync.vllm.WorkerExtension", ...)

Driver side, an adapter for an engine that lives in one of the user's Ray actors (``actor.llm``):

    sync = WeightSync([trainer], [VllmEngine(engine_actor)], config)
    sync.push(version)

Every engine worker is one receiver (a tensor-parallel engine of 2 workers is 2 receivers): it reports its own
placement, holds its own session, and loads each push through vLLM's own path, which shards and fuses the
checkpoint-named tensors (q/k/v -> qkv_proj, tensor-parallel slices) itself:

    GPU   ``model.load_weights(bucket)`` for every bucket as it lands (the path RL frameworks use);
    CPU   the push is staged (one copy of the weights) and applied at its end by
          ``model_runner.reload_weights(..., is_checkpoint_format=True)``: a second plain load_weights fails
          on the CPU backend, which repacks linear weights after the first load.

After a push the adapter resets the engine's prefix cache (cached KV blocks were computed with the old weights).
An engine put to sleep (``llm.sleep()``, GPU only) is woken in vLLM's order: weights before the load, the KV
cache after it.

This module never imports vllm itself: the driver can build a WeightSync without vLLM installed.

# Note [what crosses vLLM's channel]
# collective_rpc arguments and results travel through vLLM's own serialization between its processes, which
# carries plain values (dicts, lists, str, bytes, numbers). Configs, secrets, rendezvous points and placements
# become dicts tagged with a type name from an allowlist and are rebuilt on the other side; no callable
# crosses: the driver's sink is replaced by the worker's own loader, and only allowlisted endpoint functions
# can be named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from raysync import endpoint as ep
from raysync.config import SyncConfig
from raysync.errors import SchemaError
from raysync.placement import Placement
from raysync.sink import LoadFn
from raysync.transport.collective import Rendezvous
from raysync.wire import SessionSecret

_FUNCTIONS: dict[str, Callable] = {f.__name__: f for f in (
    ep.where, ep.receiver_connect, ep.collective_connect, ep.receiver_receive, ep.receiver_version, ep.close,
)}  # fmt: skip
_TYPES: dict[str, type] = {c.__name__: c for c in (SyncConfig, SessionSecret, Rendezvous, Placement)}
_SINK = "__raysync_sink__"  # stands for the driver's sink: the worker loads through vLLM instead


# --- the worker's loading path -----------------------------------------------------------------------------------
def engine_loader(worker: Any) -> LoadFn:
    """The sink of an engine worker: a load function over vLLM's own loading path."""
    if worker.device.type == "cpu":
        return StagedReload(worker.model_runner)
    model = worker.model_runner.get_model()
    return model.load_weights


class StagedReload:
    """Keeps a copy of every tensor of a push and applies the whole push at its end through
    ``reload_weights``: a push that fails part-way leaves the engine's weights as they were."""

    def __init__(self, model_runner: Any):
        self._runner = model_runner
        self._staged: list[tuple[str, torch.Tensor]] = []

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self._staged.extend((name, t.clone()) for name, t in batch)  # Note [ring buffer views]

    def finish(self) -> None:
        staged, self._staged = self._staged, []
        self._runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)


# --- the worker extension ----------------------------------------------------------------------------------------
class WorkerExtension:
    """``LLM(..., worker_extension_cls="raysync.vllm.WorkerExtension")``. Every name starts with ``raysync_``:
    vLLM refuses to start when an extension's attribute clashes with its Worker's."""

    def raysync_call(self, name: str, args: list | dict[str, list]) -> dict[str, Any]:
        """Run endpoint function ``name`` in this worker: ``args`` for every worker, or per worker rank.
        Returns {rank: result}, or {} when this worker has nothing to do."""
        fn = _FUNCTIONS.get(name)
        if fn is None:
            raise SchemaError(f"{name!r} is not a raysync endpoint function")
        rank = str(self.rank)
        if isinstance(args, dict):
            if rank not in args:
                return {}
            args = args[rank]
        return {rank: to_plain(fn(self, *from_plain(args)))}

    def raysync_version(self) -> int | None:
        """The last version this worker applied completely."""
        return ep.applied_version(self)


def weight_version(llm: Any) -> int | None:
    """The engine's weight version (inside the process that holds ``llm``): the oldest of its workers', None
    until every worker has applied a push."""
    versions = llm.collective_rpc("raysync_version")
    return None if None in versions else min(versions)


# --- the driver's adapter ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VllmEngine:
    """A vLLM engine held by a Ray actor as ``actor.<attr>`` (an ``LLM`` made with the worker extension),
    for WeightSync's ``receivers``."""

    actor: Any
    attr: str = "llm"

    def call(self, fn: Callable, args: tuple | dict[int, tuple] = ()) -> Any:
        """Like ActorEndpoint.call; slots are the engine's worker ranks."""
        if _FUNCTIONS.get(fn.__name__) is not fn:
            raise ValueError(f"{fn.__name__} cannot run in a vLLM worker")
        plain = {str(s): to_plain(a) for s, a in args.items()} if isinstance(args, dict) else to_plain(args)
        return self.actor.__ray_call__.remote(_on_engine, self.attr, fn.__name__, plain)


def _on_engine(actor: Any, attr: str, name: str, args: list | dict[str, list]) -> dict[int, Any]:
    """Runs in the engine's actor: forward to every worker, around it wake and reset what a push needs."""
    llm = getattr(actor, attr, None)
    if llm is None or not hasattr(llm, "collective_rpc"):
        raise TypeError(f"{type(actor).__name__}.{attr} is not a vLLM LLM; pass VllmEngine(actor, attr=...)")
    if name == "where":  # workers started by vLLM may not see Ray: they run on this actor's node
        import ray

        args = [[ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()]]
    asleep = name == "receiver_receive" and llm.llm_engine.is_sleeping()
    if asleep:
        llm.wake_up(tags=["weights"])
    replies: dict[int, Any] = {}
    for reply in llm.collective_rpc("raysync_call", args=(name, args)):
        replies.update({int(rank): from_plain(result) for rank, result in reply.items()})
    if name == "receiver_receive":
        if asleep:
            llm.wake_up(tags=["kv_cache"])
        if any(r["ok"] and not r["report"]["skipped"] for r in replies.values()):
            llm.reset_prefix_cache()  # blocks cached under the old weights must not be reused
    return replies


# --- plain values across vLLM's channel (Note [what crosses vLLM's channel]) -------------------------------------
def to_plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: to_plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"__type__": type(x).__name__, **fields}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if callable(x):
        return _SINK
    return x


def from_plain(x: Any, *, tuples: bool = False) -> Any:
    """The inverse of to_plain; inside a rebuilt dataclass, lists become tuples (their fields are tuples)."""
    if x == _SINK:
        return engine_loader
    if isinstance(x, list):
        items = [from_plain(v, tuples=tuples) for v in x]
        return tuple(items) if tuples else items
    if isinstance(x, dict):
        if "__type__" not in x:
            return {k: from_plain(v, tuples=tuples) for k, v in x.items()}
        cls = _TYPES.get(x["__type__"])
        if cls is None:
            raise SchemaError(f"type {x['__type__']!r} may not cross to a vLLM worker")
        return cls(**{k: from_plain(v, tuples=True) for k, v in x.items() if k != "__type__"})
    return x
