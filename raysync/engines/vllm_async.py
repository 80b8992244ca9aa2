"""vLLM's ``AsyncLLM`` inside a Ray actor as a WeightSync receiver, the way RL frameworks run it.

Engine side, an async Ray actor that makes the engine in its ``__init__`` (an async actor runs it in its event
loop, where AsyncLLM starts its output handler) and generates through ``generate`` from this module:

    @ray.remote
    class Rollout:
        def __init__(self, model):
            args = AsyncEngineArgs(model, worker_extension_cls="raysync.engines.vllm.WorkerExtension")
            self.llm = AsyncLLM.from_engine_args(args)

        async def rollout(self, prompt, params):
            done = await generate(self.llm, prompt, params)  # done.output: vLLM's RequestOutput
            return done.output, done.version  # the version of the weights that produced every token

A request made through ``generate`` also keeps WeightSync's ``max_version_lag``: it is not admitted on weights
more versions behind the newest one staged than that; it waits for the flip, or raises StaleWeights after its
``wait_s`` (Note [requests and the staleness bound] in raysync.engines.vllm_staged).

Driver side, the same adapter as for ``LLM``: ``WeightSync([trainer], [VllmEngine(rollout)], config)``. Each
call of the driver reaches the actor through Ray's ``__ray_call__``, which an async actor runs outside its event
loop; the call is handed to that loop (the one AsyncLLM's output handler runs on) and goes to the workers
through ``AsyncLLM.collective_rpc``. A push runs as Note [a push into a generating engine] says.

Sleep and wake, in the actor: ``await sleep(self.llm, level)`` and ``await wake_up(self.llm)`` from this module
(Note [sleep and wake of an AsyncLLM]): the version rules of raysync.engines.vllm's, and the gate's.

This module never imports vllm itself.

# Note [a push into a generating engine]
# The weights change only while no request runs, and no request sees two versions:
#   1. close: requests made through ``generate`` from now on wait (``wait_s``) until the push is done;
#   2. drain: the push waits for the requests already running through ``generate`` to finish (bounded by the
#      session's SyncConfig.timeout_s: a PeerTimeout at stage "pause");
#   3. pause: vLLM's own ``pause_generation(mode="wait")`` (0.32 has it; looked up on the engine, skipped where it is
#      missing) also drains the requests made on the AsyncLLM directly, and holds new ones in vLLM's queue,
#      so the weights change between two engine steps with nothing running ("keep" would freeze requests
#      half-way and finish them on the new weights: a mix, so raysync does not use it);
#   4. the push goes to the workers (collective_rpc), then the prefix cache is reset (its blocks were computed
#      with the old weights), then the engine's version is read back from the workers;
#   5. resume, open: vLLM's queue and ``generate``'s waiters run on the new weights.
# A request made through ``generate`` takes the version read at its admission, and after it finished the
# version is read again from the workers (one read serves every request that finished while it was waiting,
# Note [an engine's version and its weights] checked by each worker): if the two differ, the weights changed
# outside raysync while it ran, and the request says None. A request made on the AsyncLLM directly is never
# mixed by a push either (step 3), but only ``generate`` can say its version. A staged push's flip goes through
# the same steps (its step 4 is vLLM's reload of the staged copies); its stage goes through none of them: it
# lands while requests run (Note [a stage beside the engine's steps] in raysync.engines.vllm_staged).

# Note [sleep and wake of an AsyncLLM]
# ``sleep`` and ``wake_up`` below keep the rules of the ones for ``LLM`` (Note [sleep, wake and the version] in
# raysync.engines.vllm): level 1 keeps the version, level 2 makes every worker forget it before vLLM drops the
# weights; waking goes weights first, then the KV cache. And the gate's:
#   sleep: the gate closes (requests through ``generate`` wait for the wake, not in vLLM's queue, where a push
#     would wait for them), then ``AsyncLLM.sleep(level, mode)`` ("abort" or "wait": what happens to requests
#     running; "keep" is refused, a request kept across a sleep would hold a push up and, at level 2, finish on
#     other weights), then the version is read again (a read that starts after the forget: None at level 2);
#   wake_up: the weights, the KV cache, then the gate opens;
#   a push into a sleeping engine, asleep by raysync's ``sleep`` or by ``AsyncLLM.sleep``: after the drain
#     (step 2) the weights are woken, then vLLM is paused (step 3), the push loaded, the prefix cache reset, and
#     the KV cache woken after it; the engine and the gate are awake and open after the push.
# vLLM's ``is_sleeping()`` is also True while its scheduler is only paused (``pause_generation``, a level-0
# sleep), and 0.32 does not say whether the weights are resident. A paused engine is woken the same way: its
# executor is not asleep, vLLM's ``wake_up`` then resumes its scheduler (queued requests start on the old
# weights), and the pause of step 3, which comes after the wake, drains them before the load. Requests made
# through ``generate`` into an engine put to sleep on the AsyncLLM directly (the gate open) wait in vLLM's
# queue, and a push waits for them in its drain until SyncConfig.timeout_s: use this module's ``sleep``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from raysync.core.errors import PeerTimeout
from raysync.core.version import Version
from raysync.engines import vllm_staged as staged
from raysync.engines.vllm_staged import POLL_S, weights_changed
from raysync.ray import step_gate

logger = logging.getLogger(__name__)

_GATE = "_raysync_gate"
_DRAIN_S = 60.0  # the drain's limit until a session says its SyncConfig.timeout_s
_STAGE_TIMEOUTS = 10  # a staged push not landed after this many SyncConfig.timeout_s is a PeerTimeout


@dataclasses.dataclass(frozen=True)
class Generated:
    """A finished request: vLLM's final ``RequestOutput`` (an ``LLM``'s: its list of them, from
    raysync.engines.vllm.generate) and the version of the weights that made all of it (None: no version, or
    the weights changed outside raysync while it ran)."""

    output: Any
    version: Version


async def generate(
    llm: Any, prompt: Any, sampling_params: Any, request_id: str | None = None, *, wait_s: float = 600.0
) -> Generated:
    """``llm.generate`` to its end, never across a push (Note [a push into a generating engine]), started on
    weights within WeightSync's ``max_version_lag``. Waits at most ``wait_s`` for a push that is running
    (PeerTimeout at stage "generate"), and as long for a flip that the bound needs (StaleWeights)."""
    gate = gate_of(llm)
    version = await gate.admit(wait_s)
    try:
        final = None
        async for output in llm.generate(prompt, sampling_params, request_id or uuid.uuid4().hex):
            final = output
        held = await gate.read()
    finally:
        gate.leave()
    return Generated(final, version if held == version else None)


async def weight_version(llm: Any) -> Version:
    """The engine's version, read from its workers now (raysync.engines.vllm.weight_version for AsyncLLM)."""
    return staged.engine_version(await llm.collective_rpc("raysync_version"))


def gate_of(llm: Any) -> Gate:
    gate = llm.__dict__.get(_GATE)
    if gate is None:
        gate = llm.__dict__[_GATE] = Gate(llm)
    return gate


class Gate:
    """Who may run on an AsyncLLM now: requests made through ``generate``, or one push (Note [a push into a
    generating engine]). Lives on the engine's event loop; only coroutines touch it."""

    def __init__(self, llm: Any):
        self._llm = llm
        self.version: Version = None  # as last read from the workers
        self._known = False  # whether it was ever read
        self.drain_s = _DRAIN_S
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._next: asyncio.Future | None = None  # the read that starts after the one running
        self._reading = False
        self._pushing = False
        self.sleeping = False  # put to sleep by raysync's sleep, not woken since: the gate stays closed
        self.landing = (
            asyncio.Event()
        )  # set while a staged push lands in the workers (requests run meanwhile)
        self.bound = step_gate.gate_of(llm, staged.REQUESTS)  # max_version_lag's count (its stale() only)
        self.bound_moved = asyncio.Condition()  # notified when the bound's versions change, or ``held`` does
        self.held = 0  # requests waiting for a flip that the bound needs

    async def admit(self, wait_s: float) -> Version:
        while True:
            await _bounded(self._open.wait(), wait_s, "a push into the engine", "generate: wait for the push")
            if not self._known:
                await self.read()
            elif self.bound.stale() is not None:
                await self._within_bound(wait_s)
            elif self._open.is_set():  # no await since the checks above: no push can start in between
                break
        self._running += 1
        self._idle.clear()
        return self.version

    async def _within_bound(self, wait_s: float) -> None:
        """Until no WeightSync's ``max_version_lag`` forbids a request now; StaleWeights after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        async with self.bound_moved:
            self.held += 1
            self.bound_moved.notify_all()
            try:
                while (stale := self.bound.stale()) is not None:
                    left = deadline - time.monotonic()
                    try:
                        await asyncio.wait_for(self.bound_moved.wait(), max(left, 0.0))
                    except asyncio.TimeoutError:
                        raise step_gate.stale_error(stale, wait_s, staged.REQUEST_STAGE) from None
            finally:
                self.held -= 1

    async def moved(self) -> None:
        """The bound's versions changed (an announce, a settle): requests waiting for it look again."""
        async with self.bound_moved:
            self.bound_moved.notify_all()

    def leave(self) -> None:
        self._running -= 1
        if self._running == 0:
            self._idle.set()

    async def read(self) -> Version:
        """The engine's version from a read that starts after this call (one read serves every caller that
        came while the one before ran)."""
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
            if not self._reading:
                asyncio.ensure_future(self._reads())
        return await asyncio.shield(self._next)

    async def _reads(self) -> None:
        self._reading = True
        try:
            while self._next is not None:
                future, self._next = self._next, None
                try:
                    read = weight_version(self._llm)
                    self.version = await _bounded(read, self.drain_s, "the engine's workers", "version: read")
                    self._known = True
                    future.set_result(self.version)
                except Exception as e:
                    future.set_exception(e)
        finally:
            self._reading = False

    def close_for_sleep(self, engine: str) -> None:
        if self._pushing:
            raise RuntimeError(f"{engine} is receiving a push: put it to sleep after the push")
        self.sleeping = True
        self._open.clear()

    def open_after_wake(self) -> None:
        self.sleeping = False
        if not self._pushing:
            self._open.set()

    async def push(self, receive: Callable[[], Awaitable[Any]], engine: str) -> Any:
        """Run ``receive`` with no request running (steps 1-5 of Note [a push into a generating engine]), into
        an engine woken around it if it sleeps (Note [sleep and wake of an AsyncLLM])."""
        if self._pushing:
            raise RuntimeError(f"{engine} is already receiving a push: one push at a time")
        self._pushing = True
        self._open.clear()
        paused = False
        try:
            await _bounded(self._idle.wait(), self.drain_s, engine, "pause: requests running to finish")
            asleep = await _bounded(self._llm.is_sleeping(), self.drain_s, engine, "pause: is it asleep")
            if asleep:
                await _bounded(self._llm.wake_up(tags=["weights"]), self.drain_s, engine, "wake: the weights")
            if callable(getattr(self._llm, "pause_generation", None)):
                # resumed whatever happens next: a pause that timed out still holds new requests
                paused = True
                await _bounded(
                    self._llm.pause_generation(mode="wait", clear_cache=False),
                    self.drain_s,
                    engine,
                    "pause: vLLM's requests to finish",
                )
            result = await receive()
            if asleep:
                await _bounded(
                    self._llm.wake_up(tags=["kv_cache"]), self.drain_s, engine, "wake: the KV cache"
                )
                self.sleeping = False
            return result
        finally:
            try:
                await self.read()  # what the workers hold now, pushed or not
            except Exception as e:  # the next request reads again before it is admitted
                self._known = False
                logger.warning("%s: its version could not be read after a push: %s", engine, e)
            if paused:
                await self._llm.resume_generation()
            self._pushing = False
            if not self.sleeping:
                self._open.set()


# --- sleep and wake (Note [sleep and wake of an AsyncLLM]) --------------------------------------------------------
async def sleep(llm: Any, level: int = 1, *, mode: str = "abort", timeout_s: float = 600.0) -> None:
    """``await llm.sleep(level, mode)`` with the gate closed, the version forgotten first where the level drops
    the weights, and read again after. Each wait is bounded by ``timeout_s`` (PeerTimeout at stage "sleep")."""
    if mode not in ("abort", "wait"):
        raise ValueError(
            f"sleep(mode={mode!r}): raysync takes 'abort' or 'wait'; a request kept across a sleep would hold "
            f"up the next push and, at level 2, finish on other weights"
        )
    gate, engine = gate_of(llm), "vLLM AsyncLLM"
    gate.close_for_sleep(engine)
    if level >= 2:
        why = f"sleep(level={level}) discards the weights"
        await _bounded(
            llm.collective_rpc("raysync_forget_version", args=(why,)), timeout_s, engine, "sleep: forget"
        )
    await _bounded(llm.sleep(level=level, mode=mode), timeout_s, engine, f"sleep: level {level}")
    await _bounded(gate.read(), timeout_s, engine, "sleep: version read")


async def wake_up(llm: Any, *, timeout_s: float = 600.0) -> None:
    """Wake the engine in the order a push needs: the weights, then the KV cache; then open the gate."""
    engine = "vLLM AsyncLLM"
    await _bounded(llm.wake_up(tags=["weights"]), timeout_s, engine, "wake: the weights")
    await _bounded(llm.wake_up(tags=["kv_cache"]), timeout_s, engine, "wake: the KV cache")
    gate_of(llm).open_after_wake()


async def _bounded(waiting: Awaitable[Any], timeout_s: float, peer: str, stage: str) -> Any:
    try:
        return await asyncio.wait_for(waiting, timeout_s)
    except asyncio.TimeoutError:
        raise PeerTimeout(peer, stage, timeout_s) from None


# --- the driver's calls, in the actor (raysync.engines.vllm._on_engine hands them here) ---------------------------
def on_async_engine(llm: Any, actor: Any, name: str, args: Any, replies: Callable[[list], dict]) -> dict:
    """Run the driver's call ``name`` on the engine's event loop, from the thread Ray runs ``__ray_call__`` on.
    ``replies`` turns the workers' answers into {rank: result}."""
    handler = getattr(llm, "output_handler", None)
    if handler is None:
        raise TypeError(
            f"{type(actor).__name__}'s AsyncLLM has no event loop yet: make it in the actor's __init__ (an async "
            f"actor runs __init__ in its event loop) or generate once before WeightSync starts"
        )
    loop = handler.get_loop()
    engine = f"vLLM AsyncLLM in actor {type(actor).__name__}"
    return asyncio.run_coroutine_threadsafe(_call(llm, name, args, replies, engine), loop).result()


async def _call(llm: Any, name: str, args: Any, replies: Callable[[list], dict], engine: str) -> dict:
    gate = gate_of(llm)
    if name in staged.CONNECTS:
        gate.drain_s = float(
            staged.call_args(args)[1]["timeout_s"]
        )  # the session's SyncConfig, as plain values
    if staged.before_call(gate.bound, name, args):  # a stage: the bound counts from its version
        await gate.moved()
    if name not in ("receiver_receive", "receiver_flip"):
        if name == "receiver_stage":  # lands while requests run, and the engine steps
            answers = replies(await _stage(llm, args, engine, gate.drain_s))
        else:
            answers = replies(await llm.collective_rpc("raysync_call", args=(name, args)))
        connected = await gate.read() if name in staged.CONNECTS else None
        if staged.after_call(gate.bound, name, args, answers, connected):
            await gate.moved()
        return answers

    async def receive() -> dict:  # woken around it where it sleeps: Gate.push
        answers = replies(await llm.collective_rpc("raysync_call", args=(name, args)))
        if weights_changed(name, answers):
            if not await llm.reset_prefix_cache():  # blocks cached under the old weights must not be reused
                raise RuntimeError(f"{engine} took the push but refused to reset its prefix cache")
        staged.after_call(gate.bound, name, args, answers)  # settled before requests are let in again
        return answers

    try:
        answers = await gate.push(receive, engine)  # a push applied live, or a staged push's flip
    finally:
        await (
            gate.moved()
        )  # requests held by the bound look again, also when the push's wake or resume failed
    return answers


async def _stage(llm: Any, args: Any, engine: str, timeout_s: float) -> list:
    """A staged push received on a thread of each worker, asked after call by call, so that vLLM steps between
    the calls (Note [a stage beside the engine's steps] in raysync.engines.vllm_staged). The receive's own
    waits are bounded by ``timeout_s``; the whole of it by _STAGE_TIMEOUTS of them."""
    await _bounded(llm.collective_rpc("raysync_stage_begin", args=(args,)), timeout_s, engine, "stage: begin")
    limit_s = _STAGE_TIMEOUTS * timeout_s
    deadline = time.monotonic() + limit_s
    gate_of(llm).landing.set()
    try:
        while True:
            asked = llm.collective_rpc("raysync_stage_wait", args=(POLL_S,))
            done = await _bounded(asked, timeout_s, engine, "stage: is it staged?")
            if all(d is not None for d in done):
                return done
            if time.monotonic() > deadline:
                raise PeerTimeout(engine, "stage: landing in the workers", limit_s)
    finally:
        gate_of(llm).landing.clear()
