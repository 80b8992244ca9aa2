"""Where WeightSync's flips meet an engine's step loop, inside the engine's actor (issue 18).

A staged push lands while the engine keeps computing (raysync.core.staging); the flip must then happen between
two of its steps. An engine whose steps run in Ray calls of a plain actor (one call at a time) is between steps
whenever a WeightSync call runs, so a flip runs in that call. An engine that computes on a thread of its own
says where its step boundaries are: it runs its loop inside ``engine_steps(actor)`` (raysync.ray.staged_endpoint)
and calls the boundary between steps; a flip the driver asks for then waits for that boundary and runs there,
on the engine's thread:

    Ray call thread (WeightSync)                      engine thread (its loop)
    receiver_stage: announce(v), receive(flip=False)  boundary() -> v - 1 ... step on v - 1
    receiver_flip:  gate.run(flip job) ... waits      boundary(): runs the flip job -> v
                    <- the job's answer               step on v

# Note [the staleness bound at a step boundary]
# ``max_version_lag`` (WeightSync's) bounds how far the live weights may lag the newest version announced to
# this engine (a staged push started): at a boundary where live + lag < newest, the engine waits for the flip
# (or a discard, or a push applied live) rather than start a step on older weights, bounded by its wait, then
# StaleWeights names the WeightSync and the stage. The engine never flips on its own: a flip comes only from
# the driver, so the flip stays all-or-nothing across engines. A vLLM engine counts the same way, a request
# being its step: an ``LLM``'s requests wait at this gate's boundary, an ``AsyncLLM``'s on its event loop on
# ``stale()`` (raysync.engines.vllm_staged, Note [requests and the staleness bound]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raysync.core.errors import PeerTimeout, StaleWeights
from raysync.core.version import Version, is_version

_GATE = "_raysync_step_gate"
LOOP = "the engine's step loop (raysync.ray.staged_endpoint.engine_steps)"
BOUNDARY = "step boundary: waiting for the flip of a staged version"

Stale = tuple[str, Version, int, int]  # a bound broken: (sync_id, live, newest, lag)


@dataclass
class _Job:
    run: Callable[[], Any]
    done: bool = False
    taken: bool = False
    answer: Any = None
    error: BaseException | None = None


@dataclass
class _Sync:
    """What one WeightSync announced to this engine."""

    live: Version = None
    newest: int | None = None  # the newest staged version announced and not yet settled
    lag: int | None = None


@dataclass
class StepGate:
    cond: threading.Condition = field(default_factory=threading.Condition)
    loops: int = 0  # engine_steps loops running (or, for an LLM, requests in raysync.engines.vllm.generate)
    jobs: list[_Job] = field(default_factory=list)
    syncs: dict[str, _Sync] = field(default_factory=dict)
    loop: str = LOOP  # what a job waits for: the peer its PeerTimeout names

    # --- the Ray call thread ------------------------------------------------------------------------------------
    def run(self, job: Callable[[], Any], timeout_s: float, stage: str) -> Any:
        """``job()`` at a step boundary: now when no step loop runs, else at the loop's next boundary (waited for
        up to ``timeout_s``: PeerTimeout names the loop; a job not begun by then is withdrawn)."""
        with self.cond:
            if self.loops == 0:
                return job()
            posted = _Job(job)
            self.jobs.append(posted)
            self.cond.notify_all()
            if not self.cond.wait_for(
                lambda: posted.done or (self.loops == 0 and not posted.taken), timeout_s
            ):
                if not posted.taken:
                    self.jobs.remove(posted)
                    raise PeerTimeout(
                        self.loop, f"{stage}: waiting for the engine's next step boundary", timeout_s
                    )
                elif not self.cond.wait_for(lambda: posted.done, timeout_s):  # begun: one copy of the weights
                    raise PeerTimeout(
                        self.loop, f"{stage}: the flip at the engine's step boundary", 2 * timeout_s
                    )
            if not posted.done:  # the loop ended before it took the job: run it here, between no steps
                self.jobs.remove(posted)
                return job()
        if posted.error is not None:
            raise posted.error
        return posted.answer

    def announce(self, sync_id: str, version: int, lag: int | None) -> None:
        """A staged push of ``version`` starts: the bound counts from it (Note [the staleness bound ...])."""
        with self.cond:
            s = self.syncs.setdefault(sync_id, _Sync())
            s.newest, s.lag = version if s.newest is None else max(s.newest, version), lag
            self.cond.notify_all()

    def settled(self, sync_id: str, live: Version) -> None:
        """The live weights are ``live`` and nothing announced waits (a flip, a discard, a push applied live,
        a new session)."""
        with self.cond:
            s = self.syncs.setdefault(sync_id, _Sync())
            s.live, s.newest = live, None
            self.cond.notify_all()

    def forget(self, sync_id: str) -> None:
        """Session ``sync_id`` closed: its bound goes with it."""
        with self.cond:
            self.syncs.pop(sync_id, None)
            self.cond.notify_all()

    # --- the engine's thread ------------------------------------------------------------------------------------
    def boundary(self, wait_s: float, stage: str = BOUNDARY) -> None:
        """Run the flips asked for; then, while the live weights are staler than a bound, wait for one (up to
        ``wait_s``, then StaleWeights at ``stage``)."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                self._run_jobs()
                stale = self._stale()
                if stale is None:
                    return
                left = deadline - time.monotonic()
                changed = lambda was=stale: self.jobs or self._stale() != was  # noqa: E731
                if left <= 0 or not self.cond.wait_for(changed, left):
                    raise stale_error(stale, wait_s, stage)

    def _run_jobs(self) -> None:
        while self.jobs:
            job = self.jobs.pop(0)
            job.taken = True
            try:
                job.answer = job.run()
            except BaseException as e:  # handed to the caller's thread, raised there
                job.error = e
            job.done = True
            self.cond.notify_all()

    def stale(self) -> Stale | None:
        """The first WeightSync whose bound the live weights break: (sync_id, live, newest, lag), values."""
        with self.cond:
            return self._stale()

    def _stale(self) -> Stale | None:
        for sync_id, s in self.syncs.items():
            if s.lag is None or s.newest is None:
                continue
            if not is_version(s.live) or s.newest - s.live > s.lag:
                return sync_id, s.live, s.newest, s.lag
        return None

    def enter(self) -> None:
        with self.cond:
            self.loops += 1
            self.cond.notify_all()  # for whoever waits for a step to begin

    def leave(self) -> None:
        with self.cond:
            self.loops -= 1
            self.cond.notify_all()  # a job posted and not taken runs in its caller's thread now


def stale_error(stale: Stale, wait_s: float, stage: str = BOUNDARY) -> StaleWeights:
    """The error of a step (a request) that waited ``wait_s`` in vain for the flip the bound ``stale`` needs."""
    sync_id, live, newest, lag = stale
    return StaleWeights(f"WeightSync {sync_id} (its flip())", stage, wait_s, live, newest, lag)


def gate_of(actor: Any, loop: str = LOOP) -> StepGate:
    """The gate of ``actor`` (or of any object that steps: a vLLM engine), made on first use; ``loop``
    names what its jobs wait for."""
    return actor.__dict__.setdefault(_GATE, StepGate(loop=loop))
