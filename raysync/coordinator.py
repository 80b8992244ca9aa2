"""WeightSync: the driver-side coordinator. Finds where every endpoint runs, picks a transport per pair, runs
push rounds across all pairs at once, and repairs pairs whose actor was restarted.

    sync = WeightSync(senders=[trainer], receivers=[engine_a, engine_b], config=SyncConfig(...))
    print(sync.plan)                  # who sends to whom, over what, and why
    report = sync.push(version=1)     # every pair at once; raises SyncError naming the failed endpoints
    sync.versions()                   # each receiver's last fully applied version
    sync.close()                      # or use `with WeightSync(...) as sync:`

Endpoints are the user's own Ray actors. By default a sender pushes ``actor.model.named_parameters()`` and a
receiver writes into ``actor.model``'s parameters; pass ``source=`` / ``sink=`` (functions of the actor) for
anything else — a sink may return a dict of tensors or a ``load_weights``-style function. A receiver may also
be an engine adapter (``raysync.vllm.VllmEngine(actor)``): one receiver per engine worker, each loading
through the engine's own path. ``plan``, ``versions()`` and reports number receivers that way: an engine of
two workers is two receivers.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from raysync import endpoint as ep
from raysync.config import SyncConfig
from raysync.errors import PeerTimeout, RaysyncError
from raysync.placement import PairPlan, Placement, assign, choose, format_plan
from raysync.transport import registry
from raysync.wire import SessionSecret

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointFailure:
    endpoint: str  # "receiver #1 (node ..., pid ..., GPU ...)"
    stage: str
    error: str
    traceback: str


class SyncError(RaysyncError):
    """A push round failed on one or more endpoints; each failure names the endpoint, stage and traceback."""

    def __init__(self, version: int, failures: list[EndpointFailure]):
        self.version, self.failures = version, failures
        first = failures[0]
        text = f"push of version {version} failed on {len(failures)} endpoint(s); first: {first.endpoint} at " \
               f"stage '{first.stage}': {first.error}"  # fmt: skip
        if first.traceback:
            text += f"\n--- remote traceback ({first.endpoint}) ---\n{first.traceback.rstrip()}"
        super().__init__(text)


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
        lines = [f"version {self.version}: {len(self.pairs)} pair(s), {self.bytes / 1e6:.1f} MB in "
                 f"{self.seconds * 1e3:.1f} ms"]  # fmt: skip
        for p in self.pairs:
            lines.append(f"  #{p.sender} -> #{p.receiver} over {p.transport}: {p.bytes / 1e6:.1f} MB, "
                         f"{p.seconds * 1e3:.1f} ms, {p.gbps:.2f} GB/s")  # fmt: skip
        return "\n".join(lines)


class Plan(list):
    """The per-pair plan; ``str(plan)`` is a table."""

    def __init__(self, plans: list[PairPlan], senders: list[Placement], receivers: list[Placement]):
        super().__init__(plans)
        self._senders, self._receivers = senders, receivers

    def __str__(self) -> str:
        return format_plan(self, self._senders, self._receivers)


class WeightSync:
    def __init__(self, senders: Sequence[Any], receivers: Sequence[Any], config: SyncConfig | None = None, *,
                 pairs: Sequence[tuple[int, int]] | None = None, source: ep.Source = ep.model_parameters,
                 sink: ep.Sink = ep.model_destinations, transport: str | dict[tuple[int, int], str] | None = None,
                 setup_timeout_s: float = 300.0, push_timeout_s: float = 3600.0,
                 shard_sources: bool = False):  # fmt: skip
        """``pairs`` (sender index, receiver index) default to placement: the sender on the receiver's GPU,
        else on its node, else sender 0. ``transport`` overrides the plan globally or per pair.
        ``shard_sources``: every sender broadcasts a disjoint share of the tensors to every receiver over its
        own collective group (raysync.sharded): the senders must hold the same tensors (trainer ranks)."""
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
        self._setup()

    # --- set-up ------------------------------------------------------------------------------------------------
    def _get(self, refs: Any, stage: str, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PeerTimeout("Ray actors", stage, timeout_s) from None

    def _setup(self) -> None:
        calls = [a.__ray_call__.remote(ep.where) for a in self.senders]
        calls += [e.call(ep.where) for e in self.receivers]
        placements = self._get(calls, "placement", self._setup_timeout_s)
        self._sender_at = placements[: len(self.senders)]
        self._slots: list[tuple[int, int]] = []  # receiver j -> (endpoint, slot)
        self._receiver_at: list[Placement] = []
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

    def _on_receivers(self, fn: Any, args: dict[int, tuple]) -> dict[Any, int]:
        """Run ``fn`` for receivers j (args per j), one Ray call per endpoint; returns ref -> endpoint."""
        by_endpoint: dict[int, dict[int, tuple]] = {}
        for j, a in args.items():
            e, slot = self._slots[j]
            by_endpoint.setdefault(e, {})[slot] = a
        return {self.receivers[e].call(fn, per_slot): e for e, per_slot in by_endpoint.items()}

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
        address, self._pair_bytes[p.sender, p.receiver] = self._get(self.senders[p.sender].__ray_call__.remote(
            ep.sender_connect, self._sync_id, cfg, p.receiver, secret, endpoint, self._source),
            f"connect sender #{p.sender}", self._setup_timeout_s)  # fmt: skip
        self._get(list(self._on_receivers(ep.receiver_connect, {p.receiver: (
            self._sync_id, cfg, address, secret, self._sink)})),
            f"connect receiver #{p.receiver}", self._setup_timeout_s)  # fmt: skip

    def _connect_group(self, i: int, receivers: list[int]) -> None:
        secret, cfg = SessionSecret.generate(), self.config
        share = (i, len(self.senders)) if self._shard else None
        rendezvous, nbytes = self._get(self.senders[i].__ray_call__.remote(
            ep.collective_open, self._sync_id, cfg, self._sender_at[i].ip, receivers, secret, self._source, share),
            f"open the broadcast group of sender #{i}", self._setup_timeout_s)  # fmt: skip
        self._pair_bytes.update({(i, j): nbytes for j in receivers})
        joins = [self.senders[i].__ray_call__.remote(ep.collective_join, self._sync_id)]
        joins += list(self._on_receivers(ep.collective_connect, {j: (self._sync_id, cfg, rank, rendezvous, secret,
                                                                     self._sink, share)
                                                                 for rank, j in enumerate(receivers, start=1)}))  # fmt: skip
        self._get(joins, f"join the broadcast group of sender #{i}", self._setup_timeout_s)

    def _where(self, call: Any, stage: str) -> Any:
        """Probe one endpoint (``call()`` makes the Ray call), waiting (up to setup_timeout_s) while Ray
        restarts it."""
        import ray

        deadline = time.monotonic() + self._setup_timeout_s
        while True:
            try:
                return self._get(call(), stage, max(1.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:  # restarting: Ray answers at once, so ask again
                if time.monotonic() > deadline:
                    raise PeerTimeout("a restarting actor", stage, self._setup_timeout_s) from None
                time.sleep(0.2)

    def _repair(self) -> None:
        """Re-probe, re-plan and reconnect the pairs of the last failed push (their actors may have been
        restarted, maybe elsewhere)."""
        if not self._broken:
            return
        broken, self._broken = set(self._broken), set()
        for i in {i for i, _ in broken}:
            self._sender_at[i] = self._where(lambda a=self.senders[i]: a.__ray_call__.remote(ep.where),
                                             f"placement of sender #{i}")  # fmt: skip
        for e in {self._slots[j][0] for _, j in broken}:
            at = self._where(
                lambda e=e: self.receivers[e].call(ep.where), f"placement of receiver endpoint #{e}"
            )
            for j, p in self._by_receiver(e, at).items():
                self._receiver_at[j] = p
        for k, p in enumerate(self.plan):
            if (p.sender, p.receiver) in broken:
                self.plan[k] = self._choose(p.sender, p.receiver)
                logger.info("re-planned pair #%d -> #%d: %s", p.sender, p.receiver, self.plan[k].transport)
        self._connect(broken)

    # --- push rounds -------------------------------------------------------------------------------------------
    def push(self, version: int) -> SyncReport:
        """One round: every sender pushes ``version`` to its receivers, all pairs at once."""
        self._repair()
        started = time.perf_counter()
        by_sender: dict[int, list[int]] = {}
        for p in self.plan:
            by_sender.setdefault(p.sender, []).append(p.receiver)
        refs = {self.senders[i].__ray_call__.remote(ep.sender_push, self._sync_id, version, js): ("sender", i)
                for i, js in by_sender.items()}  # fmt: skip
        receiving = {j: (self._sync_id,) for js in by_sender.values() for j in js}
        refs.update(
            {ref: ("receiver", e) for ref, e in self._on_receivers(ep.receiver_receive, receiving).items()}
        )
        results, failures = self._collect(refs, version)
        results["receiver"] = {j: r for e, by_slot in results.get("receiver", {}).items()
                               for j, r in self._by_receiver(e, by_slot).items()}  # fmt: skip
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
            raise SyncError(version, failures)
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
        bar = tqdm(total=sum(self._pair_bytes.values()), unit="B", unit_scale=True, delay=1.0,
                   desc=f"push v{version}", disable=not self.config.progress, leave=False)  # fmt: skip
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
                        failures.append(EndpointFailure(self._label(role, index), f"push v{version}",
                                                        f"{type(e).__name__}: {e}".splitlines()[0], str(e)))  # fmt: skip
                        self._mark_broken(role, index)
        finally:
            bar.close()
        return results, failures

    def _mark_broken(self, role: str, index: int) -> None:
        """Every pair of this sender or receiver endpoint is reconnected before the next push."""
        self._broken.update((p.sender, p.receiver) for p in self.plan
                            if (p.sender == index if role == "sender" else self._slots[p.receiver][0] == index))  # fmt: skip

    def _label(self, role: str, index: int) -> str:
        """``index``: a sender, or a receiver endpoint (an engine adapter names all of its workers)."""
        if role == "sender":
            return f"sender #{index} ({self._sender_at[index].label()})"
        js = [j for j, (e, _) in enumerate(self._slots) if e == index]
        return ", ".join(f"receiver #{j} ({self._receiver_at[j].label()})" for j in js)

    def _failure(self, role: str, index: int, r: dict, suffix: str = "") -> EndpointFailure:
        """``index``: a sender, or a receiver j."""
        at = (self._sender_at if role == "sender" else self._receiver_at)[index]
        return EndpointFailure(
            f"{role} #{index} ({at.label()}){suffix}", r["stage"], r["error"], r["traceback"]
        )

    # --- state and teardown ------------------------------------------------------------------------------------
    def versions(self) -> list[int | None]:
        """Each receiver's last fully applied version (None: nothing yet, or restarted and not pushed since)."""
        refs = self._on_receivers(ep.receiver_version, {j: (self._sync_id,) for j in range(len(self._slots))})
        versions: dict[int, int | None] = {}
        for by_slot, e in zip(
            self._get(list(refs), "versions", self._setup_timeout_s), refs.values(), strict=True
        ):
            versions.update(self._by_receiver(e, by_slot))
        return [versions[j] for j in range(len(self._slots))]

    def close(self) -> None:
        import ray

        calls = [e.call(ep.close, (self._sync_id,)) for e in self.receivers]
        calls += [a.__ray_call__.remote(ep.close, self._sync_id) for a in self.senders]
        ray.wait(calls, num_returns=len(calls), timeout=self.config.timeout_s)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
