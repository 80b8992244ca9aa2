"""Entry points for spawned processes (importable by the spawn start method)."""

from __future__ import annotations

import hashlib
import os
import signal

import torch

from raysync import PushIncomplete, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.digest import combine, partial
from raysync.core.errors import WeightsMixed


def digest(named, on_device: bool = False) -> dict[str, str | tuple[str, int]]:
    """Each tensor's digest of its bytes: SHA-256, through the host. ``on_device``: a GPU tensor's is raysync's
    verify digest computed on its GPU instead (raysync.core.digest: any change within a word, sign bits included,
    changes it), tagged so that it never equals a SHA-256; both sides of a comparison must pass it (a 7B
    layout's SHA-256 through the host took minutes of a GPU test)."""
    named = list(named)
    on_gpu = [(n, t) for n, t in named if on_device and t.is_cuda]
    sums = combine([[partial(t.detach().contiguous().view(-1).view(torch.uint8), 0)] for _, t in on_gpu])
    out: dict[str, str | tuple[str, int]] = {n: ("gpu", d) for (n, _), d in zip(on_gpu, sums, strict=True)}
    for n, t in named:
        if n not in out:
            data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
            out[n] = hashlib.sha256(data).hexdigest()
    return out


def perturb(model, version: int) -> None:
    """Deterministic new weights for ``version`` (what an optimizer step would do)."""
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


class StagingLoader:
    """A load function that keeps every bucket and applies the push in ``finish`` (raysync.engines.vllm's contract):
    ``fail`` makes the n-th bucket raise ("call"), or the apply fail part-way and put the old weights back
    ("restore") or not ("mixed": it raises WeightsMixed)."""

    def __init__(self, dest: dict[str, torch.Tensor], fail: str = "", at: int = 2):
        self.dest, self.fail, self.at = dest, fail, at
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.calls = 0

    def __call__(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        if self.fail == "call" and self.calls == self.at:
            raise RuntimeError("loader exploded")
        self.staged += [(n, t.clone()) for n, t in batch]

    def finish(self) -> None:
        staged, self.staged = self.staged, []
        old = {n: t.clone() for n, t in self.dest.items()}
        for k, (name, t) in enumerate(staged):
            if self.fail in ("restore", "mixed") and k == self.at:
                if self.fail == "mixed":
                    raise WeightsMixed(f"applied {k} of {len(staged)} tensors, cannot undo them")
                for n, v in old.items():
                    self.dest[n].copy_(v)
                raise RuntimeError("apply failed; the old weights are back")
            self.dest[name].copy_(t)


def model_receiver(
    endpoint: str, secret: SessionSecret, config: SyncConfig, pushes: int, mode: str, out
) -> None:
    """An engine: its own copy of the tiny model (another seed), ``pushes`` receives, digests after each."""
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=99)
    params = dict(model.named_parameters())

    def load_weights(batch):
        with torch.no_grad():
            for name, t in batch:
                params[name].copy_(t)

    with WeightReceiver(endpoint, secret, config) as receiver:
        for _ in range(pushes):
            report = (
                receiver.receive(into=params) if mode == "into" else receiver.receive(load_fn=load_weights)
            )
            out.put((report.version, digest(model.named_parameters())))


def pausing_receiver(
    endpoint: str, secret: SessionSecret, config: SyncConfig, pause_at: int, out, release
) -> None:
    """Receives one push, then in the second stops inside bucket ``pause_at`` until killed (or released)."""
    dest = {f"t{i}": torch.zeros(4096) for i in range(8)}
    calls = []

    def load(batch):
        for name, t in batch:
            dest[name].copy_(t)

    def load_and_pause(batch):
        calls.append(len(batch))
        if len(calls) == pause_at + 1:
            out.put("paused")
            release.wait(60)
        load(batch)

    with WeightReceiver(endpoint, secret, config) as receiver:
        out.put("connecting")  # the parent pushes only now: a short timeout_s must not cover our start-up
        receiver.receive(load_fn=load)
        out.put("first push done")
        receiver.receive(load_fn=load_and_pause)


def plain_sender(secret: SessionSecret, config: SyncConfig, out) -> None:
    """Pushes forever (until killed); tells the parent its endpoint, then every version it completes."""
    src = {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        for version in range(1, 1000):
            try:
                sender.push(src.items(), version)
            except PushIncomplete:
                return
            out.put(version)


def collective_receiver(secret, config, rank, rendezvous, pushes, out, die_at=None, bad_from=None) -> None:
    """A rank of a broadcast group: its own copy of the tiny model, ``pushes`` receives, digest after each.
    ``die_at=(push, call)``: SIGKILL itself inside that load call; ``bad_from=n``: from push n on, one
    destination has the wrong shape. Reports (rank, "ok" | error name, detail) after each push."""
    import os
    import signal

    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveReceiver

    model = tiny_qwen2(seed=99)
    params = dict(model.named_parameters())
    calls = []

    def load(batch):
        calls.append(1)
        if die_at and push == die_at[0] and len(calls) == die_at[1]:  # the version reads MIXED mid-push
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            for name, t in batch:
                params[name].copy_(t)

    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    receiver = group.join()
    for push in range(1, pushes + 1):
        calls.clear()
        if bad_from == push:
            params["model.norm.weight"] = torch.zeros(3)
        try:
            report = receiver.receive(load_fn=load) if die_at else receiver.receive(into=params)
        except Exception as e:
            out.put((rank, type(e).__name__, str(e)))
            if die_at or bad_from == 1:
                return
            continue
        out.put((rank, "ok", (report.version, digest(model.named_parameters()))))
    group.close()


def nccl_receiver(secret, config, rank, rendezvous, pushes, out) -> None:
    """A GPU rank of an NCCL broadcast group (GPU ``rank``): receives into its own copy of the tiny model."""
    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveReceiver

    torch.cuda.set_device(rank)
    model = tiny_qwen2(seed=99).cuda()
    group = CollectiveReceiver(secret, config, rank=rank, rendezvous=rendezvous)
    receiver = group.join()
    for _ in range(pushes):
        report = receiver.receive(into=dict(model.named_parameters()))
        out.put((rank, report.version, digest((n, p.cpu()) for n, p in model.named_parameters())))
    group.close()


def ipc_receiver(
    endpoint: str,
    secret: SessionSecret,
    config: SyncConfig,
    gpu: int,
    visible: str | None,
    layout: str,
    pushes: int,
    out,
) -> None:
    """A receiver on ``gpu`` (its own numbering) under its own CUDA_VISIBLE_DEVICES: reports the UUID of the
    GPU it sees the ring on, a digest of its destinations after each push, and its reserved memory."""
    import os

    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    from raysync.tools.models import allocate

    torch.cuda.set_device(gpu)
    dest = allocate(layout, device="cuda", fill=False)
    with WeightReceiver(endpoint, secret, config) as receiver:
        reserved = []
        for i in range(pushes):
            receiver.receive(into=dest)
            reserved.append(torch.cuda.memory_reserved())
            if i == 0 or i == pushes - 1:
                out.put(("digest", i, digest(dest.items(), on_device=True)))
        ring = receiver.ring.buffers[0].device  # a host ring (shm) has no GPU
        ring_gpu = str(torch.cuda.get_device_properties(ring).uuid) if ring.type == "cuda" else None
        out.put(("done", ring_gpu, str(torch.cuda.get_device_properties(gpu).uuid), reserved))


def ipc_sender_forever(
    secret: SessionSecret, config: SyncConfig, layout: str, out, fresh: bool = False
) -> None:
    """Pushes ``layout`` from GPU 0 until killed; reports its endpoint, then every completed version. ``fresh``:
    new tensor objects every push (views of the same tensors), so direct mode checks them before its PushStart
    rather than after (Note [start, then check] in raysync.core.session)."""
    from raysync.tools.models import allocate

    torch.cuda.set_device(0)
    src = allocate(layout, device="cuda")
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        for version in range(1, 1 << 30):
            sender.push([(k, v.view_as(v)) for k, v in src.items()] if fresh else src.items(), version)
            out.put(version)


def sharded_receiver(secrets, config, rank, rendezvous, pushes, out, die_at=None) -> None:
    """An engine in every share's group (rank ``rank`` in each): receives all shares at once into its own
    copy of the tiny model. ``die_at``: SIGKILL itself in the first load call of that push. Reports
    (rank, "ok" | error name, detail) after each push."""
    import os
    import signal

    from raysync.core.sharded import ShardedReceiver
    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveReceiver

    model = tiny_qwen2(seed=99)
    params = dict(model.named_parameters())

    def die(batch):
        os.kill(os.getpid(), signal.SIGKILL)

    receiver = ShardedReceiver(
        [
            CollectiveReceiver(s, config, rank=rank, rendezvous=r)
            for s, r in zip(secrets, rendezvous, strict=True)
        ]
    )
    receiver.join()
    for push in range(1, pushes + 1):
        try:
            report = receiver.receive(load_fn=die) if die_at == push else receiver.receive(into=params)
        except Exception as e:
            out.put((rank, type(e).__name__, str(e)))
            return
        out.put((rank, "ok", (report.version, report.tensors, digest(model.named_parameters()))))
    receiver.close()


def sharded_stager(secrets, config, rendezvous, out, fails: str) -> None:
    """An engine (rank 1 of every share's group) whose load function stages: it keeps every tensor it is given
    and applies them all in ``finish`` (the contract in raysync.core.sink). Push 2's apply fails: with
    ``fails="ValueError"`` before it touches anything (the old weights stay), with ``"WeightsMixed"`` half-way.
    Reports ("ok", version, digest) or (error name, version, mixed, digest, message) after each push."""
    from raysync.core.errors import WeightsMixed
    from raysync.core.sharded import ShardedReceiver
    from raysync.tools.models import tiny_qwen2
    from raysync.transport.collective import CollectiveReceiver

    params = dict(tiny_qwen2(seed=99).named_parameters())

    class Stager:
        def __init__(self, push: int):
            self.push, self.staged = push, {}

        def __call__(self, batch):
            for name, t in batch:
                self.staged[name] = t.clone()

        def finish(self) -> None:
            names = sorted(self.staged)
            with torch.no_grad():
                for k, name in enumerate(names):
                    if self.push == 2 and fails == "ValueError" and k == 0:
                        raise ValueError("the apply failed before it touched a weight")
                    if self.push == 2 and fails == "WeightsMixed" and k == len(names) // 2:
                        raise WeightsMixed("the apply failed half-way")
                    params[name].copy_(self.staged[name])

    engine = ShardedReceiver(
        [
            CollectiveReceiver(s, config, rank=1, rendezvous=r)
            for s, r in zip(secrets, rendezvous, strict=True)
        ]
    )
    engine.join()
    for push in (1, 2):
        try:
            report = engine.receive(load_fn=Stager(push))
            out.put(("ok", report.version, digest(params.items())))
        except Exception as e:
            out.put(
                (type(e).__name__, engine.version, getattr(e, "mixed", None), digest(params.items()), str(e))
            )
    engine.close()


def collective_engine(config, inbox, out) -> None:
    """An engine as WeightSync drives one inside its actor (raysync.ray.endpoint), for the groups the parent
    makes one after another: each ``inbox`` message is the (secret, rendezvous) of a new group (None: stop).
    After each connect it receives once and reports (its version before the connect, the push's version, skipped,
    its version after, a digest of its weights)."""
    from raysync.ray import endpoint as ep
    from raysync.tools.models import tiny_qwen2

    class Engine:  # what a user's actor is to raysync: an object with a model
        model = tiny_qwen2(seed=99)

    engine = Engine()
    while (group := inbox.get(timeout=120)) is not None:
        secret, rendezvous = group
        held = ep.receiver_version(engine, "sync")
        ep.collective_connect(engine, "sync", config, 1, rendezvous, secret, ep.model_destinations)
        result = ep.receiver_receive(engine, "sync")
        if not result.ok:
            out.put(("failed", result.failure.stage, result.failure.error))
            continue
        report = result.report
        after = ep.receiver_version(engine, "sync")
        out.put((held, report.version, report.skipped, after, digest(engine.model.named_parameters())))
    ep.close(engine, "sync")


def sharded_checker(secrets, config, rendezvous, out) -> None:
    """An engine (rank 1 of every share's group) whose load function refuses every push in its ``check(specs)``
    (e.g. a model raysync cannot reload): reports (error name, message, version, the names check saw, loads)."""
    from raysync.core.errors import LayoutError
    from raysync.core.sharded import ShardedReceiver
    from raysync.transport.collective import CollectiveReceiver

    seen: list[str] = []
    loads: list[str] = []

    def load(batch):
        loads.extend(name for name, _ in batch)

    def check(specs):
        seen.extend(s.name for s in specs)
        raise LayoutError("this engine cannot take these weights")

    load.check = check
    engine = ShardedReceiver(
        [
            CollectiveReceiver(s, config, rank=1, rendezvous=r)
            for s, r in zip(secrets, rendezvous, strict=True)
        ]
    )
    engine.join()
    try:
        engine.receive(load_fn=load)
        out.put(("ok", "", engine.version, sorted(seen), loads))
    except Exception as e:
        out.put((type(e).__name__, str(e), engine.version, sorted(seen), loads))
    finally:
        engine.close()


def die_instead_of_gathering(bucket: int) -> None:
    """From now on this process SIGKILLs itself where it would join the all-gather of ``bucket``."""
    from raysync.sources.walk import GatherWalk

    issue = GatherWalk.issue

    def issue_or_die(walk, k, *status):
        if k == bucket:
            os.kill(os.getpid(), signal.SIGKILL)
        issue(walk, k, *status)

    GatherWalk.issue = issue_or_die
