"""WeightSync: the driver-side coordinator. Finds where every endpoint runs, picks a transport per pair, runs
push rounds across all pairs at once, and repairs pairs whose actor was restarted.

    sync = WeightSync(senders=[trainer], receivers=[engine_a, engine_b], config=SyncConfig(...))
    print(sync.plan)                  # who sends to whom, over what, and why
    report = sync.push(version=1)     # every pair at once; raises SyncError naming the failed endpoints
    sync.versions()                   # what each receiver holds: a version, "mixed" or None
    sync.close()                      # or use `with WeightSync(...) as sync:`

Endpoints are the user's own Ray actors. By default a sender pushes ``actor.model.named_parameters()`` and a
receiver writes into ``actor.model``'s parameters; pass ``source=`` / ``sink=`` (functions of the actor) for
anything else — a sink may return a dict of tensors or a ``load_weights``-style function. A receiver may also
be an engine adapter (``raysync.engines.vllm.VllmEngine(actor)``): one receiver per engine worker, each loading
through the engine's own path. ``plan``, ``versions()`` and reports number receivers that way: an engine of
two workers is two receivers.

Ray restarts actors (``max_restarts``): every call that reaches actors goes through ``_ask``, which asks an
actor again while Ray restarts it ("The actor is restarting", ActorUnavailableError) up to setup_timeout_s,
then gives that actor a typed error (ActorUnavailable, PeerTimeout). A push is not asked again (a restarted
actor has no session): its pairs are reconnected, and pushed the full weights, at the next push.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from raysync.core.config import SyncConfig
from raysync.core.errors import (  # noqa: F401 -- SyncError and the actor errors are part of this module's API
    ActorGone,
    ActorUnavailable,
    EndpointFailure,
    PeerTimeout,
    PeerUnavailable,
    RaysyncError,
    SyncClosed,
    SyncError,
)
from raysync.core.version import MIXED, Version
from raysync.core.wire import SessionSecret
from raysync.ray import endpoint as ep
from raysync.ray.placement import PairPlan, Placement, assign, choose, format_plan
from raysync.transport import registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairReport:
    sender: int
    receiver: int
    transport: str
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class SyncReport:
    version: int
    seconds: float
    pairs: tuple[PairReport, ...]

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.pairs)

    @property
    def slowest(self) -> PairReport:
        return max(self.pairs, key=lambda p: p.seconds)

    def __str__(self) -> str:
        lines = [
            f"version {self.version}: {len(self.pairs)} pair(s), {self.bytes / 1e6:.1f} MB in "
            f"{self.seconds * 1e3:.1f} ms"
        ]
        for p in self.pairs:
            lines.append(
                f"  #{p.sender} -> #{p.receiver} over {p.transport}: {p.bytes / 1e6:.1f} MB, "
                f"{p.seconds * 1e3:.1f} ms, {p.gbps:.2f} GB/s"
            )
        return "\n".join(lines)


class Plan(list):
    """The per-pair plan; ``str(plan)`` is a table."""

    def __init__(self, plans: list[PairPlan], senders: list[Placement], receivers: list[Placement]):
        super().__init__(plans)
        self._senders, self._receivers = senders, receivers

    def __str__(self) -> str:
        return format_plan(self, self._senders, self._receivers)


class WeightSync:
    def __init__(
        self,
        senders: Sequence[Any],
        receivers: Sequence[Any],
        config: SyncConfig | None = None,
        *,
        pairs: Sequence[tuple[int, int]] | None = None,
        source: ep.SourceFn = ep.model_parameters,
        sink: ep.SinkFn = ep.model_destinations,
        transport: str | dict[tuple[int, int], str] | None = None,
        setup_timeout_s: float = 300.0,
        push_timeout_s: float = 3600.0,
        shard_sources: bool = False,
    ):
        """``pairs`` (sender index, receiver index) default to placement: the sender on the receiver's GPU,
        else on its node, else sender 0. ``transport`` overrides the plan globally or per pair.
        ``shard_sources``: every sender broadcasts a disjoint share of the tensors to every receiver over its
        own collective group (raysync.transport.sharded): the senders must hold the same tensors (trainer ranks)."""
        if not senders or not receivers:
            raise ValueError("WeightSync needs at least one sender and one receiver")
        self.senders = list(senders)
        self.receivers = [ep.as_endpoint(r) for r in receivers]  # each serves one or more receivers ("slots")
        self.config = config or SyncConfig()
        self._source, self._sink, self._override = source, sink, transport
        self._setup_timeout_s, self._push_timeout_s = setup_timeout_s, push_timeout_s
        self._sync_id = secrets.token_hex(8)
        self._wanted_pairs = list(pairs) if pairs is not None else None
        self._shard = shard_sources
        if shard_sources and (pairs is not None or transport not in (None, "collective")):
            raise ValueError("shard_sources pairs every sender with every receiver over the collective")
        self._broken: set[tuple[int, int]] = set()
        self._pair_bytes: dict[tuple[int, int], int] = {}
        self._sender_at: list[Placement] = []
        self._receiver_at: list[Placement] = []
        self._slots: list[tuple[int, int]] = []  # receiver j -> (endpoint, slot)
        self._closed = False
        self._setup()

    # --- calls to actors (Ray restarts them) -------------------------------------------------------------------
    def _ask(
        self, calls: dict[tuple[str, int], Callable[[], Any]], stage: str, timeout_s: float
    ) -> dict[tuple[str, int], Any]:
        """Make the calls (``calls[(role, index)]()`` returns an ObjectRef) and wait for them all, bounded by
        ``timeout_s``. An actor that Ray is restarting answers at once with ActorUnavailableError: it is asked
        again until it is back or the time is up. Returns each key's result, or a typed error in its place
        (never raised here): ActorUnavailable, PeerTimeout, or the RayTaskError of a call that raised."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = {make(): key for key, make in calls.items()}
        again: dict[tuple[str, int], float] = {}  # restarting: key -> when to ask again
        out: dict[tuple[str, int], Any] = {}
        while pending or again:
            now = time.monotonic()
            for key in [k for k, at in again.items() if at <= now]:
                del again[key]
                pending[calls[key]()] = key
            if now >= deadline:
                for key in [*pending.values(), *again]:
                    out[key] = self._unanswered(key, stage, timeout_s, restarting=key in again)
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
                    out[key] = self._typed(e, key, stage)
        return out

    def _get(self, calls: dict[tuple[str, int], Callable[[], Any]], stage: str) -> list[Any]:
        """``_ask`` for set-up: every result, in order, or the first error raised."""
        answers = self._ask(calls, stage, self._setup_timeout_s)
        for answer in answers.values():
            if isinstance(answer, BaseException):
                raise answer
        return [answers[key] for key in calls]

    def _unanswered(
        self, key: tuple[str, int], stage: str, timeout_s: float, restarting: bool
    ) -> RaysyncError:
        if not restarting:
            return PeerTimeout(self._label(*key), stage, timeout_s)
        return ActorUnavailable(
            self._label(*key),
            stage,
            f"{self._label(*key)} did not answer at stage '{stage}': "
            f"Ray was still restarting it after {timeout_s:g}s (raise WeightSync's "
            f"setup_timeout_s if restarts take longer here)",
        )

    def _typed(self, error: Exception, key: tuple[str, int], stage: str) -> Exception:
        """A Ray error as raysync's: an actor gone for good is ActorUnavailable; a call that raised stays
        Ray's RayTaskError (it is also an instance of the remote exception's type)."""
        import ray

        if isinstance(error, ray.exceptions.RayTaskError):
            return error
        name = self._label(*key)
        if isinstance(error, ray.exceptions.ActorDiedError):
            return ActorGone(
                name,
                stage,
                f"{name} died at stage '{stage}' and Ray will not restart it "
                f"({_first_line(error)}): give WeightSync live actors, or let Ray restart them "
                f"(max_restarts)",
            )
        return ActorUnavailable(
            name, stage, f"Ray could not reach {name} at stage '{stage}': {_first_line(error)}"
        )

    # --- set-up ------------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        calls = {
            ("sender", i): lambda a=a: a.__ray_call__.remote(ep.where) for i, a in enumerate(self.senders)
        }
        calls |= {("receiver", e): lambda r=r: r.call(ep.where) for e, r in enumerate(self.receivers)}
        placements = self._get(calls, "placement")
        self._sender_at = placements[: len(self.senders)]
        for e, by_slot in enumerate(placements[len(self.senders) :]):
            for slot in sorted(by_slot):
                self._slots.append((e, slot))
                self._receiver_at.append(by_slot[slot])
        pairs = self._wanted_pairs or assign(self._sender_at, self._receiver_at)
        if self._shard:
            pairs = [(i, j) for i in range(len(self.senders)) for j in range(len(self._receiver_at))]
        self.plan = Plan([self._choose(i, j) for i, j in pairs], self._sender_at, self._receiver_at)
        self._connect({(p.sender, p.receiver) for p in self.plan})
        logger.info("WeightSync %s set up:\n%s", self._sync_id, self.plan)

    def _on_receivers(self, fn: Any, args: dict[int, tuple]) -> dict[tuple[str, int], Callable[[], Any]]:
        """The calls of ``fn`` for receivers j (args per j), one Ray call per endpoint e, keyed ("receiver", e)
        (for ``_ask``; call one to make it)."""
        by_endpoint: dict[int, dict[int, tuple]] = {}
        for j, a in args.items():
            e, slot = self._slots[j]
            by_endpoint.setdefault(e, {})[slot] = a
        return {
            ("receiver", e): lambda e=e, a=per_slot: self.receivers[e].call(fn, a)
            for e, per_slot in by_endpoint.items()
        }

    def _by_receiver(self, e: int, by_slot: dict[int, Any]) -> dict[int, Any]:
        return {self._slots.index((e, slot)): r for slot, r in by_slot.items()}

    def _choose(self, i: int, j: int) -> PairPlan:
        if self._shard:
            return PairPlan(
                i, j, "collective", "collective", f"sharded sources: share {i} of {len(self.senders)}"
            )
        o = self._override
        override = o.get((i, j)) if isinstance(o, dict) else o
        # every built transport: what works for a pair is the endpoints' to say (their placements), not the
        # driver's, which may have no GPU at all
        return choose(i, j, self._sender_at[i], self._receiver_at[j], registry.names(), override)

    def _connect(self, pairs: set[tuple[int, int]]) -> None:
        """(Re)connect ``pairs``: a session per ring pair; a sender's whole broadcast group if any of its
        collective pairs is among them (a group is made, and lost, as a whole)."""
        for p in self.plan:
            if (p.sender, p.receiver) in pairs and p.transport != "collective":
                self._connect_ring(p)
        groups = {
            p.sender for p in self.plan if (p.sender, p.receiver) in pairs and p.transport == "collective"
        }
        for i in sorted(groups):
            self._connect_group(
                i, [p.receiver for p in self.plan if p.sender == i and p.transport == "collective"]
            )

    def _connect_ring(self, p: PairPlan) -> None:
        s = self._sender_at[p.sender]
        same_host = s.host == self._receiver_at[p.receiver].host
        endpoint = None if same_host else f"tcp://{s.ip}:*"
        secret = SessionSecret.generate()  # per pair, made here, handed out through Ray
        cfg = dataclasses.replace(self.config, transport=p.transport)
        sender = self.senders[p.sender]
        [(address, self._pair_bytes[p.sender, p.receiver])] = self._get(
            {
                ("sender", p.sender): lambda: sender.__ray_call__.remote(
                    ep.sender_connect, self._sync_id, cfg, p.receiver, secret, endpoint, self._source
                )
            },
            f"connect sender #{p.sender}",
        )
        self._get(
            self._on_receivers(
                ep.receiver_connect, {p.receiver: (self._sync_id, cfg, address, secret, self._sink)}
            ),
            f"connect receiver #{p.receiver}",
        )

    def _connect_group(self, i: int, receivers: list[int]) -> None:
        secret, cfg = SessionSecret.generate(), self.config
        share = (i, len(self.senders)) if self._shard else None
        sender = self.senders[i]
        [(rendezvous, nbytes)] = self._get(
            {
                ("sender", i): lambda: sender.__ray_call__.remote(
                    ep.collective_open,
                    self._sync_id,
                    cfg,
                    self._sender_at[i].ip,
                    receivers,
                    secret,
                    self._source,
                    share,
                )
            },
            f"open the broadcast group of sender #{i}",
        )
        self._pair_bytes.update({(i, j): nbytes for j in receivers})
        joins = {("sender", i): lambda: sender.__ray_call__.remote(ep.collective_join, self._sync_id)}
        joins |= self._on_receivers(
            ep.collective_connect,
            {
                j: (self._sync_id, cfg, rank, rendezvous, secret, self._sink, share)
                for rank, j in enumerate(receivers, start=1)
            },
        )
        self._get(joins, f"join the broadcast group of sender #{i}")

    def _repair(self) -> None:
        """Re-probe, re-plan and reconnect the pairs of the last failed push (their actors may have been
        restarted, maybe elsewhere: ``_ask`` waits for Ray to bring them back)."""
        if not self._broken:
            return
        broken = set(self._broken)  # kept until repaired: a repair that fails is tried again next push
        calls = {("sender", i): lambda a=self.senders[i]: a.__ray_call__.remote(ep.where) for i, _ in broken}
        calls |= {
            ("receiver", e): lambda r=self.receivers[e]: r.call(ep.where)
            for e in {self._slots[j][0] for _, j in broken}
        }
        placements = self._get(calls, "placement of the endpoints of the last failed push")
        for (role, index), at in zip(calls, placements, strict=True):
            if role == "sender":
                self._sender_at[index] = at
            else:
                for j, p in self._by_receiver(index, at).items():
                    self._receiver_at[j] = p
        for k, p in enumerate(self.plan):
            if (p.sender, p.receiver) in broken:
                self.plan[k] = self._choose(p.sender, p.receiver)
                logger.info("re-planned pair #%d -> #%d: %s", p.sender, p.receiver, self.plan[k].transport)
        self._connect(broken)
        self._broken -= broken

    # --- push rounds -------------------------------------------------------------------------------------------
    def push(self, version: int) -> SyncReport:
        """One round: every sender pushes ``version`` to its receivers, all pairs at once."""
        self._check_open("push")
        self._repair()
        started = time.perf_counter()
        by_sender: dict[int, list[int]] = {}
        for p in self.plan:
            by_sender.setdefault(p.sender, []).append(p.receiver)
        refs = {
            self.senders[i].__ray_call__.remote(ep.sender_push, self._sync_id, version, js): ("sender", i)
            for i, js in by_sender.items()
        }
        receiving = {j: (self._sync_id,) for js in by_sender.values() for j in js}
        refs.update({make(): key for key, make in self._on_receivers(ep.receiver_receive, receiving).items()})
        results, failures = self._collect(refs, version)
        results["receiver"] = {
            j: r
            for e, by_slot in results.get("receiver", {}).items()
            for j, r in self._by_receiver(e, by_slot).items()
        }
        pairs = []
        for i, per_receiver in results.get("sender", {}).items():
            for j, r in per_receiver.items():
                if r["ok"]:
                    transport = next(p.transport for p in self.plan if (p.sender, p.receiver) == (i, j))
                    pairs.append(PairReport(i, j, transport, r["report"]["bytes"], r["report"]["seconds"]))
                else:
                    failures.append(self._failure("sender", i, r, f" (pushing to receiver #{j})"))
                    self._broken.add((i, j))
        for j, r in results.get("receiver", {}).items():
            if not r["ok"]:
                failures.append(self._failure("receiver", j, r))
                self._broken.update((p.sender, p.receiver) for p in self.plan if p.receiver == j)
        if failures:
            mixed = sorted(j for j, r in results.get("receiver", {}).items() if r.get("version") == MIXED)
            raise SyncError(version, failures, mixed)
        report = SyncReport(
            version, time.perf_counter() - started, tuple(sorted(pairs, key=lambda p: p.receiver))
        )
        logger.info("%s", report)
        return report

    def _collect(self, refs: dict, version: int) -> tuple[dict, list[EndpointFailure]]:
        """Wait for every endpoint (bounded by push_timeout_s), with a byte progress bar for long pushes."""
        import ray

        results: dict[str, dict[int, Any]] = {}
        failures: list[EndpointFailure] = []
        pending = list(refs)
        deadline = time.monotonic() + self._push_timeout_s
        bar = tqdm(
            total=sum(self._pair_bytes.values()),
            unit="B",
            unit_scale=True,
            delay=1.0,
            desc=f"push v{version}",
            disable=not self.config.progress,
            leave=False,
        )
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    for ref in pending:  # whatever they were doing, their sessions are suspect now
                        self._mark_broken(*refs[ref])
                    names = [self._label(*refs[r]) for r in pending]
                    raise PeerTimeout(", ".join(names), f"push v{version}", self._push_timeout_s)
                done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 1.0))
                for ref in done:
                    role, index = refs[ref]
                    try:
                        results.setdefault(role, {})[index] = ray.get(ref)
                        if role == "sender":  # a sender's result arrives when all of its pairs are done
                            bar.update(sum(b for (i, _), b in self._pair_bytes.items() if i == index))
                    except ray.exceptions.RayError as e:  # the actor died, or Ray could not run the call
                        # not asked again (a restarted actor has no session): the next push repairs the pairs
                        failures.append(
                            EndpointFailure(
                                self._label(role, index), f"push v{version}", _first_line(e), str(e)
                            )
                        )
                        self._mark_broken(role, index)
        finally:
            bar.close()
        return results, failures

    def _mark_broken(self, role: str, index: int) -> None:
        """Every pair of this sender or receiver endpoint is reconnected before the next push."""
        self._broken.update(
            (p.sender, p.receiver)
            for p in self.plan
            if (p.sender == index if role == "sender" else self._slots[p.receiver][0] == index)
        )

    def _label(self, role: str, index: int) -> str:
        """``index``: a sender, or a receiver endpoint (an engine adapter names all of its workers)."""
        if role == "sender":
            at = f" ({self._sender_at[index].label()})" if index < len(self._sender_at) else ""
            return f"sender #{index}{at}"
        js = [j for j, (e, _) in enumerate(self._slots) if e == index]
        if not js:  # before the placements are known
            return f"receiver endpoint #{index}"
        return ", ".join(f"receiver #{j} ({self._receiver_at[j].label()})" for j in js)

    def _failure(self, role: str, index: int, r: dict, suffix: str = "") -> EndpointFailure:
        """``index``: a sender, or a receiver j."""
        at = (self._sender_at if role == "sender" else self._receiver_at)[index]
        return EndpointFailure(
            f"{role} #{index} ({at.label()}){suffix}", r["stage"], r["error"], r["traceback"]
        )

    # --- state and teardown ------------------------------------------------------------------------------------
    def versions(self) -> list[Version]:
        """What each receiver holds (Note [versions never lie]): the version of its last complete push,
        "mixed" after a push that failed part-way (until the next one completes), None before any push (or
        restarted by Ray and not pushed to since; also an actor that died for good). Waits (up to
        setup_timeout_s) for actors that Ray is restarting; raises ActorUnavailable if one is still not back."""
        self._check_open("versions")
        calls = self._on_receivers(
            ep.receiver_version, {j: (self._sync_id,) for j in range(len(self._slots))}
        )
        versions: dict[int, Version] = {}
        for (_, e), by_slot in self._ask(calls, "versions", self._setup_timeout_s).items():
            if isinstance(by_slot, ActorGone):
                logger.warning("%s", by_slot)  # no process, no weights: it holds no version
                by_slot = {slot: None for e_, slot in self._slots if e_ == e}
            elif isinstance(by_slot, BaseException):
                raise by_slot
            versions.update(self._by_receiver(e, by_slot))
        return [versions[j] for j in range(len(self._slots))]

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise SyncClosed(
                f"{what}() on WeightSync {self._sync_id}, which was closed (close() or the end of its "
                f"`with` block) and holds no sessions any more: make a new WeightSync"
            )

    def close(self) -> None:
        """End every session (idempotent). Actors that are gone or restarting have none left: not waited for."""
        import ray

        self._closed = True
        calls = [e.call(ep.close, (self._sync_id,)) for e in self.receivers]
        calls += [a.__ray_call__.remote(ep.close, self._sync_id) for a in self.senders]
        ray.wait(calls, num_returns=len(calls), timeout=self.config.timeout_s)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]
