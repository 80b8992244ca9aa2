"""Staged pushes through WeightSync, what runs inside the engines' actors (issue 18; the driver's side is
raysync.ray.staged_round). Like raysync.ray.endpoint, each function takes the actor first and answers with a
typed result (raysync.ray.results), a failure carrying its stage and traceback.

    receiver_stageable  can this receiver stage? (its sink gives destination tensors, one push session)
    receiver_stage      receive a push into staging memory (receive(flip=False)); the live weights untouched;
                        answers where it staged (a StagingReport: whole or groups, device or host, bytes, why)
    receiver_staged     what is live and what is staged, for the flip's check
    receiver_flip       apply the staged version at the engine's step boundary (raysync.ray.step_gate)
    receiver_discard    drop the staged version (or acknowledge a failed stage)

An engine that computes on a thread of its own runs its loop inside ``engine_steps(actor)`` and calls the
boundary it yields between steps: the flips the driver asks for run there, and WeightSync's
``max_version_lag`` is enforced there (Note [the staleness bound at a step boundary] in raysync.ray.step_gate).

A vLLM engine's workers run twins of these functions instead, under the same names (raysync.engines.vllm_staged:
the staging memory there is host copies of the push, the flip vLLM's reload).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from raysync.core.errors import StagingError
from raysync.core.session_receiver import PushReceiver
from raysync.core.sharded import ShardedReceiver
from raysync.core.staging_memory import StagingInfo
from raysync.core.version import Version
from raysync.ray.endpoint import _APPLIED, _failed, _sessions, applied_version
from raysync.ray.results import EndpointResult, RemoteFailure, StagedState, StagingReport
from raysync.ray.step_gate import gate_of

_NO_SESSION = "this actor has no session (restarted by Ray?): a version staged here is gone"


def engine_steps(
    actor: Any, wait_s: float = 300.0
) -> contextlib.AbstractContextManager[Callable[[], Version]]:
    """For an engine whose steps run on its own thread: ``with engine_steps(self) as boundary:`` around the
    loop, ``version = boundary()`` before each step. The boundary runs the flips WeightSync asked for, waits
    (up to ``wait_s``; StaleWeights) while the live weights lag the newest staged version by more than
    WeightSync's ``max_version_lag``, and returns the live version: the step that follows computes on it."""
    return _steps(actor, wait_s)


@contextlib.contextmanager
def _steps(actor: Any, wait_s: float) -> Iterator[Callable[[], Version]]:
    gate = gate_of(actor)

    def boundary() -> Version:
        gate.boundary(wait_s)
        return applied_version(actor)

    gate.enter()
    try:
        yield boundary
    finally:
        gate.leave()


def _session(receiver: Any) -> PushReceiver:
    """The push session that stages: a ring pair's receiver, or the one share of a collective receiver."""
    if isinstance(receiver, ShardedReceiver):
        if len(receiver.receivers) != 1 or receiver.receivers[0] is None:
            raise StagingError(
                f"a receiver of {len(receiver.receivers)} shares (WeightSync(shard_sources=True)) cannot stage: "
                f"push it live, or without shard_sources"
            )
        return receiver.receivers[0]
    return receiver


def receiver_stageable(actor: Any, sync_id: str) -> str | None:
    """None when this receiver can stage a push; else why not."""
    side = _sessions(actor).get(sync_id)
    if side is None:
        return _NO_SESSION
    if callable(side.sink(actor)):
        return "its sink is a load function: a staged push needs destination tensors (a dict) to flip into"
    try:
        _session(side.receiver)
    except StagingError as e:
        return str(e)
    return None


def receiver_stage(
    actor: Any, sync_id: str, version: int, max_version_lag: int | None, staging_memory: str = "auto"
) -> EndpointResult:
    """Receive the push of ``version`` into staging memory (placed by ``staging_memory``: "auto", "device" or
    "host", raysync.core.staging_memory); the engine keeps computing on the live weights. The answer says where
    the push was staged (its StagingReport)."""
    side = _sessions(actor).get(sync_id)
    if side is None:
        return _failed("stage", RuntimeError(_NO_SESSION))
    gate = gate_of(actor)
    gate.announce(sync_id, version, max_version_lag)
    try:
        session = _session(side.receiver)
        report = session.receive(into=side.sink(actor), flip=False, staging_memory=staging_memory)
    except Exception as e:
        return EndpointResult(failure=stage_failure(e), version=side.receiver.version)
    if session.version == version:  # skipped: live here already
        gate.settled(sync_id, session.version)
    staging = None if report.skipped else staging_report(session.staging, staging_memory)
    return EndpointResult(report=report, version=session.version, staging=staging)


def staging_report(info: StagingInfo | None, asked: str) -> StagingReport | None:
    """What the driver hears of a session's staging memory, placed as ``asked`` (staging_memory); None:
    nothing staged."""
    if info is None:
        return None
    return StagingReport(
        info.mode, info.why, info.memory, info.memory_why, asked, info.nbytes, info.push_bytes, info.groups
    )


def stage_failure(error: BaseException) -> RemoteFailure:
    """A staged push's failure, its stage named "stage: <where it failed>"."""
    failure = RemoteFailure.of("stage", error)
    stage = failure.stage if failure.stage.startswith("stage") else f"stage: {failure.stage}"
    return RemoteFailure(stage, failure.error, failure.traceback)


def receiver_staged(actor: Any, sync_id: str) -> StagedState:
    side = _sessions(actor).get(sync_id)
    if side is None:
        return StagedState(
            applied_version(actor), None, failure=RemoteFailure.of("flip: check", RuntimeError(_NO_SESSION))
        )
    try:
        session = _session(side.receiver)
    except StagingError as e:
        return StagedState(side.receiver.version, None, failure=RemoteFailure.of("flip: check", e))
    return StagedState(session.version, session.staged_version)


def receiver_flip(actor: Any, sync_id: str, version: int, timeout_s: float) -> StagedState:
    """Make staged ``version`` live at the engine's step boundary (now, when no ``engine_steps`` loop runs)."""
    side = _sessions(actor).get(sync_id)
    if side is None:
        return StagedState(
            applied_version(actor), None, failure=RemoteFailure.of("flip", RuntimeError(_NO_SESSION))
        )
    gate = gate_of(actor)

    def flip() -> StagedState:
        session = _session(side.receiver)
        if session.staged_version != version:
            if session.version == version:
                return StagedState(version, None, flip_s=0.0)  # live already (its stage was skipped)
            raise StagingError(
                f"version {version} is not staged here (staged: {session.staged_version}, live: "
                f"{session.version}): push it again"
            )
        done = session.flip()
        actor.__dict__[_APPLIED] = session.version
        gate.settled(sync_id, session.version)
        return StagedState(session.version, None, flip_s=done.seconds)

    try:
        return gate.run(flip, timeout_s, "flip")
    except Exception as e:
        return StagedState(side.receiver.version, _staged(side.receiver), failure=RemoteFailure.of("flip", e))


def receiver_discard(actor: Any, sync_id: str) -> StagedState:
    """Drop what is staged (or acknowledge a stage that failed); ``staged`` is the version dropped."""
    side = _sessions(actor).get(sync_id)
    if side is None:
        return StagedState(applied_version(actor), None)  # nothing staged survives a restart
    try:
        dropped = _session(side.receiver).discard()
    except Exception as e:
        return StagedState(side.receiver.version, None, failure=RemoteFailure.of("discard", e))
    gate_of(actor).settled(sync_id, side.receiver.version)
    return StagedState(side.receiver.version, dropped)


def _staged(receiver: Any) -> int | None:
    try:
        return _session(receiver).staged_version
    except StagingError:
        return None
