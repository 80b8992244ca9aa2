"""Staged pushes with a flip (issue 18, raysync.core.staging): a push lands in staging memory while an engine keeps
computing on the live weights; the engine flips it in at a step boundary; versions never lie."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from dataclasses import dataclass

import pytest
import torch
from conftest import session_pair

from raysync import PushIncomplete, SessionSecret, SyncConfig, WeightReceiver, WeightSender
from raysync.core.errors import LayoutError, PeerTimeout, RemoteError, StagingFailed, StaleWeights
from raysync.core.staging_memory import ALIGN_BYTES, plan_groups
from raysync.core.version import MIXED

DIM, LAYERS = 128, 4
CPU = torch.device("cpu")


def make_model(version: int | None) -> torch.nn.Sequential:
    """The tiny engine model; ``version`` seeds its weights (None: the engine's own initial weights)."""
    torch.manual_seed(12345 if version is None else version)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def staged_sender(secret: SessionSecret, config: SyncConfig, out, go) -> None:
    """The trainer, in its own process: pushes each version the parent asks for (None: stop), after telling it
    the digest of that version's weights."""
    with WeightSender(secret, config) as sender:
        out.put(sender.endpoint)
        while (version := go.get(timeout=120)) is not None:
            model = make_model(version)
            out.put((version, weights_digest(model)))
            sender.push(model.named_parameters(), version)


@dataclass(frozen=True)
class Step:
    version: object  # what the receiver said the live weights are, at the step boundary
    before: str  # digest of the weights when the step started
    after: str  # ... and when it ended: a flip never lands inside a step


class Engine:
    """A plain torch engine: forward steps in a loop on its own thread; at each step boundary (and only there) it
    calls ``receiver.flip()``. A flip refused after a failed stage is counted and the engine keeps serving."""

    def __init__(self, receiver: WeightReceiver, model: torch.nn.Module, flips_allowed: int | None = None):
        self.receiver, self.model = receiver, model
        self.steps: list[Step] = []
        self.refused = self.flips = 0
        self.flips_allowed = flips_allowed  # the engine stops flipping after this many (None: never stops)
        self.stop = threading.Event()
        self._cond = threading.Condition()

    def run(self) -> int:
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(0))
        while not self.stop.is_set():
            try:
                if self.flips_allowed is None or self.flips < self.flips_allowed:
                    self.flips += self.receiver.flip() is not None
            except StagingFailed:
                self.refused += 1
            version = self.receiver.version
            before = weights_digest(self.model)
            with torch.no_grad():
                self.model(x)
            with self._cond:
                self.steps.append(Step(version, before, weights_digest(self.model)))
                self._cond.notify_all()
        return len(self.steps)

    def count(self) -> int:
        with self._cond:
            return len(self.steps)

    def wait(self, done, what: str, timeout_s: float = 60) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: done(self.steps), timeout_s), f"engine: no step {what}"


def finish(steps) -> object:
    """Run a ``receiving`` generator to its end; its report."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


CONFIG = SyncConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=30, progress=False, verify=True)


@pytest.mark.parametrize(
    ("sizes", "budget", "groups"),
    [
        ([1000, 3000, 10], None, [0, 0, 0]),  # no budget: the whole push
        ([1000, 3000, 10], 1024 + 3072 + 256, [0, 0, 0]),  # fits, alignment included
        ([1000, 3000, 10], 4096, [0, 0, 1]),  # cut where the next tensor would not fit
        ([1000, 3000, 10], 3500, [0, 1, 1]),
        ([256, 256, 256, 0], 512, [0, 0, 1, 1]),  # a zero-size tensor still belongs to a group
    ],
)
def test_plan_groups_cuts_consecutive_tensors_within_the_budget(sizes, budget, groups):
    plan = plan_groups(sizes, [CPU] * len(sizes), budget)
    assert list(plan.group_of) == groups and plan.groups == max(groups) + 1
    for g in range(plan.groups):  # in each group the tensors sit side by side, aligned, within the buffer
        mine = [i for i, k in enumerate(groups) if k == g]
        ends = [plan.offsets[i] + sizes[i] for i in mine]
        assert all(plan.offsets[i] % ALIGN_BYTES == 0 for i in mine) and max(ends) <= plan.sizes[CPU]
        assert [plan.offsets[i] for i in mine] == sorted(plan.offsets[i] for i in mine)
    assert budget is None or plan.sizes[CPU] <= budget


def test_plan_groups_refuses_a_tensor_larger_than_the_budget():
    with pytest.raises(LayoutError, match="'big'.*staging_bytes=1024"):
        plan_groups([512, 4096], [CPU, CPU], 1024, ["small", "big"])


def test_an_engine_steps_on_exactly_one_version_while_three_staged_pushes_land(private_tmp, spawn, in_thread):
    """The trainer pushes from another process over shm; the engine steps all the time. Each push is held half
    staged until the engine did two more steps, which must run on the previous version; each step's weights
    equal the digest of the version reported for it; the flip happens only between steps; the staging memory
    is planned once and reused."""
    secret = SessionSecret.generate()
    out, go = spawn.ctx.Queue(), spawn.ctx.Queue()
    trainer = spawn(staged_sender, secret, CONFIG, out, go)
    endpoint = out.get(timeout=60)
    model = make_model(None)
    digests = {None: weights_digest(model)}
    with WeightReceiver(endpoint, secret, CONFIG) as receiver:
        engine = Engine(receiver, model)
        running = in_thread(engine.run)
        staging = None
        for version in (1, 2, 3):
            go.put(version)
            steps = receiver.receiving(into=dict(model.named_parameters()), flip=False)
            next(steps)  # the first bucket of this version is in staging memory
            seen = engine.count()
            engine.wait(lambda s, n=seen: len(s) >= n + 2, "while the push was half staged")
            assert receiver.version == (version - 1 or None) and receiver.staged_version is None
            report = finish(steps)
            assert report.version == version and not report.skipped
            got, digests[version] = out.get(timeout=60)
            assert got == version
            engine.wait(lambda s, v=version: s[-1].version == v, f"on version {version}")
            assert all(s.version == (version - 1 or None) for s in engine.steps[seen : seen + 2])
            staging = staging or receiver.staging
            assert receiver.staging is staging  # planned and allocated once, reused by every push
        go.put(None)
        engine.stop.set()
        assert running.result(timeout=60) == len(engine.steps)
    trainer.join(timeout=30)
    assert trainer.exitcode == 0
    assert [s for s in engine.steps if s.before != s.after] == []  # no flip inside a step
    assert [s for s in engine.steps if digests[s.version] != s.before] == []  # the version names the weights
    versions = [s.version or 0 for s in engine.steps]
    assert versions == sorted(versions) and set(versions) == {0, 1, 2, 3}
    push_bytes = sum(p.nbytes for p in model.parameters())
    assert (staging.mode, staging.groups, staging.push_bytes) == ("whole", 1, push_bytes)
    assert staging.devices == (("cpu", staging.nbytes),) and push_bytes <= staging.nbytes


def test_a_killed_trainer_mid_stage_leaves_the_engine_serving_and_the_flip_refused(
    private_tmp, spawn, in_thread
):
    config = SyncConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=3, progress=False)
    secret = SessionSecret.generate()
    out, go = spawn.ctx.Queue(), spawn.ctx.Queue()
    trainer = spawn(staged_sender, secret, config, out, go)
    endpoint = out.get(timeout=60)
    model = make_model(None)
    with WeightReceiver(endpoint, secret, config) as receiver:
        engine = Engine(receiver, model)
        running = in_thread(engine.run)
        go.put(1)
        receiver.receive(into=dict(model.named_parameters()), flip=False)
        _, one = out.get(timeout=60)
        engine.wait(lambda s: s[-1].version == 1, "on version 1")
        go.put(2)
        steps = receiver.receiving(into=dict(model.named_parameters()), flip=False)
        next(steps)  # version 2 is part staged
        os.kill(trainer.pid, signal.SIGKILL)
        with pytest.raises(PushIncomplete) as e:
            finish(steps)
        assert e.value.mixed is False and receiver.version == 1 and receiver.staged_version is None
        seen = engine.count()
        engine.wait(lambda s, n=seen: len(s) >= n + 2 and engine.refused, "after the failed stage")
        with pytest.raises(StagingFailed, match="version 2 failed.*not touched"):
            receiver.flip()
        assert receiver.discard() == 2 and receiver.flip() is None and receiver.version == 1
        engine.stop.set()
        running.result(timeout=60)
    assert {(s.version, s.before) for s in engine.steps[seen:]} == {(1, one)}  # still serving version 1


def _push(sender: WeightSender, version: int) -> None:
    sender.push(make_model(version).named_parameters(), version)


def test_max_version_lag_makes_a_step_wait_for_the_flip(private_tmp, in_thread):
    model = make_model(None)
    params = dict(model.named_parameters())
    with session_pair(CONFIG) as (sender, receiver):
        pushing = in_thread(_push, sender, 1)
        receiver.receive(into=params, flip=False)
        pushing.result(timeout=30)
        assert receiver.flip(max_version_lag=0).version == 1
        pushing = in_thread(_push, sender, 2)
        steps = receiver.receiving(into=params, flip=False)
        next(steps)  # version 2 announced and part staged: the live version 1 is one behind
        assert receiver.flip(max_version_lag=1) is None and receiver.version == 1  # within the bound
        with pytest.raises(StaleWeights, match="version 1.*version 2 was announced.*max_version_lag=0") as e:
            receiver.flip(max_version_lag=0, wait_s=0.2)
        assert e.value.stage == "flip: waiting for a staged version" and "sender" in e.value.peer
        waiting = in_thread(receiver.flip, max_version_lag=0, wait_s=30)  # a step that may not run on 1
        assert finish(steps).version == 2
        pushing.result(timeout=30)
        flipped = waiting.result(timeout=30)
        assert flipped.version == 2 and receiver.version == 2
        assert weights_digest(model) == weights_digest(make_model(2))


def test_a_newer_staged_push_replaces_one_never_flipped_and_a_live_push_drops_it(private_tmp, in_thread):
    model = make_model(None)
    params = dict(model.named_parameters())
    with session_pair(CONFIG) as (sender, receiver):
        for version in (1, 2):
            pushing = in_thread(_push, sender, version)
            receiver.receive(into=params, flip=False)
            pushing.result(timeout=30)
        assert receiver.staged_version == 2 and receiver.version is None
        assert receiver.flip().version == 2 and weights_digest(model) == weights_digest(make_model(2))
        pushing = in_thread(_push, sender, 3)
        receiver.receive(into=params, flip=False)
        pushing.result(timeout=30)
        pushing = in_thread(_push, sender, 4)
        receiver.receive(into=params)  # applied in place: staged version 3 would go back in time
        pushing.result(timeout=30)
        assert receiver.staged_version is None and receiver.flip() is None and receiver.version == 4


@pytest.mark.parametrize("staging_memory", ["auto", "host"])  # host: what a GPU engine without room gets
def test_groups_mode_flips_one_group_per_step_and_says_mixed_between(private_tmp, in_thread, staging_memory):
    model = make_model(None)
    layer = model[0].weight.nbytes + model[0].bias.nbytes
    with session_pair(CONFIG) as (sender, receiver):
        engine = Engine(receiver, model)
        running = in_thread(engine.run)
        for version in (1, 2, 3):
            pushing = in_thread(_push, sender, version)
            receiver.receive(
                into=dict(model.named_parameters()),
                flip=False,
                staging_bytes=layer + 1024,
                staging_memory=staging_memory,
            )
            pushing.result(timeout=30)
            engine.wait(lambda s, v=version: s[-1].version == v, f"on version {version}")
        engine.stop.set()
        running.result(timeout=60)
        info = receiver.staging
    assert (info.mode, info.groups) == ("groups", LAYERS) and "exceeds staging_bytes" in info.why
    assert info.memory == "host"  # the model's tensors are in host memory
    assert info.nbytes < info.push_bytes  # the budget, not the model
    digests = {v: weights_digest(make_model(v)) for v in (1, 2, 3)} | {None: weights_digest(make_model(None))}
    assert [s for s in engine.steps if s.before != s.after] == []
    assert [s for s in engine.steps if s.version != MIXED and digests[s.version] != s.before] == []
    assert any(s.version == MIXED for s in engine.steps)  # between a push's first and last flip
    assert weights_digest(model) == digests[3]


def test_groups_mode_without_an_engine_flipping_times_out_naming_the_engine(private_tmp, in_thread):
    config = SyncConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=1, progress=False)
    model = make_model(None)
    layer = model[0].weight.nbytes + model[0].bias.nbytes
    with session_pair(config) as (sender, receiver):
        pushing = in_thread(_push, sender, 1)
        with pytest.raises(PushIncomplete) as e:
            receiver.receive(into=dict(model.named_parameters()), flip=False, staging_bytes=layer)
        assert pushing.exception(timeout=30) is not None
    cause = e.value.__cause__
    assert isinstance(cause, PeerTimeout) and "engine" in cause.peer and "group 2/4" in cause.stage
    assert receiver.version is None and weights_digest(model) == weights_digest(make_model(None))


def test_a_push_failing_after_groups_flipped_says_mixed_and_the_next_push_repairs_it(private_tmp, in_thread):
    """Groups mode: the engine flips one group, then stops flipping; the push cannot land its third group and
    fails (the sender too); the live weights are MIXED and the flip is refused until discard(); the next
    push, flipped group by group, makes them exactly version 2."""
    config = SyncConfig(bucket_bytes=16 << 10, num_buffers=2, timeout_s=2, progress=False)
    model = make_model(None)
    params = dict(model.named_parameters())
    layer = model[0].weight.nbytes + model[0].bias.nbytes
    with session_pair(config) as (sender, receiver):
        engine = Engine(receiver, model, flips_allowed=1)
        running = in_thread(engine.run)
        pushing = in_thread(_push, sender, 1)
        with pytest.raises(PushIncomplete) as e:
            receiver.receive(into=params, flip=False, staging_bytes=layer)
        assert isinstance(
            pushing.exception(timeout=30), (RemoteError, PeerTimeout)
        )  # told, or timed out first
        assert isinstance(e.value.__cause__, PeerTimeout) and "group 3/4" in e.value.__cause__.stage
        assert e.value.mixed is True and receiver.version == MIXED and engine.flips == 1
        with pytest.raises(StagingFailed, match="1 of its groups were flipped: the live weights are MIXED"):
            receiver.flip()
        assert receiver.discard() == 1
        engine.flips_allowed = None
        pushing = in_thread(_push, sender, 2)
        receiver.receive(into=params, flip=False, staging_bytes=layer)
        pushing.result(timeout=30)
        engine.wait(lambda s: s[-1].version == 2, "on version 2")
        engine.stop.set()
        running.result(timeout=60)
    assert weights_digest(model) == weights_digest(make_model(2))
    assert [s for s in engine.steps if s.before != s.after] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_flip_keeps_the_live_addresses_so_a_captured_cuda_graph_runs_the_new_version(
    private_tmp, in_thread
):
    model = make_model(None).cuda()
    params = dict(model.named_parameters())
    addresses = [p.data_ptr() for p in params.values()]
    x = torch.randn(4, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        model(x)  # warm-up off the default stream, as CUDA graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = model(x)
    with session_pair(CONFIG) as (sender, receiver):
        pushing = in_thread(_push, sender, 1)  # CPU tensors over shm into GPU staging memory
        receiver.receive(into=params, flip=False)
        pushing.result(timeout=60)
        graph.replay()
        before = y.clone()
        with torch.no_grad():  # the graph's kernels may differ from eager ones in the last bits: a tolerance
            assert torch.allclose(before, model(x), rtol=1e-4, atol=1e-5) and receiver.version is None
        assert receiver.staging.devices == (("cuda:0", receiver.staging.nbytes),)
        assert receiver.flip().version == 1
        graph.replay()  # the graph captured before the flip reads the same addresses: now version 1
        with torch.no_grad():
            assert torch.allclose(y, make_model(1).cuda()(x), rtol=1e-4, atol=1e-5)
            assert not torch.allclose(y, before, rtol=1e-4, atol=1e-5)
    assert [p.data_ptr() for p in params.values()] == addresses
    assert weights_digest(model.cpu()) == weights_digest(make_model(1))
