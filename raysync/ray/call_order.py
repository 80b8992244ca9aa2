"""Which of a WeightSync's actors still run, or have queued, a Ray call made earlier by the process that pushes:
a push through push loops, which run beside the actor's own calls, must not start before them.

# Note [a push after the caller's own calls]
# Ray runs an actor's ordinary calls one at a time, in the order one caller made them: with ordinary calls,
# ``trainer.step.remote(); sync.push(v)`` reads the weights after the step, whether or not the driver waited for
# it. Push loops (raysync.ray.push_loop) run on threads of their own beside those calls, so the same code would
# read weights the step is still writing: torn weights, reported as version v. So before a push round through
# them the driver asks its own Ray core worker (in this process, no message: ~4 us on the VM) which actors its
# calls are still pending on, made from the thread that pushes or from the driver's main thread; when any is a
# member of the round, that round goes through ordinary calls, queued behind those calls as Ray queues them, and
# the report says so (SyncReport.rounds). The next round, with nothing pending, goes through the loops again.
# Ray marks a call finished a little after its answer has reached ``ray.get``: a push right after
# ``ray.get(trainer.step.remote())`` saw the step pending every time on the 2-core VM, for 26 us (median of 300;
# up to 6.6 ms with a test run loading the VM). So a call seen pending is looked at again for up to
# ANSWERED_GRACE_S (5 ms) before the round goes through ordinary calls (a train step still running takes longer).
# What this does not order: calls made from a thread of this process other than the one that pushes and the
# main thread; calls made by other processes (Ray orders calls per caller only: ordinary calls would not wait
# for them either); and calls made while the push runs (behind ordinary calls they would queue; beside the
# loops they run at once). Where Ray cannot say (a version without these calls), every round goes through
# ordinary calls, with a warning.
# raysync's own calls that read no weights and write none (a loop's liveness probe) do not count: one that
# outlived its wait stays pending in Ray, and in the CI it stayed so, with the restarted actor answering later
# calls, for as long as the test ran; each push after it would have gone through ordinary calls.
# A compiled graph (raysync.ray.push_graph, opt-in) is not checked: its actors always run a call of the
# driver's, Ray's loop that runs the graph's tasks; its Note says to wait for the train step before pushing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)
_warned: list[bool] = []
_weightless: set[bytes] = set()  # ids of raysync's calls that touch no weights (Note [a push after ...])
_ray_api: list = []  # [ray._private.worker, TaskID]: imported at the first look, not at each push's
# on the driver, per thread: its job (.job) and the task ids its calls and its main thread's are children of (.ids),
# made once per thread and job, not at each push (a core worker call each: ~9 us on the VM, cold, against ~0.1 us)
_parents = threading.local()
_NOTHING: frozenset[bytes] = frozenset()
ANSWERED_GRACE_S = 0.005  # how long a call seen pending is looked at again (the answer may be in already)


def actor_id(handle: Any) -> bytes:
    return handle._actor_id.binary()


def weightless(ref: Any) -> Any:
    """``ref``, the answer of a call of raysync's that reads and writes no weights: its call never orders a
    push, also while it is pending."""
    _weightless.add(ref.task_id().binary())
    return ref


def actors_with_pending_calls() -> frozenset[bytes] | None:
    """The ids of the actors that this thread's or the driver's main thread's Ray calls are still pending on (queued
    or running, their answer not back); None where this Ray cannot say."""
    try:
        if not _ray_api:
            import ray._private.worker
            from ray._raylet import TaskID

            _ray_api[:] = [ray._private.worker, TaskID]
        workers, task_id = _ray_api
        worker = workers.global_worker
        core = worker.core_worker
        if worker.mode == workers.SCRIPT_MODE:  # the driver: this thread's calls and its main thread's
            job = worker.current_job_id  # the same object at each push (Ray caches it): `is` spares a compare
            parents = getattr(_parents, "ids", None)
            if parents is None or (_parents.job is not job and _parents.job != job):
                # a driver's thread runs no task: its task id stays until the job ends (a new ray.init)
                parents = (core.get_current_task_id(), task_id.for_driver_task(job))
                _parents.job, _parents.ids = job, (parents[:1] if parents[0] == parents[1] else parents)
                parents = _parents.ids
        else:  # an actor or a task: the task running now
            parents = (core.get_current_task_id(),)
        tasks = [task for parent in parents for task in core.get_pending_children_task_ids(parent)]
        if not tasks:  # most pushes: nothing pending, nothing weightless left to remember
            _weightless.clear()
            return _NOTHING
        ids = {task.binary() for task in tasks}
        _weightless.intersection_update(ids)  # those no longer pending are forgotten
        return frozenset(task.actor_id().binary() for task in tasks if task.binary() not in _weightless)
    except (AttributeError, ImportError, TypeError) as e:
        if not _warned:
            _warned.append(True)
            logger.warning(
                "this Ray cannot tell which actors the driver's calls are pending on (%s): push rounds go through "
                "ordinary Ray calls (Note [a push after the caller's own calls])",
                e,
            )
        return None


def waiting_on(ids: Mapping[bytes, Any], grace_s: float = ANSWERED_GRACE_S) -> list[Any] | None:
    """The names, among ``ids`` (an actor's id, ``actor_id`` of its handle -> its name), of the actors a call of this
    caller is still pending on; None where Ray cannot say. One seen pending is looked at again for up to
    ``grace_s``: Ray marks a call finished just after its answer reached ``ray.get`` (Note [a push after the
    caller's own calls])."""
    deadline = None
    while True:
        pending = actors_with_pending_calls()
        if pending is None:
            return None
        if not pending:
            return []
        hit = [name for i, name in ids.items() if i in pending]
        now = time.monotonic()
        if deadline is None:
            deadline = now + grace_s
        if not hit or now >= deadline:
            return hit
        time.sleep(0)  # let Ray's thread finish its bookkeeping
