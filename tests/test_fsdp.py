"""FSDP2 trainers as a source, on the CPU: real ``fully_shard`` over gloo, each trainer rank a spawned process,
one engine process receiving. Rank 0 sends (``WeightSender.push(DTensorSource)``), the others take part without
sending (``DTensorSource.follow``): every rank walks the same buckets (Note [every rank walks the same buckets]).
"""

from __future__ import annotations

import hashlib
import os
import queue
import time

import pytest
import torch
from workers import die_instead_of_gathering

from raysync import SyncConfig

pytest.importorskip("transformers")

MODEL = {"hidden": 256, "layers": 2, "vocab": 16384}  # 36.5 MiB of fp32 parameters: 146 buckets
# staged: a push that fails part-way leaves the engine's weights and version as they were
CFG = SyncConfig(bucket_bytes=256 << 10, timeout_s=10, progress=False, staged=True)
# what the interpreter adds during a first push besides the buffers (the plan, the copies' views, the session's
# threads): proportional to the number of chunks, not to the model's bytes
SLACK_BYTES = 8 << 20


def _digests(named) -> dict[str, str]:
    return {
        n: hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in named
    }


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def engine(secret, cfg, endpoints, out) -> None:
    """The engine: receives until a push fails; reports each version's digests, and what a failure left."""
    from raysync import RaysyncError, WeightReceiver
    from raysync.tools.models import tiny_qwen2

    model = tiny_qwen2(seed=99, **MODEL)
    out.put(("ready", "engine"))
    with WeightReceiver(endpoints.get(timeout=120), secret, cfg) as receiver:
        while True:
            try:
                receiver.receive(into=dict(model.named_parameters()))
            except RaysyncError as e:
                out.put(
                    ("engine failed", receiver.version, _digests(model.named_parameters()), type(e).__name__)
                )
                return
            out.put(("received", receiver.version, _digests(model.named_parameters())))


def trainer(rank, world, store, secret, cfg, versions, fault, endpoints, go, release, out) -> None:
    """Trainer rank ``rank`` of ``world``: FSDP2 on gloo, an SGD step before each push. ``fault``: (rank,
    version, what) with what "killed" (SIGKILLs itself instead of joining the gather of bucket 2) or "absent" (never joins)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from raysync import RaysyncError, WeightSender
    from raysync.sources import DTensorSource
    from raysync.tools.models import tiny_qwen2

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh(
        "cpu", (world,)
    )  # gloo's mesh: without it fully_shard would use a GPU if there is one
    model = tiny_qwen2(seed=0, **MODEL)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    source = DTensorSource(model.named_parameters(), cfg)
    sender = WeightSender(secret, cfg) if rank == 0 else None
    if sender is not None:
        endpoints.put(sender.endpoint)
    out.put(("ready", rank))
    go.wait(timeout=120)
    for i, version in enumerate(versions):
        if version not in versions[:i]:  # a version pushed again (the engine has it) is not trained again
            loss = model(torch.arange(32).view(2, 16)).logits.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            full = _digests(
                (n, p.full_tensor()) for n, p in model.named_parameters()
            )  # every rank takes part
            if rank == 0:
                out.put(("trained", version, full))
        dist.barrier()
        if fault[:2] == (rank, version) and fault[2] == "absent":
            release.wait(timeout=120)
            os._exit(0)  # never took part in this push
        if fault[:2] == (rank, version) and fault[2] == "killed":
            die_instead_of_gathering(bucket=2)
        began = time.monotonic()
        try:
            if sender is not None:
                rss = _rss("VmRSS")
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS: the peak of this push alone
                report = sender.push(source, version=version)
                model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes
                out.put(("pushed", version, _rss("VmHWM") - rss, model_bytes, report.skipped))
            else:
                out.put(("followed", rank, version, source.follow(version)))
        except RaysyncError as e:
            out.put(("error", rank, type(e).__name__, e.peer, e.stage, time.monotonic() - began))
            break
    out.put(("exit", rank))
    out.close()
    out.join_thread()  # everything put is in the pipe
    os._exit(0)  # the group may have a dead peer: skip its teardown


def _run(spawn, tmp_path, world, versions, fault=(-1, -1, "")):
    from raysync import SessionSecret

    ctx = spawn.ctx
    secret, out, endpoints = SessionSecret.generate(), ctx.Queue(), ctx.Queue()
    go, release = ctx.Event(), ctx.Event()
    procs = [spawn(engine, secret, CFG, endpoints, out)]
    store = tmp_path / "store"
    args = (world, str(store), secret, CFG, versions, fault, endpoints, go, release, out)
    procs += [spawn(trainer, rank, *args) for rank in range(world)]
    events, ready, exits = [], 0, 0
    deadline = time.monotonic() + 240
    while exits < world - (fault[2] != "") or not any(e[0].startswith("engine") for e in events):
        try:
            event = out.get(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"the processes did not finish; so far: {[e[:2] for e in events]}")
        ready += event[0] == "ready"
        if ready == world + 1:
            go.set()  # the engine and every rank are up: the waits on each other start now
            ready = 0
        exits += event[0] == "exit"
        if event[0] == "error" and sum(e[0] == "error" for e in events) == world - 2:
            release.set()  # every surviving rank has raised: the absent one may go
        events.append(event)
    release.set()
    for p in procs:
        p.join(timeout=30)
    return events


def _check_pushes_bit_exact(events, versions):
    trained = {e[1]: e[2] for e in events if e[0] == "trained"}
    received = {e[1]: e[2] for e in events if e[0] == "received"}
    assert sorted(received) == versions
    for v in versions:
        assert received[v] == trained[v], (
            f"version {v}: the engine's weights are not the trainer's unsharded ones"
        )
    return trained


def test_two_fsdp2_ranks_push_bit_exact_within_the_memory_bound_and_a_killed_rank_is_named(spawn, tmp_path):
    """Two pushes land bit-exact (the engine's weights equal the unsharded ones, full_tensor() on the trainer),
    the sending rank's peak extra memory during the first push stays under the ring, one bucket gathered (and
    gloo's temporary copy of it) and the interpreter's slack, far below the model; version 2 again is skipped
    by the engine and every rank hears it (the walk ends early); then rank 1 is SIGKILLed instead of joining
    the gather of bucket 2 of push 3: rank 0 raises a typed error naming rank 1 and that bucket within
    timeout_s, and the engine keeps version 2, its weights untouched."""
    events = _run(spawn, tmp_path, world=2, versions=[1, 2, 2, 3], fault=(1, 3, "killed"))
    trained = _check_pushes_bit_exact(events, [1, 2])
    assert [e[3] for e in events if e[0] == "followed"] == ["done", "done", "skipped"]
    assert [e[4] for e in events if e[0] == "pushed"] == [False, False, True]
    ((first_extra, model_bytes, _),) = [e[2:] for e in events if e[0] == "pushed" and e[1] == 1]
    bound = CFG.num_buffers * CFG.bucket_bytes + 2 * CFG.bucket_bytes + (64 << 10) + SLACK_BYTES
    assert first_extra <= bound < model_bytes / 2, (first_extra, bound)
    (error,) = [e for e in events if e[0] == "error"]
    _, rank, kind, peer, stage, seconds = error
    assert rank == 0 and kind in ("PeerLost", "PeerTimeout"), error
    assert peer == "trainer rank 1 of 2" and stage.startswith("the all-gather of bucket 2 of "), error
    assert seconds <= CFG.timeout_s + 2, error
    (failed,) = [e for e in events if e[0] == "engine failed"]
    assert failed[1] == 2 and failed[2] == trained[2] and failed[3] == "PushIncomplete"


@pytest.mark.slow
def test_four_fsdp2_ranks_push_bit_exact_and_a_rank_that_never_joins_is_named_by_every_other(spawn, tmp_path):
    """Four ranks: a push lands bit-exact; rank 3 never joins the next one: ranks 0, 1 and 2 each raise
    PeerTimeout naming rank 3 at the start of that push within timeout_s, and the engine keeps version 1."""
    events = _run(spawn, tmp_path, world=4, versions=[1, 2], fault=(3, 2, "absent"))
    trained = _check_pushes_bit_exact(events, [1])
    assert sorted(e[1] for e in events if e[0] == "followed") == [1, 2, 3]
    errors = sorted(e for e in events if e[0] == "error")
    assert [e[1] for e in errors] == [0, 1, 2], errors
    for _, _, kind, peer, stage, seconds in errors:
        assert kind == "PeerTimeout" and peer == "trainer rank 3 of 4", errors
        assert stage == "the start of the push of version 2" and seconds <= CFG.timeout_s + 2, errors
    (failed,) = [e for e in events if e[0] == "engine failed"]
    assert failed[1] == 1 and failed[2] == trained[1]


@pytest.mark.slow
def test_a_killed_rank_is_named_by_every_surviving_rank_of_four(spawn, tmp_path):
    """Four ranks, rank 2 SIGKILLed instead of joining the gather of bucket 2 of the first push: ranks 0, 1 and 3 each
    raise a typed error naming rank 2 within timeout_s."""
    events = _run(spawn, tmp_path, world=4, versions=[1], fault=(2, 1, "killed"))
    errors = sorted(e for e in events if e[0] == "error")
    assert [e[1] for e in errors] == [0, 1, 3], errors
    for _, _, kind, peer, stage, seconds in errors:
        assert kind in ("PeerLost", "PeerTimeout") and peer == "trainer rank 2 of 4", errors
        assert "bucket 2 of" in stage and seconds <= CFG.timeout_s + 2, errors
    (failed,) = [e for e in events if e[0] == "engine failed"]
    assert failed[1] is None
