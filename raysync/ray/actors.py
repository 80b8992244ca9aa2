"""The driver's view of one WeightSync's actors: the senders, the receiver endpoints, the receivers they serve
(an engine adapter serves one receiver per engine worker, its "slots"), where each one runs, and how the driver
asks them.

Receivers are numbered j = 0, 1, ... across endpoints, slot by slot: ``slots[j] = (endpoint e, slot)``.
A call is keyed by who answers it: ("sender", i), or ("receiver", e), one call per receiver endpoint whatever
the number of its slots.

Ray restarts actors (``max_restarts``): every set-up call goes through ``ask``, which asks an actor again while
Ray restarts it ("The actor is restarting", ActorUnavailableError) until its deadline, then gives that actor a
typed error (ActorUnavailable, PeerTimeout). A push is not asked again (a restarted actor has no session).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from raysync.core.errors import ActorGone, ActorUnavailable, PeerTimeout, RaysyncError
from raysync.ray import endpoint as ep
from raysync.ray.placement import Placement

Key = tuple[str, int]  # ("sender", i) or ("receiver", e)
Calls = dict[Key, Callable[[], Any]]  # calling one makes the Ray call and returns its ObjectRef


class SyncActors:
    def __init__(
        self,
        senders: Sequence[Any],
        receivers: Sequence[Any],
        source: Callable | None = None,
        sink: Callable | None = None,
    ):
        """``source`` / ``sink``: how an actor's tensors are found, so that each endpoint reports where they are
        (endpoint.where), not only which GPUs its process sees."""
        if not senders or not receivers:
            raise ValueError("WeightSync needs at least one sender and one receiver")
        self._source, self._sink = source, sink
        self.senders = list(senders)
        self.receivers = [ep.as_endpoint(r) for r in receivers]  # each serves one or more receivers (slots)
        self.sender_at: list[Placement] = []  # updated in place: a Plan prints from these lists
        self.receiver_at: list[Placement] = []
        self.slots: list[tuple[int, int]] = []  # receiver j -> (endpoint, slot)
        self._receiver_of: dict[tuple[int, int], int] = {}  # (endpoint, slot) -> receiver j: slots, inverted

    # --- where they run ------------------------------------------------------------------------------------------
    def locate(self, timeout_s: float) -> None:
        """Every endpoint reports its placement from inside its process; receivers are numbered from them."""
        calls = self.on_senders(ep.where, {i: (None, self._source) for i in range(len(self.senders))})
        calls |= {("receiver", e): lambda r=r: self._where(r) for e, r in enumerate(self.receivers)}
        placements = self.get(calls, "placement", timeout_s)
        self.sender_at[:] = placements[: len(self.senders)]
        for e, by_slot in enumerate(placements[len(self.senders) :]):
            for slot in sorted(by_slot):
                self._receiver_of[e, slot] = len(self.slots)
                self.slots.append((e, slot))
                self.receiver_at.append(by_slot[slot])

    def relocate(self, pairs: set[tuple[int, int]], timeout_s: float) -> None:
        """Probe again the endpoints of ``pairs``: Ray may have restarted them, maybe elsewhere (``ask`` waits for
        the restart)."""
        calls = self.on_senders(ep.where, {i: (None, self._source) for i, _ in sorted(pairs)})
        calls |= {
            ("receiver", e): lambda r=self.receivers[e]: self._where(r)
            for e in {self.slots[j][0] for _, j in pairs}
        }
        placements = self.get(calls, "placement of the endpoints of the last failed push", timeout_s)
        for (role, index), at in zip(calls, placements, strict=True):
            if role == "sender":
                self.sender_at[index] = at
            else:
                for j, p in self.by_receiver(index, at).items():
                    self.receiver_at[j] = p

    def _where(self, endpoint: Any) -> Any:
        """A plain actor reports where its sink's tensors are; an engine adapter (its own plain-value channel)
        reports its workers' GPUs."""
        if isinstance(endpoint, ep.ActorEndpoint):
            return endpoint.call(ep.where, (None, self._sink))
        return endpoint.call(ep.where)

    # --- calls ---------------------------------------------------------------------------------------------------
    def on_senders(self, fn: Callable, args: dict[int, tuple]) -> Calls:
        """The calls of ``fn(actor, *args[i])`` in senders i (call one to make it)."""
        return {
            ("sender", i): lambda actor=self.senders[i], a=a: actor.__ray_call__.remote(fn, *a)
            for i, a in args.items()
        }

    def on_receivers(self, fn: Callable, args: dict[int, tuple]) -> Calls:
        """The calls of ``fn`` for receivers j (``args`` per j): one call per endpoint e, whose answer is
        {slot: result} (``by_receiver`` numbers it by receiver)."""
        by_endpoint: dict[int, dict[int, tuple]] = {}
        for j, a in args.items():
            e, slot = self.slots[j]
            by_endpoint.setdefault(e, {})[slot] = a
        return {
            ("receiver", e): lambda e=e, a=per_slot: self.receivers[e].call(fn, a)
            for e, per_slot in by_endpoint.items()
        }

    def by_receiver(self, e: int, by_slot: dict[int, Any]) -> dict[int, Any]:
        """Endpoint ``e``'s answer {slot: result} as {receiver j: result}."""
        return {self._receiver_of[e, slot]: r for slot, r in by_slot.items()}

    def ask(self, calls: Calls, stage: str, timeout_s: float) -> dict[Key, Any]:
        """Each call's answer, or a typed error in its place (never raised here): see ``ask``."""
        return ask(calls, stage, timeout_s, self.label)

    def get(self, calls: Calls, stage: str, timeout_s: float) -> list[Any]:
        """``ask`` for set-up: every answer, in the order of ``calls``, or the first error raised."""
        answers = self.ask(calls, stage, timeout_s)
        for answer in answers.values():
            if isinstance(answer, BaseException):
                raise answer
        return [answers[key] for key in calls]

    def close(self, sync_id: str, timeout_s: float) -> None:
        """End every session of ``sync_id``. Actors that are gone or restarting have none left: not waited for."""
        import ray

        calls = [e.call(ep.close, (sync_id,)) for e in self.receivers]
        calls += [a.__ray_call__.remote(ep.close, sync_id) for a in self.senders]
        ray.wait(calls, num_returns=len(calls), timeout=timeout_s)

    # --- names ---------------------------------------------------------------------------------------------------
    def label(self, key: Key) -> str:
        """A sender, or a receiver endpoint (an engine adapter names all of its workers), with where it runs."""
        role, index = key
        if role == "sender":
            at = f" ({self.sender_at[index].label()})" if index < len(self.sender_at) else ""
            return f"sender #{index}{at}"
        js = [j for j, (e, _) in enumerate(self.slots) if e == index]
        if not js:  # before the placements are known
            return f"receiver endpoint #{index}"
        return ", ".join(f"receiver #{j} ({self.receiver_at[j].label()})" for j in js)


def ask(calls: Calls, stage: str, timeout_s: float, label: Callable[[Key], str]) -> dict[Key, Any]:
    """Make the calls and wait for them all, bounded by ``timeout_s``. An actor that Ray is restarting answers
    at once with ActorUnavailableError: it is asked again until it is back or the time is up. Returns each key's
    answer, or a typed error in its place (never raised here): ActorUnavailable, ActorGone, PeerTimeout, or the
    RayTaskError of a call that raised."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = {make(): key for key, make in calls.items()}
    again: dict[Key, float] = {}  # restarting: key -> when to ask again
    out: dict[Key, Any] = {}
    while pending or again:
        now = time.monotonic()
        for key in [k for k, at in again.items() if at <= now]:
            del again[key]
            pending[calls[key]()] = key
        if now >= deadline:
            for key in [*pending.values(), *again]:
                out[key] = _unanswered(label(key), stage, timeout_s, restarting=key in again)
            break
        wait = min([deadline, *again.values()]) - now
        if not pending:
            time.sleep(wait)  # Ray answers a restarting actor's calls at once: pace the next ask
            continue
        done, _ = ray.wait(list(pending), num_returns=1, timeout=wait)
        for ref in done:
            key = pending.pop(ref)
            try:
                out[key] = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                again[key] = time.monotonic() + 0.2
            except ray.exceptions.RayError as e:
                out[key] = typed(e, label(key), stage)
    return out


def _unanswered(name: str, stage: str, timeout_s: float, restarting: bool) -> RaysyncError:
    if not restarting:
        return PeerTimeout(name, stage, timeout_s)
    return ActorUnavailable(
        name,
        stage,
        f"{name} did not answer at stage '{stage}': Ray was still restarting it after {timeout_s:g}s (raise "
        f"WeightSync's setup_timeout_s if restarts take longer here)",
    )


def typed(error: Exception, name: str, stage: str) -> Exception:
    """A Ray error as raysync's: an actor gone for good is ActorGone, one Ray could not reach ActorUnavailable;
    a call that raised stays Ray's RayTaskError (it is also an instance of the remote exception's type)."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError):
        return error
    if isinstance(error, ray.exceptions.ActorDiedError):
        return ActorGone(
            name,
            stage,
            f"{name} died at stage '{stage}' and Ray will not restart it ({first_line(error)}): give WeightSync "
            f"live actors, or let Ray restart them (max_restarts)",
        )
    return ActorUnavailable(
        name, stage, f"Ray could not reach {name} at stage '{stage}': {first_line(error)}"
    )


def first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]
