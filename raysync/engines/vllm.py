"""vLLM engines as WeightSync receivers.

Engine side, a worker extension (vLLM mixes it into each of its workers):

    llm = LLM(model, worker_extension_cls="raysync.engines.vllm.WorkerExtension", ...)

Driver side, an adapter for an engine that lives in one of the user's Ray actors (``actor.llm``):

    sync = WeightSync([trainer], [VllmEngine(engine_actor)], config)
    sync.push(version)

Requests made in the actor through ``generate(self.llm, prompts, params)`` say their version and keep
WeightSync's ``max_version_lag`` (Note [requests and the staleness bound] in raysync.engines.vllm_staged). The
same adapter drives an ``AsyncLLM`` in an async actor (raysync.engines.vllm_async); vLLM's OpenAI server is
reached through raysync.engines.vllm_server.ServerEngine; docs/vllm.md says what runs on which vLLM. Staged
pushes (``push(v, staged=True)``, ``flip()``, ``discard()``) run in the workers as raysync.engines.vllm_staged says.

Every engine worker is one receiver (a tensor-parallel engine of 2 workers is 2 receivers): it reports its own
placement, holds its own session, and loads each push through vLLM's own path, which shards and fuses the
checkpoint-named tensors (q/k/v -> qkv_proj, tensor-parallel slices) itself:

    check ``check(specs)`` when the push is accepted, before a byte moves: the push runs through vLLM's own
          loader on a meta twin of the model (raysync.engines.vllm_model); a name, shape or dtype the model does not
          take, or a parameter the push leaves out, refuses it with the tensors and the model named;
    GPU   ``model.load_weights(bucket)`` for every bucket as it lands (the path RL frameworks use), inside vLLM's
          layerwise reload where vLLM has it, which processes each layer as a checkpoint's (Note [a reload as if
          from a checkpoint] in raysync.engines.vllm_reload: what is refused, and the path without it);
    CPU   the push is staged (one copy of the weights) and applied at its end by
          ``model_runner.reload_weights(..., is_checkpoint_format=True)``: a second plain load_weights fails
          on the CPU backend, which repacks linear weights after the first load. A reload that fails part-way
          is undone before the failure is reported (or the engine's version becomes MIXED), and an output head
          tied to the embedding is re-made from it (Notes [undoing a failed reload], [tied output heads]).

After a push the adapter resets the engine's prefix cache (cached KV blocks were computed with the old weights).
An engine put to sleep (``llm.sleep()``, GPU only) is woken in vLLM's order: weights before the load, the KV
cache after it. An engine's version is only what its weights hold: a worker forgets it (None, and the next push
is applied in full, never skipped) when its weights change outside raysync (a reload, a level-2 sleep), and a
partial push names no version until pushes have written every parameter of the engine (a fresh engine's other
weights are its checkpoint's): Notes [an engine's version and its weights], [a version over every weight] (in
raysync.engines.vllm_version), [sleep, wake and the version]: ``sleep(llm, level)`` and ``wake_up(llm)`` here.

This module never imports vllm itself: the driver can build a WeightSync without vLLM installed.

# Note [what crosses vLLM's channel]
# collective_rpc arguments and results travel through vLLM's own serialization between its processes, which
# carries plain values (dicts, lists, str, bytes, numbers). Configs, secrets, rendezvous points, placements and
# the receivers' answers (EndpointResult, with its PushReport or RemoteFailure) become dicts tagged with a type
# name from an allowlist and are rebuilt on the other side; no callable crosses: the driver's sink is replaced
# by the worker's own loader, and only allowlisted endpoint functions can be named.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

from raysync.core.config import SyncConfig
from raysync.core.errors import SchemaError
from raysync.core.report import PushReport
from raysync.core.sink import LoadFn
from raysync.core.version import MIXED, Version
from raysync.core.wire import SessionSecret
from raysync.engines import vllm_staged as staged
from raysync.engines import vllm_version as versions
from raysync.engines.vllm_async import Generated
from raysync.engines.vllm_model import PushCheck
from raysync.engines.vllm_reload import has_layerwise_reload, loader_for
from raysync.engines.vllm_reload import refusal as reload_refusal
from raysync.ray import endpoint as ep
from raysync.ray import staged_endpoint as se
from raysync.ray import step_gate
from raysync.ray.placement import Placement
from raysync.ray.results import EndpointResult, RemoteFailure, StagedState
from raysync.transport.collective import Rendezvous

_FUNCTIONS: dict[str, Callable] = {
    f.__name__: f
    for f in (
        ep.where,
        ep.receiver_connect,
        ep.collective_connect,
        ep.receiver_receive,
        ep.receiver_version,
        ep.close,
    )
}
_STAGED: dict[str, Callable] = {  # a worker runs raysync.engines.vllm_staged's twins (VllmEngine only)
    f.__name__: f
    for f in (
        se.receiver_stageable,
        se.receiver_stage,
        se.receiver_staged,
        se.receiver_flip,
        se.receiver_discard,
    )
}
_TYPES: dict[str, type] = {
    c.__name__: c
    for c in (
        SyncConfig,
        SessionSecret,
        Rendezvous,
        Placement,
        EndpointResult,
        PushReport,
        RemoteFailure,
        StagedState,
    )
}
_SINK = "__raysync_sink__"  # stands for the driver's sink: the worker loads through vLLM instead

logger = logging.getLogger(__name__)


# --- the worker's loading path -----------------------------------------------------------------------------------
_PARTIAL = "_raysync_partial"  # {sync_id: whether the session's SyncConfig selects part of the tensors}
_RECEIVING = "_raysync_receiving"  # the sync_id of the receive running in this worker
_CHECKED = "_raysync_checked"  # the last push layout checked against this worker's model, and its Verdict
_LOADER = "_raysync_loader"  # the load function of the receive running in this worker


def engine_loader(worker: Any) -> LoadFn:
    """The sink of an engine worker: a load function over vLLM's own loading path (Note [a reload as if from a
    checkpoint] in raysync.engines.vllm_reload), which checks each push against the engine's model before
    anything is touched (``check``, Note [checking a push before loading])."""
    partial = worker.__dict__.get(_PARTIAL, {}).get(worker.__dict__.get(_RECEIVING), False)
    if ep.applied_version(worker) == MIXED or versions.forgotten(worker):
        partial = False  # a mix of two versions, or weights changed outside raysync: repaired by a full push
    cache = worker.__dict__.setdefault(_CHECKED, {})
    check = PushCheck(worker.model_runner, partial, cache, versions.writing(worker))
    worker.__dict__[_LOADER] = loader = loader_for(worker, check)
    return loader


def checked_parameters(worker: Any) -> frozenset[str] | None:
    """The engine's parameters, as the last push's check found them (None before any check)."""
    verdict = worker.__dict__.get(_CHECKED, {}).get("verdict")
    return verdict.parameters if verdict else None


def close_loader(worker: Any, result: EndpointResult) -> EndpointResult:
    """After a receive: the loader's last step (a layerwise reload finalized, modules processed again). If that
    fails, the push failed and the weights hold no version."""
    loader = worker.__dict__.pop(_LOADER, None)
    if loader is None:
        return result
    try:
        loader.close()
    except Exception as e:
        versions.forget_version(worker, f"vLLM's processing after the load failed: {type(e).__name__}: {e}")
        return EndpointResult(failure=RemoteFailure.of("apply", e), version=None)
    return result


# --- the worker extension ----------------------------------------------------------------------------------------
class WorkerExtension:
    """``LLM(..., worker_extension_cls="raysync.engines.vllm.WorkerExtension")``. Every name starts with ``raysync_``
    or ``_raysync_``: vLLM refuses to start when an extension's attribute clashes with its Worker's."""

    # CPU: stage a push, apply it at its end, undo a failed reload (one more copy of the weights); False: load
    # it bucket by bucket through vLLM's layerwise reload, as on GPU (not atomic)
    raysync_cpu_staged = True

    def raysync_reload_refusal(self) -> str | None:
        """Why raysync cannot load a push into this worker as vLLM loads a checkpoint, or None (Note [a reload
        as if from a checkpoint] in raysync.engines.vllm_reload)."""
        layerwise = has_layerwise_reload()
        return reload_refusal(self.model_runner, layerwise=layerwise, on_cpu=self.device.type == "cpu")

    def raysync_call(self, name: str, args: list | dict[str, list]) -> dict[str, Any]:
        """Run endpoint function ``name`` in this worker: ``args`` for every worker, or per worker rank.
        Returns {rank: result}, or {} when this worker has nothing to do."""
        fn, values = self._raysync_args(name, args)
        if values is None:
            return {}
        rank = str(self.rank)
        if name not in ("where", "receiver_version", "receiver_staged", "receiver_stageable"):
            staged.settle(self, name)  # Note [a stage beside the engine's steps]
        self._raysync_note_session(name, values)
        if name in ("receiver_receive", "receiver_version", "receiver_stage", "receiver_flip"):
            versions.check_weights(
                self
            )  # what the version says, and the skip, must be true of the weights now
        if name in ("receiver_receive", "receiver_stage"):
            versions.begin_receive(self)
        result = staged.IN_WORKER.get(name, fn)(self, *values)
        if name in ("receiver_receive", "receiver_stage"):
            result = close_loader(self, result)
        if name == "receiver_receive":
            result = versions.note_receive(self, result, checked_parameters(self))
            versions.take_print(self)
        return {rank: to_plain(result)}

    def _raysync_args(self, name: str, args: list | dict[str, list]) -> tuple[Callable, list | None]:
        """Endpoint function ``name`` (allowlisted) and this worker's arguments (None: nothing to do here)."""
        fn = _FUNCTIONS.get(name) or _STAGED.get(name)
        if fn is None:
            raise SchemaError(f"{name!r} is not a raysync endpoint function")
        if not isinstance(args, (list, dict)):
            raise SchemaError(f"raysync_call takes a list or a dict of arguments, not {type(args).__name__}")
        if isinstance(args, dict):
            args = args.get(str(self.rank))
        return fn, None if args is None else from_plain(args)

    def raysync_signed_call(self, frame: str) -> dict[str, Any]:
        """``raysync_call`` from a driver that reaches the engine over HTTP (vLLM's OpenAI server): only with
        this server's key (Note [a signed call through the server] in raysync.engines.vllm_server)."""
        from raysync.engines.vllm_server import open_call

        return self.raysync_call(*open_call(self, frame))

    def _raysync_note_session(self, name: str, values: list) -> None:
        """Whether a session's pushes may be partial is in its SyncConfig (include/exclude), which only the
        connect calls carry: kept per session for the loader of each receive (Note [checking a push before
        loading] in raysync.engines.vllm_model)."""
        partial = self.__dict__.setdefault(_PARTIAL, {})
        if name in ("receiver_connect", "collective_connect", "receiver_receive", "close"):
            staged.drop(self, values[0])  # a new session, a push applied live: what it staged is dropped
        if name in ("receiver_connect", "collective_connect"):
            sync_id, config = values[0], values[1]
            partial[sync_id] = bool(config.include or config.exclude)
        elif name in ("receiver_receive", "receiver_stage"):
            self.__dict__[_RECEIVING] = values[0]
        elif name == "close":
            partial.pop(values[0], None)

    def raysync_version(self) -> Version:
        """What this worker's weights hold: the last version applied completely, MIXED, or None."""
        versions.check_weights(self)
        return ep.applied_version(self)

    def raysync_stage_begin(self, args: list | dict[str, list]) -> None:
        """``raysync_call("receiver_stage", args)`` on a thread of this worker; ``raysync_stage_wait`` gives its
        answer (Note [a stage beside the engine's steps] in raysync.engines.vllm_staged)."""
        staged.begin(self, lambda: self.raysync_call("receiver_stage", args))

    def raysync_stage_wait(self, wait_s: float) -> dict[str, Any] | None:
        """The answer of the stage ``raysync_stage_begin`` started, once it ended (up to ``wait_s``); else None."""
        return staged.wait(self, min(wait_s, staged.POLL_S))

    def raysync_staged_bytes(self) -> int:
        """The staging memory this worker holds now: host copies of the staged pushes' tensors (Note [staging
        in a vLLM worker] in raysync.engines.vllm_staged)."""
        return staged.held_bytes(self)

    def raysync_forget_version(self, why: str) -> None:
        """The weights are about to be dropped or changed outside raysync (``why``): the worker's version
        becomes None now, and the next push is applied in full (Note [an engine's version and its weights])."""
        versions.forget_version(self, why)


def weight_version(llm: Any) -> Version:
    """The engine's weight version (inside the process that holds ``llm``): None until every worker has applied
    a push; MIXED while any worker is MIXED or the workers hold different versions (the engine's tensor-parallel
    shards then come from several versions: Note [versions never lie] in raysync.core.version)."""
    return staged.engine_version(llm.collective_rpc("raysync_version"))


def generate(
    llm: Any, prompts: Any, sampling_params: Any = None, *, wait_s: float = 600.0, **kwargs
) -> Generated:
    """``llm.generate(prompts, sampling_params, **kwargs)`` in the engine's actor, as one step of the engine:
    it starts between two calls of the driver, after the flips asked for, on weights within WeightSync's
    ``max_version_lag``, waiting up to ``wait_s`` for a flip (else StaleWeights: Note [requests and the
    staleness bound] in raysync.engines.vllm_staged). ``Generated.output``: vLLM's outputs; ``.version``:
    the version of the weights that made all of them (None: no version, or they changed outside raysync)."""
    gate = step_gate.gate_of(llm, staged.REQUESTS)
    gate.enter()
    try:
        gate.boundary(wait_s, staged.REQUEST_STAGE)
        version = weight_version(llm)
        outputs = llm.generate(prompts, sampling_params, **kwargs)
        after = weight_version(llm)
    finally:
        gate.leave()
    return Generated(outputs, version if after == version else None)


# --- sleep and wake, where raysync drives them (Note [sleep, wake and the version]) -------------------------------
# Note [sleep, wake and the version]
# vLLM's sleep(level=1) offloads the weights and wake_up puts the same bytes back: the version stays.
# sleep(level=2) discards them: after wake_up the engine holds whatever the memory holds. ``sleep`` below makes
# every worker forget its version before vLLM drops the weights (a failure in between leaves None, never a
# stale version); a level-2 sleep called on the LLM directly is caught by the worker's print instead (Note [an
# engine's version and its weights] in raysync.engines.vllm_version). Waking for a push goes weights first, then
# the KV cache, after the load: the push's buffers and the KV cache are never resident at once. ``_on_engine``
# does that for a push that reaches a sleeping engine, and ``wake_up`` for the user. vLLM's CPU build
# accepts sleep and wake_up but ignores them in its workers (its weights are never dropped there).
def sleep(llm: Any, level: int = 1) -> None:
    """``llm.sleep(level)``, with the engine's version forgotten first where the level drops the weights."""
    if level >= 2:
        llm.collective_rpc("raysync_forget_version", args=(f"sleep(level={level}) discards the weights",))
    llm.sleep(level=level)


def wake_up(llm: Any) -> None:
    """Wake the engine in the order a push needs: the weights, then the KV cache."""
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])


# --- the driver's adapter ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VllmEngine:
    """A vLLM engine held by a Ray actor as ``actor.<attr>`` (an ``LLM`` made with the worker extension),
    for WeightSync's ``receivers``. ``lora``: the actor's attribute that holds a VllmAdapters
    (raysync.engines.vllm_lora; the LLM made with LoRA enabled and its LoraWorkerExtension): the pushes are
    LoRA adapters (raysync.sources.lora.AdapterOf), each served as a new adapter version beside the base
    weights, which stay as they are (Note [adapter pushes through WeightSync] in raysync.engines.torch_lora)."""

    actor: Any
    attr: str = "llm"
    lora: str | None = None

    def call(self, fn: Callable, args: tuple | dict[int, tuple] = ()) -> Any:
        """Like ActorEndpoint.call; slots are the engine's worker ranks."""
        if _FUNCTIONS.get(fn.__name__) is not fn and _STAGED.get(fn.__name__) is not fn:
            raise ValueError(f"{fn.__name__} cannot run in a vLLM worker")
        plain = {str(s): to_plain(a) for s, a in args.items()} if isinstance(args, dict) else to_plain(args)
        return self.actor.__ray_call__.remote(_on_engine, self.attr, fn.__name__, plain, self.lora)


def _on_engine(
    actor: Any, attr: str, name: str, args: list | dict[str, list], lora: str | None = None
) -> dict[int, Any]:
    """Runs in the engine's actor: forward to every worker, around it wake and reset what a push needs. An
    ``AsyncLLM`` goes through raysync.engines.vllm_async (on its event loop, generation paused); adapter pushes
    (``lora``) through raysync.engines.vllm_lora."""
    llm = getattr(actor, attr, None)
    if llm is None or not hasattr(llm, "collective_rpc"):
        raise TypeError(f"{type(actor).__name__}.{attr} is not a vLLM LLM; pass VllmEngine(actor, attr=...)")
    if name == "where":  # workers started by vLLM may not see Ray: they run on this actor's node
        import ray

        args = [[ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()]]
    if lora is not None:
        from raysync.engines.vllm_lora import on_adapter_engine

        return on_adapter_engine(llm, getattr(actor, lora, None), name, args)
    if inspect.iscoroutinefunction(llm.collective_rpc):
        from raysync.engines.vllm_async import on_async_engine

        return on_async_engine(llm, actor, name, args, _replies)
    # between two requests of the actor's (calls of ``generate``): a push applied live, a staged one's flip, its
    # stage (received into copies: the live weights wait), every call (or at the boundary of a request waiting
    # for a flip: Note [requests and the staleness bound] in raysync.engines.vllm_staged)
    call = lambda: _on_llm(llm, name, args)  # noqa: E731
    return staged.between_requests(llm, name, args, call, lambda: weight_version(llm))


def _on_llm(llm: Any, name: str, args: list | dict[str, list]) -> dict[int, Any]:
    applies = name in ("receiver_receive", "receiver_flip")
    asleep = applies and llm.llm_engine.is_sleeping()
    if asleep:  # Note [sleep, wake and the version]: the weights now, the KV cache after the load
        llm.wake_up(tags=["weights"])
    replies = _replies(llm.collective_rpc("raysync_call", args=(name, args)))
    if asleep:
        llm.wake_up(tags=["kv_cache"])
    if staged.weights_changed(name, replies):
        llm.reset_prefix_cache()  # blocks cached under the old weights must not be reused
    return replies


def _replies(by_worker: list[dict[str, Any]]) -> dict[int, Any]:
    """The workers' answers to raysync_call, {rank: result}."""
    return {int(rank): from_plain(result) for reply in by_worker for rank, result in reply.items()}


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
