"""The step gate (raysync.ray.step_gate): where WeightSync's flips meet an engine's step loop, and the staleness
bound at its step boundaries. Threads of this process stand for the actor's Ray call thread and its loop."""

from __future__ import annotations

import threading

import pytest
from conftest import session_pair

from raysync import SyncConfig
from raysync.core.errors import PeerTimeout, StaleWeights
from raysync.ray import endpoint
from raysync.ray.step_gate import LOOP, StepGate, gate_of


def test_without_a_step_loop_a_job_runs_in_the_callers_thread():
    gate = StepGate()
    assert gate.run(threading.get_ident, 1.0, "flip") == threading.get_ident()


def test_with_a_step_loop_a_job_runs_at_its_next_boundary_on_the_loops_thread(in_thread):
    gate = StepGate()
    gate.enter()
    posted = in_thread(gate.run, threading.get_ident, 30.0, "flip")
    with gate.cond:  # the job is posted before the boundary runs it
        assert gate.cond.wait_for(lambda: gate.jobs, 30)
    gate.boundary(1.0)
    assert posted.result(timeout=30) == threading.get_ident() and gate.jobs == []
    gate.leave()


def test_a_job_the_loop_never_reaches_times_out_naming_the_loop_and_is_withdrawn():
    gate = StepGate()
    gate.enter()
    ran = []
    with pytest.raises(PeerTimeout) as e:
        gate.run(lambda: ran.append(1), 0.2, "flip")
    assert e.value.peer == LOOP and "flip: waiting for the engine's next step boundary" in e.value.stage
    gate.boundary(1.0)  # the withdrawn job does not run late
    assert ran == [] and gate.jobs == []


def test_a_job_posted_when_the_loop_ends_runs_in_the_callers_thread(in_thread):
    gate = StepGate()
    gate.enter()
    posted = in_thread(gate.run, threading.get_ident, 30.0, "flip")
    with gate.cond:
        assert gate.cond.wait_for(lambda: gate.jobs, 30)
    gate.leave()
    assert posted.result(timeout=30) != threading.get_ident() and gate.jobs == []


def test_a_job_that_raises_raises_in_the_callers_thread(in_thread):
    gate = StepGate()
    gate.enter()

    def fail() -> None:
        raise ValueError("the flip failed")

    posted = in_thread(gate.run, fail, 30.0, "flip")
    with gate.cond:
        assert gate.cond.wait_for(lambda: gate.jobs, 30)
    gate.boundary(1.0)  # the loop goes on
    assert isinstance(posted.exception(timeout=30), ValueError)
    gate.leave()


@pytest.mark.parametrize(
    ("live", "newest", "lag", "stale"),
    [(1, 2, 1, False), (1, 3, 1, True), (1, 2, 0, True), (None, 1, 5, True), (1, 9, None, False)],
)
def test_the_boundary_holds_exactly_the_steps_the_bound_forbids(live, newest, lag, stale):
    gate = StepGate()
    gate.settled("s", live)
    gate.announce("s", newest, lag)
    if not stale:
        gate.boundary(0.0)
        return
    with pytest.raises(StaleWeights) as e:
        gate.boundary(0.1)
    assert e.value.peer == "WeightSync s (its flip())" and f"max_version_lag={lag}" in str(e.value)
    assert e.value.stage == "step boundary: waiting for the flip of a staged version"


def test_a_held_boundary_goes_on_once_the_flip_lands(in_thread):
    """The flip job posted while the loop is held at its boundary runs there, and the loop goes on."""
    gate = StepGate()
    gate.settled("s", 1)
    gate.announce("s", 2, 0)
    gate.enter()
    held = in_thread(gate.boundary, 30.0)  # holds: version 2 was announced, lag 0
    assert gate.run(lambda: gate.settled("s", 2), 30.0, "flip") is None
    assert held.result(timeout=30) is None
    gate.leave()


def test_closing_a_receivers_session_drops_its_bound(private_tmp):
    """A version staged and never flipped when WeightSync closes: the engine's steps no longer wait for it
    (endpoint.close closes the session's receiver and forgets its bound), while another session's bound still
    holds."""

    class Engine:
        pass

    engine = Engine()
    gate = gate_of(engine)
    for sync_id in ("closed", "open"):
        gate.settled(sync_id, 1)
    gate.announce("closed", 2, 0)
    with pytest.raises(StaleWeights):
        gate.boundary(0.05)
    with session_pair(SyncConfig(timeout_s=30, progress=False)) as (_, receiver):
        endpoint._sessions(engine)["closed"] = endpoint._ReceiverSide(sink=None, receiver=receiver)
        endpoint.close(engine, "closed")
        assert "closed" not in endpoint._sessions(engine)
    gate.boundary(0.0)  # no bound left
    gate.announce("open", 2, 0)
    with pytest.raises(StaleWeights):
        gate.boundary(0.05)
