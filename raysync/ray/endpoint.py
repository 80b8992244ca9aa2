"""What runs inside the user's actors, through Ray's ``__ray_call__`` (no base class, no mixin).

Each function takes the actor instance first (for a vLLM engine: the worker, see raysync.engines.vllm). The sessions of one WeightSync live in a dict on the actor
(``_raysync_sessions[sync_id]``), so an actor restarted by Ray simply has none, and says so.
What they answer the driver is in raysync.ray.results: a failure carries its stage, message and traceback back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from raysync.core.config import SyncConfig
from raysync.core.receiver import WeightReceiver
from raysync.core.sender import WeightSender
from raysync.core.session import PushSender
from raysync.core.sharded import ShardedReceiver, shares
from raysync.core.source import is_source
from raysync.core.version import MIXED, Version
from raysync.core.wire import SessionSecret
from raysync.ray.placement import Placement, probe
from raysync.ray.results import EndpointResult, FanoutOpened, GroupOpened, RemoteFailure, SessionOpened
from raysync.ray.step_gate import gate_of
from raysync.ray.trainer_group import device_of, push_bytes
from raysync.transport.collective import CollectiveReceiver, CollectiveSender
from raysync.transport.process_group import Rendezvous, default_backend

_STATE = "_raysync_sessions"
_APPLIED = "_raysync_version"
_ROUNDS = "_raysync_rounds"  # sync_id -> (version, answer) of the last round run in a compiled graph  # what the weights hold, by any session: the last version applied, or MIXED

SourceFn = Callable[[Any], Iterable[tuple[str, torch.Tensor]]]
SinkFn = Callable[[Any], Any]  # -> dict of destination tensors, or a load_weights-style function


def model_parameters(actor: Any) -> Iterable[tuple[str, torch.Tensor]]:
    """Default source: ``actor.model.named_parameters()``."""
    return actor.model.named_parameters()


def model_destinations(actor: Any) -> dict[str, torch.Tensor]:
    """Default sink: the parameters of ``actor.model``, written in place."""
    return dict(actor.model.named_parameters())


@dataclass
class _SenderSide:
    source: SourceFn
    senders: dict[int, WeightSender] = field(
        default_factory=dict
    )  # ring transports: one session per receiver
    group: CollectiveSender | None = None  # the collective: one broadcast group for all its receivers
    group_receivers: list[int] = field(default_factory=list)
    fanout: WeightSender | None = None  # shm fan-out: one ring session that all its readers read
    fanout_receivers: list[int] = field(default_factory=list)

    def drop_fanout(self) -> None:
        if self.fanout is not None:
            self.fanout.close()
        self.fanout, self.fanout_receivers = None, []


@dataclass
class _ReceiverSide:
    sink: SinkFn
    receiver: WeightReceiver | ShardedReceiver  # the same receive() either way (a collective: one per share)


def _sessions(actor: Any) -> dict:
    return actor.__dict__.setdefault(_STATE, {})


def _failed(stage: str, error: BaseException, version: Version = None) -> EndpointResult:
    return EndpointResult(failure=RemoteFailure.of(stage, error), version=version)


def where(actor: Any, node: tuple[str, str] | None = None, tensors: Callable | None = None) -> Placement:
    """Where this endpoint runs. ``tensors``: its source or sink function; when the tensors it gives live in host
    memory, the endpoint is a CPU one whatever GPUs its process sees (Ray leaves every GPU visible to an actor
    that asked for none), so no pair plans CUDA IPC for CPU tensors."""
    at = probe(node)
    if tensors is not None and at.device == "cuda" and _on_host(tensors(actor)):
        at = dataclasses.replace(
            at, device="cpu", gpu_uuids=(), current_gpu=None, ipc_ok=False, peer_access=()
        )
    return at


def _on_host(tensors: Any) -> bool:
    """Whether a source's named tensors (or a lazy source's, where it says), or a sink's destinations, are in
    host memory (a load function, a lazy source that does not say: unknown, taken as not)."""
    if isinstance(tensors, Mapping):
        tensors = tensors.items()
    elif callable(tensors) and not is_source(tensors):
        return False
    return device_of(tensors) == "cpu"


# --- how the driver reaches an endpoint ---------------------------------------------------------------------------
class ActorEndpoint:
    """One of the user's Ray actors: one receiver. An engine adapter (raysync.engines.vllm.VllmEngine) has the same
    ``call`` and serves one receiver per engine worker ("slots")."""

    def __init__(self, actor: Any):
        self.actor = actor

    def call(self, fn: Callable, args: tuple | dict[int, tuple] = ()) -> Any:
        """Run ``fn(actor, *args)`` on every slot (args a tuple) or on the slots given (a dict slot -> args);
        returns a Ray ObjectRef of {slot: result}."""
        return self.actor.__ray_call__.remote(_on_slots, fn, args if isinstance(args, dict) else {0: args})


def _on_slots(actor: Any, fn: Callable, args: dict[int, tuple]) -> dict[int, Any]:
    return {slot: fn(actor, *a) for slot, a in args.items()}


def as_endpoint(receiver: Any) -> Any:
    """A Ray actor handle becomes an ActorEndpoint; an adapter (raysync.engines.vllm.VllmEngine) stays as it is."""
    import ray

    if isinstance(receiver, ray.actor.ActorHandle):
        return ActorEndpoint(receiver)
    if not callable(getattr(receiver, "call", None)):
        raise TypeError(
            f"a receiver must be a Ray actor handle or an engine adapter, got {type(receiver).__name__}"
        )
    return receiver


# --- sender side -------------------------------------------------------------------------------------------------
def sender_connect(
    actor: Any,
    sync_id: str,
    config: SyncConfig,
    receiver: int,
    secret: SessionSecret,
    endpoint: str | None,
    source: SourceFn,
) -> SessionOpened:
    """(Re)open the session for one receiver; returns the endpoint it must connect to, and the bytes a push
    of the current source moves (for the driver's progress bar)."""
    side = _sessions(actor).setdefault(sync_id, _SenderSide(source))
    old = side.senders.pop(receiver, None)
    if old is not None:
        old.close()
    if receiver in side.fanout_receivers:  # re-planned out of its fan-out: the fan-out is rebuilt whole
        side.drop_fanout()
    sender = WeightSender(secret, config, endpoint=endpoint)
    side.senders[receiver] = sender
    return SessionOpened(sender.endpoint, push_bytes(source(actor), config))


def fanout_connect(
    actor: Any,
    sync_id: str,
    config: SyncConfig,
    receivers: list[int],
    secret: SessionSecret,
    source: SourceFn,
) -> FanoutOpened:
    """(Re)open this sender's one fan-out session for ``receivers`` (raysync.ray.fanout_group): one ring that
    they all read, each bucket packed once; receiver ``receivers[k]`` connects to ``addresses[k]``."""
    side = _sessions(actor).setdefault(sync_id, _SenderSide(source))
    side.drop_fanout()
    for j in receivers:  # a pair session of a reader from before the fan-out
        old = side.senders.pop(j, None)
        if old is not None:
            old.close()
    side.fanout = WeightSender(secret, config, receivers=len(receivers))
    side.fanout_receivers = list(receivers)
    return FanoutOpened(tuple(side.fanout.endpoints), push_bytes(source(actor), config))


def packed_buckets(actor: Any, sync_id: str) -> dict[tuple[int, ...], int]:
    """How many buckets each ring session of this sender packed in its last push, by the receivers it serves:
    (j,) for a pair's session, all of its readers for the fan-out (each bucket packed once for all of them)."""
    side = _sessions(actor).get(sync_id)
    if not isinstance(side, _SenderSide):
        return {}
    packed = {(j,): s.packed_buckets for j, s in side.senders.items()}
    if side.fanout is not None:
        packed[tuple(side.fanout_receivers)] = side.fanout.packed_buckets
    return packed


def collective_open(
    actor: Any,
    sync_id: str,
    config: SyncConfig,
    host: str,
    receivers: list[int],
    secret: SessionSecret,
    source: SourceFn,
    share: tuple[int, int] | None = None,
) -> GroupOpened:
    """(Re)make this sender's broadcast group for ``receivers`` (ranks 1..N in that order). ``share=(k, S)``:
    this sender broadcasts share k of S of the tensors (raysync.core.sharded)."""
    side = _sessions(actor).setdefault(sync_id, _SenderSide(source))
    if side.group is not None:
        side.group.close()
    if share is not None:
        config = dataclasses.replace(config, include=shares(source(actor), share[1], config)[share[0]])
    # NCCL for GPU tensors, gloo for host ones (placement.check_groups reads the sender's placement the same way)
    backend = "gloo" if _on_host(source(actor)) else default_backend()
    side.group = CollectiveSender(secret, config, host=host, num_receivers=len(receivers), backend=backend)
    side.group_receivers = list(receivers)
    return GroupOpened(side.group.rendezvous, push_bytes(source(actor), config))


def collective_join(actor: Any, sync_id: str) -> None:
    _sessions(actor)[sync_id].group.join()  # returns when every rank has joined; the group owns the session


def sender_push(
    actor: Any, sync_id: str, version: int, receivers: list[int], full: bool = False
) -> dict[int, EndpointResult]:
    """Push ``version`` to every receiver of this sender at once: one thread per ring session, one for the
    broadcast group, one for the fan-out (all its readers together). ``full``: no delta this time
    (PushSender.push)."""
    side = _sessions(actor).get(sync_id)
    group = side.group.session if side is not None and side.group is not None else None  # once joined
    in_group = [j for j in receivers if group is not None and j in side.group_receivers]
    in_fanout = [j for j in receivers if side is not None and j in side.fanout_receivers]
    if side is None or any(j not in side.senders and j not in in_group + in_fanout for j in receivers):
        lost = RuntimeError(
            "this actor has no session for the receiver (restarted by Ray? a group not joined?)"
        )
        return {j: _failed("session", lost) for j in receivers}
    if in_fanout and sorted(in_fanout) != sorted(side.fanout_receivers):
        partial = ValueError(
            f"a fan-out pushes to all of its readers {side.fanout_receivers} together, not to {in_fanout}"
        )
        return {j: _failed("session", partial) for j in receivers}
    fanout = [side.fanout] if in_fanout else []
    try:
        given = side.source(actor)  # a lazy source is packed bucket by bucket by each session's own packer
        named = given if is_source(given) else list(given)  # once, shared by all sessions (read-only)
    except Exception as e:
        targets: list[PushSender] = [side.senders[j] for j in receivers if j in side.senders]
        _abort_sessions(targets + ([group] if in_group else []) + fanout, e)
        return {j: _failed("source", e) for j in receivers}

    def one(target: Any) -> EndpointResult:
        try:
            return EndpointResult(report=target.push(named, version, full=full))
        except Exception as e:
            return _failed("push", e)

    jobs = {(j,): side.senders[j] for j in receivers if j in side.senders}
    if in_group:
        jobs[tuple(in_group)] = group
    if in_fanout:
        jobs[tuple(in_fanout)] = side.fanout
    results = dict(zip(jobs, _each(one, list(jobs.values())), strict=True))
    return {j: r for js, r in results.items() for j in js}


def _each(fn: Callable[[Any], Any], items: list) -> list:
    """``fn`` of every item at once: the first in this thread, each other one on a thread of its own (a push of
    one session starts no thread: a thread's start and join cost more than a push of small tensors)."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=len(items) - 1) as pool:
        rest = pool.map(fn, items[1:])
        return [fn(items[0]), *rest]


# --- a push round in a compiled Ray graph (raysync.ray.push_graph) ---------------------------------------------------
def sender_round(actor: Any, version: int, sync_id: str, receivers: list[int]) -> dict[int, EndpointResult]:
    """``sender_push`` as a task of the round's graph (the version is the graph's input); its answer is also kept
    for ``round_answer``."""
    return _keep(actor, sync_id, version, sender_push(actor, sync_id, version, receivers))


def receiver_round(actor: Any, version: int, sync_id: str, slots: list[int]) -> dict[int, EndpointResult]:
    """``receiver_receive`` on each slot, as a task of the round's graph; its answer is also kept for
    ``round_answer``. ``version`` (the graph's input) is what the sender will push."""
    return _keep(actor, sync_id, version, {slot: _receive(actor, sync_id) for slot in slots})


def _keep(actor: Any, sync_id: str, version: int, answer: Any) -> Any:
    actor.__dict__.setdefault(_ROUNDS, {})[sync_id] = (version, answer)
    return answer


def round_answer(actor: Any, sync_id: str, version: int) -> Any:
    """What this actor answered the graph's round of ``version``, or None if it ran no such round (restarted by
    Ray, or the graph was torn down before its task began): the driver asks after a graph failed."""
    kept = actor.__dict__.get(_ROUNDS, {}).get(sync_id)
    return kept[1] if kept is not None and kept[0] == version else None


def _abort_sessions(senders: list[PushSender], error: Exception) -> None:
    """The source raised: every receiver hears it now (their waits end at once, nothing touched) rather than
    at timeout_s: ring sessions each, a broadcast group once for all its receivers."""
    _each(lambda s: s.abort(error, "source"), senders)


# --- receiver side -----------------------------------------------------------------------------------------------
def receiver_connect(
    actor: Any, sync_id: str, config: SyncConfig, endpoint: str, secret: SessionSecret, sink: SinkFn
) -> None:
    _set_receiver(actor, sync_id, sink, WeightReceiver(endpoint, secret, config))


def _set_receiver(actor: Any, sync_id: str, sink: SinkFn, receiver: WeightReceiver | ShardedReceiver) -> None:
    old = _sessions(actor).pop(sync_id, None)
    if old is not None:
        receiver.version = old.receiver.version  # a new session to the same engine keeps what it has applied
        old.receiver.close()  # with its staging memory: a version staged there is dropped
    _sessions(actor)[sync_id] = _ReceiverSide(sink, receiver)
    gate_of(actor).settled(sync_id, receiver.version)


def collective_connect(
    actor: Any,
    sync_id: str,
    config: SyncConfig,
    rank: int,
    rendezvous: Rendezvous,
    secret: SessionSecret,
    sink: SinkFn,
    share: tuple[int, int] | None = None,
) -> None:
    """Join the sender's broadcast group as ``rank`` (returns when every rank has joined). ``share=(k, S)``:
    the group of share k of this engine's ShardedReceiver; without, the one group of a ShardedReceiver of one
    share (which keeps what the destinations hold when the group is rebuilt)."""
    k, count = share if share is not None else (0, 1)
    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    side = _sessions(actor).get(sync_id)
    if side is None or not isinstance(side.receiver, ShardedReceiver) or len(side.receiver.groups) != count:
        _set_receiver(actor, sync_id, sink, ShardedReceiver([None] * count))
    receiver = _sessions(actor)[sync_id].receiver
    receiver.replace(k, group)  # the old group of share k goes first: its buffers are freed before the join
    receiver.join(shares=[k])


def receiver_receive(actor: Any, sync_id: str) -> EndpointResult:
    """Receive one push (inside a vLLM worker the answer crosses vLLM's channel as plain values, rebuilt on the
    driver's side: Note [what crosses vLLM's channel] in raysync.engines.vllm)."""
    return _receive(actor, sync_id)


def _receive(actor: Any, sync_id: str) -> EndpointResult:
    side = _sessions(actor).get(sync_id)
    if side is None:
        return _failed("session", RuntimeError("this actor has no session (restarted by Ray?)"))
    try:
        target = side.sink(actor)
        kind = {"load_fn": target} if callable(target) else {"into": target}
        report = side.receiver.receive(**kind)
        actor.__dict__[_APPLIED] = side.receiver.version
        gate_of(actor).settled(sync_id, side.receiver.version)  # a staged version was dropped, if any
        return EndpointResult(report=report, version=side.receiver.version)
    except Exception as e:
        if side.receiver.version == MIXED:  # Note [versions never lie]: the engine's weights are no version
            actor.__dict__[_APPLIED] = MIXED
        return _failed("receive", e, side.receiver.version)


def applied_version(actor: Any) -> Version:
    """What this actor's (or engine worker's) weights hold, by any session: the last version applied
    completely, MIXED after a push that failed part-way (until a push completes), None before any push."""
    return actor.__dict__.get(_APPLIED)


def receiver_version(actor: Any, sync_id: str) -> Version:
    side = _sessions(actor).get(sync_id)
    return side.receiver.version if side is not None else None


def close(actor: Any, sync_id: str) -> None:
    actor.__dict__.get(_ROUNDS, {}).pop(sync_id, None)
    side = _sessions(actor).pop(sync_id, None)
    if isinstance(side, _SenderSide):
        for sender in side.senders.values():
            sender.close()
        side.drop_fanout()
        if side.group is not None:
            side.group.close()
    elif isinstance(side, _ReceiverSide):
        side.receiver.close()
        gate_of(actor).forget(sync_id)  # a version staged and never flipped holds no step after the close


def forget_version(actor: Any) -> None:
    """The weights of this endpoint were changed outside raysync (a reload, a write, a level-2 sleep): they hold
    no version now, for the actor and for every session's receiver (Note [versions never lie]); MIXED stays
    MIXED, which is no version either. The next push of any version is applied in full, never skipped."""
    if actor.__dict__.get(_APPLIED) != MIXED:
        actor.__dict__[_APPLIED] = None
    for side in _sessions(actor).values():
        receiver = getattr(side, "receiver", None)
        if receiver is not None and receiver.version != MIXED:
            receiver.version = None
