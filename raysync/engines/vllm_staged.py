"""Staged pushes into vLLM engines (issue 18), what runs inside each engine worker. The driver's side is
raysync.ray.staged_round, the same as for any engine; raysync.engines.vllm forwards its calls to the workers
(an ``LLM`` in the actor's own call order, an ``AsyncLLM`` on its event loop: raysync.engines.vllm_async).

    stageable  can this worker stage? (a CPU worker whose pushes are staged reloads, one push session)
    stage      receive a push into host copies held for the flip; the live weights and version untouched
    staged     what is live and what is staged, for the flip's check
    flip       apply the held copies: vLLM's ``reload_weights``, as a live push does at its end on CPU
    discard    drop the held copies (their memory is freed)

WeightSync's ``max_version_lag`` is kept in the engine's actor, where requests start, around these calls
(``before_call``, ``after_call``: Note [requests and the staleness bound]).

Each takes the worker first and has the name and arguments of its twin in raysync.ray.staged_endpoint (the
functions the driver names); raysync.engines.vllm.WorkerExtension runs these in their place (``IN_WORKER``).

# Note [staging in a vLLM worker]
# vLLM's CPU build cannot take a push in place (Note [a reload as if from a checkpoint] in
# raysync.engines.vllm_reload): even a live push there is received whole into copies of its tensors, in the
# checkpoint's format (the names, shapes and dtypes the trainer sent), then applied by ``reload_weights``. A
# staged push is the same receive with the apply moved to the flip: the copies (StagedReload with ``hold``)
# are the staging memory, host memory of the push's size (``held_bytes``), allocated at each stage and freed
# at the flip or the discard (no buffer is kept between pushes). The engine generates on its live weights
# meanwhile; the flip is the reload, vLLM's post-load processing included (for the CPU backend: repacking
# every linear weight), not one copy per tensor, so its stall is a reload's. A flip that fails is undone
# (ReloadFailed: the engine keeps the old version) or leaves MIXED (WeightsMixed), as a live push would.
# The worker's version changes only at the flip (Note [versions never lie] in raysync.core.version): after the
# stage the session's receiver is told its live version again, and what the push writes is counted for the
# worker's version only when it is applied (Note [a version over every weight] in
# raysync.engines.vllm_version).

# Note [a stage beside the engine's steps]
# vLLM's EngineCore runs a call into its workers (``collective_rpc``) in its busy loop: no engine step runs
# until the call returns. A staged push received in one call would stop an AsyncLLM's generation for the
# whole transfer. So its actor (raysync.engines.vllm_async) starts the receive on a thread of each worker
# (``begin``) and then asks every worker whether it is done (``wait``), call after call, each call waiting at
# most POLL_S: vLLM runs each between two engine steps, and the engine steps on meanwhile, on its live
# weights (the receive writes only the copies, and reads the model only to check the push). An LLM's actor
# runs one call at a time anyway: its stage is one call, between two of its generate calls.
# Calls that change the worker's sessions or weights (a connect, a close, a receive, a flip, a discard, another
# stage) wait for a stage still landing (``settle``: it ends by itself, its waits are bounded by
# SyncConfig.timeout_s; at most SETTLE_S, then StagingError): they come after a driver gave up on a stage.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raysync.core.errors import StagingError, WeightsMixed
from raysync.core.version import MIXED, Version
from raysync.engines import vllm_version as versions
from raysync.ray import endpoint as ep
from raysync.ray import staged_endpoint as se
from raysync.ray.results import EndpointResult, RemoteFailure, StagedState, StagingReport
from raysync.ray.step_gate import StepGate, gate_of

logger = logging.getLogger(__name__)

_HELD = "_raysync_held"  # {sync_id: Held}: the push staged for each session, waiting for its flip
_LANDING = "_raysync_landing"  # the Landing of the staged push received on a thread of this worker
_NO_SESSION = "this worker has no session (its engine restarted?): a version staged here is gone"
POLL_S = 0.01  # the longest a ``wait`` call holds the engine's busy loop (Note [a stage beside the engine's steps])
SETTLE_S = 300.0  # the longest a call waits in ``settle`` for a stage that is still landing


@dataclass
class Held:
    """A push staged in this worker: its loader holds the copies (raysync.engines.vllm_reload.StagedReload)."""

    version: int
    loader: Any
    received: EndpointResult  # the stage's answer (its report), for the worker's version after the flip
    written: set[str]  # the engine parameters the push writes (its check's)
    parameters: frozenset[str] | None  # the engine's parameters (its check's)


def _held(worker: Any) -> dict[str, Held]:
    return worker.__dict__.setdefault(_HELD, {})


def held_bytes(worker: Any) -> int:
    """The staging memory of this worker: the bytes of the copies held, every session."""
    return sum(h.loader.nbytes for h in _held(worker).values())


def drop(worker: Any, sync_id: str) -> int | None:
    """Free what session ``sync_id`` staged (a discard, a push applied live, a new session); its version."""
    held = _held(worker).pop(sync_id, None)
    if held is None:
        return None
    held.loader.drop()
    return held.version


def stageable(worker: Any, sync_id: str) -> str | None:
    """None when this worker can stage a push; else why not."""
    side = ep._sessions(worker).get(sync_id)
    if side is None:
        return _NO_SESSION
    why = worker.raysync_reload_refusal()
    if why is not None:
        return f"raysync cannot reload this engine: {why}"
    if worker.device.type != "cpu" or not worker.raysync_cpu_staged:
        return (
            "a vLLM worker stages only where its pushes are staged reloads (a CPU worker with "
            "raysync_cpu_staged): this one loads bucket by bucket, in place"
        )
    try:
        se._session(side.receiver)
    except StagingError as e:
        return str(e)
    return None


def stage(
    worker: Any, sync_id: str, version: int, max_version_lag: int | None, staging_memory: str = "auto"
) -> EndpointResult:
    """Receive the push of ``version`` into host copies held for the flip; the engine keeps generating on
    its live weights, whose version this receive leaves as it was. ``max_version_lag`` is kept by the engine's
    actor, not here (Note [requests and the staleness bound]). ``staging_memory`` changes nothing: a CPU
    worker's device memory is host memory."""
    from raysync.engines.vllm import checked_parameters, engine_loader  # it imports this module

    side = ep._sessions(worker).get(sync_id)
    if side is None:
        return ep._failed("stage", RuntimeError(_NO_SESSION))
    drop(worker, sync_id)  # a newer staged push replaces the one held (Note [flip and versions])
    live = side.receiver.version
    loader = engine_loader(worker)
    loader.hold = True
    try:
        report = side.receiver.receive(load_fn=loader)
    except Exception as e:
        loader.drop()
        return EndpointResult(failure=se.stage_failure(e), version=side.receiver.version)
    finally:
        side.receiver.version = live  # only the flip changes what the weights hold
    result = EndpointResult(report=report, version=live)
    if not report.skipped:  # skipped: live here already
        result = dataclasses.replace(result, staging=staging_report(loader.nbytes, staging_memory))
        written, parameters = versions.writing(worker), checked_parameters(worker)
        _held(worker)[sync_id] = Held(version, loader, result, written, parameters)
        logger.info(
            "vLLM worker %s staged version %s: %d bytes of host copies, live version %s",
            worker.rank,
            version,
            loader.nbytes,
            live,
        )
    return result


def staging_report(nbytes: int, staging_memory: str) -> StagingReport:
    """What the driver hears of a stage's copies (Note [staging in a vLLM worker])."""
    return StagingReport(
        "whole",
        "a vLLM worker stages the whole push: copies in the checkpoint's format, freed at the flip",
        "host",
        "a vLLM CPU worker: device and host memory are the same memory",
        staging_memory,
        nbytes,
        nbytes,
        1,
    )


def staged(worker: Any, sync_id: str) -> StagedState:
    side = ep._sessions(worker).get(sync_id)
    if side is None:
        failure = RemoteFailure.of("flip: check", RuntimeError(_NO_SESSION))
        return StagedState(ep.applied_version(worker), None, failure=failure)
    held = _held(worker).get(sync_id)
    return StagedState(side.receiver.version, held.version if held else None)


def flip(worker: Any, sync_id: str, version: int, timeout_s: float) -> StagedState:
    """Apply staged ``version`` now: the engine's actor calls this between two of its steps (an ``LLM``
    between its calls, an ``AsyncLLM`` paused). ``timeout_s`` is the driver's wait for a step boundary, which
    the actor has found already."""
    side = ep._sessions(worker).get(sync_id)
    if side is None:
        return StagedState(
            ep.applied_version(worker), None, failure=RemoteFailure.of("flip", RuntimeError(_NO_SESSION))
        )
    held = _held(worker).get(sync_id)
    live = side.receiver.version
    if held is None or held.version != version:
        if live == version:
            return StagedState(version, None, flip_s=0.0)  # live already (its stage was skipped)
        error = StagingError(
            f"version {version} is not staged here (staged: {held and held.version}, live: {live}): push it "
            f"again"
        )
        return StagedState(live, held and held.version, failure=RemoteFailure.of("flip", error))
    del _held(worker)[sync_id]
    started = time.perf_counter()
    try:
        held.loader.apply()
    except Exception as e:
        if isinstance(e, WeightsMixed):
            _set_live(worker, side, MIXED)
        return StagedState(side.receiver.version, None, failure=RemoteFailure.of("flip", e))
    seconds = time.perf_counter() - started
    _set_live(worker, side, version)
    versions.resume_receive(worker, held.written)
    versions.note_receive(worker, held.received, held.parameters)  # a partial push may leave no version
    versions.take_print(worker)
    return StagedState(side.receiver.version, None, flip_s=seconds)


def _set_live(worker: Any, side: Any, version: Version) -> None:
    side.receiver.version = version
    worker.__dict__[ep._APPLIED] = version


def discard(worker: Any, sync_id: str) -> StagedState:
    """Drop what is staged; ``staged`` is the version dropped."""
    side = ep._sessions(worker).get(sync_id)
    dropped = drop(worker, sync_id)
    live = side.receiver.version if side is not None else ep.applied_version(worker)
    return StagedState(live, dropped)


def weights_changed(name: str, replies: dict[int, Any]) -> bool:
    """Whether the workers' answers to call ``name`` say the weights may have changed (the prefix cache then
    goes: its blocks were computed with the old ones)."""
    if name == "receiver_receive":
        return any(r.ok and not r.report.skipped for r in replies.values())
    if name == "receiver_flip":
        return any(not r.ok or r.flip_s != 0.0 for r in replies.values())
    return False


# --- the staleness bound, in the engine's actor (Note [requests and the staleness bound]) ----------------------
# Note [requests and the staleness bound]
# WeightSync's ``max_version_lag`` holds a request back rather than start it on live weights more than that many
# versions behind the newest version staged into the engine (Note [the staleness bound at a step boundary] in
# raysync.ray.step_gate: its StepGate, one per engine, keeps the count and its StaleWeights is the error). The
# engine's actor keeps it, not the workers: requests start there. Around each call of the driver: a stage
# announces its version before it starts (``before_call``); a connect (with the version read from the workers),
# a push applied live, a flip, a discard, and a stage skipped (live already) settle it with the live version the
# workers answered; a close forgets it (``after_call``). Where a request waits:
#   LLM       raysync.engines.vllm.generate: a request is one step of the engine (``enter``, ``boundary``,
#             ``leave``) and the driver's calls run as the gate's jobs, between two requests or at a request's
#             boundary, so a request that waits for a flip there runs the flip itself. The flip must reach the
#             actor while a request waits: the actor takes two calls at once (``max_concurrency=2``, one request
#             at a time: an LLM is not thread-safe); in a plain actor the request waits its ``wait_s`` in vain
#             and raises StaleWeights.
#   AsyncLLM  raysync.engines.vllm_async.generate: admission waits on the event loop until the gate's
#             ``stale()`` is None, woken by each announce and settle, or raises StaleWeights after its ``wait_s``.
# Each request says the version it ran on (``Generated.version``), as read from the workers.
CONNECTS = ("receiver_connect", "collective_connect")
REQUEST_STAGE = "generate: waiting for the flip of a staged version (max_version_lag)"
REQUESTS = "the requests of the engine's actor (raysync.engines.vllm.generate)"
_WAIT = "_raysync_wait_s"  # on an LLM: how long a call of the driver waits for a request to end (timeout_s)
_WAIT_S = 60.0  # that, until a session says its SyncConfig.timeout_s


def between_requests(
    llm: Any, name: str, args: list | dict[str, list], call: Callable[[], dict], read: Callable[[], Version]
) -> dict[int, Any]:
    """The driver's call ``name`` into an ``LLM``, made by ``call()`` as a job of the engine's gate: between two
    requests, waited for up to SyncConfig.timeout_s (a flip: its own timeout_s), PeerTimeout naming the
    requests; around it the bound announced and settled (``read()``: the engine's version)."""
    gate = gate_of(llm, REQUESTS)
    if name in CONNECTS:  # the session's SyncConfig, as plain values
        llm.__dict__[_WAIT] = float(call_args(args)[1]["timeout_s"])
    wait_s = call_args(args)[2] if name == "receiver_flip" else llm.__dict__.get(_WAIT, _WAIT_S)
    before_call(gate, name, args)

    def job() -> dict[int, Any]:
        replies = call()
        after_call(gate, name, args, replies, read() if name in CONNECTS else None)
        return replies

    return gate.run(job, wait_s, f"vLLM {name}")


def call_args(args: list | dict[str, list]) -> list:
    """The arguments of a driver's call (every worker's, or the first worker's: its sync_id and version)."""
    return args if isinstance(args, list) else next(iter(args.values()))


def before_call(gate: StepGate, name: str, args: list | dict[str, list]) -> bool:
    """Before the driver's call ``name``: a stage announces its version. Whether the bound changed."""
    if name != "receiver_stage":
        return False
    sync_id, version, lag = call_args(args)[:3]
    gate.announce(sync_id, version, lag)
    return True


def after_call(
    gate: StepGate,
    name: str,
    args: list | dict[str, list],
    replies: dict[int, Any],
    connected: Version = None,
) -> bool:
    """After the driver's call ``name`` answered ``replies`` ({rank: answer}): settle or forget the bound where
    the call did (``connected``: the engine's version, read after a connect). Whether the bound changed."""
    if name == "close":
        gate.forget(call_args(args)[0])
        return True
    if name in CONNECTS:
        live = connected
    elif name == "receiver_receive":
        live = engine_version([r.version for r in replies.values()])
    elif name in ("receiver_flip", "receiver_discard"):
        live = engine_version([r.live for r in replies.values()])
    elif name == "receiver_stage":
        version = call_args(args)[1]
        if not replies or not all(r.ok and r.version == version for r in replies.values()):
            return False  # staged (or failed: the driver discards): the announce stands
        live = version  # skipped: live here already
    else:
        return False
    gate.settled(call_args(args)[0], live)
    return True


def engine_version(by_worker: list[Version]) -> Version:
    """One version for the engine from its workers' (raysync.engines.vllm.weight_version says it)."""
    held = set(by_worker)
    if None in held:
        return None
    return held.pop() if len(held) == 1 else MIXED


# --- a stage on a thread of the worker (Note [a stage beside the engine's steps]) ------------------------------
@dataclass
class Landing:
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    answer: Any = None
    error: BaseException | None = None


def begin(worker: Any, receive: Callable[[], Any]) -> None:
    """Run ``receive()`` (the worker's call of ``stage``) on a thread of its own; ``wait`` gives its answer."""
    landing = worker.__dict__.get(_LANDING)
    if landing is not None and not landing.done.is_set():
        raise RuntimeError(f"vLLM worker {worker.rank} is receiving a staged push already: one at a time")
    landing = worker.__dict__[_LANDING] = Landing()

    def run() -> None:
        try:
            landing.answer = receive()
        except BaseException as e:  # raised in the caller's wait
            landing.error = e
        finally:
            landing.done.set()

    landing.thread = threading.Thread(target=run, name=f"raysync-stage-{worker.rank}", daemon=True)
    landing.thread.start()


def settle(worker: Any, name: str) -> None:
    """Before call ``name`` changes the worker's sessions or weights: wait for a stage still landing (not from
    the stage's own thread), at most SETTLE_S."""
    landing = worker.__dict__.get(_LANDING)
    if landing is None or landing.thread is threading.current_thread():
        return
    if not landing.done.wait(SETTLE_S):
        raise StagingError(
            f"vLLM worker {worker.rank}: {name} waited {SETTLE_S} s for a staged push still landing here"
        )


def wait(worker: Any, wait_s: float) -> Any:
    """The answer of the receive ``begin`` started, once it ended (waited for up to ``wait_s``); else None."""
    landing = worker.__dict__.get(_LANDING)
    if landing is None:
        raise RuntimeError(f"vLLM worker {worker.rank} is receiving no staged push")
    if not landing.done.wait(wait_s):
        return None
    del worker.__dict__[_LANDING]
    if landing.error is not None:
        raise landing.error
    return landing.answer


IN_WORKER = {
    "receiver_stageable": stageable,
    "receiver_stage": stage,
    "receiver_staged": staged,
    "receiver_flip": flip,
    "receiver_discard": discard,
}
