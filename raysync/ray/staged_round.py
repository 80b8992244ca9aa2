"""Staged pushes through WeightSync, the driver's side (issue 18; the engines' side is
raysync.ray.staged_endpoint):

    push(v, staged=True)   a push round whose receivers stage (receiver_stage): returns once every receiver
                           has v in its staging memory; the engines keep computing on their live weights and
                           ``versions()`` keeps saying the live version. If any endpoint fails, every receiver
                           discards what it staged and StageFailed names the endpoint and the stage.
    flip()                 check: every receiver still holds v staged (or live)? If any does not (its actor was
                           restarted, its stage failed), none flips, all discard, FlipFailed names it. Then
                           flip: each receiver applies v at its engine's next step boundary
                           (raysync.ray.step_gate). Returns a FlipReport (the stall per receiver).
    discard()              every receiver drops what it staged.

A staged push of a newer version while one waits for its flip replaces it (the older is never flipped); a push
applied live (``push(v)``) drops it too (Note [flip and versions] in raysync.core.staging).

# Note [all or nothing across engines]
# The check and the flip are two rounds: between them an engine can still fail (its actor dies, its step loop
# stops past timeout_s). Then the engines that had flipped stay on the new version, the others on the old
# one, and FlipFailed says which (``flipped``); versions() reports each. Everything short of that (a stage
# that failed, a staged version lost with its actor) is found by the check, before any engine flips.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from raysync.core.errors import (
    ActorUnavailable,
    EndpointFailure,
    FlipFailed,
    NothingStaged,
    PeerTimeout,
    StageFailed,
    SyncError,
)
from raysync.core.staging_memory import STAGING_MEMORY
from raysync.ray import staged_endpoint as se
from raysync.ray.actors import SyncActors, first_line
from raysync.ray.connections import PairConnections, Plan
from raysync.ray.push_graph import RoundPlan
from raysync.ray.push_round import PushRound
from raysync.ray.report import FlipReport, SyncReport
from raysync.ray.results import StagedState, StagingReport

logger = logging.getLogger(__name__)


def check_staged_options(max_version_lag: int | None, staging_memory: str) -> None:
    """WeightSync's options for staged pushes, checked: ValueError naming the value and what it may be."""
    if max_version_lag is not None and max_version_lag < 0:
        raise ValueError(f"max_version_lag={max_version_lag}: 0 or more, or None for no bound")
    if staging_memory not in STAGING_MEMORY:
        raise ValueError(
            f"staging_memory={staging_memory!r}: one of {', '.join(map(repr, STAGING_MEMORY))} "
            f"(where the engines stage a push: raysync.core.staging_memory)"
        )


class StagedPushes:
    """The staged push of one WeightSync that waits for its flip (``version``), and the rounds around it."""

    def __init__(
        self,
        actors: SyncActors,
        connections: PairConnections,
        *,
        setup_timeout_s: float,
        max_version_lag: int | None,
        staging_memory: str = "auto",
    ):
        check_staged_options(max_version_lag, staging_memory)
        self.actors, self.connections = actors, connections
        self._setup_timeout_s, self._lag = setup_timeout_s, max_version_lag
        self.staging_memory = staging_memory
        self.staging: dict[int, StagingReport] = {}  # receiver j -> where its last staged push was staged
        self.version: int | None = None  # staged on every receiver, waiting for flip()
        self._failed: StageFailed | PeerTimeout | None = None  # the last staged push, if it failed
        self._stageable = False  # every receiver said it can stage (asked once)

    def push(self, version: int, *, full: bool, timeout_s: float, progress: bool) -> SyncReport:
        self._check_stageable(version)
        self.version, self._failed = None, None
        stage = (se.receiver_stage, (version, self._lag, self.staging_memory))
        round_ = _StageRound(
            self.actors,
            self.connections,
            version,
            timeout_s=timeout_s,
            progress=progress,
            full=full,
            receive=stage,
        )
        try:
            report = round_.run(None)  # ordinary calls: a compiled graph's receivers apply live
        except SyncError as e:
            self._discard(f"the staged push of version {version} failed")
            self._failed = StageFailed(version, e.failures, e.mixed)
            raise self._failed from e
        except PeerTimeout as e:
            self._failed = e  # its pairs are reconnected before the next push: their staging goes with them
            raise
        self.version = version
        self.staging.update(round_.staging)
        return dataclasses.replace(report, staged=True)

    def describe(self) -> str:
        """The engines' staging, for ``sync.plan``: chosen at the first staged push, then as each reported it."""
        head = f"staging (staging_memory={self.staging_memory!r})"
        if not self.staging:
            return f"{head}: chosen at the first staged push"
        lines = [f"{head}, as each receiver staged its last staged push:"]
        for j in range(len(self.actors.slots)):
            lines.append(f"  receiver #{j}: {self.staging.get(j, 'not staged yet')}")
        return "\n".join(lines)

    def flip(self, timeout_s: float) -> FlipReport:
        """Check that every receiver still holds the staged version, then flip it everywhere."""
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise NothingStaged(
                f"flip() refused: the last staged push failed, nothing flips ({failed})"
            ) from failed
        if self.version is None:
            raise NothingStaged("flip() with nothing staged: push(version, staged=True) first")
        version, started = self.version, time.perf_counter()
        self.version = None
        states, failures = self._ask(se.receiver_staged, (), "flip: check the staged version")
        for j, s in states.items():
            if s.ok and version not in (s.staged, s.live):
                failures[j] = self._failure(
                    j,
                    "flip: check the staged version",
                    f"StagingError: version {version} is not staged here (staged: {s.staged}, live: {s.live})",
                )
        if failures:
            self._discard(f"the flip of version {version} was refused")
            raise FlipFailed(version, list(failures.values()))
        # each flip waits up to timeout_s for its engine's step boundary, then copies
        states, failures = self._ask(se.receiver_flip, (version, timeout_s), "flip", extra_s=2 * timeout_s)
        if failures:
            flipped = sorted(j for j, s in states.items() if s.live == version)
            self._discard(f"the flip of version {version} failed")
            raise FlipFailed(version, list(failures.values()), flipped)
        stalls = tuple(states[j].flip_s or 0.0 for j in range(len(self.actors.slots)))
        return FlipReport(version, time.perf_counter() - started, stalls)

    def discard(self) -> int | None:
        """Every receiver drops what it staged; returns the version that was waiting for its flip."""
        version, self.version, self._failed = self.version, None, None
        self._discard("discard()")
        return version

    def dropped(self) -> None:
        """A push applied live dropped what was staged (the sessions did: Note [flip and versions])."""
        self.version, self._failed = None, None

    def staged_versions(self) -> list[int | None]:
        """What each receiver holds staged; None also where its actor has no session (restarted by Ray)."""
        states, failures = self._ask(se.receiver_staged, (), "staged versions")
        unanswered = [f for j, f in failures.items() if j not in states]
        if unanswered:  # unknown is not None (Note [versions never lie])
            f = unanswered[0]
            raise ActorUnavailable(
                f.endpoint, f.stage, f"{f.endpoint} did not say what it holds staged: {f.error}"
            )
        return [states[j].staged for j in range(len(self.actors.slots))]

    # --- rounds of calls ---------------------------------------------------------------------------------------
    def _check_stageable(self, version: int) -> None:
        """Before the first staged push: every receiver can stage (a sink of tensors, one session)."""
        if self._stageable:
            return
        reasons, failures = self._ask(se.receiver_stageable, (), "stage: can it stage?", typed=False)
        for j, reason in reasons.items():
            if reason:
                failures[j] = self._failure(j, "stage: can it stage?", f"StagingError: {reason}")
        if failures:
            raise StageFailed(version, [failures[j] for j in sorted(failures)])
        self._stageable = True

    def _discard(self, why: str) -> None:
        _, failures = self._ask(se.receiver_discard, (), "discard")
        for f in failures.values():  # its pairs are reconnected before the next push, with new staging memory
            logger.warning(
                "after %s: %s could not discard at stage %s: %s", why, f.endpoint, f.stage, f.error
            )

    def _ask(
        self, fn: Callable, args: tuple, stage: str, *, typed: bool = True, extra_s: float = 0.0
    ) -> tuple[dict[int, Any], dict[int, EndpointFailure]]:
        """``fn(actor, sync_id, *args)`` on every receiver: {j: answer} of those that answered, and a failure
        for each j that did not (or whose StagedState says it failed). Their pairs are reconnected next push.
        Bounded by setup_timeout_s (Ray may be restarting an actor) + ``extra_s``."""
        slots, sync_id = self.actors.slots, self.connections.sync_id
        calls = self.actors.on_receivers(fn, {j: (sync_id, *args) for j in range(len(slots))})
        calls = {key: (lambda make=make: _call_or_put(make)) for key, make in calls.items()}
        answers: dict[int, Any] = {}
        failures: dict[int, EndpointFailure] = {}
        for (_, e), by_slot in self.actors.ask(calls, stage, self._setup_timeout_s + extra_s).items():
            if isinstance(by_slot, BaseException):
                for j in [j for j, (e_, _) in enumerate(slots) if e_ == e]:
                    failures[j] = self._failure(j, stage, first_line(by_slot), str(by_slot))
                self.connections.mark_broken(self.connections.pairs_of(("receiver", e)))
                continue
            for j, answer in self.actors.by_receiver(e, by_slot).items():
                if typed and isinstance(answer, StagedState) and not answer.ok:
                    f = answer.failure
                    failures[j] = self._failure(j, f.stage, f.error, f.traceback)
                    if "no session" in f.error:
                        self.connections.mark_broken(self.connections.pairs_to(j))
                answers[j] = answer
        return answers, failures

    def _failure(self, j: int, stage: str, error: str, traceback: str = "") -> EndpointFailure:
        return EndpointFailure(
            f"receiver #{j} ({self.actors.receiver_at[j].label()})", stage, error, traceback
        )


class StagingPlan(RoundPlan):
    """A WeightSync's plan: its pairs, the engines' staging (``staging`` {receiver j: StagingReport} as each
    staged its last staged push, {} before the first), then how push rounds reach the actors (the last line)."""

    def __init__(self, plan: RoundPlan, staged: StagedPushes):
        super().__init__(list(plan), staged.actors, plan.rounds)
        self.staging = dict(staged.staging)
        self._staging_text = staged.describe()

    def __str__(self) -> str:
        return f"{Plan.__str__(self)}\n{self._staging_text}\n{self.rounds}"


class _StageRound(PushRound):
    """A staged push's round, which also keeps where each receiver staged it (``staging``)."""

    staging: dict[int, StagingReport]

    def _read_receivers(self) -> None:
        super()._read_receivers()
        self.staging = {j: r.staging for j, r in self._received.items() if r.ok and r.staging is not None}


def _call_or_put(make: Callable[[], Any]) -> Any:
    """Make the call; an adapter that refuses the function (a vLLM engine: not on its allowlist) answers with
    its refusal instead."""
    import ray

    try:
        return make()
    except ValueError as e:
        return ray.put(e)
